"""A pod's volumes on the host, and the rewriting of the pod's paths and addresses onto the host's.

Volumes live under `<state>/pods/<namespace>_<name>/volumes/<volume>`: `configMap` volumes are written
from the ConfigMap (`items`, `optional`, `defaultMode` honoured) and rewritten when it changes, by
swapping a `..data` symlink as the real kubelet's AtomicWriter does (`write_atomically`), so readers
never see half a file; `emptyDir` is a fresh directory. `persistentVolumeClaim` volumes resolve through
the `claims` mapping given to the kubelet, and `hostPath` volumes are the host directory itself. An
argument, env value or command path that starts with a container's `mountPath` (also after `--flag=`,
or after `NAME=` as in `--lora-modules NAME=PATH`) is rewritten to the host directory. A missing ConfigMap or claim, or another volume type, keeps the
containers in `ContainerCreating` with a `FailedMount` event and message, retried every few seconds.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember_localcluster.kubelet.podstatus import _event

if TYPE_CHECKING:
    from ember_localcluster.kubelet.containers import _Container
    from ember_localcluster.kubelet.podworker import _PodWorker

MOUNT_RETRY_SECONDS = 2.0


class _MountError(Exception):
    """A volume cannot be set up (FailedMount)."""


# -- files ----------------------------------------------------------------------------------------------


def write_atomically(target: Path, files: Mapping[str, bytes], mode: int = 0o644) -> bool:
    """Make directory `target` hold exactly `files` (relative path → content) in one atomic step.

    As the kubelet's AtomicWriter: the files live in a timestamped directory `..<time>.<random>`,
    `..data` is a symlink to it, and each top-level name is a symlink through `..data`. An update
    writes a new directory and renames a fresh symlink over `..data`, so a reader sees either all old or
    all new files. Returns False (and touches nothing) when the content is already there.
    """
    for rel in files:
        parts = Path(rel).parts
        if not parts or Path(rel).is_absolute() or ".." in parts or parts[0].startswith(".."):
            raise ValueError(f"invalid path in volume: {rel!r}")
    target.mkdir(parents=True, exist_ok=True)
    data_link = target / "..data"
    old = target / os.readlink(data_link) if data_link.is_symlink() else None
    if old is not None and _read_tree(old) == dict(files):
        return False
    stamp = datetime.now(UTC).strftime("..%Y_%m_%d_%H_%M_%S.")
    new = Path(tempfile.mkdtemp(prefix=stamp, dir=target))
    new.chmod(0o755)
    for rel, content in files.items():
        path = new / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)
    staged = target / "..data_tmp"
    staged.unlink(missing_ok=True)
    staged.symlink_to(new.name)
    os.replace(staged, data_link)
    tops = {Path(rel).parts[0] for rel in files}
    for name in tops:
        if not (target / name).is_symlink():
            (target / name).symlink_to(f"..data/{name}")
    for entry in target.iterdir():
        if not entry.name.startswith("..") and entry.name not in tops:
            entry.unlink()
    if old is not None and old != new:
        shutil.rmtree(old, ignore_errors=True)
    return True


def _read_tree(root: Path) -> dict[str, bytes]:
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _configmap_contents(configmap: Mapping[str, Any]) -> dict[str, bytes]:
    files = {key: str(value).encode() for key, value in (configmap.get("data") or {}).items()}
    for key, value in (configmap.get("binaryData") or {}).items():
        files[key] = base64.b64decode(value)
    return files


# -- mounting -------------------------------------------------------------------------------------------


def _mount(worker: _PodWorker) -> None:
    volumes: dict[str, Path] = {}
    worker.configmap_volumes = {}
    try:
        for volume in worker.spec.get("volumes") or []:
            volumes[volume["name"]] = _mount_volume(worker, volume)
    except _MountError as error:
        worker.mount_error = f'MountVolume.SetUp failed for volume "{volume["name"]}" : {error}'
        _event(worker, "FailedMount", worker.mount_error, "Warning")
        waiting = "PodInitializing" if worker.init_containers else "ContainerCreating"
        for c in worker.every_container:
            c.state = {"waiting": {"reason": waiting, "message": worker.mount_error}}
        return
    worker.mount_error = ""
    worker.volumes = volumes


def _mount_volume(worker: _PodWorker, volume: dict[str, Any]) -> Path:
    local = worker.dir / "volumes" / volume["name"]
    if "configMap" in volume:
        source = volume["configMap"]
        worker.configmap_volumes.setdefault((worker.namespace, source.get("name", "")), []).append(volume)
        _write_configmap(worker, volume)
        return local
    if "emptyDir" in volume:
        local.mkdir(parents=True, exist_ok=True)
        return local
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"].get("claimName", "")
        path = worker.kubelet.claims.get(claim)
        if path is None:
            known = ", ".join(sorted(worker.kubelet.claims)) or "none"
            raise _MountError(
                f'persistentvolumeclaim "{claim}" not found (the claims this kubelet has: {known})'
            )
        return path
    if "hostPath" in volume:
        path, kind = Path(volume["hostPath"]["path"]), volume["hostPath"].get("type") or ""
        if kind == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
        elif kind == "Directory" and not path.is_dir():
            raise _MountError(f"hostPath type check failed: {path} is not a directory")
        elif kind == "File" and not path.is_file():
            raise _MountError(f"hostPath type check failed: {path} is not a file")
        return path
    kinds = sorted(set(volume) - {"name"})
    raise _MountError(f"{', '.join(kinds) or 'this'} volumes are not supported by the process kubelet")


def _write_configmap(worker: _PodWorker, volume: dict[str, Any]) -> None:
    source = volume["configMap"]
    configmap = worker.kubelet.configmaps.get((worker.namespace, source.get("name", "")))
    optional = bool(source.get("optional"))
    if configmap is None and not optional:
        raise _MountError(f'configmap "{source.get("name")}" not found')
    contents = _configmap_contents(configmap or {})
    items = source.get("items")
    if items:
        files = {}
        for item in items:
            if item["key"] in contents:
                files[item["path"]] = contents[item["key"]]
            elif not optional:
                raise _MountError(f"configmap references non-existent config key: {item['key']}")
    else:
        files = contents
    try:
        write_atomically(worker.dir / "volumes" / volume["name"], files, source.get("defaultMode", 0o644))
    except (OSError, ValueError) as error:
        raise _MountError(str(error)) from error


# -- rewriting: the pod's view of the filesystem and network onto the host's --------------------------

_ANY_ADDRESS = re.compile(r"(?P<flag>-{1,2}[\w.-]+=)?0\.0\.0\.0(?P<port>:\d+)?")
_FLAG_VALUE = re.compile(r"(-{1,2}[\w.-]+=|[^=/\s][^=\s]*=)(/.*)")
_HOST = re.compile(r"(?P<flag>-{1,2}[\w.-]+=)?(?P<host>[a-z0-9][a-z0-9.-]*)(?P<port>:\d+)?")


@dataclass(slots=True)
class _Rewriter:
    ip: str
    mounts: list[tuple[str, Path]]  # (mountPath without trailing slash, host directory), longest first
    hosts: dict[str, str] = field(default_factory=dict)  # pods' DNS names → their addresses

    def path(self, value: str) -> str | None:
        for mount_path, host in self.mounts:
            if value == mount_path or value.startswith(mount_path + "/"):
                return str(host) + value[len(mount_path) :]
        return None

    def __call__(self, value: str) -> str:
        if (match := _ANY_ADDRESS.fullmatch(value)) is not None:
            return f"{match.group('flag') or ''}{self.ip}{match.group('port') or ''}"
        if (match := _HOST.fullmatch(value)) is not None and (ip := self.hosts.get(match.group("host"))):
            return f"{match.group('flag') or ''}{ip}{match.group('port') or ''}"
        if (host := self.path(value)) is not None:
            return host
        if (match := _FLAG_VALUE.fullmatch(value)) is not None and (host := self.path(match.group(2))):
            return match.group(1) + host
        return value


def _rewriter(worker: _PodWorker, c: _Container) -> _Rewriter:
    assert worker.volumes is not None
    mounts = []
    for mount in c.spec.get("volumeMounts") or []:
        host = worker.volumes.get(mount.get("name", ""))
        mount_path = str(mount.get("mountPath", "")).rstrip("/")
        if host is None or not mount_path:
            continue
        mounts.append((mount_path, host / mount["subPath"] if mount.get("subPath") else host))
    mounts.sort(key=lambda m: len(m[0]), reverse=True)
    return _Rewriter(worker.ip, mounts, worker.kubelet.pod_dns_names())
