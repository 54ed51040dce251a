from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("interval_seconds",)
    INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    interval_seconds: float
    def __init__(self, interval_seconds: _Optional[float] = ...) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("device", "used_bytes", "total_bytes", "effective_used_bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    used_bytes: int
    total_bytes: int
    effective_used_bytes: int
    def __init__(self, device: _Optional[str] = ..., used_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ..., effective_used_bytes: _Optional[int] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("upper_bounds", "cumulative_counts", "sum")
    UPPER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    upper_bounds: _containers.RepeatedScalarFieldContainer[float]
    cumulative_counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    def __init__(self, upper_bounds: _Optional[_Iterable[float]] = ..., cumulative_counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("model", "timestamp", "num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "block_size", "kv_bytes_used", "kv_bytes_total", "kv_bytes_key_only", "preemptions_total", "oom_total", "prompt_tokens_total", "generated_tokens_total", "latency_count", "latency_seconds_sum", "avg_latency_seconds", "prefix_cache_enabled", "prefix_queried_tokens", "prefix_hit_tokens", "device_memory", "policy_version", "policy_json", "startup_policy_json", "capabilities", "time_to_first_token", "time_per_output_token", "request_latency", "prefix_hit_ratio_window", "kv_bytes_reclaimable", "eviction_k", "disk_records", "disk_bytes", "rebuild_records_skipped", "kv_blocks_compressed", "kv_bytes_compressed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_KEY_ONLY_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    OOM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LATENCY_COUNT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    AVG_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    STARTUP_POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIME_PER_OUTPUT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_LATENCY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATIO_WINDOW_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECLAIMABLE_FIELD_NUMBER: _ClassVar[int]
    EVICTION_K_FIELD_NUMBER: _ClassVar[int]
    DISK_RECORDS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    REBUILD_RECORDS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    model: str
    timestamp: float
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    block_size: int
    kv_bytes_used: int
    kv_bytes_total: int
    kv_bytes_key_only: int
    preemptions_total: int
    oom_total: int
    prompt_tokens_total: int
    generated_tokens_total: int
    latency_count: int
    latency_seconds_sum: float
    avg_latency_seconds: float
    prefix_cache_enabled: bool
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    device_memory: DeviceMemory
    policy_version: int
    policy_json: str
    startup_policy_json: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    time_to_first_token: Histogram
    time_per_output_token: Histogram
    request_latency: Histogram
    prefix_hit_ratio_window: float
    kv_bytes_reclaimable: int
    eviction_k: int
    disk_records: int
    disk_bytes: int
    rebuild_records_skipped: int
    kv_blocks_compressed: int
    kv_bytes_compressed: int
    def __init__(self, model: _Optional[str] = ..., timestamp: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_bytes_used: _Optional[int] = ..., kv_bytes_total: _Optional[int] = ..., kv_bytes_key_only: _Optional[int] = ..., preemptions_total: _Optional[int] = ..., oom_total: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., generated_tokens_total: _Optional[int] = ..., latency_count: _Optional[int] = ..., latency_seconds_sum: _Optional[float] = ..., avg_latency_seconds: _Optional[float] = ..., prefix_cache_enabled: _Optional[bool] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., device_memory: _Optional[_Union[DeviceMemory, _Mapping]] = ..., policy_version: _Optional[int] = ..., policy_json: _Optional[str] = ..., startup_policy_json: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., time_to_first_token: _Optional[_Union[Histogram, _Mapping]] = ..., time_per_output_token: _Optional[_Union[Histogram, _Mapping]] = ..., request_latency: _Optional[_Union[Histogram, _Mapping]] = ..., prefix_hit_ratio_window: _Optional[float] = ..., kv_bytes_reclaimable: _Optional[int] = ..., eviction_k: _Optional[int] = ..., disk_records: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., rebuild_records_skipped: _Optional[int] = ..., kv_blocks_compressed: _Optional[int] = ..., kv_bytes_compressed: _Optional[int] = ...) -> None: ...

class UpdatePolicyRequest(_message.Message):
    __slots__ = ("confkv_json", "replace", "max_batch_size", "expected_version", "require_live", "reason")
    CONFKV_JSON_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUIRE_LIVE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    confkv_json: str
    replace: bool
    max_batch_size: int
    expected_version: int
    require_live: bool
    reason: str
    def __init__(self, confkv_json: _Optional[str] = ..., replace: _Optional[bool] = ..., max_batch_size: _Optional[int] = ..., expected_version: _Optional[int] = ..., require_live: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class UpdatePolicyResponse(_message.Message):
    __slots__ = ("version", "policy_json", "changed_fields", "live_fields", "deferred_fields", "message")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELDS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    version: int
    policy_json: str
    changed_fields: _containers.RepeatedScalarFieldContainer[str]
    live_fields: _containers.RepeatedScalarFieldContainer[str]
    deferred_fields: _containers.RepeatedScalarFieldContainer[str]
    message: str
    def __init__(self, version: _Optional[int] = ..., policy_json: _Optional[str] = ..., changed_fields: _Optional[_Iterable[str]] = ..., live_fields: _Optional[_Iterable[str]] = ..., deferred_fields: _Optional[_Iterable[str]] = ..., message: _Optional[str] = ...) -> None: ...

class CompressRequest(_message.Message):
    __slots__ = ("strategy", "force")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    force: bool
    def __init__(self, strategy: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RebuildIndexRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WarmupRequest(_message.Message):
    __slots__ = ("prompts", "top_k")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedScalarFieldContainer[str]
    top_k: int
    def __init__(self, prompts: _Optional[_Iterable[str]] = ..., top_k: _Optional[int] = ...) -> None: ...

class ActionResponse(_message.Message):
    __slots__ = ("message", "blocks_affected")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_AFFECTED_FIELD_NUMBER: _ClassVar[int]
    message: str
    blocks_affected: int
    def __init__(self, message: _Optional[str] = ..., blocks_affected: _Optional[int] = ...) -> None: ...
