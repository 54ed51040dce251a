"""Block pool mechanism: exact block ids, free order, reference counts; KV cache accounting."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache.block_pool import BlockPool, NoFreeBlocks
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV


def test_allocate_takes_head_and_free_appends_to_tail_in_order() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert (a, b) == ([0, 1], [2, 3, 4])
    pool.free([3, 1])
    assert pool.free_block_ids() == [5, 3, 1]
    assert pool.allocate(2) == [5, 3]
    assert pool.num_free == 1 and pool.num_used == 5


def test_no_free_blocks_allocates_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1


def test_shared_block_returns_only_when_last_reference_goes() -> None:
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.incref([blk])
    pool.free([blk])
    assert pool.ref_count(blk) == 1 and blk not in pool.free_block_ids()
    pool.free([blk])
    assert pool.free_block_ids() == [1, 0]
    with pytest.raises(ValueError):
        pool.free([blk])


def _cache(num_blocks: int = 10) -> KVCache:
    return KVCache(CacheSpec(2, 2, 4, 4, torch.float32, torch.device("cpu")), num_blocks)


def test_k_and_v_tables_come_from_one_pool_and_bytes_are_counted_from_it() -> None:
    cache = _cache()
    seq = SeqKV()
    assert cache.blocks_needed(seq, 5) == 4  # 2 K blocks + 2 V blocks
    assert cache.null_block == 0 and cache.num_blocks == 9  # reserved at start, nobody's
    cache.reserve(seq, 5)
    assert (seq.k_blocks, seq.v_blocks) == ([1, 2], [3, 4])
    assert cache.seq_bytes(seq) == 4 * cache.spec.block_bytes == cache.used_bytes
    cache.commit(seq, 5)
    assert cache.blocks_needed(seq, 3) == 0 and cache.blocks_needed(seq, 4) == 2
    cache.free(seq)
    assert cache.num_free == 9 and seq.num_slots == 0 and seq.k_blocks == []


def test_rewrite_keeps_the_planned_slots_and_frees_tail_blocks_in_the_same_call() -> None:
    cache = _cache()
    seq = SeqKV()
    cache.reserve(seq, 12)
    cache.plan_writes([seq], [12], torch.arange(12))
    cache.commit(seq, 12)
    keep = torch.tensor(list(range(4)) + [10, 11])  # sinks and the recent window
    order = keep.expand(2, 2, 6)
    assert cache.rewrite(seq, order, n_key=0) == 2  # 3 -> 2 blocks per table
    assert seq.num_slots == 6 and cache.num_free == 9 - 4
    assert cache.slot_positions(seq)[0, 0].tolist() == [0, 1, 2, 3, 10, 11]
    # The first block's values dropped (KEY_ONLY): its V entry becomes the null block, freed now.
    assert cache.rewrite(seq, torch.arange(6).expand(2, 2, 6), n_key=4) == 1
    assert seq.v_blocks[0] == cache.null_block and cache.held_blocks(seq) == 3


def test_block_bytes_and_budget_sizing() -> None:
    spec = CacheSpec(3, 2, 8, 16, torch.bfloat16, torch.device("cpu"))
    assert spec.block_bytes == 16 * 3 * 2 * (8 * 2 + 4)
    cache = KVCache.from_budget(spec, 10 * spec.block_bytes + 5)
    assert cache.num_blocks == 9  # the null block is the pool's tenth
    with pytest.raises(ValueError, match="maxCacheSize"):
        KVCache.from_budget(spec, 2 * spec.block_bytes)


def test_live_resize_evicts_cached_blocks_first_and_never_takes_held_ones() -> None:
    cache = KVCache(CacheSpec(2, 2, 4, 4, torch.float32, torch.device("cpu")), 11, prefix_salt=b"m")
    running, done = SeqKV(), SeqKV()
    for seq in (running, done):
        cache.reserve(seq, 8)
        cache.plan_writes([seq], [8], torch.arange(8))
        cache.commit(seq, 8)
    cache.register(done, list(range(100, 108)))
    cache.free(done)  # 4 blocks stay cached and evictable
    assert (cache.num_blocks, cache.num_free, len(cache.eviction)) == (10, 6, 2)
    assert cache.resize(5) == 5 and len(cache.eviction) == 0  # free blocks, then the cached ones
    assert cache.num_free == 1 and cache.held_blocks(running) == 4
    with pytest.raises(ValueError, match="running requests hold"):
        cache.resize(3)
    assert cache.resize(10) == 10 and cache.num_free == 6
    assert cache.reclaimable_bytes == 6 * cache.spec.block_bytes
