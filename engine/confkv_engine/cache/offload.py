"""The disk tier behind the prefix cache: evicted blocks spill to ``engine.cacheDir``, misses read back.

``DiskTier`` is the cache's ``EvictionSink``. A spill only copies the block's bytes and queues them:
a writer thread does the checksummed, fsynced ``DiskStore.put`` (milliseconds each), so an engine
step that evicts never waits for the disk. The store's admission rule keeps blocks used fewer than
twice off the SSD. ``load_chain`` extends a prefix-cache hit with the blocks the disk holds for
the next keys of the same chain (verified token by token, like an in-memory hit), inserting them
as evictable cached entries; admission then shares them as usual. Reading back is synchronous but
bounded by ``MAX_LOAD_BLOCKS`` per admission, and only runs on a miss the disk can serve.

The store's index survives restarts: ``DiskStore`` rebuilds it from the record files when it opens
(torn or corrupt records are skipped and counted), and ``rebuild()`` does it again on demand.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from confkv_engine.cache.disk import DiskStore, RebuildReport, capacity_from_volume
from confkv_engine.cache.kv_cache import KVCache
from confkv_engine.cache.prefix import CachedBlock, block_key

log = logging.getLogger("confkv.cache.disk")

MAX_LOAD_BLOCKS = 64  # blocks read back for one admission (a 1,024-token prefix at block size 16)
QUEUE_LIMIT = 256  # spills waiting for the writer; beyond it new spills are dropped (counted)


@dataclass
class DiskTierStats:
    """What the tier itself did; the store's own figures (records, bytes, rebuilds) are ``store.stats()``."""

    spilled: int = 0
    dropped: int = 0
    loaded: int = 0


class DiskTier:
    def __init__(self, directory: str, capacity_bytes: int | None = None) -> None:
        capacity = capacity_bytes or capacity_from_volume(directory)
        self.store = DiskStore(directory, capacity)
        self.stats = DiskTierStats()
        self._queue: queue.Queue[tuple[CachedBlock, bytes, int] | None] = queue.Queue(QUEUE_LIMIT)
        self._writer = threading.Thread(target=self._write_loop, name="confkv-disk", daemon=True)
        self._writer.start()

    # ---- EvictionSink ------------------------------------------------------------------------
    def spill(self, entry: CachedBlock, payload: bytes, uses: int) -> None:
        try:
            self._queue.put_nowait((entry, payload, uses))
        except queue.Full:
            self.stats.dropped += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                entry, payload, uses = item
                if self.store.put(entry.key, entry.parent, list(entry.tokens), payload, uses=uses):
                    self.stats.spilled += 1
            except Exception:  # a full or failing disk loses cache entries, never requests
                log.exception("disk tier write failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued spill is written (tests, shutdown)."""
        self._queue.join()

    # ---- reading back ------------------------------------------------------------------------
    def load_chain(self, cache: KVCache, tokens: list[int], have: list[CachedBlock], max_blocks: int) -> int:
        """Insert into ``cache`` the disk's blocks that continue the cached chain ``have`` over
        ``tokens`` (at most ``max_blocks`` blocks in all); returns blocks loaded."""
        if cache.prefix is None:
            return 0
        bs, loaded = cache.spec.block_size, 0
        parent = have[-1].key if have else None
        for b in range(len(have), min(max_blocks, len(have) + MAX_LOAD_BLOCKS, len(tokens) // bs)):
            block_tokens = tuple(tokens[b * bs:(b + 1) * bs])
            key = block_key(parent, cache.prefix.salt, block_tokens)
            if key in cache.prefix:
                parent = key
                continue
            record = self.store.get(key)
            if record is None or tuple(record.token_ids) != block_tokens or record.parent != parent:
                break
            if not cache.load_entry(key, parent, block_tokens, bytes(record.payload)):
                break
            loaded += 1
            parent = key
        self.stats.loaded += loaded
        return loaded

    def hot_prefixes(self, n: int) -> list[list[int]]:
        return self.store.hot_prefixes(n)

    def rebuild(self) -> RebuildReport:
        return self.store.rebuild()

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=30.0)
        self.store.close()
