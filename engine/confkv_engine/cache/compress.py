"""Choosing and compressing KV blocks: the procedures behind ``KVCache.compress_cold`` / ``compress_tables``
and the three phases the background worker runs them in.

A pool block is compressed only when every one of its references is known and rewritten at once
(table entries of the given sequences, and the prefix entry that holds it): its reference count
must equal that number, otherwise someone else (a sequence not listed) still reads it by id and
it is left alone. Compressing a block encodes it (a copy), frees the pool block, then writes the
encoding into an arena slot; the pool block is freed *before* the arena asks for a host, so an
arena's growth is served by the block just freed and compression never evicts a cached entry.

**Three phases, so encoding never holds the engine lock.** ``select_cold`` / ``select_tables`` (under
the lock, between two steps) choose the blocks and snapshot them: a copy of each block and of a K
block's positions, on a side stream after a fence on CUDA (``streams``), so a later step may free or
rewrite the block meanwhile. ``encode_jobs`` (no lock; the expensive part) encodes the snapshots on
the side stream. ``install_jobs`` (under the lock again) swaps the table and prefix entries of every
block that is still what was chosen: the same allocation (``BlockPool.generation``), the same
reference count, the same holders at the same table indices, the same prefix entry. A block freed,
reused, compressed by someone else or shared anew meanwhile is left as it is and its encoding is
discarded (counted in ``CompressResult.discarded``), so a reader never sees another block's codes.

K blocks are compressed only when their slots hold consecutive positions in every (layer, head):
that is true of full blocks of requests without retention and of prefix entries, and it means a
compressed K block needs no position metadata (``KVCache.slot_positions`` regenerates it). A block
holding values the codec refuses (inf, nan, beyond fp16) stays uncompressed.

The way back (``promote_entry``): a prefix hit on an entry whose blocks were compressed while it
was idle decodes them into pool blocks again when admission has blocks to spare, so a hot prefix
that went cold once (a server idle for ``coldAfterSeconds``) is not dequantized in every layer of
every decode step of every request that shares it from then on (measured: 34.9 against 18.8 ms
per token behind a 768-token compressed system prompt). Only a handle the index alone holds is
promoted (no reader sees its table change); with no room it stays compressed and is read through
the codec as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.codec.blocks import encode_rows
from confkv_engine.cache.codec.spec import CodecSpec
from confkv_engine.cache.layout import CompressResult, SeqKV
from confkv_engine.cache.owner import BlockOwner as KVCache
from confkv_engine.cache.prefix import CachedBlock
from confkv_engine.cache.streams import Event, SideStream

Holder = tuple[SeqKV, str, int]  # (a sequence, its table "k" or "v", index in it)


@dataclass
class EncodeJob:
    """One pool block chosen for compression: who references it, its snapshot, then its encoding."""

    kind: str  # "k" or "v"
    block: int
    generation: int  # the pool's allocation of ``block`` when chosen
    holders: list[Holder]
    entry_key: bytes | None  # the prefix entry holding it
    spec: CodecSpec
    side: SideStream = field(default_factory=SideStream)
    data: Tensor | None = None  # snapshot [L, bs, Hkv, D]
    positions: Tensor | None = None  # a K block's snapshot [L, bs, Hkv]
    rows: Tensor | None = None  # the encoding, once made
    first_pos: int | None = None
    done: Event | None = None  # the side stream's event after the snapshot, then after the encode

    @property
    def refs(self) -> int:
        return len(self.holders) + (self.entry_key is not None)


def _specs(cache: KVCache, bits: int, group: int) -> tuple[CodecSpec, CodecSpec]:
    spec = cache.spec
    # Cold int2 blocks take the range fit (KIVI-int2 on the tuning windows: +22.3% -> +9.2% over the
    # full cache on prose, +39.9% -> +23.2% on the repeating text; arena.RANGE_FIT for the tiers').
    return block_codecs(spec.block_size, spec.num_kv_heads, spec.head_dim, bits, group,
                        cache.kv.element_size(), range_fit=True)


def select_cold(cache: KVCache, bits: int, group: int, cold_after: float, limit: int,
                now: float) -> list[EncodeJob]:
    """Phase 1 (under the lock): blocks of evictable prefix entries unused for ``cold_after`` seconds,
    the longest unused first, at most ``limit`` (one over when an entry's second block is the
    last), snapshotted."""
    specs, jobs = _specs(cache, bits, group), []
    while len(jobs) < limit:
        key = cache.pop_cold(now - cold_after)  # oldest first: None when the rest came later
        if key is None:
            break
        entry = cache.prefix.get(key) if cache.prefix is not None else None
        if entry is None:
            continue
        for kind, block in (("k", entry.k_block), ("v", entry.v_block)):
            job = _choose(cache, kind, block, [], key, specs[kind == "v"])
            if job is not None:
                jobs.append(job)
    return _snapshot(cache, jobs)


def select_tables(cache: KVCache, seqs: list[SeqKV], eligible: list[int], bits: int, group: int,
                  limit: int) -> list[EncodeJob]:
    """Phase 1 (under the lock): blocks ``[0, eligible[i])`` of ``seqs[i]`` (K and V tables), at most
    ``limit``, snapshotted (see ``KVCache.compress_tables``)."""
    specs = _specs(cache, bits, group)
    holders: dict[int, list[Holder]] = {}
    entry_keys: dict[int, bytes] = {}  # pool block -> key of the prefix entry holding it
    for s in seqs:
        for kind, table in (("k", s.k_blocks), ("v", s.v_blocks)):
            for i, b in enumerate(table):
                holders.setdefault(b, []).append((s, kind, i))
        for key in s.block_keys:
            entry = cache.prefix.get(key) if cache.prefix is not None else None
            if entry is not None:
                entry_keys[entry.k_block] = entry_keys[entry.v_block] = key
    jobs: list[EncodeJob] = []
    seen: set[int] = set()
    for s, n in zip(seqs, eligible, strict=True):
        for i in range(min(n, len(s.k_blocks))):
            for kind, b in (("k", s.k_blocks[i]), ("v", s.v_blocks[i])):
                if len(jobs) >= limit:
                    return _snapshot(cache, jobs)
                if b in seen:
                    continue
                seen.add(b)
                key = entry_keys.get(b)
                if key is not None and _entry_block(cache, key, kind) != b:
                    key = None
                job = _choose(cache, kind, b, holders.get(b, []), key, specs[kind == "v"])
                if job is not None:
                    jobs.append(job)
    return _snapshot(cache, jobs)


def _entry_block(cache: KVCache, key: bytes, kind: str) -> int | None:
    """The ``kind`` block of the prefix entry ``key`` now; None when the index has no such entry."""
    entry = cache.prefix.get(key) if cache.prefix is not None else None
    if entry is None:
        return None
    return entry.k_block if kind == "k" else entry.v_block


def _choose(cache: KVCache, kind: str, block: int, holders: list[Holder], key: bytes | None,
            spec: CodecSpec) -> EncodeJob | None:
    """A job for ``block`` when compressing it can be done and gains something; else None."""
    job = EncodeJob(kind, block, 0, holders, key, spec)
    if is_compressed(block) or block == cache.null_block or job.refs == 0:
        return None
    if cache.pool.ref_count(block) != job.refs:
        return None
    if spec.nbytes >= cache.store.host_bytes:  # e.g. int8 codes of an fp8 pool: nothing to gain
        return None
    if cache.kv.dtype == torch.int8:  # its blocks are codes already (their scales live beside them)
        return None
    job.generation = cache.pool.generation(block)
    return job


def _snapshot(cache: KVCache, jobs: list[EncodeJob]) -> list[EncodeJob]:
    """Copy every chosen block (and a K block's positions) on a compression stream after a fence;
    the compute stream waits for the copies before it may rewrite the blocks."""
    streams, bs = cache.streams, cache.spec.block_size
    fence = streams.fence()
    for job in jobs:
        job.side = streams.for_compression()
        job.side.wait(fence)
        with job.side.running():
            job.data = cache.kv[:, job.block].clone()
            if job.kind == "k":
                job.positions = cache.pos[:, job.block * bs:(job.block + 1) * bs, :].clone()
        job.done = job.side.record()
        streams.hand_over(job.done)
    return jobs


def encode_jobs(jobs: list[EncodeJob]) -> list[EncodeJob]:
    """Phase 2 (no lock, any thread): encode the snapshots on their side streams. A K block whose
    positions are not consecutive, or a block the codec refuses, gets no encoding."""
    for job in jobs:
        if job.data is None:
            continue
        with job.side.running():
            job.first_pos = _consecutive_start(job.positions) if job.kind == "k" else None
            if job.kind != "k" or job.first_pos is not None:
                try:
                    job.rows = encode_rows(job.data, job.spec)
                except ValueError:
                    job.rows = None
        job.data = job.positions = None
        job.done = job.side.record()
    return jobs


def install_jobs(cache: KVCache, jobs: list[EncodeJob]) -> CompressResult:
    """Phase 3 (under the lock): swap in the encodings of the blocks still as chosen (see the module
    doc); the others are discarded."""
    used, done, discarded = cache.pool.num_used, 0, 0
    for job in jobs:
        if job.rows is None:
            continue
        if not _still_chosen(cache, job):
            discarded += 1
            continue
        cache.streams.hand_over(job.done, job.rows)
        _swap(cache, job)
        done += 1
    result = _result(cache, done, used)
    result.discarded = discarded
    return result


def _still_chosen(cache: KVCache, job: EncodeJob) -> bool:
    b = job.block
    if cache.pool.generation(b) != job.generation or cache.pool.ref_count(b) != job.refs:
        return False
    for seq, kind, i in job.holders:
        table = seq.k_blocks if kind == "k" else seq.v_blocks
        if i >= len(table) or table[i] != b:
            return False
    return job.entry_key is None or _entry_block(cache, job.entry_key, job.kind) == b


def _swap(cache: KVCache, job: EncodeJob) -> None:
    """Free the pool block, store its encoding, point every holder at the new handle."""
    assert job.rows is not None
    cache.free_blocks([job.block] * job.refs)
    handle = cache.store.put(job.rows, job.spec, job.refs, job.first_pos, lambda: cache.take_blocks(1)[0])
    for seq, kind, i in job.holders:
        (seq.k_blocks if kind == "k" else seq.v_blocks)[i] = handle
    key, prefix = job.entry_key, cache.prefix
    entry = prefix.get(key) if key is not None and prefix is not None else None
    if entry is not None:
        updated = replace(entry, k_block=handle) if job.kind == "k" else replace(entry, v_block=handle)
        cache.prefix.replace(updated)
        if entry.key in cache.eviction:  # still evictable: now through its compressed copy
            cache.count_idle_handle(handle)


def compress_now(cache: KVCache, jobs: list[EncodeJob]) -> CompressResult:
    """All three phases at once (the caller holds whatever lock it needs)."""
    return install_jobs(cache, encode_jobs(jobs))


def _consecutive_start(pos: Tensor | None) -> int | None:
    """The first position of a K block whose slots (``pos`` [L, bs, Hkv]) hold ``p, p+1, ...`` in every
    (layer, head), else None."""
    if pos is None:
        return None
    bs = pos.shape[1]
    first = int(pos[0, 0, 0])
    expected = torch.arange(first, first + bs, dtype=pos.dtype, device=pos.device)[None, :, None]
    return first if first >= 0 and bool((pos == expected).all()) else None


def _result(cache: KVCache, blocks: int, used_before: int) -> CompressResult:
    freed = used_before - cache.pool.num_used
    return CompressResult(blocks, freed, freed * cache.spec.block_bytes)


def promote_entry(cache: KVCache, entry: CachedBlock, spare: int) -> tuple[CachedBlock, int]:
    """Decode ``entry``'s compressed blocks back into at most ``spare`` pool blocks (see the module
    doc); returns the entry as the index now holds it and the pool blocks it took."""
    handles = [(kind, b) for kind, b in (("k", entry.k_block), ("v", entry.v_block)) if is_compressed(b)]
    if not handles or len(handles) > spare or cache.prefix is None:
        return entry, 0
    if any(cache.store.ref(h) != 1 for _, h in handles):
        return entry, 0  # a running request reads it through its handle: leave it
    if any(kind == "k" and cache.store.first_pos(h) is None for kind, h in handles):
        return entry, 0
    blocks = {"k": entry.k_block, "v": entry.v_block}
    for (kind, handle), block in zip(handles, cache.take_blocks(len(handles)), strict=True):
        cache.storage.set_block(block, cache.store.decode_block(handle))
        if kind == "k":
            bs, first = cache.spec.block_size, cache.store.first_pos(handle)
            cache.pos[:, block * bs:(block + 1) * bs] = torch.arange(
                first, first + bs, dtype=cache.pos.dtype, device=cache.pos.device)[None, :, None]
        blocks[kind] = block
    cache.free_blocks([h for _, h in handles])
    promoted = replace(entry, k_block=blocks["k"], v_block=blocks["v"])
    cache.prefix.replace(promoted)
    return promoted, len(handles)
