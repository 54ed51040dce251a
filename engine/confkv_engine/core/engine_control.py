"""The engine's control surface (``core.control_api.EngineControlTarget``): live policy, resize,
stats, the disk index, compression control and shutdown.

``EngineControlSurface`` is the base of ``engine.LLMEngine``, kept apart from the step loop: every
change here is checked first and then lands between two steps, under the lock the engine steps
under (``parts.EngineParts.lock``, the one object the compression worker is handed too). It works
through the parts' public methods only.
"""

from __future__ import annotations

import threading

import torch

from confkv_api.config import CompressionSection, ConfKVSection
from confkv_api.units import parse_size
from confkv_engine.cache.disk.sink import DiskSink
from confkv_engine.cache.kv_cache import CompressResult, KVCache
from confkv_engine.cache.planner import MemoryPlan, requested_pool_bytes
from confkv_engine.core.compression import CompressionControl
from confkv_engine.core.control_api import (
    BATCH_FIELD,
    COMPRESSION_FIELD,
    EVICTION_FIELD,
    RETENTION_FIELDS,
    SIZE_FIELD,
    CapacityInUse,
    EngineStats,
    PolicyRejected,
)
from confkv_engine.core.sampling_params import InvalidRequest
from confkv_engine.core.scheduler import Scheduler
from confkv_engine.retention.manager import RetentionManager, config_from_section


