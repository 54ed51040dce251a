"""The whole ``confkv.json`` contract, shared by engine, agent and operator.

One pydantic model per section. Keys are camelCase (as in the ConfKVDeployment CR); unknown keys are
errors whose message names the key. Every section has defaults, so ``{}`` is a valid document.

Sections:
- ``model``: what to load (restart-only).
- ``engine``: server and scheduler settings (restart-only).
- ``confkv``: cache policy (applied live).
- ``alerts`` / ``remediation``: the agent's rules and playbook (applied live).

The operator's CR spec adds deployment-only groups (replicas, resources, cacheStorage); those live
in ``confkv_api.deployment`` and are not part of ``confkv.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from confkv_api.control_socket import check_socket_address, default_control_socket
from confkv_api.units import parse_duration, parse_size

BUILTIN_MODEL = "builtin:smollm2-135m"

# Longest context any field is sized for (the cap of model.maxModelLen): windows, budgets and token
# batches beyond it can only be typos.
MAX_TOKENS = 1_048_576
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


class ConfigError(ValueError):
    """A config document that does not validate; the message names the offending key."""


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ModelSection(_Model):
    """What the engine loads. ``source``: ``builtin:smollm2-135m``, a GGUF file path, or a Hugging
    Face directory (config.json, safetensors, tokenizer.json); ``hfId`` names the HF repo the
    operator fetches into ``source`` when set. ``servedName`` is the name responses carry;
    ``servedAliases`` are further names the API accepts and lists (vLLM's --served-model-name list)."""

    source: str = BUILTIN_MODEL
    hf_id: str | None = None
    served_name: str | None = None
    served_aliases: list[str] = Field(default_factory=list)  # more names clients may send
    # auto: bfloat16 on CUDA (float16 where the GPU has no bf16), float32 on CPU.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # How linear layers are served: auto keeps a GGUF's quantized tensors quantized on CPU
    # (int4 / int8 kernels, bf16 activations where native); fp32 / bf16 expand them (see loader).
    weights: Literal["auto", "fp32", "bf16", "int8", "int4"] = "auto"
    # torch.compile of the elementwise blocks at start-up (see model.compiled); off by default: it
    # costs start-up time and measured no gain on the development CPU (docs/performance.md).
    compile: bool = False
    max_model_len: int | None = Field(default=None, ge=16, le=MAX_TOKENS)
    token_secret_ref: str | None = None


class EngineSection(_Model):
    """Server and scheduler settings (changes need a restart)."""

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_batch_size: int = Field(default=64, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=2048, ge=16, le=MAX_TOKENS)
    prefill_chunk: int = Field(default=512, ge=16, le=MAX_TOKENS)
    block_size: int = Field(default=16, ge=1, le=256)
    max_waiting: int = Field(default=256, ge=1, le=1_000_000)
    # Side CUDA streams for cache work, so it overlaps the decode steps: spills to the disk tier use
    # the first, read-backs the second, compression's encodes the rest in turn (with one or two
    # streams they share). Ignored on CPU, where the same code runs inline.
    cuda_streams: int = Field(default=4, ge=1, le=64)
    # Decode steps replay CUDA graphs captured at padded batch sizes (CUDA only; vLLM's opposite
    # switch is --enforce-eager). Off: every step runs eagerly.
    cuda_graphs: bool = True
    # Largest HTTP request body (bytes); larger ones get 413 before they are read or parsed.
    max_request_bytes: int = Field(default=DEFAULT_MAX_REQUEST_BYTES, ge=1024, le=2**30)
    # max_tokens of a chat completion that sends none (unset: the rest of the context, as OpenAI);
    # explicit values and /v1/completions' OpenAI default of 16 are unchanged.
    max_tokens_default: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    api_key: str | None = None
    grpc_socket: str | None = None
    cache_dir: str | None = None
    # Tensor-parallel degree: ranks on this machine, one per GPU (gloo processes on CPU); it must
    # divide the model's query and KV heads (checked at load, when the model is known).
    tensor_parallel: int = Field(default=1, ge=1, le=64)

    @property
    def control_socket(self) -> str:
        """The gRPC control socket: ``grpcSocket``, else one per port in the user's private
        directory (``control_socket.py``)."""
        return self.grpc_socket or default_control_socket(self.port)

    @field_validator("grpc_socket")
    @classmethod
    def _unix_socket_only(cls, value: str | None) -> str | None:
        return None if value is None else check_socket_address(value)

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, value: str | None) -> str | None:
        # An empty key would let any empty bearer in; unset means "no key", so say that instead.
        if value is not None and (not value or value != value.strip()):
            raise ValueError("apiKey must be non-empty without surrounding whitespace "
                             "(leave it unset to serve without a key)")
        return value

    @model_validator(mode="after")
    def _chunk_fits_budget(self) -> EngineSection:
        if self.prefill_chunk > self.max_num_batched_tokens:
            raise ValueError(
                f"prefillChunk ({self.prefill_chunk}) must be <= maxNumBatchedTokens "
                f"({self.max_num_batched_tokens})"
            )
        if self.prefill_chunk % self.block_size:
            # Chunks end on block boundaries (retention decides there), so a chunk that is not a whole
            # number of blocks could never be scheduled under a retention policy.
            raise ValueError(f"prefillChunk ({self.prefill_chunk}) must be a multiple of blockSize "
                             f"({self.block_size})")
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


