"""Disk store of the KV cache manager: evicted prefix blocks spill to a cache directory (NVMe in production).

Layout of ``directory``::

    LOCK                 flock'ed while a store is open (two engines must not share a directory)
    index.sqlite3        the SQLite index (WAL mode), see ``index``
    blocks/xx/<key>.blk  one record file per block, see ``format`` and ``files``

**One file per block, not segments.** A block is 0.1-2 MB (16 tokens x all layers), so a file each
costs little, and eviction is an ``unlink``: append-only segments would have to be compacted, i.e.
rewritten, which is exactly the SSD wear the admission filter is there to spare. Writes cost the
same: ``bench/cache/disk_store.py`` measured a file per block (write, fsync, rename) at 276 records/s
against 263 for appends to a segment (write, fsync) with 190 KB blocks, both bound by the fsync.

**Crash consistency.** A put writes ``<key>.blk.<n>.tmp``, fsyncs it, renames it to ``<key>.blk``,
and only then commits the index row; eviction deletes the row first, the file after. So a crash
leaves complete records (adopted again by the next rebuild) and temporary files (removed by it),
never a row pointing at partial bytes. Every read verifies the payload against the BLAKE2b digest in
the index; a record that fails is dropped and counted, never served. The folder is not fsynced after
the rename (a second fsync per block): a power cut may then forget the newest names, which only
loses cache entries, and the index is rebuilt from the files on open anyway. ``durable=False``
skips the file fsync too (tests, benchmarks): a power cut may then leave torn records, which the
checksums catch.

**Rebuild.** Opening a store rebuilds the index from the record files (headers and sizes are checked;
with ``verify_on_open`` every payload too). Records that are torn, corrupt, misnamed or of another
format version are deleted and counted in ``RebuildReport.skipped``; hit statistics of surviving
records are carried over from the old index when it is readable. ``rebuild()`` does the same on demand
(verifying payloads by default).

**Admission.** Not every evicted block deserves the SSD: by default (``policy``) a block is
written once it has been used twice, as NVIDIA Dynamo's KV block manager filters disk offload.

**Threads.** A writer lock guards the index and the counters; file writes, reads and checksums run
outside it, and each thread has its own SQLite connection, so a read waits at most for one short
commit. Puts arriving during a rebuild are declined (the cache stays correct without them).
"""

from __future__ import annotations

import dataclasses
import fcntl
import itertools
import logging
import os
import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confkv_engine.cache.disk.files import (
    ScanResult,
    capacity_from_volume,
    read_record,
    record_path,
    scan_blocks,
    write_record,
)
from confkv_engine.cache.disk.format import Bytes, CorruptRecord, decode_record, encode_header
from confkv_engine.cache.disk.index import BlockIndex, IndexRow
from confkv_engine.cache.disk.policy import (
    DEFAULT_ADMISSION,
    OFFER_MEMORY,
    AdmissionRule,
    OfferMemory,
    admit_reused,
    select_hot_chains,
)

log = logging.getLogger(__name__)
__all__ = ["DEFAULT_ADMISSION", "AdmissionRule", "DiskRecord", "DiskStats", "DiskStore", "RebuildReport",
           "admit_reused", "capacity_from_volume"]

EVICT_BATCH = 32
# Accesses are buffered and written in one transaction: a commit per hit cost about 40% of a
# 16 KiB get. Eviction, rebuild, warm-up and close flush the buffer first.
TOUCH_BUFFER = 256


@dataclass(frozen=True)
class DiskRecord:
    key: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    payload: bytes
    meta: dict[str, Any]
    hits: int


@dataclass(frozen=True)
class RebuildReport:
    records: int  # records in the index afterwards
    skipped: int  # torn or corrupt record files deleted
    bytes: int  # bytes of the records kept
    orphans: int = 0  # temporary files of interrupted puts deleted
    evicted: int = 0  # records evicted because the log held more than the capacity
    index_recreated: bool = False  # the old index file was unusable and was replaced


@dataclass
class DiskStats:
    records: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    bytes_written: int = 0
    rejected: int = 0  # declined by the admission rule
    duplicates: int = 0  # already on disk
    no_room: int = 0  # larger than the capacity, or the rest is reserved by puts in flight
    busy: int = 0  # declined during a rebuild
    write_errors: int = 0
    evictions: int = 0
    corrupt_reads: int = 0  # records that failed verification on read (dropped, not served)
    rebuild_skipped: int = 0  # total over every rebuild since the store opened
    rebuilds: int = 0