class EngineControlSurface:
    """Control calls over the engine's parts; the engine sets these attributes from its parts."""

    cache: KVCache
    disk: DiskSink | None
    scheduler: Scheduler
    retention: RetentionManager
    compression_control: CompressionControl
    lock: threading.RLock
    device: torch.device
    memory_plan: MemoryPlan
    num_oom: int
    prompt_tokens_total: int
    generated_tokens_total: int
    num_finished: int

    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    def set_max_batch_size(self, n: int) -> None:
        """Live change (remediation): applies from the next step; running sequences over the new
        limit finish normally, nothing new is admitted until the batch is below it."""
        if n < 1:
            raise InvalidRequest(f"max batch size must be >= 1, got {n}", param="maxBatchSize")
        with self.lock:
            self.scheduler.set_max_batch_size(n)

    def live_fields(self) -> list[str]:
        return [BATCH_FIELD, *RETENTION_FIELDS, EVICTION_FIELD, SIZE_FIELD, COMPRESSION_FIELD]

    def capabilities(self) -> list[str]:
        caps = ["compress"] + (["prefix-cache", "warmup"] if self.cache.prefix_enabled else [])
        return caps + (["rebuild-index"] if self.disk is not None else [])

    def _resize(self, max_cache_size: str | None) -> None:
        """Live ``maxCacheSize``: the same bytes mean the same pool as at start-up (the null block is
        inside it). A size the machine cannot hold is refused here, not capped as at start-up: the
        caller asked for a pool it would not get."""
        size = parse_size(max_cache_size) if max_cache_size else None
        try:  # a fraction is of total memory less the start-up plan's weights, activations and reserve
            wanted = requested_pool_bytes(self.memory_plan, size)
        except ValueError as err:
            raise CapacityInUse(f"maxCacheSize {max_cache_size!r} refused: {err}") from None
        try:
            self.cache.resize(wanted // self.cache.spec.block_bytes - 1)  # less the null block
        except ValueError as err:
            raise CapacityInUse(f"maxCacheSize {max_cache_size!r} ({wanted} bytes) refused: {err}") from None

    def rebuild_index(self) -> str:
        """Rebuild the disk store's index from its record files (torn or corrupt ones are skipped)."""
        if self.disk is None:
            raise PolicyRejected("this engine has no cache directory (engine.cacheDir): nothing to rebuild")
        report = self.disk.rebuild()
        return (f"rebuilt the disk index: {report.records} records ({report.bytes} bytes), "
                f"{report.skipped} torn or corrupt skipped, {report.orphans} unfinished writes removed")

    def hot_prefixes(self, n: int) -> list[list[int]]:
        """Token ids of the most-hit prefixes the disk store remembers (for a warm-up with no prompts)."""
        return self.disk.hot_prefixes(n) if self.disk is not None else []

    def close(self) -> None:
        """Release what outlives requests (the compression worker, the disk store's writer and index)."""
        self.stop_compression()
        if self.disk is not None:
            with self.lock:
                self.cache.offer_all()
            self.disk.flush()
            self.disk.close()

    def apply_policy(self, confkv: ConfKVSection, max_batch_size: int, changed: list[str]) -> None:
        """Everything is computed and checked first, then set between two steps (all or nothing).
        Retention settings apply to requests admitted from now on."""
        retention = None
        if any(p.startswith(RETENTION_FIELDS) for p in changed):
            try:
                retention = config_from_section(confkv, self.retention.interval,
                                                self.retention.defaults.scorer)
                self.retention.check(retention)
            except ValueError as err:
                raise PolicyRejected(f"invalid policy: {err}") from None
        compression = None
        if any(p.startswith(COMPRESSION_FIELD) for p in changed):
            compression = self.compression_control.checked(confkv.compression)
        if max_batch_size < 1:
            raise PolicyRejected(f"invalid policy: maxBatchSize must be >= 1, got {max_batch_size}")
        with self.lock:  # the engine steps under this lock: the change lands between two steps
            if SIZE_FIELD in changed:  # first: it is the one change that can still be refused here
                self._resize(confkv.max_cache_size)
            if BATCH_FIELD in changed:
                self.scheduler.set_max_batch_size(max_batch_size)
            if retention is not None:
                self.retention.set_defaults(retention)
            if any(p.startswith(EVICTION_FIELD) for p in changed):
                ev = confkv.eviction
                self.cache.set_eviction_k(ev.k if ev.policy == "LRU-K" else 1)
        if compression is not None:  # outside the lock: stopping the worker waits for its pass
            self.compression_control.set(compression)

    def stats(self) -> EngineStats:
        with self.lock:
            cache, used = self.cache, self.cache.used_bytes
            tiers = self.retention.tier_bytes([(s.kv, s.policy_state) for s in self.scheduler.running])
            return EngineStats(
                num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                num_total_blocks=cache.num_blocks, num_free_blocks=cache.num_free,
                block_size=cache.spec.block_size, kv_bytes_used=used,
                kv_bytes_total=cache.total_bytes, kv_bytes_full=used - tiers["key_only"],
                kv_bytes_key_only=tiers["key_only"],
                num_preemptions=self.scheduler.num_preemptions, num_oom=self.num_oom,
                prompt_tokens_total=self.prompt_tokens_total,
                generated_tokens_total=self.generated_tokens_total,
                num_requests_finished=self.num_finished,
                prefix_cache_enabled=cache.prefix_enabled,
                prefix_queried_tokens=cache.hits.queried, prefix_hit_tokens=cache.hits.hit,
                prefix_hit_ratio_window=cache.hits.window_ratio(),
                kv_bytes_evictable=2 * len(cache.eviction) * cache.spec.block_bytes,
                kv_bytes_reserved=cache.reserved_bytes,
                kv_bytes_reclaimable=cache.reclaimable_bytes,
                eviction_k=cache.eviction.k, **self._disk_stats(),
                kv_blocks_compressed=len(cache.store),
                kv_bytes_compressed=cache.store.stored_bytes)

    def _disk_stats(self) -> dict[str, int]:
        if self.disk is None:
            return {}
        store, sink = self.disk.store.stats(), self.disk.stats
        return {"disk_records": store.records, "disk_bytes": store.bytes_used, "disk_spilled": sink.spilled,
                "disk_loaded": sink.loaded, "rebuild_records_skipped": store.rebuild_skipped}

    # ---- compression (``core.compression``) -------------------------------------------------
    @property
    def compression(self) -> CompressionSection:
        """The live compression settings."""
        return self.compression_control.config

    def compress(self, bits: int | None = None, force: bool = False) -> CompressResult:
        """Compress KV blocks now with ``bits`` (default: the config's). Not forced: evictable cached
        blocks unused for coldAfterSeconds. Forced: every evictable cached block, then running
        requests' blocks outside the recent window. Pool blocks it frees are usable at once."""
        return self.compression_control.compress(list(self.scheduler.running), bits, force)

    def start_compression(self) -> None:
        """Start the background worker (compresses cold cached blocks); a no-op when compression is
        disabled in the config, and it starts later if a live change enables it."""
        self.compression_control.start()

    def stop_compression(self) -> None:
        """Stop the background worker and wait for it (a pass in progress completes first)."""
        self.compression_control.stop()
