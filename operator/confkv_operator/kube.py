"""The only module that talks to the Kubernetes API (besides Kopf itself): server-side apply of children,
drift detection on the fields the operator sets, discovery of optional CRDs, pod listing.

Children are written by server-side apply with the field manager ``confkv-operator`` (``force=true``):
the API server remembers which fields the operator's last apply set, so a field the new desired object
no longer carries (a nodeSelector, a resource limit, the ``fetch-model`` init container and its volume)
is removed from the child, while fields other controllers own (an HPA's replicas are not ours anyway, a
``kubectl rollout restart`` annotation) stay. Each child carries the hash of what was applied
(``confkv.io/applied-hash``): an apply is sent only when that hash changes (the spec changed) or a field
the operator sets has drifted, so a steady resync makes no writes.

Requests go through the ``kubernetes`` client's configured ApiClient (in-cluster or kubeconfig auth),
with JSON bodies (JSON is YAML, so apply patches are JSON too).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import kubernetes
from kubernetes.utils import parse_quantity

log = logging.getLogger(__name__)
Obj = dict[str, Any]

#: kind -> (plural, namespaced)
_PLURALS = {
    "ConfigMap": "configmaps", "Service": "services", "ServiceAccount": "serviceaccounts", "Pod": "pods",
    "Deployment": "deployments", "Role": "roles", "RoleBinding": "rolebindings",
    "PodDisruptionBudget": "poddisruptionbudgets", "ServiceMonitor": "servicemonitors",
    "PrometheusRule": "prometheusrules", "ConfKVDeployment": "confkvdeployments",
    "PersistentVolumeClaim": "persistentvolumeclaims", "NetworkPolicy": "networkpolicies",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers", "ScaledObject": "scaledobjects",
    "InferencePool": "inferencepools", "LeaderWorkerSet": "leaderworkersets",
}
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"
FIELD_MANAGER = "confkv-operator"
APPLIED_HASH_ANNOTATION = "confkv.io/applied-hash"
_TIMEOUT = (5.0, 30.0)


class KubeError(RuntimeError):
    """A non-2xx answer; ``status`` is the HTTP code (0 when the server could not be reached)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


def object_path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{base}/namespaces/{quote(namespace)}/{_PLURALS[kind]}"
    return f"{path}/{quote(name)}" if name else path


def _same_scalar(want: Any, have: Any) -> bool:
    if want == have:
        return True
    # The API server normalises quantities ("1" for 1, "1Gi" stays): compare their values.
    if isinstance(want, (int, str)) and isinstance(have, (int, str)) and not isinstance(want, bool):
        try:
            return parse_quantity(want) == parse_quantity(have)
        except (ValueError, TypeError, ArithmeticError):
            return False
    return False