class DiskStore:
    """Checksummed block store under a byte cap, indexed in SQLite, rebuilt from its files on open."""

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int,
                 admit: AdmissionRule = DEFAULT_ADMISSION, *, verify_on_open: bool = False,
                 durable: bool = True) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"disk store capacity must be positive, got {capacity_bytes} bytes")
        self.directory = Path(directory)
        self.blocks_dir = self.directory / "blocks"
        self._capacity = int(capacity_bytes)
        self._admit = admit
        self._durable = durable
        self._lock = threading.Condition(threading.Lock())
        self._stats = DiskStats(capacity_bytes=self._capacity)
        self._offers = OfferMemory(OFFER_MEMORY)
        self._pending: set[bytes] = set()
        self._touches: dict[bytes, tuple[int, int, int | None]] = {}  # key -> (count, last, prev)
        self._reserved = 0
        self._inflight = 0
        self._rebuilding = False
        self._tick = 0
        self._tmp_ids = itertools.count()
        self._closed = True
        self._lock_fd = self._lock_directory()
        self._index = BlockIndex(self.directory / "index.sqlite3")
        self._closed = False
        try:
            self.last_rebuild = self.rebuild(verify_payloads=verify_on_open)
        except BaseException:
            self.close()
            raise

    def _lock_directory(self) -> int:
        for sub in [f"{i:02x}" for i in range(256)]:
            (self.blocks_dir / sub).mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"cache directory {self.directory} is in use by another disk store") from None
        return fd

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: bytes, parent: bytes | None, token_ids: Sequence[int], payload: Bytes,
            meta: dict[str, Any] | None = None, *, uses: int = 1) -> bool:
        """Spill one block; True when it is now on disk. ``uses``: times the block was used in memory."""
        if uses < 0:
            raise ValueError(f"uses must be >= 0, got {uses}")
        payload = memoryview(payload).cast("B")  # any C-contiguous buffer, counted in bytes
        header, digest = encode_header(key, parent, token_ids, payload, meta)
        size = len(header) + len(payload)
        if not self._reserve(key, uses, size):
            return False
        try:
            write_record(self.blocks_dir, key, header, payload, f"{os.getpid()}-{next(self._tmp_ids)}",
                         durable=self._durable)
        except OSError as exc:
            log.warning("disk store: writing block %s failed: %s", key.hex(), exc)
            with self._lock:
                self._release(key, size)
                self._stats.write_errors += 1
            return False
        with self._lock:
            self._tick += 1
            self._index.insert(IndexRow(key, parent, tuple(token_ids), dict(meta or {}), size, digest,
                                        gen=self._tick, last_access=self._tick))
            self._release(key, size)
            self._offers.forget(key)
            st = self._stats
            st.records, st.bytes_used, st.puts, st.bytes_written = (
                st.records + 1, st.bytes_used + size, st.puts + 1, st.bytes_written + size)
        return True

    def _reserve(self, key: bytes, uses: int, size: int) -> bool:
        with self._lock:
            self._check_open()
            st = self._stats
            if self._rebuilding:
                st.busy += 1
                return False
            if key in self._pending or self._index.contains(key):
                st.duplicates += 1
                return False
            if not self._admit(uses + self._offers.bump(key)):
                st.rejected += 1
                return False
            if size > self._capacity or not self._make_room(size):
                st.no_room += 1
                return False
            self._pending.add(key)
            self._reserved += size
            self._inflight += 1
            return True

    def _release(self, key: bytes, size: int) -> None:
        self._pending.discard(key)
        self._reserved -= size
        self._inflight -= 1
        self._lock.notify_all()

    def _make_room(self, need: int) -> bool:
        """Evict (caller holds the lock) until ``need`` more bytes fit under the capacity."""
        st = self._stats
        if st.bytes_used + self._reserved + need > self._capacity:
            self._flush_touches()
        while st.bytes_used + self._reserved + need > self._capacity:
            victims = self._index.eviction_order(EVICT_BATCH)
            if not victims:
                return False
            chosen, freed = [], 0
            for key, size in victims:
                chosen.append(key)
                freed += size
                if st.bytes_used - freed + self._reserved + need <= self._capacity:
                    break
            self._index.delete_many(chosen)  # rows first, files after: a crash leaves adoptable files
            for key in chosen:
                self._unlink(key)
            st.records -= len(chosen)
            st.bytes_used -= freed
            st.evictions += len(chosen)
        return True

    def _unlink(self, key: bytes) -> None:
        record_path(self.blocks_dir, key).unlink(missing_ok=True)

    def set_capacity(self, capacity_bytes: int) -> int:
        """Change the byte cap live; returns how many records were evicted to meet it."""
        if capacity_bytes <= 0:
            raise ValueError(f"disk store capacity must be positive, got {capacity_bytes} bytes")
        with self._lock:
            self._check_open()
            before = self._stats.evictions
            self._capacity = self._stats.capacity_bytes = int(capacity_bytes)
            self._make_room(0)
            return self._stats.evictions - before

    # -- reads --------------------------------------------------------------------------------

    def get(self, key: bytes, *, touch: bool = True) -> DiskRecord | None:
        """The verified record, or None (missing, evicted meanwhile, or corrupt: then dropped)."""
        self._check_open()
        try:
            row = self._index.lookup(key)
        except sqlite3.Error:  # a rebuild is replacing an unusable index file right now
            row = None
        data = read_record(self.blocks_dir, key) if row is not None else None
        if row is None or data is None:
            with self._lock:
                self._stats.misses += 1
            return None
        try:
            _header, payload = decode_record(data, key, row.digest)
        except CorruptRecord as exc:
            log.warning("disk store: block %s is corrupt (%s); dropped", key.hex(), exc)
            self._drop_corrupt(key, row.gen)
            return None
        with self._lock:
            self._stats.hits += 1
            pending = self._record_access(key) if touch else self._touches.get(key, (0, 0, None))[0]
        return DiskRecord(key, row.parent, row.token_ids, payload, row.meta, row.hits + pending)

    def _record_access(self, key: bytes) -> int:
        """Buffer one access (caller holds the lock); returns the accesses buffered for the key."""
        self._tick += 1
        count, last, _prev = self._touches.get(key, (0, 0, None))
        self._touches[key] = (count + 1, self._tick, last if count else None)
        if len(self._touches) >= TOUCH_BUFFER:
            self._flush_touches()
        return count + 1

    def _flush_touches(self) -> None:
        if self._touches:
            self._index.touch_many((k, n, last, prev) for k, (n, last, prev) in self._touches.items())
            self._touches.clear()

    def _drop_corrupt(self, key: bytes, gen: int) -> None:
        with self._lock:
            self._stats.misses += 1
            self._stats.corrupt_reads += 1
            freed = self._index.delete(key, gen)
            if freed:
                self._unlink(key)
                self._stats.records -= 1
                self._stats.bytes_used -= freed

    def contains(self, key: bytes) -> bool:
        self._check_open()
        return self._index.contains(key)

    def keys(self) -> list[bytes]:
        """Every key on disk (e.g. to tell the cache manager what a restart kept)."""
        self._check_open()
        return self._index.keys()

    def touch(self, key: bytes) -> bool:
        """Count a hit served from a copy of the block elsewhere (eviction and warm-up value)."""
        with self._lock:
            self._check_open()
            if not self._index.contains(key):
                return False
            self._record_access(key)
            return True

    def hot_prefixes(self, n: int) -> list[list[int]]:
        """Token ids of up to ``n`` hit chains worth prefilling (most tokens saved first, none a
        prefix of another); only chains whose every block is on disk, from the root, are returned."""
        if n <= 0:
            return []
        with self._lock:
            self._check_open()
            self._flush_touches()
        rows = self._index.rooted_chains()
        chains = select_hot_chains({k: (p, d, h) for k, p, d, h in rows}, n)
        tokens = self._index.tokens_of({k for chain in chains for k in chain})
        return [[t for k in chain for t in tokens.get(k, ())] for chain in chains
                if all(k in tokens for k in chain)]

    def stats(self) -> DiskStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    # -- rebuild and lifecycle ----------------------------------------------------------------

    def rebuild(self, *, verify_payloads: bool = True) -> RebuildReport:
        """Rebuild the index from the record files; bad records are deleted and counted."""
        with self._lock:
            self._check_open()
            if self._rebuilding:
                raise RuntimeError("a rebuild of this disk store is already running")
            self._rebuilding = True
            self._lock.wait_for(lambda: self._inflight == 0)
        try:
            scan = scan_blocks(self.blocks_dir, verify_payloads)  # slow I/O: reads go on meanwhile
            with self._lock:
                return self._install(scan)
        finally:
            with self._lock:
                self._rebuilding = False

    def _install(self, scan: ScanResult) -> RebuildReport:
        recreated = not self._index.open()  # an unusable index file is replaced by an empty one
        self._flush_touches()
        old = self._index.access_stats()
        rows = []
        for h in scan.headers:
            a = old.get(h.key)
            rows.append(IndexRow(h.key, h.parent, h.token_ids, h.meta, h.total_size, h.digest, gen=0,
                                 hits=a.hits if a else 0, last_access=a.last_access if a else 0,
                                 prev_access=a.prev_access if a else 0))
        self._index.replace_all(rows)
        records, size, tick = self._index.totals()
        st = self._stats
        st.records, st.bytes_used = records, size
        self._tick = max(self._tick, tick)
        before = st.evictions
        self._make_room(0)
        st.rebuild_skipped += scan.skipped
        st.rebuilds += 1
        return RebuildReport(st.records, scan.skipped, st.bytes_used, scan.orphans, st.evictions - before,
                             recreated)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"disk store {self.directory} is closed")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._lock.wait_for(lambda: self._inflight == 0)
            self._flush_touches()
            self._closed = True
            self._index.close()
            os.close(self._lock_fd)

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
