"""Kopf handlers, kept thin: validate, build (pure), ensure (kube.py), compute status (pure).

``register`` wires the handlers into a registry with the settings' timer interval, so ``main`` and the
tests run the same operator with their own settings.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from confkv_api.config import ConfigError
from confkv_api.deployment import DeploymentSpec, load_deployment_spec

from . import names as n
from .builders import build_children
from .groups import LWS_API_VERSION, LWS_KIND, serving_selector
from .hostpaths import HostPathRefused, split_host_path
from .kube import Kube, KubeError
from .podstatus import pods_report
from .settings import OperatorSettings
from .status import (
    auth_condition,
    compute_status,
    invalid_status,
    last_remediation,
    merge_conditions,
    missing_api_status,
    open_api_message,
    status_delta,
)
from .storage import build_claims

log = logging.getLogger(__name__)
#: group/version -> the optional kinds looked up there (``builders.OPTIONAL_KINDS``).
_OPTIONAL_GROUPS = {"monitoring.coreos.com/v1": {"ServiceMonitor", "PrometheusRule"},
                    "keda.sh/v1alpha1": {"ScaledObject"},
                    "inference.networking.k8s.io/v1": {"InferencePool"},
                    LWS_API_VERSION: {LWS_KIND}}
#: Children a spec can switch off, named after the CR: deleted when no longer wanted.
SWITCHABLE_KINDS = (("networking.k8s.io/v1", "NetworkPolicy"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
                    ("monitoring.coreos.com/v1", "PrometheusRule"),
                    ("autoscaling/v2", "HorizontalPodAutoscaler"), ("keda.sh/v1alpha1", "ScaledObject"),
                    ("inference.networking.k8s.io/v1", "InferencePool"),
                    # The workload switches with spec.nodes: a Deployment for 1, a LeaderWorkerSet above.
                    ("apps/v1", "Deployment"), (LWS_API_VERSION, LWS_KIND))
_ALWAYS_SERVED = frozenset({"NetworkPolicy", "HorizontalPodAutoscaler", "Deployment"})
#: Native sidecars (init containers with restartPolicy Always) are on by default from Kubernetes 1.29.
_NATIVE_SIDECAR_MINOR = 29


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _write_status(patch: kopf.Patch, current: Mapping[str, Any], desired: dict[str, Any]) -> None:
    desired = {**desired, "conditions": merge_conditions(current.get("conditions") or [],
                                                         desired["conditions"], _now())}
    for key, value in status_delta(current, desired).items():
        patch.status[key] = value


def check_spec(raw: Mapping[str, Any], settings: OperatorSettings) -> DeploymentSpec:
    """The CR model plus the checks that need the operator's settings; raises ConfigError."""
    spec = load_deployment_spec(dict(raw))
    if spec.cache_storage.type == "hostPath":
        try:
            split_host_path(spec.cache_storage.host_path or "", settings.host_path_prefixes)
        except HostPathRefused as err:
            raise ConfigError(f"invalid ConfKVDeployment spec: {err}") from None
    return spec


def _validate(spec: Mapping[str, Any], status: Mapping[str, Any], generation: int, patch: kopf.Patch,
              settings: OperatorSettings) -> DeploymentSpec | str:
    """The validated spec, or the error message (after recording it in the status)."""
    try:
        return check_spec(spec, settings)
    except ConfigError as err:
        _write_status(patch, status, invalid_status(str(err), generation))
        return str(err)


def _temporary(err: KubeError) -> kopf.TemporaryError:
    # Unreachable server, conflicts and throttling clear up quickly; other rejections need a human.
    delay = 5 if err.status in (0, 409, 429) or err.status >= 500 else 60
    return kopf.TemporaryError(f"Kubernetes API: {err}", delay=delay)


def _served(kube: Kube) -> frozenset[str]:
    kinds: set[str] = set()
    for group_version, wanted in _OPTIONAL_GROUPS.items():
        kinds |= kube.served_kinds(group_version) & wanted
    return frozenset(kinds)


