"""Choosing and compressing KV blocks: the procedures behind ``KVCache.compress_cold`` / ``compress_tables``.

A pool block is compressed only when every one of its references is known and rewritten at once
(table entries of the given sequences, and the prefix entry that holds it): its reference count
must equal that number, otherwise someone else (a sequence not listed) still reads it by id and
it is left alone. Compressing a block encodes it (a copy), frees the pool block, then writes the
encoding into an arena slot; the pool block is freed *before* the arena asks for a host, so an
arena's growth is served by the block just freed and compression never evicts a cached entry.

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

from dataclasses import replace

import torch

from confkv_engine.cache.arena import block_codecs
from confkv_engine.cache.block_pool import is_compressed
from confkv_engine.cache.codec.blocks import encode_rows
from confkv_engine.cache.codec.spec import CodecSpec
from confkv_engine.cache.layout import CompressResult, SeqKV
from confkv_engine.cache.owner import BlockOwner as KVCache
from confkv_engine.cache.prefix import CachedBlock

Holder = tuple[list[int], int]  # (a block table, index in it)


def _specs(cache: KVCache, bits: int, group: int) -> tuple[CodecSpec, CodecSpec]:
    spec = cache.spec
    return block_codecs(spec.block_size, spec.num_kv_heads, spec.head_dim, bits, group,
                        cache.kv.element_size())


def compress_cold_entries(cache: KVCache, bits: int, group: int, cold_after: float,
                          limit: int, now: float) -> CompressResult:
    specs, used = _specs(cache, bits, group), cache.pool.num_used
    done = 0
    while done < limit:
        key = cache.pop_cold(now - cold_after)  # oldest first: None when the rest came later
        if key is None:
            break
        entry = cache.prefix.get(key) if cache.prefix is not None else None
        if entry is None:
            continue
        for kind in ("k", "v"):
            entry = cache.prefix.get(key)
            block = entry.k_block if kind == "k" else entry.v_block
            done += compress_block(cache, kind, block, [], entry, specs[kind == "v"])
    return _result(cache, done, used)


def compress_seq_blocks(cache: KVCache, seqs: list[SeqKV], eligible: list[int], bits: int,
                        group: int, limit: int) -> CompressResult:
    specs, used = _specs(cache, bits, group), cache.pool.num_used
    holders: dict[int, list[Holder]] = {}
    entry_keys: dict[int, bytes] = {}  # pool block -> key of the prefix entry holding it
    for s in seqs:
        for table in (s.k_blocks, s.v_blocks):
            for i, b in enumerate(table):
                holders.setdefault(b, []).append((table, i))
        for key in s.block_keys:
            entry = cache.prefix.get(key) if cache.prefix is not None else None
            if entry is not None:
                entry_keys[entry.k_block] = entry_keys[entry.v_block] = key
    done = 0
    for s, n in zip(seqs, eligible, strict=True):
        for i in range(min(n, len(s.k_blocks))):
            for kind, table in (("k", s.k_blocks), ("v", s.v_blocks)):
                if done >= limit:
                    return _result(cache, done, used)
                b = table[i]
                key = entry_keys.get(b)
                entry = cache.prefix.get(key) if key is not None and cache.prefix is not None else None
                if entry is not None and b != (entry.k_block if kind == "k" else entry.v_block):
                    entry = None
                done += compress_block(cache, kind, b, holders.get(b, []), entry, specs[kind == "v"])
    return _result(cache, done, used)


def compress_block(cache: KVCache, kind: str, block: int, holders: list[Holder],
                   entry: CachedBlock | None, spec: CodecSpec) -> int:
    """Compress pool block ``block`` (``kind`` "k" or "v"), referenced by ``holders`` and ``entry`` (its
    prefix entry, if any); returns 1 when it was compressed, 0 when it is left as it is."""
    refs = len(holders) + (entry is not None)
    if is_compressed(block) or block == cache.null_block or refs == 0 or cache.pool.ref_count(block) != refs:
        return 0
    if spec.nbytes >= cache.store.host_bytes:  # e.g. int8 codes of an fp8 pool: nothing to gain
        return 0
    if cache.kv.dtype == torch.int8:  # its blocks are codes already (their scales live beside them)
        return 0
    first_pos = _consecutive_start(cache, block) if kind == "k" else None
    if kind == "k" and first_pos is None:
        return 0
    try:
        rows = encode_rows(cache.kv[:, block], spec)  # a copy: the pool block may be reused below
    except ValueError:
        return 0
    cache.free_blocks([block] * refs)
    handle = cache.store.put(rows, spec, refs, first_pos, lambda: cache.take_blocks(1)[0])
    for table, i in holders:
        table[i] = handle
    if entry is not None:
        updated = replace(entry, k_block=handle) if kind == "k" else replace(entry, v_block=handle)
        cache.prefix.replace(updated)
        if entry.key in cache.eviction:  # still evictable: now through its compressed copy
            cache.count_idle_handle(handle)
    return 1


def _consecutive_start(cache: KVCache, block: int) -> int | None:
    """The first position of a block whose slots hold ``p, p+1, ...`` in every (layer, head), else None."""
    bs = cache.spec.block_size
    pos = cache.pos[:, block * bs:(block + 1) * bs, :]
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
