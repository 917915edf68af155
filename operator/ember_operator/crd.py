"""The InferenceService CustomResourceDefinition, derived from `ember_operator.spec`'s models.

Regenerate the committed copy with `make crds` (which runs this module).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml
from pydantic import BaseModel

from ember_operator.spec import (
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    InferenceServiceSpec,
    InferenceServiceStatus,
)

REGENERATE = "make crds"

Schema = dict[str, Any]


def _structural(node: Schema, defs: dict[str, Schema]) -> Schema:
    """pydantic's JSON schema -> a structural OpenAPI v3 schema, the only kind Kubernetes v1 CRDs accept."""
    if "$ref" in node:  # Kubernetes does not resolve references: inline the definition
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        return _structural({**target, **{k: v for k, v in node.items() if k != "$ref"}}, defs)
    if "anyOf" in node:  # pydantic's Optional: absence already means null, so keep the one real type
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"no structural form for a union of {branches}")
        rest = {k: v for k, v in node.items() if k != "anyOf" and not (k == "default" and v is None)}
        return _structural({**branches[0], **rest}, defs)
    out: Schema = {}
    for key, value in node.items():
        if key in ("title", "$defs") or (key == "additionalProperties" and value is False):
            continue  # pruning of unknown fields already does what `additionalProperties: false` would
        if key == "additionalProperties" and value is True:
            if not node.get("x-kubernetes-preserve-unknown-fields"):
                raise ValueError(f"a free-form object needs x-kubernetes-preserve-unknown-fields: {node}")
            continue  # structural schemas say it with x-kubernetes-preserve-unknown-fields alone
        if key in ("exclusiveMinimum", "exclusiveMaximum"):  # JSON Schema's number -> OpenAPI 3.0's flag
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
        else:  # default, enum, description, ...: values, not schemas, so copied untouched
            out[key] = value
    return out


def _model_schema(model: type[BaseModel]) -> Schema:
    schema = model.model_json_schema(by_alias=True)
    return _structural(schema, schema.get("$defs", {}))


def _column(name: str, type_: str, path: str, description: str) -> dict[str, str]:
    return {"name": name, "type": type_, "jsonPath": path, "description": description}


# The Service takes the name as is (63 at most); pod, ConfigMap and PDB names add suffixes to it.
MAX_NAME_LENGTH = 52
# With resources.nodes > 1 a replica is a LeaderWorkerSet named `<name>-` plus 5 generated characters; its
# worker StatefulSet is `<lws>-0`, whose pods carry controller-revision-hash `<statefulset>-<hash>` (a hash
# of up to 10 characters), a label value of at most 63.
MAX_GROUP_NAME_LENGTH = 63 - len("-") - 10 - len("-0") - len("-") - 5


def crd_manifest() -> dict[str, Any]:
    root: Schema = {
        "type": "object",
        "required": ["spec"],
        # The name becomes the Service's name (DNS-1035) and a label value, and pods and ConfigMaps append
        # suffixes to it: refused here, the API server answers a clear 422 instead of the operator's
        # children failing one by one.
        "x-kubernetes-validations": [
            {
                "rule": f"self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && "
                f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
                "message": "metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', "
                f"starting with a letter and ending with a letter or digit) of at most {MAX_NAME_LENGTH} "
                "characters, leaving room for the suffixes of the objects made from it",
                "fieldPath": ".metadata.name",
                "reason": "FieldValueInvalid",
            },
            {
                "rule": f"self.spec.resources.nodes == 1 || size(self.metadata.name) <= {MAX_GROUP_NAME_LENGTH}",
                "message": f"metadata.name may have at most {MAX_GROUP_NAME_LENGTH} characters when "
                "resources.nodes > 1: each replica is a LeaderWorkerSet named after it, whose worker "
                "StatefulSet's pods carry a controller-revision-hash label of the StatefulSet's name and a "
                "hash, and a label value may not exceed 63 characters",
                "fieldPath": ".metadata.name",
                "reason": "FieldValueInvalid",
            },
        ],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            # Declared so that the rules' fieldPath `.metadata.name` names a field of the schema: kube-apiserver
            # refuses a fieldPath its schema does not declare. The root's metadata may declare nothing else.
            "metadata": {"type": "object", "properties": {"name": {"type": "string"}}},
            "spec": _model_schema(InferenceServiceSpec),
            "status": _model_schema(InferenceServiceStatus),
        },
    }
    version = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": root},
        "subresources": {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas.desired",
                "statusReplicasPath": ".status.replicas",
                "labelSelectorPath": ".status.selector",
            },
        },
        "additionalPrinterColumns": [
            _column("Ready", "string", '.status.conditions[?(@.type=="Ready")].status', "Serving traffic"),
            _column("Active", "integer", ".status.replicas", "Engine pods serving or starting"),
            _column("Warm", "integer", ".status.warmReplicas", "Pods in the warm pool"),
            _column("Desired", "integer", ".status.desiredReplicas", "The autoscaler's target"),
            _column(
                "Queue",
                "number",
                ".status.autoscaler.inputs.queueDepth",
                "Requests waiting per Ready active pod (mean, at the last scrape)",
            ),
            _column(
                "KV",
                "number",
                ".status.autoscaler.inputs.kvCacheUtilization",
                "KV-cache use per Ready active pod, 0..1 (mean, at the last scrape)",
            ),
            _column("Routers", "string", ".status.router.summary", "Router pods Ready / wanted"),
            _column("Age", "date", ".metadata.creationTimestamp", "Time since creation"),
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": SHORT_NAMES,
                "categories": ["ember"],
            },
            "versions": [version],
        },
    }


def render_crd_yaml() -> str:
    header = f"# Generated from ember_operator.spec; do not edit. Regenerate with:\n#   {REGENERATE}\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False)


if __name__ == "__main__":
    sys.stdout.write(render_crd_yaml())
