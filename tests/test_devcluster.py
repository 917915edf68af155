"""`ember dev up` / `down` end to end: kubectl applies the local example, the operator starts real engine
processes through the process kubelet, and a chat request is served through the Service's local address."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from waiting import free_port, wait_for

REPO = Path(__file__).resolve().parents[1]
EMBER = str(Path(sys.executable).parent / "ember")


def test_dev_up_apply_serve_delete_down(tmp_path: Path) -> None:
    kubectl_bin = shutil.which("kubectl") or "/usr/bin/kubectl"
    assert Path(kubectl_bin).exists(), "kubectl is required (Debian: kubernetes-client)"
    state = tmp_path / "dev"
    up = subprocess.run(
        [EMBER, "dev", "up", "--dir", str(state), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert up.returncode == 0, up.stdout + up.stderr + (state / "dev.log").read_text()
    assert f"export KUBECONFIG={state / 'kubeconfig'}" in up.stdout

    def kubectl(*args: str) -> str:
        out = subprocess.run(
            [
                kubectl_bin,
                "--kubeconfig",
                str(state / "kubeconfig"),
                "--cache-dir",
                str(tmp_path / "kc"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    def eis() -> dict[str, Any]:
        return dict(json.loads(kubectl("get", "eis", "tiny", "-o", "json")))

    def ready() -> bool:
        conditions = {c["type"]: c["status"] for c in eis().get("status", {}).get("conditions", [])}
        return conditions.get("Ready") == "True" and conditions.get("WarmPoolReady") == "True"

    try:
        kubectl("apply", "-f", str(REPO / "examples" / "local.yaml"))
        wait_for(ready, timeout=180, what="the tiny InferenceService Ready with its warm pod")
        table = kubectl("get", "inferenceservices")
        assert "tiny" in table and "READY" in table and "WARM" in table

        svc = json.loads(kubectl("get", "service", "tiny", "-o", "json"))
        (ingress,) = svc["status"]["loadBalancer"]["ingress"]
        base = f"http://{ingress['ip']}:{ingress['ports'][0]['port']}"
        assert eis()["status"]["endpoint"] == base
        reply = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] is not None

        kubectl("delete", "-f", str(REPO / "examples" / "local.yaml"))
        wait_for(
            lambda: not json.loads(kubectl("get", "pods", "-o", "json"))["items"],
            timeout=120,
            what="engine pods gone",
        )
    finally:
        down = subprocess.run(
            [EMBER, "dev", "down", "--dir", str(state)], capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (state / "dev.pid").exists()