class PrefixCacheSection(_Model):
    """Sharing of full KV blocks across requests with the same prefix (read at start-up)."""

    enabled: bool = True


class WarmupSection(_Model):
    """Prompts prefilled into the prefix cache at start-up, before readiness turns true."""

    prompts: list[str] = Field(default_factory=list, max_length=256)


class CompressionSection(_Model):
    enabled: bool = True
    bits: Literal[8, 4] = 8
    group_size: int = Field(default=64, ge=8, le=1024)
    cold_after_seconds: float = Field(default=30.0, ge=0.0, le=7 * 86_400.0)


TierName = Literal["full", "key_only", "int8", "int4", "k4v2", "int2"]
# Precision tiers highest first; k4v2 keeps keys at int4 and values at int2.
_PRECISION_TIERS = ("int8", "int4", "k4v2", "int2")


def check_tiers(tiers: list[str]) -> list[str]:
    """``tiers``: the kept tiers, highest first (DISCARD is implied): ["full"], ["full", "key_only"], or
    "full" then precision tiers highest first (["full", "int4", "int2"])."""
    if not tiers or tiers[0] != "full":
        raise ValueError(f"tiers must start with 'full', got {tiers}")
    rest = tiers[1:]
    if rest == ["key_only"]:
        return tiers
    if "key_only" in rest:
        raise ValueError("key_only cannot be combined with precision tiers (it costs more than a precision "
                         "tier that keeps the value); use ['full', 'key_only']")
    unknown = [t for t in rest if t not in _PRECISION_TIERS]
    if unknown:
        raise ValueError(f"after 'full' only precision tiers ({', '.join(_PRECISION_TIERS)}) or 'key_only' "
                         f"may follow, got {tiers}")
    order = [_PRECISION_TIERS.index(t) for t in rest]
    if order != sorted(set(order)):
        raise ValueError(f"precision tiers must be distinct and highest first, got {tiers}")
    return tiers


KVCacheDtype = Literal["auto", "bfloat16", "float16", "float32", "int8", "fp8"]
CODED_CACHE_DTYPES = ("int8", "fp8")  # pools whose entries are codes: no precision tiers on top