def _ensure_claims(kube: Kube, body: kopf.Body, spec: DeploymentSpec) -> int:
    created = 0
    for claim, owned in build_claims(body.metadata.name, spec):
        claim["metadata"]["namespace"] = body.metadata.namespace
        if owned:
            kopf.adopt(claim, owner=body)
        created += kube.ensure_absent_only(claim) == "created"
    return created


def _prune(kube: Kube, body: kopf.Body, children: list[dict[str, Any]], served: frozenset[str]) -> int:
    """Delete the switchable children the spec no longer asks for (monitoring off, no autoscaling, ...)."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    if not any(c["kind"] in ("Deployment", LWS_KIND) for c in children):
        # The LeaderWorkerSet cannot be made (its API is missing): the running pods keep serving.
        wanted.add(("Deployment", body.metadata.name))
    name, namespace, uid = body.metadata.name, body.metadata.namespace, body.metadata.uid
    deleted = 0
    for api_version, kind in SWITCHABLE_KINDS:
        if (kind in _ALWAYS_SERVED or kind in served) and (kind, name) not in wanted:
            deleted += kube.delete_owned(api_version, kind, namespace, name, uid)
    return deleted


def _status(kube: Kube, body: kopf.Body, spec: DeploymentSpec, served: frozenset[str],
            pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The status from the workload (Deployment or LeaderWorkerSet) and the pods."""
    name, namespace = body.metadata.name, body.metadata.namespace
    generation = body.metadata.get("generation") or 0
    if spec.nodes > 1 and LWS_KIND not in served:
        return missing_api_status(
            f"spec.nodes {spec.nodes} needs the LeaderWorkerSet API ({LWS_API_VERSION}), which this cluster "
            "does not serve: install the LeaderWorkerSet controller (https://lws.sigs.k8s.io), or set "
            "nodes to 1", generation)
    api_version, kind = (LWS_API_VERSION, LWS_KIND) if spec.nodes > 1 else ("apps/v1", "Deployment")
    workload = kube.get(api_version, kind, namespace, name)
    selector = ",".join(f"{k}={v}" for k, v in sorted(serving_selector(name, spec).items()))
    return compute_status(name, namespace, spec.engine.port, spec.model.hf_id or spec.model.source,
                          spec.replicas, generation, workload, pods_report(pods), selector=selector)


def sync(body: kopf.Body, spec: DeploymentSpec, memo: kopf.Memo, patch: kopf.Patch) -> dict[str, int]:
    """Ensure every child and refresh the status; returns counts of created/patched/unchanged children."""
    kube: Kube = memo.kube
    settings: OperatorSettings = memo.settings
    name, namespace = body.metadata.name, body.metadata.namespace
    native = (kube.server_minor() or 0) >= _NATIVE_SIDECAR_MINOR
    served = _served(kube)
    children = build_children(name, namespace, spec, settings, served, native_sidecars=native)
    kopf.adopt(children, owner=body)
    counts = {"created": _ensure_claims(kube, body, spec), "patched": 0, "unchanged": 0}
    for child in children:
        counts[kube.ensure(child)] += 1
    counts["deleted"] = _prune(kube, body, children, served)
    pods = kube.list_pods(namespace, n.selector_string(name))
    desired = _status(kube, body, spec, served, pods)
    ref = spec.engine.api_key_secret_ref
    generation = body.metadata.get("generation") or 0
    desired["conditions"].append(auth_condition(name, (ref.name, ref.key) if ref else None, generation))
    remediation = last_remediation(pods)
    if remediation:
        desired["lastRemediation"] = remediation
    _write_status(patch, body.get("status") or {}, desired)
    return counts


def reconcile(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, reason: str) -> None:
    """create / resume / update: an invalid spec fails permanently (until the next edit)."""
    generation = body.metadata.get("generation") or 0
    spec = _validate(body.get("spec") or {}, body.get("status") or {}, generation, patch, memo.settings)
    if isinstance(spec, str):
        kopf.warn(body, reason="InvalidSpec", message=spec)
        raise kopf.PermanentError(spec)  # retried only when the spec changes
    try:
        counts = sync(body, spec, memo, patch)
    except KubeError as err:
        raise _temporary(err) from None
    if spec.engine.api_key_secret_ref is None:
        # Once per create/resume/spec change (not per resync): the condition keeps saying it meanwhile.
        kopf.warn(body, reason="APIUnauthenticated", message=open_api_message(body.metadata.name))
    log.info("%s %s/%s: %s", reason, body.metadata.namespace, body.metadata.name, counts)


