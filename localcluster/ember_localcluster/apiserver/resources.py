"""Resource types: what the server can store, and how a CustomResourceDefinition becomes one.

A `ResourceType` is one served (group, version, plural). Objects live per (group, plural), so all
served versions of a CRD share one storage and an object reads back under whichever version the
request names; there is no conversion between versions (the project serves only one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from . import celcost, crdschema
from .errors import Cause, forbidden, required

VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(slots=True, frozen=True)
class ScalePaths:
    """Where `/scale` reads and writes: CRD `subresources.scale`, as dotted paths like `.spec.replicas`."""

    spec_replicas: str
    status_replicas: str
    label_selector: str | None = None


@dataclass(slots=True)
class ResourceType:
    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    has_status: bool = False
    scale: ScalePaths | None = None
    # Custom resources only: the version's openAPIV3Schema and additionalPrinterColumns.
    schema: dict[str, Any] | None = None
    printer_columns: tuple[dict[str, Any], ...] = ()
    selectable_fields: tuple[str, ...] = ()
    custom: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


def _wrong(path: str, detail: str) -> Cause:
    return Cause(path, "FieldValueInvalid", f"Invalid value: {detail}")


def _schema_causes(node: Any, path: str) -> list[Cause]:
    """A schema must be a tree of objects wherever the validator walks it."""
    if not isinstance(node, dict):
        return [_wrong(path, "must be an object")]
    causes = []
    properties = node.get("properties", {})
    if not isinstance(properties, dict):
        causes.append(_wrong(f"{path}.properties", "must be an object"))
    else:
        for key, child in properties.items():
            causes += _schema_causes(child, f"{path}.properties[{key}]")
    for key in ("items", "additionalProperties"):
        if key in node and not (key == "additionalProperties" and isinstance(node[key], bool)):
            causes += _schema_causes(node[key], f"{path}.{key}")
    rules = node.get("x-kubernetes-validations", [])
    if not (
        isinstance(rules, list) and all(isinstance(r, dict) and isinstance(r.get("rule"), str) for r in rules)
    ):
        causes.append(_wrong(f"{path}.x-kubernetes-validations", "each rule needs a string `rule`"))
    else:
        for index, rule in enumerate(rules):
            causes += _field_path_causes(
                node, rule.get("fieldPath"), f"{path}.x-kubernetes-validations[{index}]"
            )
    return causes


def _field_path_causes(node: dict[str, Any], field_path: Any, path: str) -> list[Cause]:
    """apiextensions-apiserver's checks of a rule's `fieldPath` (ValidateCustomResourceDefinitionOpenAPISchema)."""
    if field_path is None or field_path == "":
        return []
    where, shown = f"{path}.fieldPath", json.dumps(field_path)
    causes = []
    if not isinstance(field_path, str):
        return [_wrong(where, f"{shown}: must be a string")]
    if not field_path.strip():
        causes.append(_wrong(where, f"{shown}: fieldPath must be non-empty if specified"))
    if "\n" in field_path or "\r" in field_path:
        causes.append(_wrong(where, f"{shown}: fieldPath must not contain line breaks"))
    if not _names_a_field(node, field_path):
        causes.append(_wrong(where, f"{shown}: fieldPath must be a valid path"))
    return causes


_PATH_TOKEN = re.compile(r"'(?:[^'\\]|\\.)*'|[.\[\]]|[^.\[\]']+")


def _names_a_field(node: dict[str, Any], field_path: str) -> bool:
    """Whether the path walks the schema's declared fields and map keys, as `cel.ValidFieldPath` walks them:
    `.name` or `['name']` steps into a declared property, or any key of a map (additionalProperties)."""
    tokens = _PATH_TOKEN.findall(field_path)
    if "".join(tokens) != field_path:
        return False
    at = 0
    while at < len(tokens):
        if tokens[at] == "." and at + 1 < len(tokens) and tokens[at + 1] not in ".[]":
            name, at = tokens[at + 1], at + 2
        elif tokens[at] == "[" and at + 2 < len(tokens) and tokens[at + 2] == "]":
            quoted, at = tokens[at + 1], at + 3
            if len(quoted) < 2 or quoted[0] != "'" or quoted[-1] != "'":
                return False
            name = re.sub(r"\\(.)", r"\1", quoted[1:-1])
        else:
            return False
        properties = node.get("properties")
        if properties:
            if name not in properties:
                return False
            node = properties[name]
        elif isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
        else:
            return False
    return True


def _root_metadata_causes(root: Any, path: str) -> list[Cause]:
    """The root's `metadata` may restrict `name` and `generateName` and nothing else: the server supplies
    ObjectMeta's schema itself (apiextensions-apiserver's validateStructuralMetadataInvariants)."""
    metadata = root.get("properties", {}).get("metadata") if isinstance(root, dict) else None
    if not isinstance(metadata, dict):
        return []
    rest = {k: v for k, v in metadata.items() if k not in ("type", "properties", "default")}
    properties = metadata.get("properties") or {}
    if rest or not isinstance(properties, dict) or set(properties) - {"name", "generateName"}:
        message = (
            "must not specify anything other than name and generateName, but metadata is implicitly specified"
        )
        return [forbidden(f"{path}.properties[metadata]", message)]
    return []


def _version_causes(version: Any, path: str) -> list[Cause]:
    if not isinstance(version, dict) or not isinstance(version.get("name"), str) or not version["name"]:
        return [required(f"{path}.name")]
    causes = []
    schema = version.get("schema", {})
    root = schema.get("openAPIV3Schema", {}) if isinstance(schema, dict) else schema
    if isinstance(schema, dict) and schema.get("openAPIV3Schema") is None:
        # apiextensions v1 (ValidateCustomResourceDefinitionVersion): every version needs a schema.
        causes.append(
            Cause(
                f"{path}.schema.openAPIV3Schema", "FieldValueRequired", "Required value: schemas are required"
            )
        )
    else:
        where = f"{path}.schema.openAPIV3Schema"
        causes += _schema_causes(root, where)
        if not causes:  # the checks below read the schema as a tree of objects
            causes += crdschema.openapi_causes(root, where) + crdschema.structural_causes(root, where)
            causes += _root_metadata_causes(root, where)
        if not causes:  # as upstream, the CEL checks run on a schema without other errors
            causes += [Cause(*problem) for problem in celcost.schema_problems(root, where)]
        if not causes:  # defaults are checked against a structural schema whose rules compile
            causes += crdschema.default_causes(root, where)
    subresources = version.get("subresources") or {}
    if not isinstance(subresources, dict):
        causes.append(_wrong(f"{path}.subresources", "must be an object"))
    elif (scale := subresources.get("scale")) is not None and not (
        isinstance(scale, dict)
        and all(isinstance(scale.get(k), str) for k in ("specReplicasPath", "statusReplicasPath"))
    ):
        causes.append(required(f"{path}.subresources.scale.specReplicasPath"))
    columns = version.get("additionalPrinterColumns") or []
    if not (
        isinstance(columns, list)
        and all(isinstance(c, dict) and "name" in c and "jsonPath" in c for c in columns)
    ):
        causes.append(_wrong(f"{path}.additionalPrinterColumns", "each column needs a name and a jsonPath"))
    return causes


def crd_causes(crd: dict[str, Any]) -> list[Cause]:
    """The checks of the real server that registration and validation here rely on."""
    spec = crd.get("spec")
    if not isinstance(spec, dict):
        return [required("spec")]
    names: dict[str, Any] = spec["names"] if isinstance(spec.get("names"), dict) else {}
    causes = [
        required(path)
        for path, value in (
            ("spec.group", spec.get("group")),
            ("spec.names.plural", names.get("plural")),
            ("spec.names.kind", names.get("kind")),
        )
        if not isinstance(value, str) or not value
    ]
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        message = 'Unsupported value: supported values: "Cluster", "Namespaced"'
        causes.append(Cause("spec.scope", "FieldValueNotSupported", message))
    versions = spec.get("versions")
    if not isinstance(versions, list) or not versions:
        return [*causes, required("spec.versions")]
    for index, version in enumerate(versions):
        causes += _version_causes(version, f"spec.versions[{index}]")
    if not causes and sum(1 for v in versions if v.get("storage")) != 1:
        causes.append(_wrong("spec.versions", "must have exactly one version marked as storage version"))
    name = crd["metadata"].get("name")
    if not causes and name != f"{names['plural']}.{spec['group']}":
        causes.append(_wrong("metadata.name", f'"{name}": must be spec.names.plural+"."+spec.group'))
    return causes


def crd_resource_types(crd: dict[str, Any]) -> list[ResourceType]:
    """One `ResourceType` per served version of a (validated) CRD."""
    spec = crd["spec"]
    names = spec["names"]
    types = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        subresources = version.get("subresources") or {}
        scale = subresources.get("scale")
        types.append(
            ResourceType(
                group=spec["group"],
                version=version["name"],
                kind=names["kind"],
                plural=names["plural"],
                namespaced=spec["scope"] == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                has_status="status" in subresources,
                scale=ScalePaths(
                    scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath")
                )
                if scale
                else None,
                schema=(version.get("schema") or {}).get("openAPIV3Schema")
                or {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
                selectable_fields=tuple(
                    str(f.get("jsonPath", "")).lstrip(".") for f in version.get("selectableFields") or ()
                ),
                custom=True,
            )
        )
    return types
