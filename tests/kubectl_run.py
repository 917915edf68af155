"""kubectl against a test's API server, with a discovery cache of the test's own (kubectl caches discovery
per server address, and ports get reused)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from ember_localcluster.apiserver import APIServer


def kubectl(
    server: APIServer, tmp_path: Path, *args: str, ok: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run kubectl; with `ok`, fail the test unless it succeeds."""
    binary = shutil.which("kubectl")
    assert binary, "kubectl is not on PATH; it is part of the machine setup (apt install kubectl)"
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    command = [binary, "--kubeconfig", str(kubeconfig), "--cache-dir", str(tmp_path / "cache"), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if ok:
        assert result.returncode == 0, f"{' '.join(args)} failed: {result.stderr}"
    return result
