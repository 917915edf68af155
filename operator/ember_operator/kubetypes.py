"""The Kubernetes core/v1 types the InferenceService spec embeds, field for field as the API defines them.

They are typed (not free-form objects) so that the CRD's schema, and so the API server, checks them when an
InferenceService is applied, and so that each reaches the engine pods exactly as written
(`model_dump(by_alias=True, exclude_none=True)` gives the Kubernetes JSON). Required fields, enums and ranges
are those of the Kubernetes API; where it forbids a combination (two sources for one env var) a CEL rule says
so, with a pydantic validator beside it. Lists that CEL rules look into are bounded so that the API server's
cost estimate for those rules stays within its budget.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

# A Kubernetes resource quantity such as "500m", "8Gi" or "2".
QUANTITY = r"^[0-9]+(\.[0-9]+)?([numkMGTPE]|[KMGTPE]i)?$"
# Kubernetes reads m, u and n as thousandths, millionths and billionths, and takes a fraction without a
# suffix as it is: as a byte count ("512m" is 0.512 bytes) each is a fraction of a byte, never meant.
# The API server estimates a rule's cost from the string's maxLength: without one, `matches` over a string
# as long as a request exceeds the per-rule budget and the CRD is refused.
QUANTITY_MAX = 64
FRACTIONAL_BYTES = "^[0-9]+[.][0-9]+$|[mun]$"
ZERO_BYTES = "^0+([.]0+)?([kMGTPE]|[KMGTPE]i)?$"


def bytes_message(name: str) -> str:
    return (
        f"{name} is a number of bytes: m, u and n are thousandths, millionths and billionths (512m is 0.512 "
        "bytes) and a number without a suffix takes no fraction; write e.g. 512Mi or 512M"
    )


def byte_rules(name: str, at_least_one: bool = False) -> dict[str, Any]:
    """The CEL rules of a byte-count quantity field named `name` (`check_bytes` is the same in Python)."""
    rules = [{"rule": f"!self.matches('{FRACTIONAL_BYTES}')", "message": bytes_message(name)}]
    if at_least_one:
        rules.append(
            {"rule": f"!self.matches('{ZERO_BYTES}')", "message": f"{name} must be at least one byte"}
        )
    return {"x-kubernetes-validations": rules}


def check_bytes(name: str, value: str | None, at_least_one: bool = False) -> str | None:
    if value is not None and re.search(FRACTIONAL_BYTES, value):
        raise ValueError(f"{bytes_message(name)} (got {value!r})")
    if value is not None and at_least_one and re.search(ZERO_BYTES, value):
        raise ValueError(f"{name} must be at least one byte (got {value!r})")
    return value


# An object name (DNS-1123 subdomain): Secrets, ConfigMaps, ServiceAccounts, PriorityClasses, ...
SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SUBDOMAIN_MAX = 253
# An environment variable name as the API server accepts it (printable ASCII, no '=').
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
MAX_ENV = 128


class KubeObject(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_kube(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


def _exactly_one(fields: tuple[str, ...], what: str) -> ConfigDict:
    rule = " + ".join(f"(has(self.{f}) ? 1 : 0)" for f in fields) + " == 1"
    return ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": rule, "message": f"{what} needs exactly one of {', '.join(fields)}"}
            ]
        }
    )


def _count_set(model: BaseModel, fields: tuple[str, ...]) -> int:
    return sum(getattr(model, f) is not None for f in fields)


# -- scheduling ------------------------------------------------------------------------------------------


class NodeSelectorRequirement(KubeObject):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] | None = None


class NodeSelectorTerm(KubeObject):
    match_expressions: list[NodeSelectorRequirement] | None = None
    match_fields: list[NodeSelectorRequirement] | None = None


class NodeSelector(KubeObject):
    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1)


class PreferredSchedulingTerm(KubeObject):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(KubeObject):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = None


class LabelSelectorRequirement(KubeObject):
    key: str = Field(min_length=1)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None


class LabelSelector(KubeObject):
    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None


class PodAffinityTerm(KubeObject):
    label_selector: LabelSelector | None = None
    namespaces: list[str] | None = None
    topology_key: str = Field(min_length=1)
    namespace_selector: LabelSelector | None = None
    match_label_keys: list[str] | None = None
    mismatch_label_keys: list[str] | None = None


class WeightedPodAffinityTerm(KubeObject):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(KubeObject):
    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = None
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = None


class Affinity(KubeObject):
    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class TopologySpreadConstraint(KubeObject):
    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = Field(
        default=None, description="Default: this InferenceService's engine pods."
    )
    min_domains: int | None = Field(default=None, ge=1)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None
    match_label_keys: list[str] | None = None


class LocalObjectReference(KubeObject):
    name: str = Field(min_length=1, max_length=SUBDOMAIN_MAX, pattern=SUBDOMAIN)


# -- security ----------------------------------------------------------------------------------------------


class SeccompProfile(KubeObject):
    type: Literal["RuntimeDefault", "Localhost", "Unconfined"]
    localhost_profile: str | None = None


class AppArmorProfile(KubeObject):
    type: Literal["RuntimeDefault", "Localhost", "Unconfined"]
    localhost_profile: str | None = None


class SELinuxOptions(KubeObject):
    user: str | None = None
    role: str | None = None
    type: str | None = None
    level: str | None = None


class Sysctl(KubeObject):
    name: str = Field(min_length=1)
    value: str


class Capabilities(KubeObject):
    add: list[str] | None = None
    drop: list[str] | None = None


class PodSecurityContext(KubeObject):
    run_as_user: int | None = Field(default=None, ge=0)
    run_as_group: int | None = Field(default=None, ge=0)
    run_as_non_root: bool | None = None
    fs_group: int | None = Field(default=None, ge=0)
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = None
    supplemental_groups: list[int] | None = None
    supplemental_groups_policy: Literal["Merge", "Strict"] | None = None
    seccomp_profile: SeccompProfile | None = None
    app_armor_profile: AppArmorProfile | None = None
    se_linux_options: SELinuxOptions | None = None
    se_linux_change_policy: Literal["MountOption", "Recursive"] | None = None
    sysctls: list[Sysctl] | None = None


class SecurityContext(KubeObject):
    allow_privilege_escalation: bool | None = None
    capabilities: Capabilities | None = None
    privileged: bool | None = None
    proc_mount: Literal["Default", "Unmasked"] | None = None
    read_only_root_filesystem: bool | None = None
    run_as_user: int | None = Field(default=None, ge=0)
    run_as_group: int | None = Field(default=None, ge=0)
    run_as_non_root: bool | None = None
    seccomp_profile: SeccompProfile | None = None
    app_armor_profile: AppArmorProfile | None = None
    se_linux_options: SELinuxOptions | None = None


# -- environment -------------------------------------------------------------------------------------------


class KeySelector(KubeObject):
    """ConfigMapKeySelector and SecretKeySelector, which have the same fields."""

    name: str = Field(min_length=1, max_length=SUBDOMAIN_MAX, pattern=SUBDOMAIN)
    key: str = Field(min_length=1)
    optional: bool | None = None


class ObjectFieldSelector(KubeObject):
    field_path: str = Field(min_length=1)
    api_version: str | None = None


class ResourceFieldSelector(KubeObject):
    container_name: str | None = None
    resource: str = Field(min_length=1)
    divisor: str | None = Field(default=None, pattern=QUANTITY)


_VALUE_SOURCES = ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef")


class EnvVarSource(KubeObject):
    model_config = _exactly_one(_VALUE_SOURCES, "valueFrom")

    field_ref: ObjectFieldSelector | None = None
    resource_field_ref: ResourceFieldSelector | None = None
    config_map_key_ref: KeySelector | None = None
    secret_key_ref: KeySelector | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if _count_set(self, ("field_ref", "resource_field_ref", "config_map_key_ref", "secret_key_ref")) != 1:
            raise ValueError(f"valueFrom needs exactly one of {', '.join(_VALUE_SOURCES)}")
        return self


class EnvVar(KubeObject):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!(has(self.value) && has(self.valueFrom))",
                    "message": "env: value and valueFrom are exclusive",
                }
            ]
        }
    )

    name: str = Field(min_length=1, max_length=SUBDOMAIN_MAX, pattern=ENV_NAME)
    value: str | None = None
    value_from: EnvVarSource | None = None

    @model_validator(mode="after")
    def _value_or_source(self) -> Self:
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: value and valueFrom are exclusive")
        return self

    def to_kube(self) -> dict[str, object]:
        out = super().to_kube()
        if self.value_from is None:
            out.setdefault("value", "")
        return out


class SourceReference(KubeObject):
    """ConfigMapEnvSource and SecretEnvSource."""

    name: str = Field(min_length=1, max_length=SUBDOMAIN_MAX, pattern=SUBDOMAIN)
    optional: bool | None = None


class EnvFromSource(KubeObject):
    model_config = _exactly_one(("configMapRef", "secretRef"), "envFrom")

    prefix: str | None = None
    config_map_ref: SourceReference | None = None
    secret_ref: SourceReference | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Self:
        if _count_set(self, ("config_map_ref", "secret_ref")) != 1:
            raise ValueError("envFrom needs exactly one of configMapRef, secretRef")
        return self
