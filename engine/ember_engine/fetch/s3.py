"""`s3://bucket/prefix`: the objects under a prefix, from AWS S3 or any S3-compatible store (`--endpoint`,
or AWS_ENDPOINT_URL), through boto3.

Credentials and region come the usual AWS way (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
AWS_REGION, or an instance role). The listing (ListObjectsV2, every page) gives each object's size and ETag;
an ETag that is an MD5 (single-part uploads, no '-') is checked, and so is a whole-object SHA-256 checksum
when the object has one (HeadObject with checksum mode on). Downloads resume with a ranged GetObject. The
revision is a digest of the listing, so a changed object means a new fetch.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Iterator
from typing import Any

from ember_engine.fetch.files import FetchError, RemoteFile, TransientError

CHUNK = 1 << 20
_SOURCE = re.compile(r"^s3://(?P<bucket>[^/\s]+)(/(?P<prefix>.*))?$")
_MD5 = re.compile(r"^[0-9a-f]{32}$")
# Errors a second try may not see.
_TRANSIENT_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "503", "500"}


class S3Source:
    def __init__(self, uri: str, endpoint: str | None = None) -> None:
        import boto3
        from botocore.config import Config

        match = _SOURCE.match(uri)
        if match is None:
            raise FetchError(f"not an S3 source: {uri!r} (s3://bucket/prefix)")
        self.uri = uri
        self.bucket = match["bucket"]
        self.prefix = (match["prefix"] or "").strip("/")
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL") or None
        # S3-compatible stores are addressed by path (http://host/bucket/key); AWS picks its own style.
        config = Config(
            s3={"addressing_style": "path" if endpoint else "auto"},
            retries={"max_attempts": 3, "mode": "standard"},
            connect_timeout=10,
            read_timeout=60,
        )
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name=region, config=config)

    def describe(self) -> str:
        return self.uri

    def _call(self, what: str, method: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError, ConnectionError, EndpointConnectionError

        try:
            return method(**kwargs)
        except ClientError as error:
            info = error.response.get("Error", {})
            code, message = str(info.get("Code", "")), info.get("Message", "")
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            text = f"{what}: {code or status}: {message or error}"
            if code in _TRANSIENT_CODES:
                raise TransientError(text) from error
            if code in ("NoSuchBucket", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                text += " (the bucket, and the credentials from AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            raise FetchError(text) from error
        except (EndpointConnectionError, ConnectionError) as error:
            raise TransientError(f"{what}: {error}") from error
        except BotoCoreError as error:
            raise FetchError(f"{what}: {error}") from error

    def listing(self) -> tuple[str, list[RemoteFile]]:
        root = f"{self.prefix}/" if self.prefix else ""
        files: list[RemoteFile] = []
        token: str | None = None
        while True:
            page = self._call(
                f"listing s3://{self.bucket}/{root}",
                self.client.list_objects_v2,
                Bucket=self.bucket,
                Prefix=root,
                **({"ContinuationToken": token} if token else {}),
            )
            for obj in page.get("Contents", []):
                key = obj["Key"]
                if key.endswith("/"):  # a folder marker, not a file
                    continue
                etag = str(obj.get("ETag", "")).strip('"')
                digests = {"md5": etag} if _MD5.match(etag) else {}
                files.append(
                    RemoteFile(
                        key[len(root) :],
                        int(obj["Size"]),
                        digests,
                    )
                )
            if not page.get("IsTruncated"):
                break
            token = page.get("NextContinuationToken")
        files = [self._with_checksum(root, f) for f in files]
        revision = hashlib.sha256(
            "\n".join(
                f"{f.path} {f.size} {sorted(f.digests.items())}" for f in sorted(files, key=lambda f: f.path)
            ).encode()
        ).hexdigest()[:16]
        return revision, files

    def _with_checksum(self, root: str, file: RemoteFile) -> RemoteFile:
        head = self._call(
            f"s3://{self.bucket}/{root}{file.path}",
            self.client.head_object,
            Bucket=self.bucket,
            Key=root + file.path,
            ChecksumMode="ENABLED",
        )
        checksum = head.get("ChecksumSHA256")
        if checksum and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT" and "-" not in checksum:
            return RemoteFile(
                file.path, file.size, {**file.digests, "sha256": base64.b64decode(checksum).hex()}
            )
        return file

    def read(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        root = f"{self.prefix}/" if self.prefix else ""
        extra = {"Range": f"bytes={offset}-"} if offset else {}
        response = self._call(
            f"s3://{self.bucket}/{root}{file.path}",
            self.client.get_object,
            Bucket=self.bucket,
            Key=root + file.path,
            **extra,
        )
        match = re.match(r"bytes (\d+)-", response.get("ContentRange") or "")
        return (int(match.group(1)) if match else 0), self._chunks(response["Body"])

    def _chunks(self, body: Any) -> Iterator[bytes]:
        from botocore.exceptions import BotoCoreError
        from urllib3.exceptions import HTTPError

        try:
            yield from body.iter_chunks(CHUNK)
        except (BotoCoreError, HTTPError, OSError) as error:
            raise TransientError(f"{type(error).__name__}: {error}") from error
        finally:
            body.close()
