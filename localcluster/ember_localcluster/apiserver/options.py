"""Query options as kube-apiserver validates them before it reads a body, with its 422 messages
(`CreateOptions.meta.k8s.io "" is invalid: ...`): ValidateCreateOptions, ValidateUpdateOptions,
ValidatePatchOptions and ValidateDeleteOptions of apimachinery's meta/v1 validation (dryRun, fieldValidation,
fieldManager, force, propagationPolicy) and ValidateListOptions of meta/internalversion (resourceVersionMatch,
sendInitialEvents). DeleteOptions come from the body when the request has one, else from the query (as
the delete handlers decode them), and are validated before anything is deleted. And field selectors on custom resources, which know only metadata.name and
metadata.namespace (and a version's selectableFields) as field labels (a 400 otherwise).
"""

from __future__ import annotations

import json
from typing import Any

from .deletion import DeleteOptions
from .errors import Cause, bad_request, int_param, invalid, not_supported
from .resources import ResourceType
from .selectors import FieldSelector

FIELD_MANAGER_MAX = 128
_FIELD_VALIDATION = ("", "Ignore", "Strict", "Warn")
_PROPAGATION = ("Foreground", "Background", "Orphan")


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(json.dumps(v) for v in values)


def _refuse(kind: str, causes: list[Cause]) -> None:
    if causes:
        raise invalid(kind, "meta.k8s.io", "", causes)


def write_options(query: Any, kind: str, *, apply: bool | None = None) -> tuple[bool, bool]:
    """(dry run, strict field validation) of a create, update, patch or delete; a 422 for bad options.
    `apply` (patches only): whether the patch is a server-side apply."""
    causes = []
    if kind == "PatchOptions" and apply is not None:
        if not apply and "force" in query:
            causes.append(
                Cause("force", "FieldValueForbidden", "Forbidden: may not be specified for non-apply patch")
            )
        if apply and not query.get("fieldManager"):
            causes.append(
                Cause("fieldManager", "FieldValueRequired", "Required value: is required for apply patch")
            )
    manager = query.get("fieldManager", "")
    if kind != "DeleteOptions" and len(manager.encode()) > FIELD_MANAGER_MAX:
        message = f"Too long: may not be more than {FIELD_MANAGER_MAX} bytes"
        causes.append(Cause("fieldManager", "FieldValueTooLong", message))
    dry_run = query.getall("dryRun", [])
    causes += _dry_run_causes(dry_run)
    validation = query.get("fieldValidation", "")
    if kind != "DeleteOptions" and validation not in _FIELD_VALIDATION:
        message = (
            f"Unsupported value: {json.dumps(validation)}: supported values: {_quoted(_FIELD_VALIDATION)}"
        )
        causes.append(Cause("fieldValidation", "FieldValueNotSupported", message))
    _refuse(kind, causes)
    return bool(dry_run), validation == "Strict"


def _dry_run_causes(dry_run: list[str]) -> list[Cause]:
    """ValidateDryRun: every value `All` (the list printed as Go's %#v prints a []string)."""
    if all(value == "All" for value in dry_run):
        return []
    listed = ", ".join(json.dumps(v) for v in dry_run)
    return [not_supported("dryRun", f"[]string{{{listed}}}", ("All",))]


_JSON_TYPES = {bool: "bool", int: "number", float: "number", str: "string", list: "array", dict: "object"}


def _body_field(body: dict[str, Any], key: str, wanted: type, go_type: str) -> Any:
    """A field of a DeleteOptions body; a 400 as the JSON decoder's when it has the wrong type."""
    value = body.get(key)
    if value is None or (isinstance(value, wanted) and (wanted is bool or not isinstance(value, bool))):
        return value
    shown = _JSON_TYPES.get(type(value), "value")
    raise bad_request(
        f"json: cannot unmarshal {shown} into Go struct field DeleteOptions.{key} of type {go_type}"
    )