def drifted(desired: Any, live: Any) -> list[str]:
    """Paths where ``live`` differs from ``desired``, looking only at what ``desired`` sets: fields the
    server adds (defaults, status, metadata) are not drift. Lists must match element by element."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return ["."]
        return [f".{key}{sub if sub != '.' else ''}" for key, value in desired.items()
                for sub in drifted(value, live.get(key))]
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return ["."]
        pairs = enumerate(zip(desired, live, strict=True))
        return [f"[{i}]{sub if sub != '.' else ''}"
                for i, (want, have) in pairs for sub in drifted(want, have)]
    return [] if _same_scalar(desired, live) else ["."]


def with_applied_hash(desired: Obj) -> Obj:
    """``desired`` with the hash of its own content in ``confkv.io/applied-hash``."""
    digest = hashlib.sha256(json.dumps(desired, sort_keys=True).encode()).hexdigest()[:16]
    meta = desired["metadata"]
    annotations = {**(meta.get("annotations") or {}), APPLIED_HASH_ANNOTATION: digest}
    return {**desired, "metadata": {**meta, "annotations": annotations}}


class Kube:
    """Thin synchronous API access; one instance per operator process (thread-safe: urllib3 pool)."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api
        self._minor: int | None = None

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account, else the kubeconfig ($KUBECONFIG or ~/.kube/config); the
        process-wide default configuration is left alone."""
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            return cls(kubernetes.config.new_client_from_config())
        return cls(kubernetes.client.ApiClient(configuration))

    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, str] | None = None,
                content_type: str = "application/json") -> Obj | None:
        """One call; GET of a missing object returns None, every other non-2xx raises KubeError."""
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method, url, headers, body, _ = self.api.param_serialize(
            method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
            auth_settings=["BearerToken"])
        try:
            response = self.api.call_api(method, url, headers, body, _request_timeout=_TIMEOUT)
            response.read()
        except kubernetes.client.exceptions.ApiException as err:
            raise KubeError(err.status or 0, str(err.reason)) from None
        except Exception as err:  # urllib3 connection errors: the caller retries later
            raise KubeError(0, f"{type(err).__name__}: {err}") from None
        if method == "GET" and response.status == 404:
            return None
        if not 200 <= response.status < 300:
            raise KubeError(response.status, response.data.decode(errors="replace")[:500])
        return json.loads(response.data) if response.data else {}

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Obj | None:
        return self.request("GET", object_path(api_version, kind, namespace, name))

    def ensure(self, desired: Obj) -> str:
        """Apply the object when it is absent, its desired state changed or a field it sets drifted.
        Returns created / patched / unchanged."""
        desired = with_applied_hash(desired)
        meta = desired["metadata"]
        path = object_path(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
        live = self.request("GET", path)
        if live is None:
            self.apply(path, desired)
            return "created"
        changed = (live.get("metadata", {}).get("annotations") or {}).get(APPLIED_HASH_ANNOTATION) != \
            meta["annotations"][APPLIED_HASH_ANNOTATION]
        paths = [] if changed else drifted(desired, live)
        if not changed and not paths:
            return "unchanged"
        log.info("applying %s/%s: %s", desired["kind"], meta["name"],
                 "desired state changed" if changed else "drifted at " + ", ".join(paths[:5]))
        self.apply(path, desired)
        return "patched"

    def ensure_absent_only(self, desired: Obj) -> str:
        """Create the object when absent and never touch it afterwards (PersistentVolumeClaims: their
        spec is immutable once bound, and the data on them is the user's)."""
        meta = desired["metadata"]
        path = object_path(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
        if self.request("GET", path) is not None:
            return "unchanged"
        self.apply(path, desired)
        return "created"

    def delete_owned(self, api_version: str, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
        """Delete the object when it exists and ``owner_uid`` controls it (a child the spec no longer
        asks for); objects of the same name that someone else made are left alone."""
        path = object_path(api_version, kind, namespace, name)
        live = self.request("GET", path)
        refs = (live or {}).get("metadata", {}).get("ownerReferences") or []
        if not any(ref.get("uid") == owner_uid and ref.get("controller") for ref in refs):
            return False
        try:
            self.request("DELETE", path)
        except KubeError as err:
            if err.status != 404:
                raise
        return True

    def apply(self, path: str, desired: Obj) -> Obj | None:
        return self.request("PATCH", path, desired, content_type=APPLY_PATCH,
                            query={"fieldManager": FIELD_MANAGER, "force": "true"})

    def served_kinds(self, group_version: str) -> frozenset[str]:
        """Kinds served under ``/apis/<group_version>`` (empty when the group is not installed)."""
        try:
            doc = self.request("GET", f"/apis/{group_version}")
        except KubeError as err:
            if err.status in (403, 404, 503):
                return frozenset()
            raise
        return frozenset(r["kind"] for r in (doc or {}).get("resources", []) if "/" not in r["name"])

    def server_minor(self) -> int | None:
        """The API server's minor version (``/version``), read once; None when it cannot be read."""
        if self._minor is None:
            try:
                doc = self.request("GET", "/version") or {}
            except KubeError:
                return None  # asked again next time
            digits = "".join(ch for ch in str(doc.get("minor", "")) if ch.isdigit())  # "29+" on EKS/GKE
            self._minor = int(digits) if digits else None
        return self._minor

    def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        doc = self.request("GET", f"/api/v1/namespaces/{quote(namespace)}/pods",
                           query={"labelSelector": selector})
        return list((doc or {}).get("items", []))
