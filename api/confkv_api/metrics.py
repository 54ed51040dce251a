"""Prometheus metric names: the contract between engine, agent, alert rules and dashboards.

Every name carries the ``confkv_`` prefix. Histograms expose ``_bucket``/``_sum``/``_count``;
counters expose ``_total``.
"""

# Engine: KV cache.
KV_CACHE_USAGE_RATIO = "confkv_kv_cache_usage_ratio"  # gauge, used blocks / total blocks
# gauge, label tier=full|key_only|free|evictable|reclaimable|total
KV_CACHE_BYTES = "confkv_kv_cache_bytes"
KV_CACHE_CAPACITY_BYTES = "confkv_kv_cache_capacity_bytes"  # gauge, bytes of the whole pool
PREFIX_CACHE_HIT_RATIO = "confkv_prefix_cache_hit_ratio"  # gauge, hit / queried tokens, last 5 minutes
PREFIX_CACHE_QUERIED_TOKENS = "confkv_prefix_cache_queried_tokens"  # counter
PREFIX_CACHE_HIT_TOKENS = "confkv_prefix_cache_hit_tokens"  # counter
# counter: torn or corrupt disk-store records the index rebuilds skipped (never served)
CACHE_REBUILD_RECORDS_SKIPPED = "confkv_cache_rebuild_records_skipped_total"

# Engine: scheduler and requests.
REQUESTS_RUNNING = "confkv_requests_running"  # gauge
REQUESTS_WAITING = "confkv_requests_waiting"  # gauge
REQUEST_LATENCY_SECONDS = "confkv_request_latency_seconds"  # histogram, end-to-end
TIME_TO_FIRST_TOKEN_SECONDS = "confkv_time_to_first_token_seconds"  # histogram
# histogram, (finish - first token) / (output tokens - 1), once per request with >= 2 output tokens
TIME_PER_OUTPUT_TOKEN_SECONDS = "confkv_time_per_output_token_seconds"
PROMPT_TOKENS = "confkv_prompt_tokens"  # counter
GENERATION_TOKENS = "confkv_generation_tokens"  # counter
PREEMPTIONS = "confkv_preemptions"  # counter
OOM_ERRORS = "confkv_oom_errors"  # counter
REQUESTS_FINISHED = "confkv_requests_finished"  # counter, label: reason=stop|length|abort|error

# Engine: device.
DEVICE_MEMORY_USED_BYTES = "confkv_device_memory_used_bytes"  # gauge, label: device
DEVICE_MEMORY_TOTAL_BYTES = "confkv_device_memory_total_bytes"  # gauge, label: device
# gauge, label: device; used less the KV pool's reclaimable bytes (what the VRAM alert compares)
DEVICE_MEMORY_EFFECTIVE_USED_BYTES = "confkv_device_memory_effective_used_bytes"

# Agent.
AGENT_ALERT_STATE = "confkv_agent_alert_state"  # gauge, labels: alert, state (0/1)
AGENT_REMEDIATIONS = "confkv_agent_remediations"  # counter, labels: alert, action, result
AGENT_ALERT_VALUE = "confkv_agent_alert_value"  # gauge, label: alert (absent: no data)
AGENT_VRAM_USED_RATIO = "confkv_agent_vram_used_ratio"  # gauge, labels: source=nvml|engine, device
AGENT_ENGINE_UP = "confkv_agent_engine_up"  # gauge, 1 when the engine's control socket answers
AGENT_POLICY_VERSION = "confkv_agent_policy_version"  # gauge, the engine's live policy version
AGENT_CONFIG_RELOADS = "confkv_agent_config_reloads"  # counter, label: result=applied|invalid
# gauge, label: alert; 1 while the agent's scale-out recommendation for that alert stands (the
# autoscaler reads it), 0 once the alert resolves
AGENT_SCALE_OUT_RECOMMENDED = "confkv_agent_scale_out_recommended"