def resync(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch) -> None:
    """Timer: restore drifted or deleted children and refresh the status. Never raises for bad specs."""
    generation = body.metadata.get("generation") or 0
    spec = _validate(body.get("spec") or {}, body.get("status") or {}, generation, patch, memo.settings)
    if isinstance(spec, str):
        return
    try:
        counts = sync(body, spec, memo, patch)
    except KubeError as err:
        log.warning("resync %s/%s: %s", body.metadata.namespace, body.metadata.name, err)
        return
    if counts["created"] or counts["patched"] or counts["deleted"]:
        log.info("resync %s/%s restored children: %s", body.metadata.namespace, body.metadata.name, counts)
        kopf.info(body, reason="ChildrenRestored",
                  message=f"re-created {counts['created']}, restored {counts['patched']} drifted, "
                          f"deleted {counts['deleted']} unwanted children")


def configure(settings: kopf.OperatorSettings, ours: OperatorSettings) -> None:
    """Kopf settings: progress in annotations (the CRD's structural status schema prunes unknown fields)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=n.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=n.KOPF_PREFIX, key="last-handled-configuration")
    # Kopf needs a finalizer to stop the timer cleanly on deletion; name it after our group.
    settings.persistence.finalizer = n.FINALIZER
    settings.posting.level = logging.WARNING  # Events on the CR for failures only
    settings.execution.max_workers = 8
    # A deletion waits for a running (sync, uncancellable) timer to finish; Kopf re-checks only every
    # 60 s by default, which would hold the finalizer that long.
    settings.background.cancellation_polling = min(1.0, ours.resync_seconds)
    settings.peering.standalone = ours.standalone
    # Namespace scope: no cluster-wide list/watch of CRDs and namespaces (the Role cannot grant them).
    settings.scanning.disabled = not ours.scans_cluster
    if ours.peering_name:
        settings.peering.name = ours.peering_name
        settings.peering.priority = ours.peering_priority
        # The chart creates one ClusterKopfPeering. With CONFKV_NAMESPACES set Kopf would otherwise look
        # for a KopfPeering in every watched namespace (and globs cannot be enumerated).
        settings.peering.clusterwide = True


def register(registry: kopf.OperatorRegistry, ours: OperatorSettings, kube: Kube | None = None) -> None:
    """Attach every handler to ``registry``. ``kube`` may be injected (tests); else built at start-up."""
    resource = (n.GROUP, n.VERSION, n.PLURAL)

    @kopf.on.startup(registry=registry)
    def _startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings, ours)
        memo.settings = ours
        memo.kube = kube or Kube.from_environment()

    @kopf.on.login(registry=registry)
    def _login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # In-cluster service account first, else $KUBECONFIG / ~/.kube/config (Kopf's own readers).
        return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.create(*resource, registry=registry)
    def _create(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
        reconcile(body, memo, patch, "created")

    @kopf.on.resume(*resource, registry=registry)
    def _resume(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
        reconcile(body, memo, patch, "resumed")

    @kopf.on.update(*resource, registry=registry, field="spec")
    def _update(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
        reconcile(body, memo, patch, "updated")

    @kopf.on.delete(*resource, registry=registry, optional=True)
    def _delete(body: kopf.Body, **_: Any) -> None:
        # optional=True: this handler adds no finalizer of its own and cleans nothing up (every child has
        # an ownerReference, so the garbage collector removes them); Kopf's finalizer is the timer's.
        log.info("deleted %s/%s; children are garbage-collected", body.metadata.namespace, body.metadata.name)

    @kopf.timer(*resource, registry=registry, interval=ours.resync_seconds, idle=None)
    def _resync(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
        resync(body, memo, patch)
