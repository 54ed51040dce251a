"""The engine's side of the control plane: the typed status snapshot and the protocol the gRPC
servicer (``control``) and the HTTP metrics (``http``) use, so neither reaches into the engine.

``LLMEngine`` implements ``EngineControlTarget``; ``AsyncEngine.stats`` hands out the last snapshot
without waiting for the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from confkv_api.config import ConfKVSection
from confkv_engine.cache.layout import CompressResult

#: The dotted config path of the live batch-size setting.
BATCH_FIELD = "engine.maxBatchSize"
#: LRU-K's K (and LRU vs LRU-K) of the prefix cache: live, cached blocks and their history stay.
EVICTION_FIELD = "confkv.eviction"
#: The KV pool's size: lowering evicts cached blocks first; raising grows the pool if memory allows.
SIZE_FIELD = "confkv.maxCacheSize"
#: Fields the retention manager reads when a request is admitted: live (running requests keep theirs).
RETENTION_FIELDS = ("confkv.kvPolicy", "confkv.confidenceThresholds", "confkv.sinks", "confkv.window",
                    "confkv.budget", "confkv.budgetTokens", "confkv.budgetMode", "confkv.budgetBasis")
#: The live compression settings (enabled, bits, groupSize, coldAfterSeconds).
COMPRESSION_FIELD = "confkv.compression"


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    block_size: int
    kv_bytes_used: int
    kv_bytes_total: int
    kv_bytes_full: int
    kv_bytes_key_only: int
    num_preemptions: int
    num_oom: int
    prompt_tokens_total: int
    generated_tokens_total: int
    num_requests_finished: int
    prefix_cache_enabled: bool = False
    prefix_queried_tokens: int = 0  # prompt tokens looked up at first admission (cumulative)
    prefix_hit_tokens: int = 0  # of those, served from the prefix cache (cumulative)
    prefix_hit_ratio_window: float | None = None  # hit / queried over the last 5 minutes; None: no lookups
    kv_bytes_evictable: int = 0  # cached blocks nobody references: reclaimable at once
    kv_bytes_reserved: int = 0  # pool bytes the cache keeps for itself (the null block; in the total)
    kv_bytes_reclaimable: int = 0  # free + evictable + retired pool bytes (the VRAM signal subtracts them)
    eviction_k: int = 0  # the prefix cache's live LRU-K K (1 = LRU)
    disk_records: int = 0  # blocks the disk store holds
    disk_bytes: int = 0
    disk_spilled: int = 0  # evicted blocks written to disk since start
    disk_loaded: int = 0  # blocks read back from disk into the prefix cache
    rebuild_records_skipped: int = 0  # torn or corrupt records the index rebuilds skipped
    kv_blocks_compressed: int = 0  # K or V blocks stored quantized inside pool memory
    kv_bytes_compressed: int = 0  # their encoded bytes (scales and minimums included)


class PolicyRejected(ValueError):
    """A policy the engine cannot apply (the message says why); nothing was changed."""


class CapacityInUse(PolicyRejected):
    """A smaller cache than running requests hold, or a larger one than the machine can hold now;
    nothing changed."""


class EngineControlTarget(Protocol):
    """What the control plane may ask of a running engine."""

    def live_fields(self) -> list[str]:
        """Dotted camelCase config paths (or prefixes) that take effect without a restart."""
        ...

    def capabilities(self) -> list[str]:
        """What the engine can do beyond the live fields (e.g. 'prefix-cache', 'compress')."""
        ...

    @property
    def max_batch_size(self) -> int: ...

    def apply_policy(self, confkv: ConfKVSection, max_batch_size: int, changed: list[str]) -> None:
        """Apply the validated policy's ``changed`` live fields between two steps, all or nothing;
        raises ``PolicyRejected`` (nothing changed) when the engine cannot take it."""
        ...

    def compress(self, bits: int | None, force: bool) -> CompressResult:
        """Quantize KV blocks now (``bits`` None: the policy's); forced: running requests' cold
        blocks too. Pool blocks it frees are usable at once."""
        ...

    def rebuild_index(self) -> str:
        """Rebuild the disk store's block index; returns what happened (raises PolicyRejected without one)."""
        ...

    def hot_prefixes(self, n: int) -> list[list[int]]:
        """Token ids of the most-hit prefixes the engine remembers (disk store), best first."""
        ...
