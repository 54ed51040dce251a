"""The whole ``confkv.json`` contract, shared by engine, agent and operator.

One pydantic model per section. Keys are camelCase (as in the ConfKVDeployment CR); unknown keys are
errors whose message names the key. Every section has defaults, so ``{}`` is a valid document.

Sections:
- ``model``: what to load (restart-only).
- ``engine``: server and scheduler settings (restart-only).
- ``confkv``: cache policy (applied live).
- ``alerts`` / ``remediation``: the agent's rules and playbook (applied live).

The operator's CR spec adds deployment-only groups (replicas, resources, cacheStorage); those live
in ``DeploymentSpec`` below and are not part of ``confkv.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

BUILTIN_MODEL = "builtin:smollm2-135m"

_SIZE_UNITS = {
    "": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
    "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_DURATION_RE = re.compile(r"^(\d+)(ms|s|m|h)$")
_DURATION_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class ConfigError(ValueError):
    """A config document that does not validate; the message names the offending key."""


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


def parse_size(value: str | int | float) -> tuple[str, float]:
    """Parse a cache size: ``"80%"`` -> ("fraction", 0.8); ``"512Mi"``/``1024`` -> ("bytes", n)."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        if isinstance(value, float) and value <= 1.0:
            return "fraction", value
        return "bytes", float(value)
    text = value.strip()
    if text.endswith("%"):
        pct = float(text[:-1])
        if not 0 < pct <= 100:
            raise ValueError(f"percentage must be in (0, 100], got {text!r}")
        return "fraction", pct / 100.0
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"invalid size {value!r}: use bytes (e.g. 536870912, '512Mi', '2G') or '80%'")
    number = float(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]
    if number <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return "bytes", number


def parse_duration(value: str) -> float:
    """Parse a Prometheus-style duration (``5m``, ``30s``, ``1h``, ``500ms``) into seconds."""
    match = _DURATION_RE.match(value.strip())
    if not match:
        raise ValueError(f"invalid duration {value!r}: use e.g. '30s', '5m', '1h'")
    return int(match.group(1)) * _DURATION_SECONDS[match.group(2)]


class ModelSection(_Model):
    """What the engine loads. ``source``: ``builtin:smollm2-135m``, a GGUF file path, or a Hugging
    Face directory (config.json, safetensors, tokenizer.json); ``hfId`` names the HF repo the
    operator fetches into ``source`` when set."""

    source: str = BUILTIN_MODEL
    hf_id: str | None = None
    served_name: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # How linear layers are served: auto keeps a GGUF's quantized tensors quantized on CPU
    # (int4 / int8 kernels, bf16 activations where native); fp32 / bf16 expand them (see loader).
    weights: Literal["auto", "fp32", "bf16", "int8", "int4"] = "auto"
    max_model_len: int | None = Field(default=None, ge=16, le=1_048_576)
    token_secret_ref: str | None = None


