"""The Argo CD health check for InferenceService, run the way Argo CD runs it: Lua 5.1, base and table only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lupa.lua51
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "manifests" / "argocd" / "health.lua"
CM_PATCH = REPO / "manifests" / "argocd" / "argocd-cm-patch.yaml"
CM_KEY = "resource.customizations.health.ember.dev_InferenceService"


def _lua_runtime() -> lupa.lua51.LuaRuntime:
    lua = lupa.lua51.LuaRuntime(register_eval=False, register_builtins=False)
    # Argo CD opens only the package, base and table libraries (and a trimmed os) unless useOpenLibs is set,
    # so strings have no methods either: take away what gopher-lua would not have.
    lua.execute(
        """
        getmetatable("").__index = nil
        string, math, io, debug, coroutine, python = nil, nil, nil, nil, nil, nil
        """
    )
    return lua


def _to_lua(lua: lupa.lua51.LuaRuntime, value: Any) -> Any:
    # As Argo CD's decodeValue: maps become tables, lists 1-based sequences.
    if isinstance(value, dict):
        return lua.table_from({k: _to_lua(lua, v) for k, v in value.items()})
    if isinstance(value, list):
        return lua.table_from([_to_lua(lua, v) for v in value])
    return value


def health(obj: dict[str, Any]) -> dict[str, str]:
    lua = _lua_runtime()
    lua.globals().obj = _to_lua(lua, obj)
    result = lua.execute(SCRIPT.read_text())  # Argo CD's DoString: the chunk's return value
    out = dict(result.items())
    assert set(out) == {"status", "message"}
    return out


def _cond(kind: str, status: str, reason: str = "", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message, "observedGeneration": 3}


def _service(status: dict[str, Any] | None, generation: int = 3) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": "default", "generation": generation},
        "spec": {"model": {"name": "m", "source": "/models/m"}},
    }
    if status is not None:
        obj["status"] = status
    return obj


def _status(*conditions: dict[str, Any], **counts: int) -> dict[str, Any]:
    fields = {"replicas": 2, "warmReplicas": 1, "readyReplicas": 2, "desiredReplicas": 2, **counts}
    return {"observedGeneration": 3, "conditions": list(conditions), **fields}


SETTLED = (_cond("Reconciling", "False", "Converged"), _cond("Stalled", "False", "NoProblems"))

CASES = {
    "no status": (_service(None), "Progressing", "Waiting for the operator to observe generation 3"),
    "stale generation": (
        _service({**_status(_cond("Ready", "True", "MinimumReplicasReady")), "observedGeneration": 2}),
        "Progressing",
        "Waiting for the operator to observe generation 3",
    ),
    "status without observedGeneration": (
        _service({"replicas": 0}),
        "Progressing",
        "Waiting for the operator to observe generation 3",
    ),
    "stalled beats ready": (
        _service(
            _status(
                _cond("Ready", "True", "MinimumReplicasReady", "1/2 active Ready, 0 warm"),
                _cond("Reconciling", "False", "Stalled", "waiting for a change to the spec"),
                _cond("Stalled", "True", "ImageUnavailable", "pod chat-1a2b3: ErrImagePull"),
            )
        ),
        "Degraded",
        "ImageUnavailable: pod chat-1a2b3: ErrImagePull",
    ),
    "reconciling": (
        _service(
            _status(
                _cond("Ready", "True", "MinimumReplicasReady", "1/2 active Ready, 1 warm"),
                _cond("Reconciling", "True", "ScalingUp", "1/2 active Ready, 1 warm"),
                _cond("Stalled", "False", "NoProblems"),
                readyReplicas=1,
            )
        ),
        "Progressing",
        "ScalingUp: 1/2 active Ready, 1 warm",
    ),
    "ready": (
        _service(
            _status(_cond("Ready", "True", "MinimumReplicasReady", "2/2 active Ready, 1 warm"), *SETTLED)
        ),
        "Healthy",
        "2 active, 1 warm, 2 ready",
    ),
    "ready without counts": (
        _service({"observedGeneration": 3, "conditions": [_cond("Ready", "True"), *SETTLED]}),
        "Healthy",
        "0 active, 0 warm, 0 ready",
    ),
    "not ready": (
        _service(
            _status(
                _cond("Ready", "False", "MinimumReplicasUnavailable", "0/2 active Ready, 0 warm"),
                *SETTLED,
                readyReplicas=0,
                warmReplicas=0,
            )
        ),
        "Degraded",
        "MinimumReplicasUnavailable: 0/2 active Ready, 0 warm",
    ),
    "not ready, bare condition": (
        _service(_status({"type": "Ready", "status": "False"})),
        "Degraded",
        "Not ready",
    ),
    "scaled to zero": (
        _service(
            _status(
                _cond("Ready", "True", "MinimumReplicasReady", "0/0 active Ready, 1 warm"),
                *SETTLED,
                replicas=0,
                readyReplicas=0,
                desiredReplicas=0,
            )
        ),
        "Suspended",
        "Scaled to zero, 1 warm",
    ),
    "scaling to zero is still progress": (
        _service(
            _status(
                _cond("Reconciling", "True", "ScalingDown", "0/0 active Ready, 0 warm"),
                replicas=1,
                desiredReplicas=0,
            )
        ),
        "Progressing",
        "ScalingDown: 0/0 active Ready, 0 warm",
    ),
    "zero active but one wanted": (
        _service(
            _status(
                _cond("Ready", "False", "MinimumReplicasUnavailable", "0/1 active Ready, 0 warm"),
                *SETTLED,
                replicas=0,
                readyReplicas=0,
                desiredReplicas=1,
            )
        ),
        "Degraded",
        "MinimumReplicasUnavailable: 0/1 active Ready, 0 warm",
    ),
    "conditions missing": (
        _service({"observedGeneration": 3, "replicas": 1}),
        "Progressing",
        "Waiting for the Ready condition",
    ),
    "empty conditions": (
        _service({"observedGeneration": 3, "conditions": []}),
        "Progressing",
        "Waiting for the Ready condition",
    ),
    "ready unknown": (
        _service(_status(_cond("Ready", "Unknown", "MetricsUnavailable", "no pod answered"), *SETTLED)),
        "Progressing",
        "MetricsUnavailable: no pod answered",
    ),
    "other conditions are not health": (
        _service(
            _status(
                _cond("Ready", "True", "MinimumReplicasReady"),
                *SETTLED,
                _cond("WarmPoolReady", "False", "PoolFilling", "0/1 warm pods Ready"),
                _cond("MetricsAvailable", "False", "ScrapeFailed"),
                _cond("FallbackActive", "True", "Overloaded"),
            )
        ),
        "Healthy",
        "2 active, 1 warm, 2 ready",
    ),
    "newer status than generation": (
        _service(_status(_cond("Ready", "True"), *SETTLED), generation=2),
        "Healthy",
        "2 active, 1 warm, 2 ready",
    ),
}


@pytest.mark.parametrize(("obj", "status", "message"), CASES.values(), ids=CASES.keys())
def test_health(obj: dict[str, Any], status: str, message: str) -> None:
    assert health(obj) == {"status": status, "message": message}


def test_sandbox_matches_argocd() -> None:
    # The cases above prove the script needs nothing beyond Argo CD's default libraries only if those are
    # really gone here.
    lua = _lua_runtime()
    assert lua.eval("_VERSION") == "Lua 5.1"
    assert lua.eval("string == nil and math == nil and python == nil")
    with pytest.raises(lupa.lua51.LuaError):
        lua.execute('return ("x"):upper()')


def test_argocd_cm_patch_embeds_the_script_verbatim() -> None:
    patch = yaml.safe_load(CM_PATCH.read_text())
    assert (patch["apiVersion"], patch["kind"]) == ("v1", "ConfigMap")
    assert (patch["metadata"]["name"], patch["metadata"]["namespace"]) == ("argocd-cm", "argocd")
    assert set(patch["data"]) == {CM_KEY}
    assert patch["data"][CM_KEY] == SCRIPT.read_text()
