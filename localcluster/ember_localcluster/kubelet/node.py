"""The node the process kubelet stands for: its name, the host's address, the pods' addresses.

Each pod gets a loopback address of its own, `127.1.N.M` by default (on Linux every 127/8 address is
local), reported as `podIP`/`podIPs`; `hostIP` is 127.0.0.1. In place of a network namespace, an
argument or env value that binds all interfaces (`0.0.0.0`, `--host=0.0.0.0`, `0.0.0.0:8080`) is
rewritten to the pod's address (`podvolumes._Rewriter`), so two pods can both listen on port 8000.
Addresses are locked host-wide (a `flock` per address), so several local control planes can run side by
side. Pods share the host's PID space: their processes are signalled by process group.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from pathlib import Path

HOST_IP = "127.0.0.1"
NODE_NAME = "ember-local"
# Shared by every kubelet on this machine: who holds which pod address.
ADDRESS_LOCKS = Path(tempfile.gettempdir()) / "ember-pod-addresses"


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _Addresses:
    """Pod IPs: 127.X.N.M from a /16 loopback prefix, lowest free first; never the host's 127.0.0.1.

    An address is held with an exclusive `flock` on a file named after it in `lock_dir`, so kubelets of
    other local control planes on this machine (in this process or another) never hand out the same
    address. Container processes inherit the locked descriptor, so an address stays taken while any
    process that may listen on it lives, even past a crash of the kubelet; then the kernel drops it.
    """

    def __init__(self, prefix: str, lock_dir: Path) -> None:
        match = re.fullmatch(r"127\.(\d{1,3})\.", prefix)
        if match is None or int(match.group(1)) > 255:
            raise ValueError(f"ip_prefix must look like '127.X.' (a loopback /16), got {prefix!r}")
        self.prefix = prefix
        self.lock_dir = lock_dir
        self.held: dict[str, int] = {}  # address → the descriptor holding its lock

    def allocate(self) -> str:
        self.lock_dir.mkdir(parents=True, exist_ok=True)
        for n in range(256):
            for m in range(1, 255):
                ip = f"{self.prefix}{n}.{m}"
                if ip in self.held or ip == HOST_IP:
                    continue
                fd = os.open(self.lock_dir / ip, os.O_CREAT | os.O_RDWR, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self.held[ip] = fd
                return ip
        raise RuntimeError(f"no free pod address left in {self.prefix}0.0/16")

    def release(self, ip: str) -> None:
        fd = self.held.pop(ip, None)
        if fd is not None:
            os.close(fd)

    def release_all(self) -> None:
        for ip in list(self.held):
            self.release(ip)
