"""Legacy (non-aggregated) discovery documents, built from the registry on every request.

Aggregated discovery (`application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList`) is
deliberately not offered: clients that ask for it get plain `application/json` and fall back to the
per-group-version documents, which is what kubectl and the Python client do.
"""

from __future__ import annotations

from typing import Any

from .registry import Registry

SERVER_VERSION = {
    "major": "1",
    "minor": "35",
    "gitVersion": "v1.35.0-confkv-emulator",
    "gitCommit": "0" * 40,
    "gitTreeState": "clean",
    "buildDate": "2025-01-01T00:00:00Z",
    "goVersion": "go1.24.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}


def api_versions(host: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}],
    }


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def api_group_list(registry: Registry) -> dict[str, Any]:
    groups = registry.group_versions()
    return {
        "kind": "APIGroupList",
        "apiVersion": "v1",
        "groups": [_group(name, groups[name]) for name in sorted(groups)],
    }


def api_group(registry: Registry, name: str) -> dict[str, Any] | None:
    versions = registry.group_versions().get(name)
    if not versions:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(name, versions)}


def api_resource_list(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = sorted(registry.in_group_version(group, version), key=lambda t: t.plural)
    if not types:
        return None
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": [entry for t in types for entry in t.discovery_entries()],
    }