class ConfKVSection(_Model):
    """Cache policy; every field but ``decisionInterval`` and ``kvCacheDtype`` is applied live."""

    kv_policy: Literal["full", "streaming", "h2o", "conf-kv"] = "full"
    confidence_thresholds: ConfidenceThresholds = ConfidenceThresholds()
    sinks: int = Field(default=4, ge=0, le=1024)
    # The minimal always-FULL recent window; None: one decision interval (the smallest the engine
    # can run), or 2 tokens for a precision chain (``tiers`` with int8/int4/k4v2/int2, whose window
    # may be shorter). Under a budget the window grows to a share of it (see docs/retention.md).
    window: int | None = Field(default=None, ge=16, le=MAX_TOKENS)
    # Sequences under a retention policy prefill in chunks of at most this many tokens (rounded up to
    # whole blocks, capped by engine.prefillChunk) and the policy acts after each: the budget then holds
    # within one such chunk. 32 is what bench/quality/kv_quality.py measures; larger trades budget precision
    # (and quality) for prefill speed. Fixed at start (not live).
    decision_interval: int = Field(default=32, ge=1, le=MAX_TOKENS)
    budget: float | None = Field(default=None, gt=0.0, le=1.0)
    budget_tokens: int | None = Field(default=None, ge=16, le=MAX_TOKENS)
    budget_mode: Literal["always", "pressure"] = "always"
    # What `budget` is a fraction of: the full cache at the request's final length (prompt + max_tokens),
    # the bytes admission reserves for it, held from its first token ("final"), or at its current length
    # ("length": the reservation is filled only as the sequence grows). docs/retention.md, "Budget basis".
    budget_basis: Literal["final", "length"] = "final"
    # conf-kv's kept tiers, highest first (DISCARD implied). The default ["full", "int4", "k4v2", "int2"]
    # lets confidence choose each token's precision (docs/retention.md, Precision tiers): decode attends the
    # frozen blocks from their codes at about the full policy's step cost, and it keeps far more quality
    # than dropping V at the same bytes. ["full", "key_only"] (FULL / KEY_ONLY / DISCARD) stays available.
    # An int8 / fp8 pool's default is ["full", "key_only"] (``_default_tiers_for_the_pool``).
    tiers: list[TierName] = Field(default_factory=lambda: ["full", "int4", "k4v2", "int2"], min_length=1,
                                  max_length=5)
    eviction: EvictionSection = EvictionSection()
    prefix_cache: PrefixCacheSection = PrefixCacheSection()
    warmup: WarmupSection = WarmupSection()
    max_cache_size: str | None = None
    compression: CompressionSection = CompressionSection()
    # Storage dtype of the whole KV pool, as vLLM's --kv-cache-dtype: auto = model.dtype; fp8 =
    # float8 e4m3 with a scale of 1.0 (vLLM's default; |x| > 448 saturates); int8 = symmetric codes
    # with an fp16 scale per token and KV head. Read at start (not live).
    kv_cache_dtype: KVCacheDtype = "auto"

    @field_validator("max_cache_size")
    @classmethod
    def _valid_size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value)
        return value

    @field_validator("tiers")
    @classmethod
    def _valid_tiers(cls, value: list[str]) -> list[str]:
        return check_tiers(value)

    @model_validator(mode="after")
    def _one_budget(self) -> ConfKVSection:
        if self.budget is not None and self.budget_tokens is not None:
            raise ValueError("set at most one of budget and budgetTokens")
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_tiers_for_the_pool(cls, data: Any) -> Any:
        # An int8 or fp8 pool holds codes already, so precision tiers cannot re-encode it: there the
        # default chain is FULL / KEY_ONLY (a default that follows --kv-cache-dtype, as vLLM's do);
        # a precision chain asked for explicitly is refused below, never silently replaced.
        if isinstance(data, dict) and "tiers" not in data and \
                data.get("kvCacheDtype", data.get("kv_cache_dtype")) in CODED_CACHE_DTYPES:
            return {**data, "tiers": ["full", "key_only"]}
        return data

    @model_validator(mode="after")
    def _tiers_fit_the_pool(self) -> ConfKVSection:
        if self.kv_cache_dtype not in CODED_CACHE_DTYPES or set(self.tiers) <= {"full", "key_only"}:
            return self
        raise ValueError(f"tiers {self.tiers} need a bfloat16, float16 or float32 KV cache (kvCacheDtype "
                         f"{self.kv_cache_dtype} holds codes already); use tiers ['full', 'key_only']")


class AlertRule(_Model):
    enabled: bool = True
    threshold: float
    for_: str = Field(default="0s", alias="for")

    @field_validator("for_")
    @classmethod
    def _valid_for(cls, value: str) -> str:
        parse_duration(value)
        return value


LatencySignal = Literal["ttft", "tpot", "e2e"]
#: The quantile of the latency signal the rule compares (agent and PrometheusRule alike).
LATENCY_QUANTILE = 0.95


class LatencyRule(AlertRule):
    """``latencyMs``: the p95 (over the rule's window) of ``signal``, in milliseconds. ``ttft``: time to
    first token; ``tpot``: time per output token; ``e2e``: arrival to finish, which grows with the
    answer's length (so a long answer alone fires it: meant for fixed-length batch work)."""

    signal: LatencySignal = "ttft"


def _rule(threshold: float, for_: str, kind: type[AlertRule] = AlertRule) -> Any:
    return Field(default_factory=lambda: kind(threshold=threshold, **{"for": for_}))


class AlertsSection(_Model):
    """The four rules of the deployment guide. vram: used fraction; latencyMs: p95 time to first token
    (or per output token, or end to end: ``signal``) in ms; hitRate: prefix-cache hit fraction (fires
    when below); oomPerHour: count."""

    vram: AlertRule = _rule(0.85, "5m")
    latency_ms: LatencyRule = _rule(500.0, "1m", LatencyRule)
    hit_rate: AlertRule = _rule(0.70, "5m")
    oom_per_hour: AlertRule = _rule(3.0, "0s")


RemediationAction = Literal[
    "raiseLruK", "warmup", "compress", "lowerMaxCacheSize", "stricterThresholds",
    "halveBatchSize", "smallerBatches", "recommendScaleOut", "recommendPrefillTuning",
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
    """Return a copy with ``values`` (snake_case, None ignored) applied to one section, revalidated.
    Only the fields that were set carry over (of every section: one call per section must not fix
    the others' defaults), so a default that follows another field (``ConfKVSection.tiers`` follows
    ``kvCacheDtype``) follows the override too."""
    current = config.model_dump(mode="json", by_alias=True, exclude_unset=True)  # every section's set fields
    sub = getattr(config, section).model_dump(mode="json", by_alias=False, exclude_unset=True)
    sub.update({k: v for k, v in values.items() if v is not None})
    try:
        validated = type(getattr(config, section)).model_validate(sub)
    except ValidationError as err:
        raise ConfigError(f"invalid {section} settings: {_format_errors(err)}") from None
    current[section] = validated.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return load_config(current)
