"""The disk store behind the prefix cache: evicted blocks spill to ``engine.cacheDir``, misses read back.

``DiskSink`` is the cache's ``EvictionSink``. A spill only queues the block's bytes, still in flight
on CUDA (copied device-to-pinned on the cache's spill stream, ``streams.PendingBytes``): the writer
thread waits for the copy, then does the checksummed, fsynced ``DiskStore.put`` (milliseconds each),
so an engine step that evicts never waits for the device or the disk. The store's admission rule
keeps blocks used fewer than twice off the SSD. Reading back runs on a second thread of its own
(``readback``): ``start_load`` queues a chain that continues a prefix-cache hit, the reader reads,
verifies and decodes its records (token by token against the chain, like an in-memory hit) while the
engine keeps stepping, and the engine installs the decoded blocks between two steps. Reads do not
queue behind writes (an fsync each), and a read is only started when the disk's index holds the
chain's next block.

The store's index survives restarts: ``DiskStore`` rebuilds it from the record files when it opens
(torn or corrupt records are skipped and counted), and ``rebuild()`` does it again on demand.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import torch

from confkv_engine.cache.disk.store import DiskStore, RebuildReport, capacity_from_volume
from confkv_engine.cache.prefix import CachedBlock
from confkv_engine.cache.readback import MAX_LOAD_BLOCKS, ChainLink, ChainLoad
from confkv_engine.cache.streams import PendingBytes

log = logging.getLogger("confkv.cache.disk")

QUEUE_LIMIT = 256  # spills waiting for the writer; beyond it new spills are dropped (counted)


@dataclass
class DiskSinkStats:
    """What the sink itself did; the store's own figures (records, bytes, rebuilds) are ``store.stats()``."""

    spilled: int = 0
    dropped: int = 0
    loaded: int = 0  # blocks read back, verified and decoded by the reader


class DiskSink:
    def __init__(self, directory: str, capacity_bytes: int | None = None) -> None:
        capacity = capacity_bytes or capacity_from_volume(directory)
        self.store = DiskStore(directory, capacity)
        self.stats = DiskSinkStats()
        self._queue: queue.Queue[tuple[CachedBlock, PendingBytes, int] | None] = queue.Queue(QUEUE_LIMIT)
        self._writer = threading.Thread(target=self._write_loop, name="confkv-disk", daemon=True)
        self._writer.start()
        self._reads: queue.Queue[ChainLoad | None] = queue.Queue()
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="confkv-disk-read", daemon=True)
        self._reader.start()

    # ---- EvictionSink ------------------------------------------------------------------------
    def spill(self, entry: CachedBlock, payload: PendingBytes, uses: int) -> None:
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
                if self.store.put(entry.key, entry.parent, list(entry.tokens), payload.bytes(), uses=uses):
                    self.stats.spilled += 1
            except Exception:  # a full or failing disk loses cache entries, never requests
                log.exception("disk store write failed")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued spill is written (tests, shutdown)."""
        self._queue.join()

    # ---- reading back (``readback``) ---------------------------------------------------------
    def start_load(self, links: list[ChainLink], shape: tuple[int, ...], dtype: torch.dtype,
                   scale_shape: tuple[int, ...] | None = None, pin: bool = False) -> ChainLoad | None:
        """Queue a read of ``links`` (at most ``MAX_LOAD_BLOCKS``) for the reader thread; None, at
        once, when the disk has no record of the first block not cached in memory. ``pin``: decode
        into pinned memory (for a CUDA pool)."""
        first = next((link for link in links if not link.cached), None)
        if first is None or self._closing.is_set() or not self.store.contains(first.key):
            return None
        load = ChainLoad(links[:MAX_LOAD_BLOCKS], shape, dtype, scale_shape, pin=pin)
        self._reads.put(load)
        return load

    def _read_loop(self) -> None:
        while True:
            load = self._reads.get()
            if load is None:
                return
            try:
                self._read(load)
            except Exception:  # a failing disk costs cache hits, never requests
                log.exception("disk store read failed")
            finally:
                load.done.set()  # however it ended: the waiting request is admitted with what landed

    def _read(self, load: ChainLoad) -> None:
        for link in load.links:
            if link.cached:
                continue
            if self._closing.is_set():
                return
            record = self.store.get(link.key)  # checksum verified; a corrupt record is dropped, counted
            if record is None or tuple(record.token_ids) != link.tokens or record.parent != link.parent:
                return
            pair = load.decode(bytes(record.payload))
            if pair is None:
                return
            load.pairs[link.key] = pair
            self.stats.loaded += 1

    def hot_prefixes(self, n: int) -> list[list[int]]:
        return self.store.hot_prefixes(n)

    def rebuild(self) -> RebuildReport:
        return self.store.rebuild()

    def close(self) -> None:
        """Stop both threads: loads still queued end at once (their requests recompute), spills
        queued before the close are written."""
        self._closing.set()
        self._reads.put(None)
        self._reader.join(timeout=30.0)
        self._queue.put(None)
        self._writer.join(timeout=30.0)
        self.store.close()
