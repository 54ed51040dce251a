"""Spec sections of a ConfKVDeployment about how the cluster runs its pods (operator only; none of them
reaches ``confkv.json``): pod settings and a validated partial pod-template override, claims the
operator creates, the NetworkPolicy, the monitoring objects, autoscaling and the InferencePool.

The pod override (``pod.template``) is a partial PodTemplateSpec merged over the rendered one, as
KServe and Dynamo accept a partial pod spec. It is checked against an allow-list: scheduling, DNS,
image pull, extra containers, volumes and the engine's or agent's env, resources and mounts may be
changed; what keeps the pod safe and working (security contexts, the service account and its token,
host namespaces, hostPath volumes, the operator's own volumes, commands and probes of the operator's
containers, the selector labels) may not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .config import _Model

#: Volumes the operator renders itself (an override may not replace them).
OPERATOR_VOLUMES = frozenset({"config", "socket", "tmp", "cache", "model", "kube-api-access", "dshm"})
#: Containers the operator renders (an override may only add env, envFrom, resources, volumeMounts).
OPERATOR_CONTAINERS = frozenset({"confkv-engine", "confkv-agent", "fetch-model"})
#: Environment variables the operator sets on the engine container.
OPERATOR_ENV = frozenset({"POD_NAME", "POD_NAMESPACE", "CONFKV_DEPLOYMENT", "HOME", "CONFKV_API_KEY",
                          "CONFKV_AGENT_PORT"})
#: Labels the selector uses: changing them on the pod template would orphan the pods.
SELECTOR_LABELS = frozenset({"app.kubernetes.io/name", "app.kubernetes.io/instance"})

_TEMPLATE_SPEC_KEYS = frozenset({
    "affinity", "tolerations", "nodeSelector", "topologySpreadConstraints", "schedulerName",
    "priorityClassName", "runtimeClassName", "imagePullSecrets", "dnsPolicy", "dnsConfig", "hostAliases",
    "terminationGracePeriodSeconds", "readinessGates", "containers", "initContainers", "volumes",
})
_OWN_CONTAINER_KEYS = frozenset({"name", "env", "envFrom", "resources", "volumeMounts"})
_NEW_CONTAINER_FORBIDDEN = frozenset({"securityContext"})
_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
#: A Kubernetes resource quantity ("4", "500m", "96Gi", "1e3").
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkKMGTPE]i?)?$"


class ClaimSpec(_Model):
    """A PersistentVolumeClaim the operator creates when it is absent (named by ``claimName``, sized by
    ``size``). Never changed afterwards; kept when the CR is deleted unless ``retainOnDelete`` is false.
    ReadOnlyMany is not offered: nothing could fill an empty read-only claim."""

    storage_class_name: str | None = Field(default=None, pattern=_NAME_PATTERN, max_length=253)
    access_mode: Literal["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany"] = "ReadWriteOnce"
    retain_on_delete: bool = True


class EnvVar(_Model):
    """An extra environment variable of the engine container (``valueFrom``: a core/v1 EnvVarSource)."""

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=253)
    value: str | None = None
    value_from: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.name in OPERATOR_ENV:
            raise ValueError(f"env {self.name} is set by the operator")
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: value and valueFrom are exclusive")
        return self


class VolumeMount(_Model):
    """Where an extra volume (``pod.volumes``) appears in the engine container."""

    name: str = Field(pattern=_NAME_PATTERN, max_length=63)
    mount_path: str = Field(pattern=r"^/")
    read_only: bool = False
    sub_path: str | None = None


def _check_volume(volume: Any, where: str) -> None:
    if not isinstance(volume, dict) or not isinstance(volume.get("name"), str):
        raise ValueError(f"{where}: a volume needs a name")
    if volume["name"] in OPERATOR_VOLUMES:
        raise ValueError(f"{where}: volume {volume['name']!r} is the operator's")
    if "hostPath" in volume:
        raise ValueError(f"{where}: hostPath volumes are refused (cacheStorage.type hostPath is the "
                         "allowed way, under the operator's prefixes)")


def _check_container(container: Any, where: str) -> None:
    if not isinstance(container, dict) or not isinstance(container.get("name"), str):
        raise ValueError(f"{where}: a container needs a name")
    if container["name"] in OPERATOR_CONTAINERS:
        extra = sorted(set(container) - _OWN_CONTAINER_KEYS)
        if extra:
            raise ValueError(f"{where}: the operator's container {container['name']!r} takes only "
                             f"{sorted(_OWN_CONTAINER_KEYS - {'name'})}, not {extra}")
        for env in container.get("env") or []:
            if isinstance(env, dict) and env.get("name") in OPERATOR_ENV:
                raise ValueError(f"{where}: env {env['name']} is set by the operator")
    elif _NEW_CONTAINER_FORBIDDEN & set(container):
        raise ValueError(f"{where}: securityContext is the operator's (containers run as the pod's "
                         "non-root user without privileges)")
    elif "image" not in container:
        raise ValueError(f"{where}: a new container needs an image")


def check_template(template: dict[str, Any]) -> None:
    """Raise ValueError when the partial pod template asks for something outside the allow-list."""
    extra = sorted(set(template) - {"metadata", "spec"})
    if extra:
        raise ValueError(f"pod.template takes metadata and spec, not {extra}")
    meta = template.get("metadata") or {}
    if set(meta) - {"labels", "annotations"}:
        raise ValueError("pod.template.metadata takes labels and annotations only")
    if SELECTOR_LABELS & set(meta.get("labels") or {}):
        raise ValueError(f"pod.template.metadata.labels may not set {sorted(SELECTOR_LABELS)}")
    spec = template.get("spec") or {}
    refused = sorted(set(spec) - _TEMPLATE_SPEC_KEYS)
    if refused:
        raise ValueError(f"pod.template.spec may not set {refused} (allowed: {sorted(_TEMPLATE_SPEC_KEYS)})")
    for key in ("containers", "initContainers"):
        for i, container in enumerate(spec.get(key) or []):
            _check_container(container, f"pod.template.spec.{key}[{i}]")
    for i, volume in enumerate(spec.get("volumes") or []):
        _check_volume(volume, f"pod.template.spec.volumes[{i}]")


class PodSpecSection(_Model):
    """Pod-level settings of the serving pods, and the partial pod-template override."""

    runtime_class_name: str | None = Field(default=None, pattern=_NAME_PATTERN, max_length=253)
    priority_class_name: str | None = Field(default=None, pattern=_NAME_PATTERN, max_length=253)
    image_pull_secrets: list[str] = Field(default_factory=list)
    shm_size: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    affinity: dict[str, Any] | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    env: list[EnvVar] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    native_sidecar: bool = True
    template: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> PodSpecSection:
        if SELECTOR_LABELS & set(self.labels):
            raise ValueError(f"pod.labels may not set {sorted(SELECTOR_LABELS)}")
        for i, volume in enumerate(self.volumes):
            _check_volume(volume, f"pod.volumes[{i}]")
        names = {v["name"] for v in self.volumes}
        missing = sorted({m.name for m in self.volume_mounts} - names)
        if missing:
            raise ValueError(f"pod.volumeMounts name volumes not in pod.volumes: {missing}")
        if self.affinity is not None and set(self.affinity) - {"nodeAffinity", "podAffinity",
                                                               "podAntiAffinity"}:
            raise ValueError("pod.affinity takes nodeAffinity, podAffinity and podAntiAffinity")
        if self.template is not None:
            check_template(self.template)
        return self


class MonitoringSpec(_Model):
    """The per-CR ServiceMonitor and PrometheusRule (created when their CRDs are served)."""

    enabled: bool = True
    labels: dict[str, str] = Field(default_factory=dict)
    interval: str = Field(default="30s", pattern=r"^[0-9]+(ms|s|m|h)$")


def _same_namespace() -> list[dict[str, Any]]:
    return [{"podSelector": {}}]


def _monitoring_namespace() -> list[dict[str, Any]]:
    return [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


class NetworkPolicySpec(_Model):
    """Ingress to the serving pods: the API port from ``apiFrom`` peers (default: pods of the same
    namespace), the agent's metrics port from ``metricsFrom`` (default: the ``monitoring`` namespace,
    which also gets the API port because the engine's /metrics is served there). Peers are core
    NetworkPolicyPeer objects."""

    enabled: bool = True
    api_from: list[dict[str, Any]] = Field(default_factory=_same_namespace)
    metrics_from: list[dict[str, Any]] = Field(default_factory=_monitoring_namespace)

    @field_validator("api_from", "metrics_from")
    @classmethod
    def _peers(cls, peers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for peer in peers:
            if not peer or set(peer) - {"podSelector", "namespaceSelector", "ipBlock"}:
                raise ValueError("a peer takes podSelector, namespaceSelector and ipBlock")
        return peers


class AutoscalingSpec(_Model):
    """Replicas from load: an HPA on the engine's queue depth and KV-cache usage (Pods metrics served
    by prometheus-adapter) or, with ``backend: keda`` (``auto`` picks it when KEDA's CRD is served),
    a KEDA ScaledObject on the same series from Prometheus. Both scale the CR through its scale
    subresource, so the operator carries the count to the Deployment."""

    enabled: bool = False
    backend: Literal["auto", "hpa", "keda"] = "auto"
    min_replicas: int = Field(default=1, ge=1, le=1000)
    max_replicas: int = Field(default=4, ge=1, le=1000)
    target_queue_depth: float = Field(default=4.0, gt=0.0, le=100000.0)
    target_kv_cache_usage: float = Field(default=0.8, gt=0.0, le=1.0)
    scale_down_stabilization_seconds: int = Field(default=900, ge=0, le=3600)
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingSpec:
        if self.max_replicas < self.min_replicas:
            raise ValueError("autoscaling.maxReplicas must be >= minReplicas")
        return self


class EndpointPickerRef(_Model):
    """The endpoint picker (EPP) Service the gateway asks which pod serves a request."""

    name: str | None = Field(default=None, pattern=_NAME_PATTERN, max_length=253)
    port: int = Field(default=9002, ge=1, le=65535)
    failure_mode: Literal["FailOpen", "FailClose"] = "FailClose"


class InferencePoolSpec(_Model):
    """An ``InferencePool`` (inference.networking.k8s.io/v1) over the CR's pods, for a gateway with the
    endpoint picker (llm-d's or the reference one) to route by prefix and load. The EPP itself is
    installed with its own chart; ``endpointPicker.name`` defaults to ``<name>-epp``."""

    enabled: bool = False
    endpoint_picker: EndpointPickerRef = EndpointPickerRef()
