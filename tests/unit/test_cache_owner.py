"""The cache core as the one owner of its blocks: admission's one question (``KVCache.lookup`` and its
``PrefixHit``), the one way blocks come (``take_blocks``, evicting cached ones when the free queue
runs short) and references go (``free_blocks``: positions cleared only when the last one goes)."""

from __future__ import annotations

import torch

from confkv_engine.cache.kv_cache import KVCache
from tests.unit.test_prefix_cache import BS, HOT, SPEC, admit, make_cache, serve


def test_lookup_answers_admission_in_one_result() -> None:
    cache = make_cache(11)
    serve(cache, HOT + [1])  # HOT's two blocks are cached and evictable now
    hit = cache.lookup(HOT + [2], (len(HOT + [2]) - 1) // BS)
    assert [e.key for e in hit.blocks] == [e.key for e in cache.match(HOT + [2], 2)]
    assert hit.tokens == 2 * BS and hit.load is None  # no disk store: nothing to read back
    assert hit.reclaimable_taken == cache.evictable_among(hit.blocks) == 4  # two K/V pairs
    miss = cache.lookup([9] * (3 * BS), 2)
    assert (miss.blocks, miss.tokens, miss.reclaimable_taken) == ([], 0, 0)


def test_lookup_without_a_prefix_cache_finds_nothing() -> None:
    off = KVCache(SPEC, 9)
    assert not off.prefix_enabled
    hit = off.lookup(HOT + [1], 2)
    assert (hit.blocks, hit.tokens, hit.reclaimable_taken, hit.load) == ([], 0, 0, None)


def test_free_blocks_clears_positions_only_when_the_last_reference_goes() -> None:
    cache = make_cache(11)
    a = admit(cache, HOT + [1])  # its two full blocks are registered: index + sequence hold them
    first = a.k_blocks[0]
    slots = torch.arange(first * BS, (first + 1) * BS)
    assert cache.pool.ref_count(first) == 2 and bool((cache.pos[:, slots] >= 0).all())
    cache.free_blocks([first])  # one of two references: still cached, positions kept
    assert cache.pool.ref_count(first) == 1 and bool((cache.pos[:, slots] >= 0).all())
    cache.free_blocks([first])  # the last one: back to the free queue, slots empty
    assert cache.pool.ref_count(first) == 0 and bool((cache.pos[:, slots] == -1).all())


def test_take_blocks_evicts_cached_blocks_when_the_free_queue_runs_short() -> None:
    cache = make_cache(7)  # 6 usable blocks
    serve(cache, HOT + [1])  # two cached pairs, evictable: 4 blocks
    assert cache.pool.num_free == 2 and cache.num_free == 6
    taken = cache.take_blocks(6)
    assert len(set(taken)) == 6 and len(cache.prefix) == 0 and cache.num_free == 0
    cache.free_blocks(taken)
    assert cache.num_free == 6
