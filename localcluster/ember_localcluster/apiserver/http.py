"""The aiohttp application: Kubernetes REST paths onto the store, Status bodies for every failure.

Paths: `/api/v1/...` and `/apis/G/V/...` as `[namespaces/NS/]plural[/name[/status|scale]]` (with care
for `/api/v1/namespaces/NAME[/status]`), plus discovery, `/version` and the OpenAPI documents (`openapi.py`).
Collections take GET (a list, or a watch with `?watch=true|1`), POST and DELETE; objects GET, PUT,
PATCH and DELETE; `/status` and `/scale` GET, PUT and PATCH; a pod's `/binding` POST (`binding.py`), its
`/eviction` POST (`eviction.py`) and its `/log` GET (`podlogs.py`). Lists honour label and field selectors
and `limit`/`continue` (a `continue` token resumes after the last name it saw). `dryRun=All` (for a
DELETE in its DeleteOptions, from the body or else the query) validates and answers without storing or
deleting anything; `fieldValidation=Strict` refuses unknown fields of custom resources (and of any ObjectMeta), in
the create and update handlers' words (`<Kind> in version "<v>" cannot be handled as a <Kind>: strict
decoding error: ...`) or the patch handler's (the bare `strict decoding error: ...`); bad options are
422s (`options.py`). Bodies are JSON, YAML or, for built-in kinds, protobuf
(`protobuf.py`).

Client mistakes are 4xx `Status` bodies (400 for undecodable bodies, 404 for unknown paths, 405 for
unsupported methods, 415 for unknown media types); a 500 means a bug here and is logged.
"""

from __future__ import annotations

import base64
import json
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from . import binding, deletion, discovery, eviction, openapi, patching, protobuf, scale
from .admission import PODS
from .errors import (
    APIError,
    StrictDecodingError,
    bad_request,
    int_param,
    method_not_allowed,
    page_not_found,
    unreadable_body,
)
from .options import check_field_labels, check_list_options, delete_options, write_options
from .podlogs import serve_pod_log
from .resources import ResourceType
from .selectors import FieldSelector, LabelSelector, parse_field_selector, parse_label_selector
from .store import Store
from .streaming import serve_watch
from .tables import to_table, wants_table
from .watch import Watcher

log = logging.getLogger("ember.apiserver")

POD_SUBRESOURCES = ("binding", "eviction", "log")
# Kinds whose registry sets ReturnDeletedObject: an immediate DELETE answers the object, not a Status.
RETURNS_DELETED_OBJECT = (("", "pods"), ("", "services"), ("", "serviceaccounts"), ("", "namespaces"))


@dataclass(slots=True)
class Target:
    rtype: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(body).encode(), status=status, content_type="application/json")


async def _read_body(request: web.Request, *, required: bool = True) -> Any:
    raw = await request.read()
    if not raw:
        if required:
            raise bad_request("the request body is empty")
        return None
    content_type = request.content_type.lower()
    if content_type == protobuf.MEDIA_TYPE:
        return protobuf.decode_body(raw)
    if "yaml" not in content_type and content_type not in ("application/json", "application/octet-stream"):
        raise unreadable_body(content_type)
    return patching.decode(raw, as_yaml="yaml" in content_type)


def _continue_after(token: str) -> tuple[str, str]:
    try:
        namespace, name = json.loads(base64.urlsafe_b64decode(token))["after"]
        return (namespace, name)
    except (ValueError, KeyError, TypeError):
        raise APIError(410, "Expired", "the provided continue parameter is too old or malformed") from None


