"""Kubernetes `Status` error bodies, raised as one exception type.

Every failure the server reports is a `meta/v1 Status` with `reason`, `code` and, where Kubernetes
gives them, `details` (name, group, kind, causes). kopf and the official client parse exactly these
fields: kopf reads `code` to decide whether to retry, the client raises `ApiException(status=code)`.
The messages follow the real API server's wording, so tests may match on them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Cause:
    """One field error of a 422 `Invalid` response (`details.causes[]`)."""

    field: str
    reason: str
    message: str

    def render(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


def required(path: str, detail: str = "") -> Cause:
    """apimachinery's field.Required."""
    return Cause(path, "FieldValueRequired", f"Required value: {detail}" if detail else "Required value")


def invalid_value(path: str, shown: str, detail: str) -> Cause:
    """field.Invalid, the value already printed as Go prints it."""
    return Cause(path, "FieldValueInvalid", f"Invalid value: {shown}: {detail}")


def forbidden(path: str, detail: str) -> Cause:
    """field.Forbidden."""
    return Cause(path, "FieldValueForbidden", f"Forbidden: {detail}")


def not_supported(path: str, shown: str, supported: tuple[str, ...]) -> Cause:
    """field.NotSupported, the value already printed as Go prints it."""
    listed = ", ".join(json.dumps(v) for v in supported)
    return Cause(path, "FieldValueNotSupported", f"Unsupported value: {shown}: supported values: {listed}")


@dataclass
class APIError(Exception):
    code: int
    reason: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if not self.reason:  # StatusReasonUnknown, omitted from the body
            del body["reason"]
        if self.details:
            body["details"] = self.details
        return body


def _qualified(kind_plural: str, group: str) -> str:
    return f"{kind_plural}.{group}" if group else kind_plural


def not_found(plural: str, group: str, name: str) -> APIError:
    return APIError(
        404,
        "NotFound",
        f'{_qualified(plural, group)} "{name}" not found',
        {"name": name, "group": group, "kind": plural},
    )


def already_exists(plural: str, group: str, name: str) -> APIError:
    return APIError(
        409,
        "AlreadyExists",
        f'{_qualified(plural, group)} "{name}" already exists',
        {"name": name, "group": group, "kind": plural},
    )


def conflict(plural: str, group: str, name: str) -> APIError:
    return APIError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {_qualified(plural, group)} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again",
        {"name": name, "group": group, "kind": plural},
    )


def precondition_failed(plural: str, group: str, name: str, detail: str) -> APIError:
    """A storage precondition (uid, resourceVersion) that the stored object fails: errors.NewConflict."""
    return APIError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {_qualified(plural, group)} "{name}": {detail}',
        {"name": name, "group": group, "kind": plural},
    )


# rest.EnsureObjectNamespaceMatchesRequestNamespace
NAMESPACE_MISMATCH = "the namespace of the provided object does not match the namespace sent on the request"


def invalid(kind: str, group: str, name: str, causes: list[Cause]) -> APIError:
    rendered = [cause.render() for cause in causes]
    summary = rendered[0] if len(rendered) == 1 else "[" + ", ".join(rendered) + "]"
    return APIError(
        422,
        "Invalid",
        f'{_qualified(kind, group)} "{name}" is invalid: {summary}',
        {
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": c.reason, "message": c.message, "field": c.field} for c in causes],
        },
    )


class StrictDecodingError(APIError):
    """A 400 for the unknown fields strict field validation refuses; the create and update handlers name
    the kind before it (`with_kind`), the patch handler does not."""

    def with_kind(self, kind: str, version: str) -> APIError:
        """transformDecodeError's wording."""
        return bad_request(f'{kind} in version "{version}" cannot be handled as a {kind}: {self.message}')


def strict_decoding(paths: list[str]) -> StrictDecodingError:
    """runtime's strictDecodingError: every unknown field in one message."""
    listed = ", ".join(f'unknown field "{path}"' for path in paths)
    return StrictDecodingError(400, "BadRequest", f"strict decoding error: {listed}")


def bad_request(message: str) -> APIError:
    return APIError(400, "BadRequest", message)


def method_not_allowed(method: str) -> APIError:
    return APIError(
        405, "MethodNotAllowed", f"the server does not allow this method on the requested resource ({method})"
    )


def unsupported_media_type() -> APIError:
    return APIError(
        415,
        "UnsupportedMediaType",
        "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
    )


def unreadable_body(content_type: str) -> APIError:
    message = (
        f"the media type {content_type!r} is not supported: this server reads JSON, YAML and, for the"
        " built-in kinds kubectl's typed `create <kind>` commands make, application/vnd.kubernetes.protobuf"
    )
    return APIError(415, "UnsupportedMediaType", message)


def expired(requested: int, oldest: int) -> APIError:
    return APIError(410, "Expired", f"too old resource version: {requested} ({oldest})")


def page_not_found(path: str) -> APIError:
    return APIError(404, "NotFound", f"the server could not find the requested resource ({path})", {})


def int_param(query: Any, key: str) -> int | None:
    """An integer query parameter (None when absent or empty); a 400 naming it when it is not one."""
    if not query.get(key):
        return None
    try:
        return int(query[key])
    except ValueError:
        raise bad_request(f"invalid {key}: {query[key]!r}") from None
