"""Prometheus metrics of one engine server, on a registry of its own (tests run several servers).

Per-request metrics (latency, TTFT, token counts, finish reasons) are observed when a request
finishes. Cache, scheduler and device figures are read at scrape time from the engine's last
stats snapshot, so scraping never touches the engine thread.

The Gateway API Inference Extension's model-server protocol: its endpoint picker (EPP, the reference
one and llm-d's) scrapes three gauges from each pod, under vLLM's names by default, so they are also
exposed under those names (``PROTOCOL_GAUGES``), with vLLM's semantics:

- ``vllm:num_requests_waiting``: requests queued for a batch slot (admitted, not running; preempted
  ones are back in the queue), the EPP's TotalQueuedRequests;
- ``vllm:num_requests_running``: requests in the running batch, TotalRunningRequests;
- ``vllm:kv_cache_usage_perc``: the fraction (0..1, despite the name) of KV blocks in use; cached
  prefix blocks nobody references count as free, as in vLLM, since an allocation takes them at once.
  ``vllm:gpu_cache_usage_perc`` is the same value under the name EPP releases before vLLM's rename read;
- ``vllm:cache_config_info`` (value 1) with labels ``block_size`` and ``num_gpu_blocks``, which the
  prefix-cache scorer reads to size its index.

The ``confkv_`` names carry the same values for the project's own rules and dashboard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from confkv_api import metrics as names
from confkv_engine.cache.memory import device_memory
from confkv_engine.core.control_api import EngineStats
from confkv_engine.core.outputs import RequestOutput

log = logging.getLogger(__name__)

# ``*_created`` samples double the exposition and no dashboard or rule here reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, float("inf"))
# Per output token after the first; 0.25 and 0.5 s are bounds so the CPU and GPU thresholds fall on them.
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, float("inf"))
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))


#: The model-server protocol's gauges under the names the EPP reads by default (see the docstring).
PROTOCOL_WAITING = "vllm:num_requests_waiting"
PROTOCOL_RUNNING = "vllm:num_requests_running"
PROTOCOL_KV_USAGE = "vllm:kv_cache_usage_perc"
PROTOCOL_KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"
PROTOCOL_CACHE_INFO = "vllm:cache_config_info"
PROTOCOL_GAUGES = (PROTOCOL_WAITING, PROTOCOL_RUNNING, PROTOCOL_KV_USAGE, PROTOCOL_KV_USAGE_LEGACY,
                   PROTOCOL_CACHE_INFO)


def kv_usage(s: EngineStats) -> float:
    """Fraction of KV blocks in use; free and evictable cached blocks are not in use."""
    total = s.num_total_blocks
    return (total - s.num_free_blocks) / total if total else 0.0


def _suffixless(name: str) -> str:
    """prometheus-client appends ``_total`` to counters itself."""
    return name.removesuffix("_total")


class _SnapshotCollector(Collector):
    """Gauges and cumulative counters derived from the engine's stats snapshot at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], device: str) -> None:
        self._stats = stats
        self._device = device

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        yield from self._cache(s)
        yield from self._scheduler(s)
        yield from self._device_memory(s)
        yield from self._protocol(s)

    def _protocol(self, s: EngineStats) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(PROTOCOL_WAITING, "Requests waiting for a batch slot.", value=s.num_waiting)
        yield GaugeMetricFamily(PROTOCOL_RUNNING, "Requests in the running batch.", value=s.num_running)
        usage = kv_usage(s)
        yield GaugeMetricFamily(PROTOCOL_KV_USAGE, "Fraction of KV-cache blocks in use, 0..1.", value=usage)
        yield GaugeMetricFamily(PROTOCOL_KV_USAGE_LEGACY, "Fraction of KV-cache blocks in use (older name).",
                                value=usage)
        info = GaugeMetricFamily(PROTOCOL_CACHE_INFO, "KV cache configuration (value 1).",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(s.block_size), str(s.num_total_blocks)], 1.0)
        yield info

    def _cache(self, s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(names.KV_CACHE_USAGE_RATIO, "Used KV blocks / total KV blocks.",
                                value=kv_usage(s))
        total = s.kv_bytes_total
        used = s.kv_bytes_used
        key_only = s.kv_bytes_key_only
        full = s.kv_bytes_full
        tiers = GaugeMetricFamily(names.KV_CACHE_BYTES, "KV cache bytes by tier.", labels=["tier"])
        free = max(0, total - used - s.kv_bytes_reserved)  # the null block is the cache's own
        for tier, value in (("full", full), ("key_only", key_only), ("free", free),
                            ("evictable", s.kv_bytes_evictable), ("reclaimable", s.kv_bytes_reclaimable),
                            ("total", total)):
            tiers.add_metric([tier], value)
        yield tiers
        yield GaugeMetricFamily(names.KV_CACHE_CAPACITY_BYTES, "Bytes of the whole KV pool.", value=total)
        queried = s.prefix_queried_tokens
        hits = s.prefix_hit_tokens
        ratio = s.prefix_hit_ratio_window
        yield GaugeMetricFamily(names.PREFIX_CACHE_HIT_RATIO,
                                "Prefix-cache hit / queried tokens over the last 5 minutes (NaN: none).",
                                value=float("nan") if ratio is None else ratio)
        yield CounterMetricFamily(_suffixless(names.PREFIX_CACHE_QUERIED_TOKENS),
                                  "Prompt tokens looked up in the prefix cache.", value=queried)
        yield CounterMetricFamily(_suffixless(names.PREFIX_CACHE_HIT_TOKENS),
                                  "Prompt tokens found in the prefix cache.", value=hits)
        yield CounterMetricFamily(_suffixless(names.CACHE_REBUILD_RECORDS_SKIPPED),
                                  "Torn or corrupt disk-store records skipped by index rebuilds.",
                                  value=s.rebuild_records_skipped)

    def _scheduler(self, s: EngineStats) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        yield GaugeMetricFamily(names.REQUESTS_RUNNING, "Requests being decoded.",
                                value=s.num_running)
        yield GaugeMetricFamily(names.REQUESTS_WAITING, "Requests admitted but not running.",
                                value=s.num_waiting)
        yield CounterMetricFamily(_suffixless(names.PREEMPTIONS), "Sequences preempted (recompute).",
                                  value=s.num_preemptions)
        yield CounterMetricFamily(_suffixless(names.OOM_ERRORS), "Device out-of-memory errors caught.",
                                  value=s.num_oom)

    def _device_memory(self, s: EngineStats) -> Iterator[GaugeMetricFamily]:
        label, used, total = device_memory(self._device)
        effective = GaugeMetricFamily(names.DEVICE_MEMORY_EFFECTIVE_USED_BYTES,
                                      "Device memory used less the KV pool's reclaimable bytes.",
                                      labels=["device"])
        effective.add_metric([label], max(0, used - s.kv_bytes_reclaimable))
        yield effective
        used_m = GaugeMetricFamily(names.DEVICE_MEMORY_USED_BYTES,
                                   "GPU memory in use (cuda) or this process's RSS (cpu).", labels=["device"])
        used_m.add_metric([label], used)
        total_m = GaugeMetricFamily(names.DEVICE_MEMORY_TOTAL_BYTES,
                                    "GPU memory (cuda) or the machine's RAM (cpu).", labels=["device"])
        total_m.add_metric([label], total)
        yield used_m
        yield total_m


class EngineMetrics:
    """All ``confkv_`` engine metrics of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(names.REQUEST_LATENCY_SECONDS, "End-to-end request latency.",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "Time to first generated token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(names.TIME_PER_OUTPUT_TOKEN_SECONDS, "Time per output token after the first.",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(_suffixless(names.PROMPT_TOKENS), "Prompt tokens of finished requests.",
                                     registry=self.registry)
        self.generation_tokens = Counter(_suffixless(names.GENERATION_TOKENS), "Generated tokens.",
                                         registry=self.registry)
        self.finished = Counter(_suffixless(names.REQUESTS_FINISHED), "Finished requests by reason.",
                                ["reason"], registry=self.registry)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(reason=reason)

    def attach_engine(self, stats: Callable[[], EngineStats], device: str) -> None:
        """Expose the snapshot-derived metrics once the engine exists (the model loads after start-up)."""
        self.registry.register(_SnapshotCollector(stats, device))

    def observe_finished(self, out: RequestOutput) -> None:
        """Called from the engine thread for every finished request."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.output_token_ids))
        self.finished.labels(reason=out.finish_reason or "stop").inc()
        if out.finish_reason in ("abort", "error") or not out.arrival_time:
            return
        end = out.finish_time or out.arrival_time
        self.latency.observe(max(0.0, end - out.arrival_time))
        if out.first_token_time is not None:
            self.ttft.observe(max(0.0, out.first_token_time - out.arrival_time))
            n = len(out.output_token_ids)
            if n >= 2:
                self.tpot.observe(max(0.0, end - out.first_token_time) / (n - 1))

    def observe_aborted(self, request_id: str) -> None:
        """A request abandoned by its client (disconnect) and aborted in the engine."""
        self.finished.labels(reason="abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