class Handler:
    def __init__(
        self,
        store: Store,
        *,
        bookmark_interval: float,
        pods_dirs: Mapping[str, Path] | None = None,
        requests: Counter[tuple[str, str, str]] | None = None,
    ) -> None:
        self.store = store
        # (verb, resource, subresource) -> requests served, as kube-apiserver's apiserver_request_total
        self.requests: Counter[tuple[str, str, str]] = requests if requests is not None else Counter()
        self.bookmark_interval = bookmark_interval
        # node name -> the pods directory of the kubelet running that node (read by `pods/log`)
        self.pods_dirs: Mapping[str, Path] = pods_dirs if pods_dirs is not None else {}

    async def dispatch(self, request: web.Request) -> web.StreamResponse:
        log.debug("%s %s", request.method, request.path_qs)
        try:
            return await self._dispatch(request)
        except APIError as error:
            log.debug("%s %s -> %s", request.method, request.path_qs, error)
            response = _json(error.status(), error.code)
            if retry := error.details.get("retryAfterSeconds"):  # as responsewriters.ErrorNegotiated
                response.headers["Retry-After"] = str(retry)
            return response
        except Exception:
            log.exception("internal error serving %s %s", request.method, request.path_qs)
            failure = APIError(
                500, "InternalError", "an error on the server has prevented the request from succeeding"
            )
            return _json(failure.status(), 500)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [part for part in request.path.split("/") if part]
        registry = self.store.registry
        if parts[:1] == ["api"] and len(parts) > 2:
            return await self._resource(request, self._counted(request, "", parts[1], parts[2:]))
        if parts[:1] == ["apis"] and len(parts) > 3:
            return await self._resource(request, self._counted(request, parts[1], parts[2], parts[3:]))
        if request.method != "GET":
            raise method_not_allowed(request.method)
        if parts == ["version"]:
            return _json(discovery.SERVER_VERSION)
        if parts in (["healthz"], ["livez"], ["readyz"]):
            return web.Response(text="ok")
        document = None
        if parts[:1] == ["openapi"] and not openapi.accepts_json(request.headers.get("Accept", "")):
            return web.Response(status=406)  # kube-openapi: no body, for a type it cannot produce
        if parts == ["openapi", "v2"]:
            document = openapi.v2_document(registry)
        elif parts[:2] == ["openapi", "v3"]:
            document = openapi.document(registry, parts[2:])
        elif parts == ["api"]:
            document = discovery.api_versions(request.host)
        elif parts == ["apis"]:
            document = discovery.api_group_list(registry)
        elif len(parts) == 2 and parts[0] == "apis":
            document = discovery.api_group(registry, parts[1])
        elif len(parts) == 2 and parts[0] == "api":
            document = discovery.api_resource_list(registry, "", parts[1])
        elif len(parts) == 3 and parts[0] == "apis":
            document = discovery.api_resource_list(registry, parts[1], parts[2])
        if document is None:
            raise page_not_found(request.path)
        return _json(document)

    def _counted(self, request: web.Request, group: str, version: str, rest: list[str]) -> Target:
        """The target of a resource request, counted by kube-apiserver's verb: GET of a collection is
        LIST (WATCH with `watch`), DELETE of one DELETECOLLECTION, the other methods their own names."""
        # Counted before the path is resolved: a request for a resource not served (404) counts too.
        namespace_object = len(rest) == 3 and rest[0] == "namespaces" and rest[2] in ("status", "finalize")
        names = rest[2:] if rest[0] == "namespaces" and len(rest) >= 3 and not namespace_object else rest
        verb = request.method
        if len(names) == 1 and verb == "GET":
            verb = "WATCH" if request.query.get("watch") in ("true", "1") else "LIST"
        elif len(names) == 1 and verb == "DELETE":
            verb = "DELETECOLLECTION"
        self.requests[(verb, names[0], names[2] if len(names) > 2 else "")] += 1
        return self._target(group, version, rest, request.path)

    def _target(self, group: str, version: str, rest: list[str], path: str) -> Target:
        namespace = None
        is_namespace_object = len(rest) == 3 and rest[0] == "namespaces" and rest[2] in ("status", "finalize")
        if rest[0] == "namespaces" and len(rest) >= 3 and not is_namespace_object:
            namespace, rest = rest[1], rest[2:]
        rtype = self.store.registry.lookup(group, version, rest[0])
        if len(rest) > 3 or rtype is None or (namespace is not None and not rtype.namespaced):
            raise page_not_found(path)
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        if subresource not in (None, "status", "scale", *POD_SUBRESOURCES) or (
            (subresource == "status" and not rtype.has_status)
            or (subresource == "scale" and rtype.scale is None)
            or (subresource in POD_SUBRESOURCES and rtype.storage != PODS)
        ):
            raise page_not_found(path)
        if name is not None and rtype.namespaced and namespace is None:
            raise page_not_found(path)
        return Target(rtype, namespace, name, subresource)

    async def _resource(self, request: web.Request, target: Target) -> web.StreamResponse:
        if target.name is None:
            return await self._collection(request, target)
        if target.subresource == "scale":
            return await self._scale(request, target)
        if target.subresource in POD_SUBRESOURCES:
            return await self._pod_subresource(request, target)
        return await self._object(request, target)

    async def _pod_subresource(self, request: web.Request, target: Target) -> web.StreamResponse:
        namespace, name = target.namespace, target.name
        assert namespace is not None and name is not None
        if target.subresource == "binding":
            if request.method != "POST":
                raise method_not_allowed(request.method)
            dry_run, _ = write_options(request.query, "CreateOptions")
            body = await _read_body(request)
            return _json(binding.bind(self.store, namespace, name, body, dry_run=dry_run), 201)
        if target.subresource == "eviction":
            if request.method != "POST":
                raise method_not_allowed(request.method)
            dry_run, _ = write_options(request.query, "CreateOptions")
            body = await _read_body(request)
            raw = body.get("deleteOptions") if isinstance(body, dict) else None
            # Its dryRun is the eviction's own (eviction.py); the rest are the pod's delete options.
            raw = {k: v for k, v in raw.items() if k != "dryRun"} if isinstance(raw, dict) else {}
            options = delete_options(raw, {})
            status, code = eviction.evict(self.store, namespace, name, body, options, dry_run=dry_run)
            return _json(status, code)
        if request.method != "GET":
            raise method_not_allowed(request.method)
        return await serve_pod_log(request, self.store, self.pods_dirs, namespace, name)

    def _render(
        self, request: web.Request, rtype: ResourceType, obj: dict[str, Any], status: int = 200
    ) -> web.Response:
        table = wants_table(request.headers.get("Accept", ""))
        if table is None:
            return _json(obj, status)
        meta = {"resourceVersion": obj["metadata"].get("resourceVersion", "")}
        return _json(
            to_table(rtype, [obj], table, request.query.get("includeObject", "Metadata"), meta), status
        )

    async def _collection(self, request: web.Request, target: Target) -> web.StreamResponse:
        rtype, query = target.rtype, request.query
        labels = parse_label_selector(query.get("labelSelector"))
        fields = parse_field_selector(query.get("fieldSelector"))
        if request.method == "GET":
            check_list_options(query, watch=query.get("watch") in ("true", "1"))
        check_field_labels(rtype, fields)
        if request.method == "GET" and query.get("watch") in ("true", "1"):
            watcher = Watcher(rtype, target.namespace, labels, fields)
            return await serve_watch(
                request, self.store, watcher, int_param(query, "timeoutSeconds"), self.bookmark_interval
            )
        if request.method == "GET":
            return self._list(request, target, labels, fields)
        if request.method == "POST" and (target.namespace is not None or not rtype.namespaced):
            dry_run, strict = write_options(query, "CreateOptions")
            body = await _read_body(request)
            try:
                created = self.store.create(rtype, target.namespace, body, dry_run=dry_run, strict=strict)
            except StrictDecodingError as error:
                raise error.with_kind(rtype.kind, rtype.version) from None
            return self._render(request, rtype, created, 201)
        if request.method == "DELETE":
            options = delete_options(await _read_body(request, required=False), query)
            deleted = deletion.delete_collection(self.store, rtype, target.namespace, labels, fields, options)
            return _json(self._list_body(rtype, deleted, ""))
        raise method_not_allowed(request.method)

    def _list_body(self, rtype: ResourceType, items: list[dict[str, Any]], token: str) -> dict[str, Any]:
        return {
            "kind": rtype.list_kind,
            "apiVersion": rtype.api_version,
            "metadata": {"resourceVersion": str(self.store.rv), "continue": token},
            "items": items,
        }

    def _list(
        self, request: web.Request, target: Target, labels: LabelSelector, fields: FieldSelector
    ) -> web.Response:
        query = request.query
        items = self.store.list(target.rtype, target.namespace, labels, fields)
        if query.get("continue"):
            after = _continue_after(query["continue"])
            items = [
                obj
                for obj in items
                if (obj["metadata"].get("namespace") or "", obj["metadata"]["name"]) > after
            ]
        limit, token = int_param(query, "limit"), ""
        if limit and len(items) > limit:
            items = items[:limit]
            last = items[-1]["metadata"]
            token = base64.urlsafe_b64encode(
                json.dumps({"after": [last.get("namespace") or "", last["name"]]}).encode()
            ).decode()
        body = self._list_body(target.rtype, items, token)
        table = wants_table(request.headers.get("Accept", ""))
        if table is None:
            return _json(body)
        return _json(
            to_table(target.rtype, items, table, query.get("includeObject", "Metadata"), body["metadata"])
        )

    async def _object(self, request: web.Request, target: Target) -> web.StreamResponse:
        rtype, namespace, name, sub = target.rtype, target.namespace, target.name, target.subresource
        assert name is not None
        store, query, method = self.store, request.query, request.method
        if method == "GET":
            return self._render(request, rtype, store.get(rtype, namespace, name))
        if method == "PUT":
            dry_run, strict = write_options(query, "UpdateOptions")
            body = await _read_body(request)
            try:
                updated = store.update(
                    rtype, namespace, name, body, subresource=sub, dry_run=dry_run, strict=strict
                )
            except StrictDecodingError as error:
                raise error.with_kind(rtype.kind, rtype.version) from None
            return self._render(request, rtype, updated)
        if method == "PATCH":
            is_apply = request.headers.get("Content-Type", "").split(";")[0].strip() == patching.APPLY
            dry_run, strict = write_options(query, "PatchOptions", apply=is_apply)
            patched, created = store.patch(
                rtype,
                namespace,
                name,
                request.headers.get("Content-Type", ""),
                await request.read(),
                subresource=sub,
                field_manager=query.get("fieldManager"),
                dry_run=dry_run,
                strict=strict,
            )
            return self._render(request, rtype, patched, 201 if created else 200)
        if method == "DELETE" and sub is None:
            options = delete_options(await _read_body(request, required=False), query)
            deleted = deletion.delete(store, rtype, namespace, name, options)
            if rtype.storage not in RETURNS_DELETED_OBJECT and deletion.deleted_now(
                store, rtype, deleted, options
            ):
                return _json(deletion.success_status(rtype, deleted))
            return self._render(request, rtype, deleted)
        raise method_not_allowed(method)

    async def _scale(self, request: web.Request, target: Target) -> web.StreamResponse:
        rtype, namespace, name = target.rtype, target.namespace, target.name
        assert name is not None
        if request.method == "GET":
            return _json(scale.get_scale(self.store, rtype, namespace, name))
        if request.method == "PUT":
            dry_run, _ = write_options(request.query, "UpdateOptions")
            body = await _read_body(request)
            return _json(scale.write_scale(self.store, rtype, namespace, name, None, body, dry_run=dry_run))
        if request.method == "PATCH":
            content_type = request.headers.get("Content-Type", "")
            is_apply = content_type.split(";")[0].strip() == patching.APPLY
            dry_run, _ = write_options(request.query, "PatchOptions", apply=is_apply)
            raw, manager = await request.read(), request.query.get("fieldManager")
            scaled, _ = self.store.patch(
                rtype,
                namespace,
                name,
                content_type,
                raw,
                subresource="scale",
                field_manager=manager,
                dry_run=dry_run,
            )
            return _json(scaled)
        raise method_not_allowed(request.method)


def build_app(
    store: Store,
    *,
    bookmark_interval: float,
    pods_dirs: Mapping[str, Path] | None = None,
    requests: Counter[tuple[str, str, str]] | None = None,
) -> web.Application:
    handler = Handler(store, bookmark_interval=bookmark_interval, pods_dirs=pods_dirs, requests=requests)
    app = web.Application(client_max_size=32 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handler.dispatch)
    return app
