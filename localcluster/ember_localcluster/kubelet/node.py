"""The nodes the process kubelet stands for: their Node objects, the host's address, the pods' addresses.

**Nodes.** A kubelet registers its Node objects when it starts, as a kubelet does (`--register-node`):
created with `kubernetes.io/hostname`, `kubernetes.io/os` and `kubernetes.io/arch` labels (plus their
`beta.` twins), `nvidia.com/gpu.present=true` on nodes with GPUs (the label NVIDIA's GPU feature
discovery sets, which GPU workloads select on), any configured labels and taints
(`--register-with-taints`), and its `status`: `capacity` and `allocatable`
for `cpu` and `memory` (the host's, unless configured), `ephemeral-storage` (the state directory's
filesystem), `pods` (110) and `nvidia.com/gpu` (as configured; nodes without GPUs do not list it, as
without a device plugin), the conditions MemoryPressure, DiskPressure and PIDPressure False and Ready
True with the kubelet's reasons and messages, the addresses `InternalIP` 127.0.0.1 and `Hostname`, and
`nodeInfo`. A node that already exists (a kubelet started again) keeps its taints and gets its labels
and status refreshed. Allocatable equals capacity (no reservations or eviction thresholds). The status is
written once (and again when a lost node comes back); the node's heartbeat is its Lease (`nodelease`),
which the node lifecycle controller reads. Every node shares the host: each reports the host's CPUs and memory, and its GPUs are only a
number to schedule against (engines run on the CPU here).

**Pod network.** Each pod gets a loopback address of its own, `127.1.N.M` by default (on Linux every
127/8 address is local), reported as `podIP`/`podIPs`; `hostIP` is 127.0.0.1. In place of a network
namespace, an argument or env value that binds all interfaces (`0.0.0.0`, `--host=0.0.0.0`,
`0.0.0.0:8080`) is rewritten to the pod's address (`podvolumes._Rewriter`), so two pods can both listen
on port 8000. Addresses are locked host-wide (a `flock` per address), so several local control planes can
run side by side. Pods share the host's PID space: their processes are signalled by process group.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HOST_IP = "127.0.0.1"
NODE_NAME = "ember-local"
DEFAULT_GPUS_PER_NODE = 1
DEFAULT_MAX_PODS = 110  # the kubelet's --max-pods
GPU = "nvidia.com/gpu"
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
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


# -- Node objects ------------------------------------------------------------------------------------------


def _host_cpus() -> str:
    return str(os.cpu_count() or 1)


def _host_memory() -> str:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        total = 8 * 2**30
    return f"{total // 1024}Ki"  # the kubelet reports memory in Ki


@dataclass(frozen=True)
class NodeConfig:
    """One Node a process kubelet registers and runs pods for.

    `cpu` and `memory` are quantities (default: the host's CPUs and memory), `gpus` the `nvidia.com/gpu`
    it offers, `pods` its pod capacity; `labels` are added to the kubelet's own and `taints` (each a
    `{"key", "value", "effect"}` mapping) are set when the node is created.
    """

    name: str = NODE_NAME
    gpus: int = DEFAULT_GPUS_PER_NODE
    cpu: str | None = None
    memory: str | None = None
    pods: int = DEFAULT_MAX_PODS
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()


def node_names(count: int) -> list[str]:
    """`ember-local`, `ember-local-2`, `ember-local-3`, ...: the first keeps the single node's name."""
    return [NODE_NAME if i == 0 else f"{NODE_NAME}-{i + 1}" for i in range(count)]


def local_nodes(
    count: int = 1,
    gpus_per_node: int = DEFAULT_GPUS_PER_NODE,
    *,
    cpu: str | None = None,
    memory: str | None = None,
    taints: Sequence[Mapping[str, str]] = (),
) -> list[NodeConfig]:
    """`count` alike nodes (see `node_names`)."""
    if count < 1:
        raise ValueError(f"a local cluster needs at least one node, got {count}")
    if gpus_per_node < 0:
        raise ValueError(f"gpus per node must be 0 or more, got {gpus_per_node}")
    return [
        NodeConfig(name, gpus=gpus_per_node, cpu=cpu, memory=memory, taints=tuple(dict(t) for t in taints))
        for name in node_names(count)
    ]


def parse_taint(text: str) -> dict[str, str]:
    """`key[=value]:Effect`, as `kubectl taint` and the kubelet's `--register-with-taints` write a taint."""
    spec, _, effect = text.rpartition(":")
    key, _, value = spec.partition("=")
    if not key or effect not in TAINT_EFFECTS:
        raise ValueError(f"invalid taint spec: {text!r} (want key[=value]:{'|'.join(TAINT_EFFECTS)})")
    taint = {"key": key, "effect": effect}
    if value:
        taint["value"] = value
    return taint


def _architecture() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def _os_image() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip().strip('"')
    return platform.platform()


def node_labels(config: NodeConfig) -> dict[str, str]:
    labels = {
        "beta.kubernetes.io/arch": _architecture(),
        "beta.kubernetes.io/os": "linux",
        "kubernetes.io/arch": _architecture(),
        "kubernetes.io/hostname": config.name,
        "kubernetes.io/os": "linux",
    }
    if config.gpus > 0:
        labels[f"{GPU}.present"] = "true"
    return {**labels, **config.labels}


def node_manifest(config: NodeConfig) -> dict[str, Any]:
    """The Node a kubelet creates for `config`, without its status (`node_status`)."""
    spec: dict[str, Any] = {}
    if config.taints:
        spec["taints"] = [dict(t) for t in config.taints]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": config.name, "labels": node_labels(config)},
        "spec": spec,
    }


def node_status(config: NodeConfig, state_dir: Path, kubelet_version: str) -> dict[str, Any]:
    """What the kubelet reports in `status` (see the module docstring)."""
    capacity = {
        "cpu": config.cpu or _host_cpus(),
        "ephemeral-storage": f"{shutil.disk_usage(state_dir).total // 1024}Ki",
        "memory": config.memory or _host_memory(),
        "pods": str(config.pods),
    }
    if config.gpus > 0:
        capacity[GPU] = str(config.gpus)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    conditions = [
        {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        for kind, status, reason, message in (
            (
                "MemoryPressure",
                "False",
                "KubeletHasSufficientMemory",
                "kubelet has sufficient memory available",
            ),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            ("Ready", "True", "KubeletReady", "kubelet is posting ready status"),
        )
    ]
    machine_id = ""
    with contextlib.suppress(OSError):
        machine_id = Path("/etc/machine-id").read_text().strip()
    return {
        "capacity": capacity,
        "allocatable": dict(capacity),
        "conditions": conditions,
        "addresses": [
            {"type": "InternalIP", "address": HOST_IP},
            {"type": "Hostname", "address": config.name},
        ],
        "nodeInfo": {
            "machineID": machine_id,
            "systemUUID": machine_id,
            "bootID": "",
            "kernelVersion": platform.release(),
            "osImage": _os_image(),
            "containerRuntimeVersion": f"process://{platform.python_version()}",
            "kubeletVersion": kubelet_version,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": _architecture(),
        },
    }
