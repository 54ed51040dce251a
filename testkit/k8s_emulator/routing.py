"""URL parsing: which resource type, namespace, name and subresource a request addresses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from . import errors
from .registry import Registry, ResourceType


class RequestRecord(NamedTuple):
    """One resource request, with the verb in RBAC terms (get/list/watch/create/update/patch/delete)."""

    verb: str
    path: str
    resource: str  # plural, or "plural/subresource" as RBAC rules name it
    namespace: str | None


@dataclass(frozen=True)
class Target:
    rtype: ResourceType
    version: str
    namespace: str | None
    name: str | None
    subresource: str | None

    @property
    def rbac_resource(self) -> str:
        return f"{self.rtype.plural}/{self.subresource}" if self.subresource else self.rtype.plural


def rbac_verb(method: str, target: Target, watch: bool) -> str:
    if method == "GET":
        return "get" if target.name else ("watch" if watch else "list")
    if method == "DELETE" and not target.name:
        return "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(
        method, method.lower()
    )


def _split_prefix(parts: list[str]) -> tuple[str, str, list[str]] | None:
    """('', 'v1', rest) for /api/v1/..., (group, version, rest) for /apis/g/v/...; None otherwise."""
    if len(parts) >= 3 and parts[0] == "api" and parts[1] == "v1":
        return "", "v1", parts[2:]
    if len(parts) >= 4 and parts[0] == "apis":
        return parts[1], parts[2], parts[3:]
    return None


def parse(registry: Registry, path: str) -> Target | None:
    """Resolve a resource URL; None when it is not a resource URL at all (discovery and the like)."""
    parts = [p for p in path.split("/") if p]
    split = _split_prefix(parts)
    if split is None:
        return None
    group, version, rest = split
    namespace: str | None = None
    # /api/v1/namespaces/{ns}/{plural}/... but not /api/v1/namespaces/{name}[/status|/finalize]
    if len(rest) >= 3 and rest[0] == "namespaces" and not (group == "" and rest[2] in ("status", "finalize")):
        namespace, rest = rest[1], rest[2:]
    if not 1 <= len(rest) <= 3:
        raise errors.not_found("", path)
    rtype = registry.get(group, version, rest[0])
    if rtype is None:
        raise errors.ApiError(404, f"the server could not find the requested resource ({path})")
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if namespace is not None and not rtype.namespaced:
        raise errors.ApiError(404, f"the server could not find the requested resource ({path})")
    if sub is not None and not ((sub == "status" and rtype.status) or (sub == "scale" and rtype.scale)):
        raise errors.ApiError(404, f"the server could not find the requested resource ({path})")
    if name is not None and rtype.namespaced and namespace is None:
        raise errors.ApiError(404, f"the server could not find the requested resource ({path})")
    return Target(rtype, version, namespace, name, sub)
