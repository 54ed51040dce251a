"""Object storage with API-server semantics: uid, resourceVersion, generation, finalizers, GC.

All writes go through one lock. Stored objects are never mutated after commit (every write stores
a fresh dict), so watch events can share them; readers get deep copies.
"""

from __future__ import annotations

import copy
import datetime
import secrets
import threading
import uuid
from collections.abc import Callable
from typing import Any

from . import errors
from .registry import Registry, ResourceType, types_from_crd
from .watching import Event, Hub, Watcher

Obj = dict[str, Any]
Key = tuple[str, str]
CRD_KEY = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACE_KEY = ("", "namespaces")
# Metadata the server owns: clients cannot change these with PUT or PATCH.
_SERVER_META = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "resourceVersion",
    "name",
    "namespace",
)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_part(obj: Obj) -> Obj:
    """Everything generation tracks: the object minus metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


class Store:
    def __init__(
        self, registry: Registry, initial_namespaces: tuple[str, ...] = ("default", "kube-system")
    ) -> None:
        self.registry = registry
        self.lock = threading.RLock()
        self.hub = Hub()
        self._initial_namespaces = initial_namespaces
        self._objects: dict[Key, dict[tuple[str | None, str], Obj]] = {}
        self._rv = 0
        self.reset()

    # ----------------------------------------------------------------- bookkeeping
    def reset(self) -> None:
        with self.lock:
            self.registry.reset()
            self.hub.reset()
            self._objects = {}
            self._rv = 0
            ns_type = self.registry.find("v1", "namespaces")
            for name in self._initial_namespaces:
                self.create(ns_type, None, {"metadata": {"name": name}})

    @property
    def resource_version(self) -> int:
        with self.lock:
            return self._rv

    def _bucket(self, key: Key) -> dict[tuple[str | None, str], Obj]:
        return self._objects.setdefault(key, {})

    def _bump(self, obj: Obj) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        return obj

    def _uids(self) -> set[str]:
        return {o["metadata"]["uid"] for bucket in self._objects.values() for o in bucket.values()}

    @staticmethod
    def _ns(rtype: ResourceType, namespace: str | None) -> str | None:
        return namespace if rtype.namespaced else None

    # ----------------------------------------------------------------- reads
    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        with self.lock:
            return copy.deepcopy(self._current(rtype, namespace, name))

    def find(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj | None:
        with self.lock:
            obj = self._bucket(rtype.key).get((self._ns(rtype, namespace), name))
            return copy.deepcopy(obj) if obj is not None else None

    def _current(self, rtype: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self._bucket(rtype.key).get((self._ns(rtype, namespace), name))
        if obj is None:
            raise errors.not_found(rtype.plural, name, rtype.group)
        return obj

    def list(self, rtype: ResourceType, namespace: str | None) -> tuple[list[Obj], int]:
        """Objects of a type (all namespaces when `namespace` is None), sorted, plus the list's rv."""
        with self.lock:
            items = [
                copy.deepcopy(obj)
                for (ns, _), obj in sorted(
                    self._bucket(rtype.key).items(), key=lambda kv: (kv[0][0] or "", kv[0][1])
                )
                if namespace is None or ns == namespace
            ]
            return items, self._rv

    # ----------------------------------------------------------------- watch
    def subscribe(self, watcher: Watcher, since: int | None) -> list[Event]:
        """Register a watcher; returns what it must send first (current objects, or history after `since`).

        Done under the lock so no event falls between the initial batch and the live queue.
        """
        with self.lock:
            if since is None:
                initial = [
                    Event(int(obj["metadata"]["resourceVersion"]), "ADDED", watcher.key, ns, obj)
                    for (ns, _), obj in sorted(
                        self._bucket(watcher.key).items(), key=lambda kv: (kv[0][0] or "", kv[0][1])
                    )
                    if watcher.namespace in (None, ns)
                ]
            else:
                initial = self.hub.since(watcher.key, watcher.namespace, since)
            self.hub.add(watcher)
            return initial

    def unsubscribe(self, watcher: Watcher) -> None:
        with self.lock:
            self.hub.remove(watcher)

    def close_watchers(self) -> None:
        with self.lock:
            self.hub.close_all()

    # ----------------------------------------------------------------- create
    def create(self, rtype: ResourceType, namespace: str | None, body: Any) -> Obj:
        with self.lock:
            obj = self._new_object(rtype, namespace, body)
            name, ns = obj["metadata"]["name"], obj["metadata"].get("namespace")
            if (ns, name) in self._bucket(rtype.key):
                raise errors.already_exists(rtype.plural, name, rtype.group)
            if ns is not None and (None, ns) not in self._bucket(NAMESPACE_KEY):
                raise errors.not_found("namespaces", ns)
            if rtype.key == CRD_KEY:
                crd_type = types_from_crd(obj)
                obj["status"] = _crd_status(crd_type)
                self.registry.register(crd_type)
            self._bump(obj)
            self._bucket(rtype.key)[(ns, name)] = obj
            self.hub.emit(Event(self._rv, "ADDED", rtype.key, ns, obj))
            return copy.deepcopy(obj)

    def _new_object(self, rtype: ResourceType, namespace: str | None, body: Any) -> Obj:
        if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
            raise errors.invalid(f"{rtype.kind} body must be a JSON object with a metadata object")
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if not isinstance(meta.get("name"), str) or not meta["name"]:
            raise errors.invalid(
                f"{rtype.kind}: metadata.name: Required value: name or generateName is required"
            )
        body_ns = meta.get("namespace")
        if rtype.namespaced:
            if body_ns and namespace and body_ns != namespace:
                raise errors.bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace or body_ns or "default"
        else:
            meta.pop("namespace", None)
        for field in _SERVER_META[:-2]:
            meta.pop(field, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        obj["apiVersion"], obj["kind"] = rtype.api_version(_version_of(obj, rtype)), rtype.kind
        if rtype.status:
            obj.pop("status", None)  # status is only writable through the /status subresource
        _apply_defaults(rtype, obj)
        return obj

    # ----------------------------------------------------------------- update / patch
    def replace(
        self, rtype: ResourceType, namespace: str | None, name: str, body: Any, subresource: str | None = None
    ) -> Obj:
        if not isinstance(body, dict):
            raise errors.invalid(f"{rtype.kind} body must be a JSON object")
        return self.modify(rtype, namespace, name, lambda _old: copy.deepcopy(body), subresource)

    def modify(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        change: Callable[[Obj], Obj],
        subresource: str | None = None,
    ) -> Obj:
        """Read-modify-write: `change` gets a copy of the current object and returns the wanted one.

        A resourceVersion in the returned object is a precondition (409 Conflict on mismatch), as with
        the real server for both PUT and PATCH.
        """
        with self.lock:
            old = self._current(rtype, namespace, name)
            wanted = change(copy.deepcopy(old))
            if not isinstance(wanted, dict) or not isinstance(wanted.get("metadata", {}), dict):
                raise errors.invalid(f"{rtype.kind}: the result must be an object with a metadata object")
            wanted_rv = (wanted.get("metadata") or {}).get("resourceVersion")
            if wanted_rv not in (None, "", old["metadata"]["resourceVersion"]):
                raise errors.conflict(rtype.plural, name, rtype.group)
            new = self._merge_server_fields(rtype, old, wanted, subresource)
            return copy.deepcopy(self._commit(rtype, old, new))

    def _merge_server_fields(
        self, rtype: ResourceType, old: Obj, wanted: Obj, subresource: str | None
    ) -> Obj:
        if subresource == "status":
            new = copy.deepcopy(old)
            if "status" in wanted:
                new["status"] = wanted["status"]
            else:
                new.pop("status", None)
            return new
        new = wanted
        meta = new.setdefault("metadata", {})
        if rtype.status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        if "managedFields" not in meta and "managedFields" in old["metadata"]:
            meta["managedFields"] = copy.deepcopy(old["metadata"]["managedFields"])  # kept when omitted
        for field in _SERVER_META:
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        if _spec_part(new) != _spec_part(old):
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        return new

    def _commit(self, rtype: ResourceType, old: Obj, new: Obj) -> Obj:
        if new == old:
            return old  # no-op writes keep the resourceVersion, as on a real server
        meta = new["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            return self._remove(rtype, new)
        if rtype.key == CRD_KEY:
            crd_type = types_from_crd(new)
            new["status"] = _crd_status(crd_type)
            self.registry.register(crd_type)
        self._bump(new)
        self._bucket(rtype.key)[(meta.get("namespace"), meta["name"])] = new
        self.hub.emit(Event(self._rv, "MODIFIED", rtype.key, meta.get("namespace"), new, old))
        return new

    # ----------------------------------------------------------------- delete
    def delete(self, rtype: ResourceType, namespace: str | None, name: str, *, orphan: bool = False) -> Obj:
        with self.lock:
            return copy.deepcopy(self._delete(rtype, self._current(rtype, namespace, name), orphan=orphan))

    def _delete(self, rtype: ResourceType, obj: Obj, *, orphan: bool = False) -> Obj:
        if not obj["metadata"].get("finalizers"):
            return self._remove(rtype, obj, orphan=orphan)
        if obj["metadata"].get("deletionTimestamp"):
            return obj
        new = copy.deepcopy(obj)
        new["metadata"].update(deletionTimestamp=now(), deletionGracePeriodSeconds=0)
        return self._commit(rtype, obj, new)

    def _remove(self, rtype: ResourceType, obj: Obj, *, orphan: bool = False) -> Obj:
        meta = obj["metadata"]
        self._bucket(rtype.key).pop((meta.get("namespace"), meta["name"]), None)
        gone = copy.deepcopy(obj)
        self._bump(gone)
        self.hub.emit(Event(self._rv, "DELETED", rtype.key, meta.get("namespace"), gone, obj))
        if rtype.key == CRD_KEY:
            self._drop_crd_type(obj)
        elif rtype.key == NAMESPACE_KEY:
            self._empty_namespace(meta["name"])
        if not orphan:
            self._collect_garbage(meta["uid"])
        return gone

    def _drop_crd_type(self, crd: Obj) -> None:
        spec = crd.get("spec") or {}
        key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
        rtype = self.registry.by_key(key)
        if rtype is None:
            return
        for obj in list(self._bucket(key).values()):
            self._remove(rtype, obj)
        self.registry.unregister(key)
        self._objects.pop(key, None)

    def _empty_namespace(self, namespace: str) -> None:
        """Namespace deletion deletes its contents at once (the real one does it asynchronously)."""
        for rtype in self.registry.all():
            if rtype.namespaced:
                for (ns, _), obj in list(self._bucket(rtype.key).items()):
                    if ns == namespace:
                        self._delete(rtype, obj)

    def _collect_garbage(self, removed_uid: str) -> None:
        """Background cascade: delete dependents none of whose owners exist any more (recursively)."""
        alive = self._uids()
        for rtype in self.registry.all():
            for obj in list(self._bucket(rtype.key).values()):
                owners = {ref.get("uid") for ref in obj["metadata"].get("ownerReferences") or []}
                if removed_uid in owners and not owners & alive:
                    current = self._bucket(rtype.key).get(
                        (obj["metadata"].get("namespace"), obj["metadata"]["name"])
                    )
                    if current is not None:
                        self._delete(rtype, current)


def _version_of(obj: Obj, rtype: ResourceType) -> str | None:
    version = str(obj.get("apiVersion") or "").rpartition("/")[2]
    return version if version in rtype.versions else None


def _apply_defaults(rtype: ResourceType, obj: Obj) -> None:
    """The few server-side defaults tests rely on."""
    if rtype.key == NAMESPACE_KEY:
        obj["status"] = {"phase": "Active"}
    elif rtype.key == ("apps", "deployments"):
        obj.setdefault("spec", {}).setdefault("replicas", 1)


def _crd_status(rtype: ResourceType) -> dict[str, Any]:
    accepted = {
        "plural": rtype.plural,
        "singular": rtype.singular,
        "kind": rtype.kind,
        "listKind": f"{rtype.kind}List",
    }
    if rtype.short_names:
        accepted["shortNames"] = list(rtype.short_names)
    conditions = [
        {"type": t, "status": "True", "reason": r, "message": m, "lastTransitionTime": now()}
        for t, r, m in (
            ("NamesAccepted", "NoConflicts", "no conflicts found"),
            ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        )
    ]
    return {"acceptedNames": accepted, "conditions": conditions, "storedVersions": [rtype.versions[0]]}
