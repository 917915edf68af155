"""The scheduler's queue rules for a pod that found no node: when it is tried again, as kube-scheduler's
scheduling queue decides (its unschedulable pool, back-off queue and flush). Pure."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

INITIAL_BACKOFF_SECONDS = 1.0  # kube-scheduler's podInitialBackoffDuration
MAX_BACKOFF_SECONDS = 10.0  # podMaxBackoffDuration
MAX_UNSCHEDULABLE_SECONDS = 300.0  # podMaxInUnschedulablePodsDuration


@dataclass(slots=True)
class Backoff:
    """A pod that found no node: how often, when last, and whether a change since may have made room."""

    attempts: int
    failed_at: float  # time.monotonic()
    moved: bool = False

    def retry_at(self) -> float:
        if not self.moved:
            return self.failed_at + MAX_UNSCHEDULABLE_SECONDS
        backoff = INITIAL_BACKOFF_SECONDS * 2 ** (self.attempts - 1)
        return self.failed_at + min(MAX_BACKOFF_SECONDS, backoff)


def placement(node: dict[str, Any]) -> tuple[str, ...]:
    """What of a node decides which pods it takes (not its heartbeats)."""
    meta, spec, status = node["metadata"], node.get("spec") or {}, node.get("status") or {}
    parts = (meta.get("labels"), spec.get("taints"), spec.get("unschedulable"), status.get("allocatable"))
    return tuple(json.dumps(part, sort_keys=True) for part in parts)
