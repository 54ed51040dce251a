"""In-process Kubernetes API server emulator over HTTP, for testing the Kopf operator with the real
`kubernetes` Python client and the real `kubectl`.

Why not kmock: kmock 0.8 lacks resourceVersion/uid/generation, answers POST with 200, crashes on
`/api/v1/namespaces`, advertises core discovery wrongly and replays watches.

Usage::

    from testkit.k8s_emulator import KubeEmulator

    with KubeEmulator() as api:                 # free localhost port, background thread, plain http
        api.url                                  # "http://127.0.0.1:PORT"
        api.kubeconfig_path                      # kubeconfig for kubectl / kubernetes.config / kopf
        ...
        api.request_log                          # [RequestRecord(verb, path, resource, namespace)]
        api.reset()                              # back to the initial state

    # Kopf in-process (kopf.testing.KopfRunner): the kubernetes client reads $KUBECONFIG at import
    # time, so point the process at the emulator explicitly first:
    api.activate()
    with KopfRunner(["run", "-A", "--standalone", "operator.py"], timeout=60) as runner: ...
    api.deactivate()                             # stop() also does it

Public API of `KubeEmulator(*, namespaces=("default", "kube-system"), host="127.0.0.1", port=0)`:

- `start()` / `stop()` / context manager; `url`; `kubeconfig_path` (context "emulator", namespace
  "default", a dummy bearer token the server ignores).
- `activate()` / `deactivate()`: make it the process-default cluster ($KUBECONFIG, the kubernetes
  client's default kubeconfig location and default Configuration), for in-process Kopf and for code
  that calls `kubernetes.client.XxxApi()` without arguments. `api_client()`: a fresh
  `kubernetes.client.ApiClient` bound to the emulator, leaving process defaults alone.
- `request_log`: list of `RequestRecord(verb, path, resource, namespace)` NamedTuples for every
  resource request (discovery is not logged). `verb` is in RBAC terms: get, list, watch, create,
  update, patch, delete, deletecollection; `resource` is the plural, or "plural/status",
  "plural/scale" for subresources, as RBAC rules name them.
- `rbac_usage()`: set of (apiGroup, resource, verb) triples, to compare against a ClusterRole.
- `clear_log()`; `reset()` (objects, CRD-registered types, watches and log back to the start).
- Direct, thread-safe helpers that bypass HTTP (no request-log entries):
  `get(api_version, resource, name, namespace=None) -> dict | None`,
  `list(api_version, resource, namespace=None) -> list[dict]`, `create(manifest)`, `apply(manifest)`,
  `patch(api_version, resource, name, patch, namespace=None, *, content_type=MERGE, subresource=None)`,
  `patch_status(api_version, resource, name, status, namespace=None)`,
  `delete(api_version, resource, name, namespace=None)`,
  `patch_deployment_status(name, namespace="default", *, ready=True, replicas=None, ready_replicas=None)`
  (plays the Deployment controller: replicas/ready/available counts, observedGeneration, conditions),
  `serves(api_version, resource) -> bool`, `resource(api_version, name) -> ResourceType`,
  `snapshot()` (all objects, for debugging), and the static `wait_for(condition, timeout=10.0)` poller.
  `resource` arguments accept the plural, singular, kind or a short name ("ckv").
- `crd_manifest(group, version, kind, *, plural=None, short_names=(), scope="Namespaced",
  status=True, scale=False, printer_columns=())`: a minimal CRD manifest for tests.

What it does:
- Discovery: /version, /api, /api/v1, /apis, /apis/{group}, /apis/{group}/{version}, legacy form only
  (aggregated discovery is refused by answering plain application/json; kubectl falls back).
  /openapi/* is 404 (use `kubectl apply/create --validate=false`). `kubectl get` gets
  server-side Tables: Name, a CRD's additionalPrinterColumns, Age.
- Built-in types: namespaces, configmaps, secrets, services, serviceaccounts, pods, nodes, events (core
  and events.k8s.io), apps/v1 deployments (status + scale), policy/v1 poddisruptionbudgets, RBAC roles,
  rolebindings, clusterroles, clusterrolebindings, apiextensions.k8s.io/v1 customresourcedefinitions,
  coordination.k8s.io/v1 leases, persistentvolumeclaims, networking.k8s.io/v1 networkpolicies,
  autoscaling/v2 horizontalpodautoscalers. Creating a CRD registers its type (versions, names, shortNames,
  scope, status/scale subresources) in discovery and CRUD at once; deleting it removes the type and
  its objects. Anything else (kopf peerings, ServiceMonitor, ...) exists only through its CRD.
- CRUD: uid, global resourceVersion bumped on every change (no-op writes do not bump it), generation
  (1, then +1 whenever anything outside metadata/status changes), creationTimestamp; POST 201,
  409 AlreadyExists, 404 NotFound (also for a missing namespace), 409 Conflict on a stale
  resourceVersion in PUT or PATCH bodies, 422 Invalid for malformed bodies, 405 for unsupported verbs.
  Lists across namespaces, labelSelector (=, ==, !=, in, notin, exists, !exists) and equality
  fieldSelector on any dotted path. Status subresource: /status writes change only status; main
  writes never change status for types that have the subresource (status is dropped on create).
  Scale subresource via specReplicasPath/statusReplicasPath/labelSelectorPath.
- PATCH: merge-patch (RFC 7386), json-patch (RFC 6902 incl. `test`; failures are 422 like the real
  server, which Kopf relies on), strategic-merge (approximation, see `patching`), apply-patch+yaml
  (server-side apply: `fieldManager` required, `managedFields` per manager, fields a manager's new
  apply leaves out are removed, then strategic merge; no conflicts; see `managed`).
- Watches: newline-delimited JSON, chunked, open until timeoutSeconds or server stop/reset. With a
  resourceVersion N only events after N are sent (from a bounded history; older -> ERROR 410); with
  none or "0" the current objects come first as ADDED (plus the initial-events-end BOOKMARK when
  sendInitialEvents=true). Label/field selectors apply, with ADDED/DELETED on selector entry/exit.
- Deletion: finalizers (deletionTimestamp set, removal when the last finalizer goes), synchronous
  background cascade through ownerReferences (recursive; propagationPolicy=Orphan skips it;
  Foreground is treated as Background), namespace deletion deletes its contents at once.

What it does NOT do: OpenAPI/CRD schema validation, defaulting beyond Deployment spec.replicas=1 and
Namespace status.phase, CEL, RBAC/authentication, admission, field ownership of non-apply writes,
version conversion, pagination (`limit` is ignored, everything comes in one page), watch bookmarks (except the
initial-events-end one), DeleteOptions preconditions, protobuf (bodies other than JSON get 415, so
kubectl's imperative generators such as `kubectl create configmap x --from-literal=...`, which send
protobuf, fail: use `kubectl apply/create -f` manifests), Tables in watch streams (`kubectl get -w`),
or any controller: no Deployment/ReplicaSet/Pod controller, so tests call `patch_deployment_status()`
themselves.
"""

from .errors import ApiError
from .patching import APPLY, JSON_PATCH, MERGE, STRATEGIC
from .registry import ResourceType, ScaleSpec
from .routing import RequestRecord
from .samples import crd_manifest
from .server import KubeEmulator

__all__ = [
    "APPLY",
    "JSON_PATCH",
    "MERGE",
    "STRATEGIC",
    "ApiError",
    "KubeEmulator",
    "RequestRecord",
    "ResourceType",
    "ScaleSpec",
    "crd_manifest",
]
