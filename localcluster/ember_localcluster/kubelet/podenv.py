"""A container's environment and command line, as the process kubelet builds them.

`env` (`value` with `$(VAR)` expansion, `valueFrom.fieldRef` for metadata.name, namespace, uid,
labels['k'], annotations['k'], spec.nodeName, spec.serviceAccountName, status.podIP(s) and
status.hostIP(s), `valueFrom.configMapKeyRef` and `valueFrom.secretKeyRef`) and `envFrom` ConfigMaps and
Secrets, on top of this process's own environment; `$(VAR)` references in command and args are expanded
too. The working directory is the pod's directory. Unless the pod sets `automountServiceAccountToken: false`,
`KUBECONFIG` names the cluster's kubeconfig, standing in for the mounted service account token (the
local API server authorizes every request, so the pod's ServiceAccount and its bindings grant nothing
more). A missing ConfigMap, Secret or key is a `CreateContainerConfigError` with the kubelet's message.
"""

from __future__ import annotations

import base64
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ember_localcluster.kubelet.node import HOST_IP
from ember_localcluster.kubelet.podvolumes import _Rewriter, _rewriter

if TYPE_CHECKING:
    from ember_localcluster.kubelet.containers import _Container
    from ember_localcluster.kubelet.podworker import _PodWorker

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class _ConfigError(Exception):
    """The container cannot be configured (CreateContainerConfigError)."""


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` escapes, the rest is kept."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(replace, value)


def _field(worker: _PodWorker, path: str) -> str:
    meta = worker.pod["metadata"]
    simple = {
        "metadata.name": worker.name,
        "metadata.namespace": worker.namespace,
        "metadata.uid": worker.uid,
        "spec.nodeName": worker.node_name,
        "spec.serviceAccountName": worker.spec.get("serviceAccountName") or "default",
        "status.podIP": worker.ip,
        "status.podIPs": worker.ip,
        "status.hostIP": HOST_IP,
        "status.hostIPs": HOST_IP,
    }
    if path in simple:
        return simple[path]
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match is not None:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise _ConfigError(f"unsupported fieldRef fieldPath: {path}")


def _data(worker: _PodWorker, kind: str, name: str) -> dict[str, str] | None:
    """A ConfigMap's data or a Secret's (decoded) in the pod's namespace; None when there is none."""
    if kind == "ConfigMap":
        configmap = worker.kubelet.configmaps.get((worker.namespace, name))
        return None if configmap is None else dict(configmap.get("data") or {})
    secret = worker.kubelet.secrets.get((worker.namespace, name))
    if secret is None:
        return None
    data = {k: base64.b64decode(v).decode(errors="replace") for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


def _environment(worker: _PodWorker, c: _Container, rewrite: _Rewriter) -> dict[str, str]:
    # The kubelet's messages (makeEnvironmentVariables): the API's NotFound for a missing object, "couldn't
    # find key" for a missing key; `optional` skips either.
    env: dict[str, str] = {}
    for source in c.spec.get("envFrom") or []:
        kind, ref = (
            ("ConfigMap", source["configMapRef"])
            if "configMapRef" in source
            else ("Secret", source.get("secretRef"))
        )
        if ref is None:
            raise _ConfigError(f"envFrom {sorted(source)} is not supported by the process kubelet")
        data = _data(worker, kind, ref.get("name", ""))
        if data is None and not ref.get("optional"):
            raise _ConfigError(f'{kind.lower()} "{ref.get("name")}" not found')
        for key, value in (data or {}).items():
            env[source.get("prefix", "") + key] = rewrite(value)
    for var in c.spec.get("env") or []:
        if "valueFrom" not in var:
            env[var["name"]] = rewrite(expand(str(var.get("value", "")), env))
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = _field(worker, source["fieldRef"].get("fieldPath", ""))
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind, ref = (
                ("ConfigMap", source["configMapKeyRef"])
                if "configMapKeyRef" in source
                else ("Secret", source["secretKeyRef"])
            )
            data = _data(worker, kind, ref.get("name", ""))
            if data is not None and ref.get("key") in data:
                env[var["name"]] = rewrite(data[ref["key"]])
            elif ref.get("optional"):
                continue
            elif data is None:
                raise _ConfigError(f'{kind.lower()} "{ref.get("name")}" not found')
            else:
                raise _ConfigError(
                    f"couldn't find key {ref.get('key')} in {kind} {worker.namespace}/{ref.get('name')}"
                )
        else:
            raise _ConfigError(f"env {var['name']}: {sorted(source)} is not supported by the process kubelet")
    return env


def _command(
    worker: _PodWorker, c: _Container, entrypoint: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    rewrite = _rewriter(worker, c)
    env = _environment(worker, c, rewrite)
    words = [*(c.spec.get("command") or entrypoint), *(c.spec.get("args") or [])]
    if not words:
        raise _ConfigError("no command specified")
    argv = [rewrite(expand(str(word), env)) for word in words]
    argv[0] = worker.kubelet.resolve(argv[0])
    inherited = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    if worker.spec.get("automountServiceAccountToken") is not False:
        # The stand-in for the service account token a kubelet mounts: the cluster's kubeconfig.
        inherited["KUBECONFIG"] = str(worker.kubelet.kubeconfig)
    return argv, {**inherited, "HOSTNAME": worker.name, **env}