def delete_options(body: Any, query: Any) -> DeleteOptions:
    """The DeleteOptions of a DELETE: decoded from its body when it has one (the query is then not read),
    else from its query; a 422 as ValidateDeleteOptions refuses them."""
    if body is not None:
        if not isinstance(body, dict):
            raise bad_request("the body of the request is not a valid DeleteOptions object")
        grace = _body_field(body, "gracePeriodSeconds", int, "int64")
        policy = _body_field(body, "propagationPolicy", str, "v1.DeletionPropagation")
        orphan = _body_field(body, "orphanDependents", bool, "bool")
        dry_run = _body_field(body, "dryRun", list, "[]string") or []
        preconditions = _body_field(body, "preconditions", dict, "v1.Preconditions") or {}
    else:
        grace, policy = int_param(query, "gracePeriodSeconds"), query.get("propagationPolicy")
        orphan = {"true": True, "false": False}.get(query.get("orphanDependents", ""))
        dry_run, preconditions = query.getall("dryRun", []), {}
    causes = []
    if orphan is not None and policy is not None:
        message = f"Invalid value: {json.dumps(policy)}: orphanDependents and deletionPropagation cannot be both set"
        causes.append(Cause("propagationPolicy", "FieldValueInvalid", message))
    if policy is not None and policy not in _PROPAGATION:
        causes.append(not_supported("propagationPolicy", json.dumps(policy), (*_PROPAGATION, "nil")))
    causes += _dry_run_causes([str(value) for value in dry_run])
    _refuse("DeleteOptions", causes)
    if orphan:
        policy = "Orphan"
    return DeleteOptions(grace, policy, preconditions, dry_run=bool(dry_run))


def check_list_options(query: Any, *, watch: bool) -> None:
    match, initial = query.get("resourceVersionMatch", ""), "sendInitialEvents" in query
    has_continue = bool(query.get("continue"))
    causes = []

    def forbidden(path: str, message: str) -> None:
        causes.append(Cause(path, "FieldValueForbidden", f"Forbidden: {message}"))

    def unsupported(supported: tuple[str, ...]) -> None:
        message = f"Unsupported value: {json.dumps(match)}: supported values: {_quoted(supported)}"
        causes.append(Cause("resourceVersionMatch", "FieldValueNotSupported", message))

    if watch:
        if initial and match != "NotOlderThan":
            forbidden(
                "resourceVersionMatch",
                "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            )
        if match:
            if not initial:
                forbidden(
                    "resourceVersionMatch",
                    "resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
                )
            if match != "NotOlderThan":
                unsupported(("NotOlderThan",))
            if has_continue:
                forbidden(
                    "resourceVersionMatch", "resourceVersionMatch is forbidden when continue is provided"
                )
    else:
        if match:
            if not query.get("resourceVersion"):
                forbidden(
                    "resourceVersionMatch",
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                )
            if has_continue:
                forbidden(
                    "resourceVersionMatch", "resourceVersionMatch is forbidden when continue is provided"
                )
            if match not in ("Exact", "NotOlderThan"):
                unsupported(("Exact", "NotOlderThan", ""))
            if match == "Exact" and query.get("resourceVersion") == "0":
                forbidden(
                    "resourceVersionMatch",
                    'resourceVersionMatch "exact" is forbidden for resourceVersion "0"',
                )
        if initial:
            forbidden("sendInitialEvents", "sendInitialEvents is forbidden for list")
    _refuse("ListOptions", causes)


def check_field_labels(rtype: ResourceType, fields: FieldSelector) -> None:
    """A custom resource's field labels: metadata.name, metadata.namespace and its selectableFields."""
    if not rtype.custom:
        return
    known = {"metadata.name", "metadata.namespace", *rtype.selectable_fields}
    for path, _, _ in fields.terms:
        if path not in known:
            raise bad_request(f"field label not supported: {path}")
