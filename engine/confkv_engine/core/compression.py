"""Compression of KV blocks in the engine: what gets compressed, and the background worker.

**What.** First evictable prefix entries (no request references them) unused for
``coldAfterSeconds``, the longest unused first: compressing them costs no request anything and
keeps more prefixes cached in the same memory. When forced (the agent's remedy, or
``LLMEngine.compress(force=True)``) the age limit is dropped and running requests' full blocks are
compressed too, except the recent window: the last ``KEEP_RECENT_BLOCKS`` blocks of every sequence
(its newest tokens get most of the attention and its last block is still being written). Requests
under a retention policy keep their private blocks as they are (retention rewrites those slots in
place); only their shared prefix region may be compressed.

**Worker.** A daemon thread wakes every ``interval`` seconds and compresses at most
``BLOCKS_PER_PASS`` cold blocks in three phases (``cache.compress``): under the engine's lock it picks
the blocks and snapshots them; it releases the lock and encodes the snapshots (on CUDA on a side
stream ordered after the compute stream by an event, ``cache.streams``; on CPU on the worker thread
itself); it takes the lock again only to swap the table entries of blocks still as they were
picked, and discards the encodings of blocks freed or rewritten meanwhile. So steps run while a
pass encodes, and nothing waits on the device but the phase that needs the result. A forced
``compress`` runs the same phases on the calling thread. A live config change applies to blocks
compressed from then on (compressed blocks keep the codec they were written with).

**Control.** ``CompressionControl`` is the one owner of the live settings and the worker: the
engine holds one and delegates its control-plane calls to it. The worker exists once the server
has started it (``start``); a live ``enabled`` change then starts or stops its thread. An engine
driven in-process (tests, benchmarks) compresses only when asked (``compress``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from confkv_api.config import CompressionSection
from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.compress import EncodeJob, encode_jobs, install_jobs, select_cold, select_tables
from confkv_engine.cache.kv_cache import CompressResult, KVCache, SeqKV
from confkv_engine.core.control_api import PolicyRejected
from confkv_engine.core.sampling_params import InvalidRequest
from confkv_engine.core.threads import serial_torch_ops

log = logging.getLogger(__name__)

KEEP_RECENT_BLOCKS = 2
BLOCKS_PER_PASS = 8
WAKE_SECONDS = 1.0


class HoldsBlocks(Protocol):
    """What compression needs of a running sequence (``core.sequence.Sequence``)."""

    kv: SeqKV
    prefix_len: int
    retention: object | None


def eligible_blocks(seq: HoldsBlocks, block_size: int) -> int:
    """Leading blocks of a running sequence that forced compression may take (see the module doc)."""
    written = -(-seq.kv.num_slots // block_size)
    n = max(0, written - KEEP_RECENT_BLOCKS)
    if seq.retention is not None:
        n = min(n, seq.prefix_len // block_size)
    return n


def select_blocks(cache: KVCache, running: list[HoldsBlocks], bits: int, group: int, cold_after: float,
                  force: bool, limit: int) -> list[EncodeJob]:
    """The first phase (under the lock): cold evictable entries first, then (``force``) the running
    sequences' eligible blocks, chosen and snapshotted."""
    jobs = select_cold(cache, bits, group, 0.0 if force else cold_after, limit, time.monotonic())
    if force and len(jobs) < limit:
        bs = cache.spec.block_size
        jobs += select_tables(cache, [s.kv for s in running], [eligible_blocks(s, bs) for s in running],
                              bits, group, limit - len(jobs))
    return jobs


def compress_blocks(cache: KVCache, running: list[HoldsBlocks], bits: int, group: int,
                    cold_after: float, force: bool, limit: int) -> CompressResult:
    """All three phases at once, for a caller that holds the lock throughout (benchmarks)."""
    jobs = select_blocks(cache, running, bits, group, cold_after, force, limit)
    return install_jobs(cache, encode_jobs(jobs))


def compress_off_lock(lock: threading.RLock, cache: KVCache,
                      select: Callable[[], list[EncodeJob]]) -> CompressResult:
    """``select`` under ``lock``, encode without it, install under it again (see the module doc)."""
    with lock, torch.inference_mode():
        jobs = select()
    with torch.inference_mode():
        encode_jobs(jobs)
    with lock, torch.inference_mode():
        return install_jobs(cache, jobs)


class CompressionWorker:
    """Calls ``run_pass`` every ``interval`` seconds on a daemon thread until ``stop``."""

    def __init__(self, run_pass: Callable[[], CompressResult], interval: float = WAKE_SECONDS) -> None:
        self._run_pass = run_pass
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.passes = 0
        self.total = CompressResult()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="kv-compression", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the thread to finish and wait for it (a pass in progress completes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        serial_torch_ops()  # a long-lived thread: it must not keep a second OpenMP pool (core.threads)
        while not self._stop.wait(self.interval):
            try:
                self.total.add(self._run_pass())
            except Exception:  # a failed pass must not kill serving; the next pass retries
                log.exception("KV compression pass failed")
            self.passes += 1


class CompressionControl:
    """The engine's live compression settings and its background worker (see the module doc)."""

    def __init__(self, cache: KVCache, lock: threading.RLock, config: CompressionSection) -> None:
        self.cache = cache
        self.config = config
        self._lock = lock  # the engine's step lock: a pass lands between two steps
        self._worker: CompressionWorker | None = None

    @property
    def running(self) -> bool:
        """Whether the background thread is alive."""
        return self._worker is not None and self._worker.running

    def compress(self, running: list[HoldsBlocks], bits: int | None, force: bool) -> CompressResult:
        """Compress now with ``bits`` (default: the config's); see ``LLMEngine.compress``."""
        cfg = self.config
        bits = cfg.bits if bits is None else bits
        if bits not in (8, 4):
            raise InvalidRequest(f"compression bits must be 8 or 4, got {bits}", param="bits")
        limit = self.cache.pool.num_blocks * 2
        return compress_off_lock(self._lock, self.cache, lambda: select_blocks(
            self.cache, running, bits, cfg.group_size, cfg.cold_after_seconds, force, limit))

    def start(self) -> None:
        """Create the worker; its thread runs while the config says ``enabled``."""
        if self._worker is None:
            self._worker = CompressionWorker(self._pass)
        if self.config.enabled:
            self._worker.start()

    def stop(self) -> None:
        """Stop the worker and wait for it (a pass in progress completes first)."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def checked(self, cfg: CompressionSection) -> CompressionSection:
        """``cfg`` if this cache's codec can take it, else ``PolicyRejected`` (nothing changed)."""
        spec = self.cache.spec
        try:
            block_codecs(spec.block_size, spec.num_kv_heads, spec.head_dim, cfg.bits, cfg.group_size)
        except ValueError as err:
            raise PolicyRejected(f"invalid policy: {err}") from None
        return cfg

    def set(self, cfg: CompressionSection) -> None:
        """Live settings (checked by ``checked``); a started worker follows ``enabled``."""
        self.config = cfg
        if self._worker is not None:
            if cfg.enabled:
                self._worker.start()
            else:
                self._worker.stop()

    def _pass(self) -> CompressResult:
        cfg = self.config
        return compress_off_lock(self._lock, self.cache, lambda: select_cold(
            self.cache, cfg.bits, cfg.group_size, cfg.cold_after_seconds, BLOCKS_PER_PASS, time.monotonic()))
