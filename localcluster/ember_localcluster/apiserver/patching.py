"""The four PATCH flavours, chosen by Content-Type like the real server.

* `application/merge-patch+json`: RFC 7386 (`null` deletes a key, lists are replaced whole). kopf and
  `CustomObjectsApi.patch_*` send this.
* `application/json-patch+json`: RFC 6902 through `jsonpatch`. A failed `test` op is a 422, which kopf
  relies on to notice a conflicting finalizer change.
* `application/strategic-merge-patch+json`: built-in kinds only (a 415 for custom resources, as in
  Kubernetes), applied by `ember_operator.podpatch.strategic_merge` (the operator applies an
  InferenceService's podTemplate with it too): lists merge by key for the fields that carry a merge key in
  the Kubernetes API (containers by name, volumeMounts by mountPath, ports by containerPort or port, ...),
  and `$patch: replace|delete`, `$retainKeys` and `$deleteFromPrimitiveList/` are honoured;
  `$setElementOrder/` is accepted and ignored. The official client sends this for every dict body
  given to a built-in `patch_*` method, and kubectl for `apply` on built-ins.
* `application/apply-patch+yaml`: server-side apply without field ownership. The store creates the
  object when absent; otherwise the document is merged as a strategic (built-ins) or JSON merge
  (custom resources) patch. There are no managedFields and no conflicts, so fields dropped from an
  applied document are kept rather than removed.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonpatch
import jsonpointer
import yaml

from ember_operator.podpatch import strategic_merge

from .errors import APIError, bad_request, unsupported_media_type

MERGE = "application/merge-patch+json"
JSON = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"


class _JSONLikeLoader(yaml.SafeLoader):
    """YAML without implicit timestamps, so every document decodes to plain JSON values."""


_JSONLikeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def decode(raw: bytes, *, as_yaml: bool) -> Any:
    """A JSON or YAML body as JSON values; 400 when it is not one."""
    try:
        document = yaml.load(raw, Loader=_JSONLikeLoader) if as_yaml else json.loads(raw)
        # YAML can express what JSON cannot (binary, sets); the round trip rejects those.
        return json.loads(json.dumps(document)) if as_yaml else document
    except (ValueError, TypeError, yaml.YAMLError) as error:
        raise bad_request(f"the request body could not be decoded: {error}") from None


def parse_patch(content_type: str, raw: bytes) -> tuple[str, Any]:
    """(patch type, decoded document); 415 for an unknown patch type, 400 for an undecodable body."""
    patch_type = content_type.split(";", 1)[0].strip().lower()
    if patch_type not in (MERGE, JSON, STRATEGIC, APPLY):
        raise unsupported_media_type()
    document = decode(raw, as_yaml=patch_type == APPLY)
    if patch_type == JSON and not isinstance(document, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    if patch_type != JSON and not isinstance(document, dict):
        raise bad_request("error decoding patch: the patch must be a JSON object")
    return patch_type, document


def apply_patch(patch_type: str, target: dict[str, Any], document: Any, *, custom: bool) -> dict[str, Any]:
    """The patched copy of `target`; `target` itself is left untouched."""
    if patch_type == JSON:
        return json_patch(target, document)
    if patch_type == STRATEGIC and custom:
        raise unsupported_media_type()
    if patch_type == MERGE or (patch_type == APPLY and custom):
        return merge_patch(target, document)
    return strategic_merge(target, document)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict[str, Any], operations: list[Any]) -> dict[str, Any]:
    try:
        patch = jsonpatch.JsonPatch(operations)
        result = patch.apply(target)
    except jsonpatch.InvalidJsonPatch as error:
        raise bad_request(f"invalid JSON patch: {error}") from None
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as error:
        raise APIError(
            422, "Invalid", f"the server rejected our request due to an error in our request: {error}"
        ) from None
    except (TypeError, KeyError, AttributeError) as error:
        raise bad_request(f"invalid JSON patch: {error!r}") from None
    if not isinstance(result, dict):
        raise APIError(
            422, "Invalid", "the server rejected our request: the patched document is not an object"
        )
    return result
