"""Resource types the emulator serves: the built-in set plus types registered from CRDs."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .errors import invalid

_ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
_SUB_VERBS = ("get", "patch", "update")


@dataclass(frozen=True)
class ScaleSpec:
    """JSON paths (Kubernetes `.a.b` form) that a scale subresource reads and writes."""

    spec_replicas_path: str = ".spec.replicas"
    status_replicas_path: str = ".status.replicas"
    label_selector_path: str | None = None


@dataclass(frozen=True)
class ResourceType:
    group: str
    versions: tuple[str, ...]
    plural: str
    singular: str
    kind: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    status: bool = False
    scale: ScaleSpec | None = None
    printer_columns: tuple[dict[str, Any], ...] = field(default=(), compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def preferred_version(self) -> str:
        return self.versions[0]

    def api_version(self, version: str | None = None) -> str:
        version = version or self.preferred_version
        return f"{self.group}/{version}" if self.group else version

    def discovery_entries(self) -> list[dict[str, Any]]:
        """APIResource entries for this type and its subresources (legacy discovery form)."""
        main: dict[str, Any] = {
            "name": self.plural,
            "singularName": self.singular,
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": list(_ALL_VERBS),
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        if self.categories:
            main["categories"] = list(self.categories)
        entries = [main]
        if self.status:
            entries.append(
                {
                    "name": f"{self.plural}/status",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind,
                    "verbs": list(_SUB_VERBS),
                }
            )
        if self.scale is not None:
            entries.append(
                {
                    "name": f"{self.plural}/scale",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "group": "autoscaling",
                    "version": "v1",
                    "kind": "Scale",
                    "verbs": list(_SUB_VERBS),
                }
            )
        return entries


def _t(group: str, version: str, plural: str, kind: str, namespaced: bool = True, **kw: Any) -> ResourceType:
    return ResourceType(
        group=group,
        versions=(version,),
        plural=plural,
        singular=kind.lower(),
        kind=kind,
        namespaced=namespaced,
        **kw,
    )


_DEPLOYMENT_SCALE = ScaleSpec(label_selector_path=".status.selector")

BUILTINS: tuple[ResourceType, ...] = (
    _t("", "v1", "namespaces", "Namespace", False, short_names=("ns",), status=True),
    _t("", "v1", "configmaps", "ConfigMap", short_names=("cm",)),
    _t("", "v1", "secrets", "Secret"),
    _t("", "v1", "services", "Service", short_names=("svc",), status=True, categories=("all",)),
    _t("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _t("", "v1", "pods", "Pod", short_names=("po",), status=True, categories=("all",)),
    _t("", "v1", "events", "Event", short_names=("ev",)),
    _t("", "v1", "nodes", "Node", False, short_names=("no",), status=True),
    _t("events.k8s.io", "v1", "events", "Event", short_names=("ev",)),
    _t(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        short_names=("deploy",),
        status=True,
        scale=_DEPLOYMENT_SCALE,
        categories=("all",),
    ),
    _t("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=("pdb",), status=True),
    _t("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _t("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _t("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False),
    _t("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False),
    _t(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        False,
        short_names=("crd", "crds"),
        status=True,
    ),
    _t("coordination.k8s.io", "v1", "leases", "Lease"),
    _t("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",), status=True),
    _t("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)),
    _t("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", short_names=("hpa",),
       status=True, categories=("all",)),
)


def _get(obj: dict[str, Any], *path: str) -> Any:
    for part in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(part)  # type: ignore[assignment]
    return obj


def types_from_crd(crd: dict[str, Any]) -> ResourceType:
    """Validate the parts of a CRD the emulator needs and turn it into a ResourceType.

    Only structure is checked (names, scope, versions), never the OpenAPI schema.
    """
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group"), names.get("plural"), names.get("kind")
    if not (isinstance(group, str) and group and isinstance(plural, str) and plural and kind):
        raise invalid("CustomResourceDefinition needs spec.group, spec.names.plural and spec.names.kind")
    name = _get(crd, "metadata", "name")
    if name != f"{plural}.{group}":
        raise invalid(
            f'CustomResourceDefinition "{name}": metadata.name must be spec.names.plural+"."+spec.group'
        )
    scope = spec.get("scope")
    if scope not in ("Namespaced", "Cluster"):
        raise invalid(
            f"CustomResourceDefinition {name}: spec.scope must be Namespaced or Cluster, got {scope!r}"
        )
    served = [v for v in spec.get("versions") or [] if isinstance(v, dict) and v.get("served", True)]
    if not served or not all(isinstance(v.get("name"), str) for v in served):
        raise invalid(
            f"CustomResourceDefinition {name}: spec.versions needs at least one served named version"
        )
    # The storage version is the preferred one (what discovery advertises first).
    served.sort(key=lambda v: not v.get("storage", False))
    subresources: dict[str, Any] = {}
    columns: list[dict[str, Any]] = []
    for version in served:
        subresources.update(version.get("subresources") or {})
        columns = columns or list(version.get("additionalPrinterColumns") or [])
    scale = subresources.get("scale")
    return ResourceType(
        group=group,
        versions=tuple(v["name"] for v in served),
        plural=plural,
        singular=names.get("singular") or kind.lower(),
        kind=kind,
        namespaced=scope == "Namespaced",
        short_names=tuple(names.get("shortNames") or ()),
        categories=tuple(names.get("categories") or ()),
        status="status" in subresources,
        scale=None
        if scale is None
        else ScaleSpec(
            spec_replicas_path=scale.get("specReplicasPath", ".spec.replicas"),
            status_replicas_path=scale.get("statusReplicasPath", ".status.replicas"),
            label_selector_path=scale.get("labelSelectorPath"),
        ),
        printer_columns=tuple(columns),
    )


class Registry:
    """Thread-safe map of served resource types, keyed by (group, plural)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._types: dict[tuple[str, str], ResourceType] = {}
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._types = {t.key: t for t in BUILTINS}

    def register(self, rtype: ResourceType) -> None:
        with self._lock:
            self._types[rtype.key] = rtype

    def unregister(self, key: tuple[str, str]) -> None:
        with self._lock:
            self._types.pop(key, None)

    def all(self) -> list[ResourceType]:
        with self._lock:
            return list(self._types.values())

    def get(self, group: str, version: str, plural: str) -> ResourceType | None:
        with self._lock:
            rtype = self._types.get((group, plural))
        return rtype if rtype is not None and version in rtype.versions else None

    def by_key(self, key: tuple[str, str]) -> ResourceType | None:
        with self._lock:
            return self._types.get(key)

    def find(self, api_version: str, name: str) -> ResourceType:
        """Look a type up by apiVersion and any of plural, singular, kind or short name."""
        group, _, version = api_version.rpartition("/")
        lowered = name.lower()
        for rtype in self.all():
            if rtype.group != group or version not in rtype.versions:
                continue
            if lowered in (rtype.plural, rtype.singular, rtype.kind.lower(), *rtype.short_names):
                return rtype
        raise KeyError(f"no resource {name!r} in {api_version!r}")

    def group_versions(self) -> dict[str, list[str]]:
        """Served versions per non-core group, preferred version first."""
        groups: dict[str, list[str]] = {}
        for rtype in self.all():
            if rtype.group:
                versions = groups.setdefault(rtype.group, [])
                versions.extend(v for v in rtype.versions if v not in versions)
        return groups

    def in_group_version(self, group: str, version: str) -> Iterable[ResourceType]:
        return [t for t in self.all() if t.group == group and version in t.versions]
