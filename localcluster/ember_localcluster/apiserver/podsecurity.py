"""Pod Security admission: the namespace label `pod-security.kubernetes.io/enforce` (`privileged`,
`baseline` or `restricted`) refuses Pods that break the level's Pod Security Standard, as the built-in
PodSecurity admission plugin does: 403 Forbidden, `pods "NAME" is forbidden: violates PodSecurity
"restricted:latest": CHECK (DETAIL), CHECK (DETAIL)`, the checks in the plugin's order.

Checked, with the plugin's wording: baseline — host namespaces, privileged containers, capabilities
beyond the default set, hostPath volumes, host ports; restricted adds — volume types, privilege
escalation, capabilities not dropped (only NET_BIND_SERVICE may be added), runAsNonRoot, runAsUser=0 and
the seccomp profile. Left out: AppArmor, SELinux, /proc mount, sysctls and Windows options (nothing
here sets them), `audit`/`warn` modes and exemptions.
"""

from __future__ import annotations

from typing import Any

from .errors import APIError

ENFORCE_LABEL = "pod-security.kubernetes.io/enforce"
VERSION_LABEL = "pod-security.kubernetes.io/enforce-version"
LEVELS = ("privileged", "baseline", "restricted")

# The capabilities a container runtime grants by default (baseline may add these, no others).
_BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
_RESTRICTED_VOLUMES = (
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
)  # fmt: skip


def _quoted(names: list[str]) -> str:
    return ", ".join(f'"{n}"' for n in names)


def _containers_phrase(names: list[str]) -> str:
    return f"{'container' if len(names) == 1 else 'containers'} {_quoted(names)}"


def _all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        c
        for key in ("initContainers", "containers", "ephemeralContainers")
        for c in spec.get(key) or []
        if isinstance(c, dict)
    ]


def _sc(obj: dict[str, Any]) -> dict[str, Any]:
    value = obj.get("securityContext")
    return value if isinstance(value, dict) else {}


def _baseline(spec: dict[str, Any], containers: list[dict[str, Any]]) -> list[str]:
    out = []
    hosts = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if spec.get(k) is True]
    if hosts:
        out.append(f"host namespaces ({', '.join(hosts)})")
    privileged = [c["name"] for c in containers if _sc(c).get("privileged") is True]
    if privileged:
        out.append(
            f"privileged ({_containers_phrase(privileged)} must not set securityContext.privileged=true)"
        )
    added: dict[str, list[str]] = {}
    for c in containers:
        for cap in (_sc(c).get("capabilities") or {}).get("add") or []:
            if cap not in _BASELINE_CAPABILITIES:
                added.setdefault(c["name"], []).append(cap)
    if added:
        parts = [f'{_containers_phrase([n])} must not include {_quoted(caps)} in securityContext.capabilities.add'
                 for n, caps in added.items()]  # fmt: skip
        out.append(f"non-default capabilities ({'; '.join(parts)})")
    host_paths = [
        v.get("name", "") for v in spec.get("volumes") or [] if isinstance(v, dict) and "hostPath" in v
    ]
    if host_paths:
        out.append(
            f"hostPath volumes ({'volume' if len(host_paths) == 1 else 'volumes'} {_quoted(host_paths)})"
        )
    ports = [
        (c["name"], p["hostPort"])
        for c in containers
        for p in c.get("ports") or []
        if isinstance(p, dict) and p.get("hostPort")
    ]
    if ports:
        used = "; ".join(f"{_containers_phrase([n])} uses hostPort {port}" for n, port in ports)
        out.append(f"hostPort ({used})")
    return out


def _restricted(spec: dict[str, Any], containers: list[dict[str, Any]]) -> list[str]:
    out = []
    pod_sc = _sc(spec)
    bad_volumes = [
        (v.get("name", ""), next((k for k in v if k != "name"), "unknown"))
        for v in spec.get("volumes") or []
        if isinstance(v, dict) and not any(k in v for k in _RESTRICTED_VOLUMES)
    ]
    if bad_volumes:
        used = ", ".join(f'volume "{n}" uses restricted volume type "{kind}"' for n, kind in bad_volumes)
        out.append(f"restricted volume types ({used})")
    escalating = [c["name"] for c in containers if _sc(c).get("allowPrivilegeEscalation") is not False]
    if escalating:
        out.append(
            f"allowPrivilegeEscalation != false ({_containers_phrase(escalating)} must set "
            "securityContext.allowPrivilegeEscalation=false)"
        )
    undropped = [
        c["name"] for c in containers if "ALL" not in ((_sc(c).get("capabilities") or {}).get("drop") or [])
    ]
    extra = {
        c["name"]: [a for a in (_sc(c).get("capabilities") or {}).get("add") or [] if a != "NET_BIND_SERVICE"]
        for c in containers
    }
    details = []
    if undropped:
        details.append(f'{_containers_phrase(undropped)} must set securityContext.capabilities.drop=["ALL"]')
    for name, caps in extra.items():
        if caps:
            details.append(
                f"{_containers_phrase([name])} must not include {_quoted(caps)} in securityContext.capabilities.add"
            )
    if details:
        out.append(f"unrestricted capabilities ({'; '.join(details)})")
    pod_non_root = pod_sc.get("runAsNonRoot")
    root_ok = [
        c["name"]
        for c in containers
        if not (
            _sc(c).get("runAsNonRoot") is True
            or (pod_non_root is True and _sc(c).get("runAsNonRoot") is None)
        )
    ]
    if root_ok:
        who = "pod or " + _containers_phrase(root_ok) if pod_non_root is None else _containers_phrase(root_ok)
        out.append(f"runAsNonRoot != true ({who} must set securityContext.runAsNonRoot=true)")
    root_users = [c["name"] for c in containers if _sc(c).get("runAsUser") == 0]
    if pod_sc.get("runAsUser") == 0 or root_users:
        who = "pod" if pod_sc.get("runAsUser") == 0 else _containers_phrase(root_users)
        out.append(f"runAsUser=0 ({who} must not set runAsUser=0)")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    unconfined = [
        c["name"]
        for c in containers
        if ((_sc(c).get("seccompProfile") or {}).get("type") or pod_seccomp)
        not in ("RuntimeDefault", "Localhost")
    ]
    if unconfined:
        who = (
            "pod or " + _containers_phrase(unconfined)
            if pod_seccomp is None
            else _containers_phrase(unconfined)
        )
        out.append(
            f'seccompProfile ({who} must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")'
        )
    return out


def violations(pod: dict[str, Any], level: str) -> list[str]:
    """The checks `pod` fails at `level`, each as the plugin words it."""
    if level == "privileged":
        return []
    spec = pod.get("spec") or {}
    containers = _all_containers(spec)
    found = _baseline(spec, containers)
    if level == "restricted":
        found += _restricted(spec, containers)
    return found


def admit_pod(namespace: dict[str, Any] | None, pod: dict[str, Any]) -> None:
    """Raise the plugin's 403 when the pod's namespace enforces a level the pod breaks."""
    labels = ((namespace or {}).get("metadata") or {}).get("labels") or {}
    level = labels.get(ENFORCE_LABEL)
    if level not in LEVELS:
        return
    found = violations(pod, level)
    if found:
        version = labels.get(VERSION_LABEL) or "latest"
        name = pod["metadata"]["name"]
        message = f'pods "{name}" is forbidden: violates PodSecurity "{level}:{version}": {", ".join(found)}'
        raise APIError(403, "Forbidden", message, {"name": name, "kind": "pods"})
