"""`examples/local.yaml`'s InferenceService, `tiny`, on a `DevCluster`: its manifest, its conditions, its
engine pods, and the wait for it to serve with its warm pool full."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from waiting import wait_for

from ember_localcluster.devcluster import DevCluster

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "local.yaml"


def tiny_manifest() -> dict[str, Any]:
    return dict(yaml.safe_load(EXAMPLE.read_text()))


def tiny(cluster: DevCluster) -> dict[str, Any]:
    return cluster.api.get("ember.dev/v1alpha1", "InferenceService", "default", "tiny") or {}


def tiny_conditions(cluster: DevCluster) -> dict[str, str]:
    """Its conditions, type to status."""
    return {c["type"]: c["status"] for c in (tiny(cluster).get("status") or {}).get("conditions", [])}


def tiny_engines(cluster: DevCluster, role: str) -> list[dict[str, Any]]:
    """The engine pods of a role (active, warm) not being deleted."""
    return [
        p
        for p in cluster.api.list("v1", "Pod", "default", label_selector=f"ember.dev/role={role}")
        if not p["metadata"].get("deletionTimestamp")
    ]


def pooled(cluster: DevCluster, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Wait until it is Ready with its warm pool full; its (active, warm) pods then."""

    def conditions() -> dict[str, str]:
        return tiny_conditions(cluster)

    wait_for(
        lambda: conditions().get("Ready") == "True" and conditions().get("WarmPoolReady") == "True",
        timeout,
        conditions,
    )
    (active,), (warm,) = tiny_engines(cluster, "active"), tiny_engines(cluster, "warm")
    return active, warm
