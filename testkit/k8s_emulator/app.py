"""The aiohttp application: discovery, CRUD, subresources and watch streams over the Store."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from . import discovery, errors, managed, patching, routing, tables
from .errors import ApiError
from .registry import ResourceType, ScaleSpec
from .selectors import field_matcher, label_matcher, selector_string
from .store import Obj, Store
from .watching import Event, Watcher

logger = logging.getLogger(__name__)
RequestLog = Callable[[routing.RequestRecord, str], None]


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")


def _versioned(obj: Obj, target: routing.Target) -> Obj:
    """Serve the object under the requested version (no conversion: versions share one schema)."""
    return {**obj, "apiVersion": target.rtype.api_version(target.version)}


async def _body(request: web.Request) -> Any:
    raw = await request.read()
    if request.content_type not in ("application/json", "application/yaml", "", "application/octet-stream"):
        # kubectl speaks protobuf to built-in types unless refused; client-go retries with JSON on 415.
        raise ApiError(
            415,
            f"the body of the request was in an unknown format - accepted media types "
            f"include: application/json ({request.content_type} is not supported)",
        )
    try:
        return json.loads(raw) if raw else None
    except ValueError as exc:
        raise errors.invalid(f"cannot decode the request body as JSON: {exc}") from exc


def _path_get(obj: Obj, path: str) -> Any:
    value: Any = obj
    for part in path.strip(".").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _path_set(obj: Obj, path: str, value: Any) -> None:
    *parents, last = path.strip(".").split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[last] = value


def _list_body(target: routing.Target, items: list[dict[str, Any]], rv: int) -> dict[str, Any]:
    """A ``<Kind>List`` as the API server answers a list (and a deletecollection)."""
    return {"apiVersion": target.rtype.api_version(target.version), "kind": f"{target.rtype.kind}List",
            "metadata": {"resourceVersion": str(rv)}, "items": items}


class EmulatorApp:
    def __init__(self, store: Store, log: RequestLog) -> None:
        self.store = store
        self.log = log
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._dispatch(request)
        except ApiError as exc:
            return _json(exc.status(), exc.code)
        except Exception as exc:  # noqa: BLE001 - a bug in the emulator: tell the client what broke
            logger.exception("emulator failed on %s %s", request.method, request.path)
            return _json(ApiError(500, f"emulator error: {exc!r}").status(), 500)

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        target = routing.parse(self.store.registry, request.path)
        if target is None:
            return self._discovery(request)
        watch = request.query.get("watch") in ("true", "1")
        verb = routing.rbac_verb(request.method, target, watch)
        self.log(
            routing.RequestRecord(verb, request.path, target.rbac_resource, target.namespace),
            target.rtype.group,
        )
        handler = getattr(self, f"_do_{verb}", None)
        if handler is None:
            raise errors.method_not_allowed()
        return await handler(request, target)

    def _discovery(self, request: web.Request) -> web.Response:
        if request.method != "GET":
            raise errors.method_not_allowed()
        registry = self.store.registry
        parts = [p for p in request.path.split("/") if p]
        doc: Any = None
        if parts == ["version"]:
            doc = discovery.SERVER_VERSION
        elif parts == ["api"]:
            doc = discovery.api_versions(request.host)
        elif parts == ["api", "v1"]:
            doc = discovery.api_resource_list(registry, "", "v1")
        elif parts == ["apis"]:
            doc = discovery.api_group_list(registry)
        elif len(parts) == 2 and parts[0] == "apis":
            doc = discovery.api_group(registry, parts[1])
        elif len(parts) == 3 and parts[0] == "apis":
            doc = discovery.api_resource_list(registry, parts[1], parts[2])
        elif parts in (["healthz"], ["readyz"], ["livez"]):
            return web.Response(text="ok")
        if doc is None:
            raise ApiError(404, f"the server could not find the requested resource ({request.path})")
        return _json(doc)

    # ------------------------------------------------------------------ reads
    async def _do_get(self, request: web.Request, target: routing.Target) -> web.Response:
        obj = self.store.get(target.rtype, target.namespace, _name(target))
        if target.subresource == "scale":
            return _json(_scale_view(target.rtype, obj))
        if tables.wants_table(request.headers.get("Accept", "")):
            return _json(tables.table(target.rtype, [_versioned(obj, target)], None))
        return _json(_versioned(obj, target))

    def _matching(self, request: web.Request, target: routing.Target) -> tuple[list[Obj], int]:
        labels = label_matcher(request.query.get("labelSelector"))
        fields = field_matcher(request.query.get("fieldSelector"))
        items, rv = self.store.list(target.rtype, target.namespace)
        return [_versioned(o, target) for o in items if labels(o) and fields(o)], rv

    async def _do_list(self, request: web.Request, target: routing.Target) -> web.Response:
        items, rv = self._matching(request, target)
        if tables.wants_table(request.headers.get("Accept", "")):
            return _json(tables.table(target.rtype, items, rv))
        return _json(_list_body(target, items, rv))

    # ------------------------------------------------------------------ writes
    async def _do_create(self, request: web.Request, target: routing.Target) -> web.Response:
        if target.name is not None:
            raise errors.method_not_allowed()
        if target.rtype.namespaced and target.namespace is None:
            raise errors.method_not_allowed("namespaced resources are created under /namespaces/{namespace}/")
        obj = self.store.create(target.rtype, target.namespace, await _body(request))
        return _json(_versioned(obj, target), 201)

    async def _do_update(self, request: web.Request, target: routing.Target) -> web.Response:
        name = _name(target)
        body = await _body(request)
        if target.subresource == "scale":
            return _json(self._write_scale(target, lambda _scale: body))
        obj = self.store.replace(target.rtype, target.namespace, name, body, target.subresource)
        return _json(_versioned(obj, target))

    async def _do_patch(self, request: web.Request, target: routing.Target) -> web.Response:
        name = _name(target)
        content_type = request.content_type
        patch = patching.decode_patch(content_type, await request.read())
        if target.subresource == "scale":
            return _json(
                self._write_scale(target, lambda scale: patching.apply_patch(content_type, scale, patch))
            )
        if content_type == patching.APPLY:
            return self._apply(request, target, name, patch)
        obj = self.store.modify(
            target.rtype,
            target.namespace,
            name,
            lambda current: patching.apply_patch(content_type, current, patch),
            target.subresource,
        )
        return _json(_versioned(obj, target))

    def _apply(self, request: web.Request, target: routing.Target, name: str, patch: Any) -> web.Response:
        """Server-side apply with field ownership (``managed``): a manager's fields that its new apply
        leaves out are removed. Creating through apply also needs the ``create`` verb, as on a real server."""
        manager = request.query.get("fieldManager")
        if not manager:
            raise errors.bad_request("PATCH is not supported: fieldManager is required for apply patch")
        if not isinstance(patch, dict):
            raise errors.bad_request("apply patch must be an object")
        if self.store.find(target.rtype, target.namespace, name) is None:
            self.log(routing.RequestRecord("create", request.path, target.rbac_resource, target.namespace),
                     target.rtype.group)
            body = managed.record(patching.merge_patch(patch, {"metadata": {"name": name}}), manager, patch)
            return _json(_versioned(self.store.create(target.rtype, target.namespace, body), target), 201)

        def change(current: Obj) -> Obj:
            pruned = managed.prune(current, managed.owned(current, manager) - managed.field_paths(patch))
            return managed.record(patching.strategic_merge(pruned, patch), manager, patch)

        return _json(_versioned(self.store.modify(target.rtype, target.namespace, name, change), target))

    def _write_scale(self, target: routing.Target, change: Callable[[Obj], Any]) -> Obj:
        scale_spec = target.rtype.scale
        name = _name(target)
        if scale_spec is None:
            raise errors.method_not_allowed()

        def apply(current: Obj) -> Obj:
            new_scale = change(_scale_view(target.rtype, current))
            replicas = (
                (new_scale or {}).get("spec", {}).get("replicas") if isinstance(new_scale, dict) else None
            )
            if not isinstance(replicas, int) or replicas < 0:
                raise errors.invalid("Scale.spec.replicas: must be a non-negative integer")
            updated = copy.deepcopy(current)
            _path_set(updated, scale_spec.spec_replicas_path, replicas)
            rv = (new_scale.get("metadata") or {}).get("resourceVersion")
            updated["metadata"]["resourceVersion"] = rv or current["metadata"]["resourceVersion"]
            return updated

        obj = self.store.modify(target.rtype, target.namespace, name, apply)
        return _scale_view(target.rtype, obj)

    async def _do_delete(self, request: web.Request, target: routing.Target) -> web.Response:
        if target.subresource:
            raise errors.method_not_allowed()
        obj = self.store.delete(target.rtype, target.namespace, _name(target), orphan=await _orphan(request))
        return _json(_versioned(obj, target))

    async def _do_deletecollection(self, request: web.Request, target: routing.Target) -> web.Response:
        items, rv = self._matching(request, target)
        orphan = await _orphan(request)
        for obj in items:
            meta = obj["metadata"]
            try:
                self.store.delete(target.rtype, meta.get("namespace"), meta["name"], orphan=orphan)
            except ApiError as exc:
                if exc.code != 404:  # already gone through a cascade: fine
                    raise
        return _json(_list_body(target, items, rv))

    # ------------------------------------------------------------------ watch
    async def _do_watch(self, request: web.Request, target: routing.Target) -> web.StreamResponse:
        query = request.query
        raw_rv = query.get("resourceVersion") or "0"
        if not raw_rv.isdigit():
            raise errors.bad_request(f"invalid resourceVersion {raw_rv!r}")
        since = None if raw_rv == "0" else int(raw_rv)
        labels, fields = label_matcher(query.get("labelSelector")), field_matcher(query.get("fieldSelector"))
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        watcher = Watcher(loop, target.rtype.key, target.namespace)
        try:
            initial = self.store.subscribe(watcher, since)
        except ApiError as exc:
            await _send(response, {"type": "ERROR", "object": exc.status()})
            return response
        try:
            for event in initial:
                await _send(response, _render(event, target, labels, fields))
            if since is None and query.get("sendInitialEvents") == "true":
                await _send(response, _initial_events_end(target, self.store.resource_version))
            await self._stream(
                response, watcher, target, labels, fields, None if timeout is None else loop.time() + timeout
            )
        except (ConnectionResetError, asyncio.CancelledError):
            pass  # the client went away
        finally:
            self.store.unsubscribe(watcher)
        return response

    async def _stream(
        self,
        response: web.StreamResponse,
        watcher: Watcher,
        target: routing.Target,
        labels: Callable[[Obj], bool],
        fields: Callable[[Obj], bool],
        deadline: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return
            try:
                event = await asyncio.wait_for(watcher.queue.get(), remaining)
            except TimeoutError:
                return
            if event is None:  # the server is stopping or resetting
                return
            await _send(response, _render(event, target, labels, fields))


def _name(target: routing.Target) -> str:
    if target.name is None:
        raise errors.method_not_allowed("this verb needs a named object, not a collection")
    return target.name


async def _orphan(request: web.Request) -> bool:
    policy = request.query.get("propagationPolicy")
    body = await _body(request)
    if isinstance(body, dict):
        policy = body.get("propagationPolicy") or policy
        if body.get("orphanDependents") is True:
            policy = "Orphan"
    return policy == "Orphan"


async def _send(response: web.StreamResponse, message: dict[str, Any] | None) -> None:
    if message is not None:
        await response.write(json.dumps(message).encode() + b"\n")


def _render(
    event: Event, target: routing.Target, labels: Callable[[Obj], bool], fields: Callable[[Obj], bool]
) -> dict[str, Any] | None:
    """The watch message for an event, translating selector entry/exit into ADDED/DELETED."""

    def matches(obj: Obj | None) -> bool:
        return obj is not None and labels(obj) and fields(obj)

    kind = event.type
    if kind == "MODIFIED":
        now_in, was_in = matches(event.obj), matches(event.old)
        if not now_in and not was_in:
            return None
        kind = "MODIFIED" if now_in and was_in else ("ADDED" if now_in else "DELETED")
    elif not matches(event.obj):
        return None
    return {"type": kind, "object": _versioned(event.obj, target)}


def _initial_events_end(target: routing.Target, rv: int) -> dict[str, Any]:
    return {
        "type": "BOOKMARK",
        "object": {
            "apiVersion": target.rtype.api_version(target.version),
            "kind": target.rtype.kind,
            "metadata": {"resourceVersion": str(rv), "annotations": {"k8s.io/initial-events-end": "true"}},
        },
    }


def _scale_view(rtype: ResourceType, obj: Obj) -> Obj:
    spec = rtype.scale or ScaleSpec()
    meta = obj["metadata"]
    selector = _path_get(obj, spec.label_selector_path) if spec.label_selector_path else None
    if selector is None and rtype.key == ("apps", "deployments"):
        # No Deployment controller fills status.selector, so derive it from spec.selector.
        selector = selector_string(_path_get(obj, ".spec.selector.matchLabels") or {})
    status: dict[str, Any] = {"replicas": _path_get(obj, spec.status_replicas_path) or 0}
    if selector:
        status["selector"] = selector
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            k: meta[k]
            for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if k in meta
        },
        "spec": {"replicas": _path_get(obj, spec.spec_replicas_path) or 0},
        "status": status,
    }
