"""The InferenceService's say over its engine pods beyond the engine itself: placement and identity
(`spec.pod`), probe and shutdown timing (`spec.lifecycle`) and the escape hatch for everything else
(`spec.podTemplate`, a strategic-merge patch applied last; `podpatch` checks and applies it).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Self

from pydantic import ConfigDict, Field, field_validator, model_validator

from ember_operator.kubetypes import (
    SUBDOMAIN,
    SUBDOMAIN_MAX,
    Affinity,
    KubeObject,
    LocalObjectReference,
    PodSecurityContext,
    SecurityContext,
    TopologySpreadConstraint,
)

# Labels the operator sets on every engine pod (its Service, PDB, rolls and the router select by them).
PROTECTED_LABEL_KEYS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
)
PROTECTED_LABEL_PREFIX = "ember.dev/"
_PROTECTED_LABELS_CEL = (
    "self.all(k, !k.startsWith('ember.dev/') && !(k in ['app.kubernetes.io/name', "
    "'app.kubernetes.io/instance', 'app.kubernetes.io/managed-by']))"
)
_PROTECTED_LABELS_MESSAGE = (
    "labels may not set app.kubernetes.io/name, app.kubernetes.io/instance, app.kubernetes.io/managed-by "
    "or ember.dev/ keys: the operator selects its pods by them"
)
# Label and annotation keys: an optional DNS-subdomain prefix and a name (Kubernetes' qualified name).
QUALIFIED_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")


def check_labels(labels: dict[str, str], what: str) -> dict[str, str]:
    for key, value in labels.items():
        if not QUALIFIED_NAME.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
            raise ValueError(f"{what}: {key!r} is not a valid label key")
        if len(value) > 63 or not LABEL_VALUE.match(value):
            raise ValueError(f"{what}: the value {value!r} of {key!r} is not a valid label value")
        if key in PROTECTED_LABEL_KEYS or key.startswith(PROTECTED_LABEL_PREFIX):
            raise ValueError(f"{what}: {_PROTECTED_LABELS_MESSAGE} (got {key!r})")
    return labels


def check_annotations(annotations: dict[str, str], what: str) -> dict[str, str]:
    for key in annotations:
        if not QUALIFIED_NAME.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
            raise ValueError(f"{what}: {key!r} is not a valid annotation key")
    return annotations


def _labels_field() -> Any:
    return Field(
        default_factory=dict,
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": _PROTECTED_LABELS_CEL, "message": _PROTECTED_LABELS_MESSAGE}
            ]
        },
    )


class _Labelled(KubeObject):
    """Labels and annotations for the engine pods: valid Kubernetes keys and values, none of the operator's."""

    where: ClassVar[str] = "pod"  # how error messages name the fields
    labels: dict[str, str] = _labels_field()
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("labels")
    @classmethod
    def _labels(cls, value: dict[str, str]) -> dict[str, str]:
        return check_labels(value, f"{cls.where}.labels")

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, value: dict[str, str]) -> dict[str, str]:
        return check_annotations(value, f"{cls.where}.annotations")


class PodSettings(_Labelled):
    """`spec.pod`: where the engine pods run and who they are. Each field reaches every engine pod as
    written (the node selector and tolerations stay in `spec.resources`)."""

    affinity: Affinity | None = None
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(default_factory=list, max_length=16)
    priority_class_name: str | None = Field(default=None, max_length=SUBDOMAIN_MAX, pattern=SUBDOMAIN)
    service_account_name: str | None = Field(default=None, max_length=SUBDOMAIN_MAX, pattern=SUBDOMAIN)
    runtime_class_name: str | None = Field(default=None, max_length=SUBDOMAIN_MAX, pattern=SUBDOMAIN)
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    security_context: PodSecurityContext | None = Field(
        default=None, description="Merged over the operator's (runAsNonRoot, seccomp RuntimeDefault)."
    )
    container_security_context: SecurityContext | None = Field(
        default=None,
        description="The engine container's, merged over the operator's (no privilege escalation, every "
        "capability dropped).",
    )


PRESTOP_SECONDS = 5
GRACE_MARGIN_SECONDS = 10


class Lifecycle(KubeObject):
    """`spec.lifecycle`: how long an engine may take to start, how readiness is probed, how it stops."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!has(self.terminationGracePeriodSeconds) || "
                    f"self.terminationGracePeriodSeconds >= self.drainSeconds + {PRESTOP_SECONDS}",
                    "message": f"terminationGracePeriodSeconds must cover drainSeconds + the {PRESTOP_SECONDS} s "
                    "preStop pause, or streams still draining are killed",
                }
            ]
        }
    )

    startup_timeout_seconds: int = Field(
        default=1800,
        ge=10,
        le=86400,
        description="How long the engine may take to load its model and warm up (the model fetch, in an "
        "init container, is not counted) before the kubelet restarts it: a startup probe on /ready.",
    )
    readiness_period_seconds: int = Field(default=2, ge=1, le=300)
    readiness_failure_threshold: int = Field(default=1, ge=1, le=100)
    liveness_period_seconds: int = Field(default=10, ge=1, le=300)
    liveness_failure_threshold: int = Field(default=3, ge=1, le=100)
    drain_seconds: int = Field(
        default=30,
        ge=0,
        le=86400,
        description="After SIGTERM the engine stops taking requests and finishes those in flight (streams "
        "included) for up to this long.",
    )
    termination_grace_period_seconds: int | None = Field(
        default=None,
        ge=0,
        le=86400,
        description=f"Default: drainSeconds + the {PRESTOP_SECONDS} s preStop pause + {GRACE_MARGIN_SECONDS} s.",
    )

    @model_validator(mode="after")
    def _grace_covers_drain(self) -> Self:
        grace = self.termination_grace_period_seconds
        if grace is not None and grace < self.drain_seconds + PRESTOP_SECONDS:
            raise ValueError(
                f"terminationGracePeriodSeconds ({grace}) must cover drainSeconds + the {PRESTOP_SECONDS} s "
                "preStop pause, or streams still draining are killed"
            )
        return self

    @property
    def grace_seconds(self) -> int:
        if self.termination_grace_period_seconds is not None:
            return self.termination_grace_period_seconds
        return self.drain_seconds + PRESTOP_SECONDS + GRACE_MARGIN_SECONDS


class PodTemplateMetadata(_Labelled):
    where: ClassVar[str] = "podTemplate.metadata"


class PodTemplate(KubeObject):
    """`spec.podTemplate`: a strategic-merge patch over each engine pod, applied after every other field.

    `spec` is a patch of a core/v1 PodSpec: field names and types are checked against the Kubernetes API's
    own definitions when the operator applies it (a wrong one stalls the service naming the field), and the
    operator's contract with the engine (its container's command, args and port, the policy volume) may not
    be changed through it."""

    metadata: PodTemplateMetadata = Field(default_factory=PodTemplateMetadata)
    spec: dict[str, Any] = Field(
        default_factory=dict, json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )
