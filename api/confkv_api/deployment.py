"""The ``spec`` of a ConfKVDeployment CR (operator only; not part of ``confkv.json``).

The first five groups are the ``confkv.json`` sections; the others (replicas, nodes, resources,
storage, images, and the sections of ``cluster``: pod, monitoring, networkPolicy, autoscaling,
inferencePool) only shape the pod and the objects around it, except that nodes x gpusPerPod becomes
``engine.tensorParallel`` on GPU pods (``DeploymentSpec.tensor_parallel_degree``). ``engine`` is
the engine section plus deployment-only fields (``apiKeySecretRef``) that the operator turns into
pod settings and strips before writing ``confkv.json``.

Checks that need the operator's own settings (the hostPath allow-list) are not here: the operator
applies them on top of this model (``confkv_operator.hostpaths``). What is here is also in the CRD's
schema and CEL rules, so the API server and the operator refuse the same specs.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from .cluster import (
    QUANTITY_PATTERN,
    AutoscalingSpec,
    ClaimSpec,
    InferencePoolSpec,
    MonitoringSpec,
    NetworkPolicySpec,
    PodSpecSection,
)
from .config import (
    AlertsSection,
    ConfigError,
    ConfKVSection,
    EngineSection,
    ModelSection,
    RemediationSection,
    _format_errors,
    _Model,
)

#: Fields of confkv.json the operator owns inside pods (listen address, socket in the shared volume,
#: cache directory on the cache volume, API key); they are not settable through the CR spec.
OPERATOR_OWNED_FIELDS: frozenset[tuple[str, str]] = frozenset({
    ("engine", "host"), ("engine", "grpcSocket"), ("engine", "cacheDir"), ("engine", "apiKey"),
})

#: An absolute node path in canonical form: no "." or ".." segment, no empty segment ("//"), no trailing
#: slash, not "/" itself. RE2-compatible (no look-ahead), so the CRD carries the same pattern.
HOST_PATH_PATTERN = r"^(/([^/.][^/]*|\.[^/.][^/]*|\.\.[^/]+))+$"
#: Secret names are DNS subdomains; data keys are [-._a-zA-Z0-9]+ (core/v1 validation).
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
#: engine.tensorParallel's upper bound (EngineSection).
MAX_TENSOR_PARALLEL = 64


def _snake(camel: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), camel)


class SecretKeyRef(_Model):
    """One key of a Secret in the CR's namespace."""

    name: str = Field(pattern=SECRET_NAME_PATTERN, max_length=253)
    key: str = Field(pattern=SECRET_KEY_PATTERN, max_length=253)


class EngineSpec(EngineSection):
    """The engine section of the CR: ``confkv.json``'s engine settings plus ``apiKeySecretRef``, the
    Secret key the operator passes to the engine container as ``CONFKV_API_KEY`` (bearer key on /v1)."""

    api_key_secret_ref: SecretKeyRef | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_operator_owned_fields(cls, data: Any) -> Any:
        # The operator sets these inside the pod; accepting them here would silently ignore them (an
        # inline apiKey would look like protection while /v1 stays open).
        if isinstance(data, dict):
            owned = sorted(key for section, key in OPERATOR_OWNED_FIELDS
                           if section == "engine" and (key in data or _snake(key) in data))
            if owned:
                hint = "; put the API key in a Secret and set apiKeySecretRef" if "apiKey" in owned else ""
                raise ValueError(f"{', '.join(owned)} set by the operator, not by the spec{hint}")
        return data


#: EngineSpec fields that never reach confkv.json (snake_case names).
ENGINE_DEPLOYMENT_FIELDS: frozenset[str] = frozenset({"api_key_secret_ref"})


class Toleration(_Model):
    """A pod toleration (the subset of core/v1 Toleration a GPU pool needs)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)


class ResourceQuantities(_Model):
    """Kubernetes quantities, e.g. ``cpu: "4"``, ``memory: "96Gi"``."""

    cpu: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    memory: str | None = Field(default=None, pattern=QUANTITY_PATTERN)


class ResourcesSpec(_Model):
    """Per-pod resources of the engine container; ``gpusPerPod`` > 0 adds ``nvidia.com/gpu`` limits."""

    # > 1: the engine shards the model over the pod's GPUs (tensor parallel, one rank per GPU).
    gpus_per_pod: int = Field(default=0, ge=0, le=16)
    requests: ResourceQuantities = ResourceQuantities()
    limits: ResourceQuantities = ResourceQuantities()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class CacheStorageSpec(_Model):
    """The NVMe volume for spilled blocks and the rebuild log: an emptyDir (default), a PVC
    (``claimName``; the operator creates it with ``createClaim``) or a node directory (``hostPath``,
    only under a prefix the operator allows)."""

    type: Literal["emptyDir", "pvc", "hostPath"] = "emptyDir"
    claim_name: str | None = None
    host_path: str | None = None
    size: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    mount_path: str = "/var/cache/confkv"
    create_claim: ClaimSpec | None = None

    @field_validator("host_path")
    @classmethod
    def _canonical_host_path(cls, value: str | None) -> str | None:
        # Canonical form only, so that the operator's prefix check compares what the kubelet mounts.
        if value is not None and not re.fullmatch(HOST_PATH_PATTERN, value):
            raise ValueError(f"must be an absolute node path other than '/', without '.', '..' or empty "
                             f"segments and without a trailing slash, got {value!r}")
        return value

    @model_validator(mode="after")
    def _source_given(self) -> CacheStorageSpec:
        if self.type == "pvc" and not self.claim_name:
            raise ValueError("cacheStorage.type 'pvc' needs claimName")
        if self.type == "hostPath" and not self.host_path:
            raise ValueError("cacheStorage.type 'hostPath' needs hostPath")
        if self.type != "hostPath" and self.host_path:
            # Refused rather than ignored: the author would believe the cache is on the node's disk.
            raise ValueError(f"cacheStorage.hostPath is only used with type 'hostPath', not {self.type!r}")
        if not self.mount_path.startswith("/"):
            raise ValueError(f"cacheStorage.mountPath must be absolute, got {self.mount_path!r}")
        if self.create_claim is not None and (self.type != "pvc" or not self.size):
            raise ValueError("cacheStorage.createClaim needs type 'pvc' and a size")
        return self


class ModelStorageSpec(_Model):
    """Where model files live in the pod: a PVC (pre-populated, or filled by the fetch init container
    when ``model.hfId`` is set; the operator creates it with ``createClaim``) mounted at ``mountPath``;
    without a claim, an emptyDir."""

    claim_name: str | None = None
    mount_path: str = "/models"
    size: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    create_claim: ClaimSpec | None = None

    @model_validator(mode="after")
    def _claim(self) -> ModelStorageSpec:
        if self.create_claim is not None and (not self.claim_name or not self.size):
            raise ValueError("modelStorage.createClaim needs claimName and size")
        return self


class ImageSpec(_Model):
    """Container images; unset names fall back to the operator's defaults (env)."""

    engine: str | None = None
    agent: str | None = None
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class DeploymentSpec(_Model):
    """The whole ``spec`` of a ConfKVDeployment. The first five sections become ``confkv.json``."""

    model: ModelSection = ModelSection()
    engine: EngineSpec = EngineSpec()
    confkv: ConfKVSection = ConfKVSection()
    alerts: AlertsSection = AlertsSection()
    remediation: RemediationSection = RemediationSection()
    replicas: int = Field(default=1, ge=0, le=1000)
    # Pods per serving group: > 1 renders a LeaderWorkerSet whose groups of ``nodes`` pods form one
    # tensor-parallel group (``tensor_parallel_degree``); ``replicas`` counts groups.
    nodes: int = Field(default=1, ge=1, le=64)
    resources: ResourcesSpec = ResourcesSpec()
    cache_storage: CacheStorageSpec = CacheStorageSpec()
    model_storage: ModelStorageSpec = ModelStorageSpec()
    image: ImageSpec = ImageSpec()
    pod: PodSpecSection = PodSpecSection()
    progress_deadline_seconds: int | None = Field(default=None, ge=60, le=86400)
    monitoring: MonitoringSpec = MonitoringSpec()
    network_policy: NetworkPolicySpec = NetworkPolicySpec()
    autoscaling: AutoscalingSpec = AutoscalingSpec()
    inference_pool: InferencePoolSpec = InferencePoolSpec()

    @model_validator(mode="after")
    def _model_location(self) -> DeploymentSpec:
        if self.model.hf_id and not self.model.source.startswith(self.model_storage.mount_path + "/"):
            raise ValueError(
                f"model.hfId needs model.source to be a directory under modelStorage.mountPath "
                f"({self.model_storage.mount_path}/...), got {self.model.source!r}"
            )
        if self.model.token_secret_ref and not self.model.hf_id:
            raise ValueError("model.tokenSecretRef is only used with model.hfId")
        self._check_parallelism()
        return self

    def _check_parallelism(self) -> None:
        """``engine.tensorParallel`` is the whole group's degree: on GPU pods the operator derives it
        (nodes x gpusPerPod), so a different explicit value is a contradiction; on CPU pods it is
        given and must split evenly over the nodes. Whether the degree divides the model's heads is
        known only once the engine reads the checkpoint (it refuses at start, with the numbers)."""
        gpus, nodes, given = self.resources.gpus_per_pod, self.nodes, self.engine.tensor_parallel
        if gpus > 0 and given not in (1, nodes * gpus):
            raise ValueError(f"engine.tensorParallel {given} contradicts nodes x resources.gpusPerPod = "
                             f"{nodes * gpus} (leave it unset: the operator sets it from the GPUs)")
        if nodes * gpus > MAX_TENSOR_PARALLEL:
            raise ValueError(f"nodes x resources.gpusPerPod = {nodes * gpus} exceeds the largest "
                             f"tensor-parallel degree, {MAX_TENSOR_PARALLEL}")
        if gpus == 0 and given % nodes:
            raise ValueError(f"engine.tensorParallel {given} must be a multiple of nodes ({nodes}) on "
                             "CPU pods")

    @property
    def tensor_parallel_degree(self) -> int:
        """Ranks in one serving group: nodes x gpusPerPod on GPU pods, else engine.tensorParallel."""
        gpus = self.resources.gpus_per_pod
        return self.nodes * gpus if gpus > 0 else self.engine.tensor_parallel

    @property
    def ranks_per_pod(self) -> int:
        return self.tensor_parallel_degree // self.nodes

    def engine_section(self) -> EngineSection:
        """The engine settings as ``confkv.json`` holds them (deployment-only fields dropped)."""
        return EngineSection.model_validate(self.engine.model_dump(exclude=set(ENGINE_DEPLOYMENT_FIELDS)))


def load_deployment_spec(data: dict[str, Any]) -> DeploymentSpec:
    """Validate a CR spec; raises ConfigError with every problem named."""
    try:
        return DeploymentSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid ConfKVDeployment spec: {_format_errors(err)}") from None