class EngineSection(_Model):
    """Server and scheduler settings (changes need a restart)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=2048, ge=16)
    prefill_chunk: int = Field(default=512, ge=16)
    block_size: int = Field(default=16, ge=1, le=256)
    max_waiting: int = Field(default=256, ge=1)
    cuda_streams: int = Field(default=4, ge=1, le=64)
    api_key: str | None = None
    grpc_socket: str | None = None
    cache_dir: str | None = None

    @property
    def control_socket(self) -> str:
        """The gRPC control socket: ``grpcSocket``, else one per port, so two local servers (and
        their agents) never share a socket."""
        return self.grpc_socket or f"/tmp/confkv/engine-{self.port}.sock"

    @model_validator(mode="after")
    def _chunk_fits_budget(self) -> EngineSection:
        if self.prefill_chunk > self.max_num_batched_tokens:
            raise ValueError(
                f"prefillChunk ({self.prefill_chunk}) must be <= maxNumBatchedTokens "
                f"({self.max_num_batched_tokens})"
            )
        return self


class ConfidenceThresholds(_Model):
    """Tier thresholds from the deployment guide's ``dynamic_kv_allocation``."""

    high: float = Field(default=0.9, ge=0.0, le=1.0)
    medium: float = Field(default=0.7, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _high_above_medium(self) -> ConfidenceThresholds:
        if not self.high > self.medium:
            raise ValueError(f"high ({self.high}) must be > medium ({self.medium})")
        return self


class EvictionSection(_Model):
    """Prefix-cache eviction of unreferenced cached blocks."""

    policy: Literal["LRU-K", "LRU"] = "LRU-K"
    k: int = Field(default=2, ge=1, le=16)


class CompressionSection(_Model):
    enabled: bool = True
    bits: Literal[8, 4] = 8
    group_size: int = Field(default=64, ge=8, le=1024)
    cold_after_seconds: float = Field(default=30.0, ge=0.0)


class ConfKVSection(_Model):
    """Cache policy; every field is applied live (no restart)."""

    kv_policy: Literal["full", "streaming", "h2o", "conf-kv"] = "full"
    confidence_thresholds: ConfidenceThresholds = ConfidenceThresholds()
    sinks: int = Field(default=4, ge=0, le=1024)
    window: int = Field(default=512, ge=16)
    budget: float | None = Field(default=None, gt=0.0, le=1.0)
    budget_tokens: int | None = Field(default=None, ge=16)
    budget_mode: Literal["always", "pressure"] = "always"
    eviction: EvictionSection = EvictionSection()
    max_cache_size: str | None = None
    compression: CompressionSection = CompressionSection()

    @field_validator("max_cache_size")
    @classmethod
    def _valid_size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value

    @model_validator(mode="after")
    def _one_budget(self) -> ConfKVSection:
        if self.budget is not None and self.budget_tokens is not None:
            raise ValueError("set at most one of budget and budgetTokens")
        return self


class AlertRule(_Model):
    enabled: bool = True
    threshold: float
    for_: str = Field(default="0s", alias="for")

    @field_validator("for_")
    @classmethod
    def _valid_for(cls, value: str) -> str:
        parse_duration(value)
        return value


def _rule(threshold: float, for_: str) -> Any:
    return Field(default_factory=lambda: AlertRule(threshold=threshold, **{"for": for_}))


class AlertsSection(_Model):
    """The four rules of the deployment guide. vram: used fraction; latencyMs: average request
    latency in ms; hitRate: prefix-cache hit fraction (fires when below); oomPerHour: count."""

    vram: AlertRule = _rule(0.85, "5m")
    latency_ms: AlertRule = _rule(500.0, "1m")
    hit_rate: AlertRule = _rule(0.70, "5m")
    oom_per_hour: AlertRule = _rule(3.0, "0s")


RemediationAction = Literal[
    "raiseLruK", "warmup", "compress", "lowerMaxCacheSize", "stricterThresholds",
    "halveBatchSize", "smallerBatches", "recommendScaleOut",
]
ALL_ACTIONS: tuple[str, ...] = RemediationAction.__args__  # type: ignore[attr-defined]


class RemediationSection(_Model):
    enabled: bool = True
    dry_run: bool = False
    cooldown: str = "5m"
    allowed_actions: list[RemediationAction] = Field(default_factory=lambda: list(ALL_ACTIONS))

    @field_validator("cooldown")
    @classmethod
    def _valid_cooldown(cls, value: str) -> str:
        parse_duration(value)
        return value


class ConfKVConfig(_Model):
    """The ``confkv.json`` document read by engine and agent."""

    model: ModelSection = ModelSection()
    engine: EngineSection = EngineSection()
    confkv: ConfKVSection = ConfKVSection()
    alerts: AlertsSection = AlertsSection()
    remediation: RemediationSection = RemediationSection()


def _format_errors(err: ValidationError) -> str:
    parts = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            parts.append(f"unknown key '{where}'")
        else:
            parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def load_config(data: dict[str, Any]) -> ConfKVConfig:
    """Validate a parsed document; raises ConfigError with every problem named."""
    try:
        return ConfKVConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid confkv config: {_format_errors(err)}") from None


def load_config_file(path: str | Path) -> ConfKVConfig:
    """Read ``confkv.json`` (a file, or a directory holding one, as mounted from a ConfigMap)."""
    path = Path(path)
    if path.is_dir():
        path = path / "confkv.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"config file {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object")
    return load_config(data)


def dump_config(config: ConfKVConfig) -> dict[str, Any]:
    """The camelCase JSON form, as written into the operator's ConfigMap."""
    return config.model_dump(mode="json", by_alias=True)


def with_overrides(config: ConfKVConfig, section: str, **values: Any) -> ConfKVConfig:
    """Return a copy with ``values`` (snake_case, None ignored) applied to one section, revalidated."""
    current = dump_config(config)
    sub = getattr(config, section).model_dump(mode="json", by_alias=False)
    sub.update({k: v for k, v in values.items() if v is not None})
    try:
        validated = type(getattr(config, section)).model_validate(sub)
    except ValidationError as err:
        raise ConfigError(f"invalid {section} settings: {_format_errors(err)}") from None
    current[section] = validated.model_dump(mode="json", by_alias=True)
    return load_config(current)


# --- The ConfKVDeployment CR spec (operator only; not part of confkv.json) -------------------------

#: Fields of confkv.json the operator owns inside pods (listen address, socket in the shared volume,
#: cache directory on the cache volume, API key); they are not settable through the CR spec.
OPERATOR_OWNED_FIELDS: frozenset[tuple[str, str]] = frozenset({
    ("engine", "host"), ("engine", "grpcSocket"), ("engine", "cacheDir"), ("engine", "apiKey"),
})


class Toleration(_Model):
    """A pod toleration (the subset of core/v1 Toleration a GPU pool needs)."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)


#: A Kubernetes resource quantity ("4", "500m", "96Gi", "1e3").
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[numkKMGTPE]i?)?$"


class ResourceQuantities(_Model):
    """Kubernetes quantities, e.g. ``cpu: "4"``, ``memory: "96Gi"``."""

    cpu: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    memory: str | None = Field(default=None, pattern=QUANTITY_PATTERN)


class ResourcesSpec(_Model):
    """Per-pod resources of the engine container; ``gpusPerPod`` > 0 adds ``nvidia.com/gpu`` limits."""

    gpus_per_pod: int = Field(default=0, ge=0, le=16)
    requests: ResourceQuantities = ResourceQuantities()
    limits: ResourceQuantities = ResourceQuantities()
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class CacheStorageSpec(_Model):
    """The NVMe volume for spilled blocks and the rebuild log: an emptyDir (default), an existing
    PVC (``claimName``) or a node directory (``hostPath``)."""

    type: Literal["emptyDir", "pvc", "hostPath"] = "emptyDir"
    claim_name: str | None = None
    host_path: str | None = None
    size: str | None = Field(default=None, pattern=QUANTITY_PATTERN)
    mount_path: str = "/var/cache/confkv"

    @model_validator(mode="after")
    def _source_given(self) -> CacheStorageSpec:
        if self.type == "pvc" and not self.claim_name:
            raise ValueError("cacheStorage.type 'pvc' needs claimName")
        if self.type == "hostPath" and not self.host_path:
            raise ValueError("cacheStorage.type 'hostPath' needs hostPath")
        if not self.mount_path.startswith("/"):
            raise ValueError(f"cacheStorage.mountPath must be absolute, got {self.mount_path!r}")
        return self


class ModelStorageSpec(_Model):
    """Where model files live in the pod: a PVC (pre-populated, or filled by the fetch init container
    when ``model.hfId`` is set) mounted at ``mountPath``; without a claim, an emptyDir."""

    claim_name: str | None = None
    mount_path: str = "/models"
    size: str | None = Field(default=None, pattern=QUANTITY_PATTERN)


class ImageSpec(_Model):
    """Container images; unset names fall back to the operator's defaults (env)."""

    engine: str | None = None
    agent: str | None = None
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class DeploymentSpec(_Model):
    """The whole ``spec`` of a ConfKVDeployment. The first five sections become ``confkv.json``."""

    model: ModelSection = ModelSection()
    engine: EngineSection = EngineSection()
    confkv: ConfKVSection = ConfKVSection()
    alerts: AlertsSection = AlertsSection()
    remediation: RemediationSection = RemediationSection()
    replicas: int = Field(default=1, ge=0, le=1000)
    resources: ResourcesSpec = ResourcesSpec()
    cache_storage: CacheStorageSpec = CacheStorageSpec()
    model_storage: ModelStorageSpec = ModelStorageSpec()
    image: ImageSpec = ImageSpec()

    @model_validator(mode="after")
    def _model_location(self) -> DeploymentSpec:
        if self.model.hf_id and not self.model.source.startswith(self.model_storage.mount_path + "/"):
            raise ValueError(
                f"model.hfId needs model.source to be a directory under modelStorage.mountPath "
                f"({self.model_storage.mount_path}/...), got {self.model.source!r}"
            )
        if self.model.token_secret_ref and not self.model.hf_id:
            raise ValueError("model.tokenSecretRef is only used with model.hfId")
        return self


def load_deployment_spec(data: dict[str, Any]) -> DeploymentSpec:
    """Validate a CR spec; raises ConfigError with every problem named."""
    try:
        return DeploymentSpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid ConfKVDeployment spec: {_format_errors(err)}") from None
