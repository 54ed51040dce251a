"""Live size changes of ``KVCache`` with exact block ids: raising ``maxCacheSize`` past the pool
allocated at start grows it (new ids at the tail of the free queue, after nothing else moved) and
keeps tables, prefix entries, compressed arena content and LRU-K history; a pool the memory limit
cannot hold is refused and nothing changes; retired blocks come back after the new ones."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache.kv_cache import KVCache, SeqKV
from tests.unit.test_prefix_cache import BS, HOT, SPEC, admit, keys_of, make_cache, serve


def read(cache: KVCache, seq: SeqKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's K and V in every layer, read through its tables (compressed blocks decoded)."""
    layers = range(SPEC.num_layers)
    k = torch.stack([cache.read_table(seq.k_blocks, layer, seq.num_slots) for layer in layers])
    v = torch.stack([cache.read_table(seq.v_blocks, layer, seq.num_slots) for layer in layers])
    return k, v


def snapshot(cache: KVCache, seqs: list[SeqKV]) -> tuple:
    entries = {e.key: (e.k_block, e.v_block) for e in cache.prefix.entries()}
    history = {key: cache.eviction.history(key) for key in entries}
    refs = [cache.store.ref(b) for s in seqs for b in s.k_blocks + s.v_blocks]
    return entries, history, refs, cache.eviction.evictable(), [(s.k_blocks[:], s.v_blocks[:]) for s in seqs]


def test_raising_the_size_grows_the_pool_and_every_id_stays_valid() -> None:
    cache = make_cache(13)  # block 0 is the null block; 1..12 are handed out
    serve(cache, HOT + [1])  # HOT's two blocks stay cached
    assert cache.compress_cold(8, 2, cold_after=0.0, limit=10).blocks == 4  # into arenas in the pool
    assert [a.hosts for a in cache.store.arenas.values()] == [[7, 9], [8, 10]]
    running = admit(cache, HOT + [2])  # shares the compressed entries, computes one block
    other = admit(cache, [300, 301, 302, 303, 304])
    assert (running.k_blocks, running.v_blocks) == ([-3, -1, 11], [-4, -2, 12])
    assert (other.k_blocks, other.v_blocks) == ([3, 6], [2, 5])
    before, content = snapshot(cache, [running, other]), [read(cache, s) for s in (running, other)]
    kv_before = cache.kv
    assert cache.pool.free_block_ids() == [1, 4] and cache.num_blocks == 12

    assert cache.resize(16) == 16
    assert cache.pool.num_blocks == 17 and cache.kv is not kv_before and cache.kv.shape[1] == 17
    assert cache.pos.shape[1] == 17 * BS and cache.kv_flat.shape[1] == 17 * BS
    assert cache.pool.free_block_ids() == [1, 4, 13, 14, 15, 16]  # new ids last, nothing moved
    assert snapshot(cache, [running, other]) == before
    assert [a.hosts for a in cache.store.arenas.values()] == [[7, 9], [8, 10]]
    for seq, (k, v) in zip((running, other), content, strict=True):
        got_k, got_v = read(cache, seq)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert torch.equal(cache.slot_positions(running)[0, 0], torch.arange(9, dtype=torch.int32))

    # The prefix survives: a new request hits it and reads HOT's tokens through the grown pool.
    hit = admit(cache, HOT + [3])
    assert (hit.k_blocks, hit.v_blocks) == ([-3, -1, 1], [-4, -2, 4]) and cache.hits.hit == 16
    hit_keys = read(cache, hit)[0]
    assert torch.equal(hit_keys[:, :8], content[0][0][:, :8])  # int8: HOT's tokens, up to rounding
    assert [round(x) for x in hit_keys[0, :8, 0, 0].tolist()] == HOT
    grown = SeqKV()
    cache.reserve(grown, 2 * BS)  # the new blocks are usable
    assert (grown.k_blocks, grown.v_blocks) == ([13, 14], [15, 16])
    cache.plan_writes([grown], [2 * BS], torch.arange(2 * BS))
    assert cache.pos[0, 13 * BS:15 * BS, 0].tolist() == list(range(2 * BS))  # K blocks 13, 14


def test_a_pool_beyond_the_memory_limit_is_refused_and_nothing_changes() -> None:
    cache = make_cache(9)
    seq = admit(cache, HOT + [1])
    kv, free = cache.kv, cache.pool.free_block_ids()
    with pytest.raises(ValueError, match=f"a pool of {41 * SPEC.block_bytes} bytes .* at most "
                                         f"{20 * SPEC.block_bytes} bytes"):
        cache.resize(40, memory_limit=20 * SPEC.block_bytes)
    assert cache.kv is kv and cache.pool.num_blocks == 9 and cache.pool.free_block_ids() == free
    assert cache.resize(19, memory_limit=20 * SPEC.block_bytes) == 19  # 20 blocks with the null one
    assert cache.held_blocks(seq) == 6


def test_retired_blocks_come_back_after_the_new_ones() -> None:
    cache = make_cache(9)
    assert cache.resize(4) == 4 and cache.retired == [1, 2, 3, 4]  # taken from the free queue's head
    assert cache.total_bytes == 5 * SPEC.block_bytes  # the size in effect, the null block included
    assert cache.resize(10) == 10 and cache.retired == []
    assert cache.pool.free_block_ids() == [5, 6, 7, 8, 9, 10, 1, 2, 3, 4]
    assert cache.total_bytes == 11 * SPEC.block_bytes == cache.allocated_bytes


def test_growing_keeps_the_lru_k_order_of_cached_blocks() -> None:
    cache = make_cache(13)
    serve(cache, HOT + [1])
    serve(cache, HOT + [2])  # HOT referenced twice
    serve(cache, [400 + i for i in range(9)])  # two one-shot blocks
    order = cache.eviction.evictable()
    assert order[-2:] == list(reversed(keys_of(cache, HOT)))  # the twice-used prefix goes last
    cache.resize(20)
    assert cache.eviction.evictable() == order
