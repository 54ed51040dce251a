"""Compression's three phases (``cache.compress``: pick and snapshot, encode, swap) on a CPU pool: the
swap takes only blocks that are still the allocation that was picked. A sequence preempted and
recomputed while its blocks were encoded gets the same block ids at the same table indices with
new contents: only the pool's allocation count (``BlockPool.generation``) tells them apart."""

from __future__ import annotations

import torch

from confkv_engine.cache.compress import encode_jobs, install_jobs, select_cold, select_tables
from confkv_engine.cache.kv_cache import SeqKV
from tests.unit.test_cache_compression import BS, blocks_of, cached_chain, fill, make_cache, reference


def test_a_recomputed_sequence_is_not_swapped_in_and_keeps_its_new_contents() -> None:
    cache = make_cache(9)  # 8 usable blocks: a recompute gets the same ones back
    a = SeqKV()
    fill(cache, a, 4 * BS, seed=1)
    jobs = select_tables(cache, [a], [2], 8, 64, limit=100)
    assert sorted(j.block for j in jobs) == [1, 2, 5, 6]
    cache.free(a)  # a preemption, then the replay (other contents: another seed)
    fill(cache, a, 4 * BS, seed=2)
    assert (a.k_blocks, a.v_blocks) == ([1, 2, 3, 4], [5, 6, 7, 8])  # same ids, same indices
    now_k, now_v = blocks_of(cache, a.k_blocks), blocks_of(cache, a.v_blocks)
    result = install_jobs(cache, encode_jobs(jobs))
    assert (result.blocks, result.discarded) == (0, 4) and len(cache.store) == 0
    assert torch.equal(blocks_of(cache, a.k_blocks), now_k)
    assert torch.equal(blocks_of(cache, a.v_blocks), now_v)
    assert [cache.pool.generation(b) for b in (1, 2, 5, 6)] == [2, 2, 2, 2]


def test_blocks_still_as_picked_are_swapped_in_beside_discarded_ones() -> None:
    cache = make_cache(20)
    a, b = SeqKV(), SeqKV()
    fill(cache, a, 3 * BS, seed=1)
    fill(cache, b, 3 * BS, seed=2)
    original = blocks_of(cache, b.k_blocks[:2]), blocks_of(cache, b.v_blocks[:2])
    jobs = select_tables(cache, [a, b], [2, 2], 8, 64, limit=100)
    assert len(jobs) == 8
    cache.free(a)  # gone while encoded: its four encodings are dropped
    result = install_jobs(cache, encode_jobs(jobs))
    assert (result.blocks, result.discarded) == (4, 4)
    assert all(h < 0 for h in b.k_blocks[:2] + b.v_blocks[:2])
    ref_k, ref_v = reference(cache, torch.stack(original), 8)
    assert torch.equal(blocks_of(cache, b.k_blocks[:2]), ref_k)
    assert torch.equal(blocks_of(cache, b.v_blocks[:2]), ref_v)


def test_a_cold_entry_hit_while_encoded_is_swapped_for_its_new_reader_too() -> None:
    """An entry shared by a new request after it was picked has one more reference than counted:
    its encoding is discarded (the reader keeps the pool blocks it attached)."""
    cache = make_cache(12, prefix=True)
    tokens, _ = cached_chain(cache, 2)
    jobs = select_cold(cache, 8, 64, cold_after=0.0, limit=10, now=float("inf"))
    assert len(jobs) == 4
    reader = SeqKV()
    cache.attach(reader, cache.match(tokens, 2), 0)
    result = install_jobs(cache, encode_jobs(jobs))
    assert (result.blocks, result.discarded) == (0, 4)
    assert all(blk >= 0 for blk in reader.k_blocks + reader.v_blocks)
