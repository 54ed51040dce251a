"""Prefix cache of ``KVCache`` without a model: exact block ids and reference counts, K/V pairs,
LRU-K eviction order when the pool runs short, live K changes, hash collisions, immutability of
shared blocks, and the hit counter's window.

Every request is served the way the scheduler and the engine do it: ``match`` (never the last
prompt token) -> ``attach`` -> ``reserve`` -> write the new slots -> ``commit`` -> ``register`` ->
``free``. A slot's K holds its token id and its V minus the token id, so a hit can be checked to
hand out exactly the request's own tokens.
"""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache import prefix as prefix_module
from confkv_engine.cache import prefix_cache as prefix_cache_module
from confkv_engine.cache.block_pool import NoFreeBlocks
from confkv_engine.cache.kv_cache import CacheSpec, EvictionSink, KVCache, SeqKV
from confkv_engine.cache.prefix import HitCounter

BS = 4
SPEC = CacheSpec(num_layers=2, num_kv_heads=1, head_dim=2, block_size=BS, dtype=torch.float32,
                 device=torch.device("cpu"))


def make_cache(num_blocks: int, k: int = 2, sink: EvictionSink | None = None) -> KVCache:
    return KVCache(SPEC, num_blocks, prefix_salt=b"test-model", eviction_k=k, sink=sink)


def write(cache: KVCache, seq: SeqKV, tokens: list[int]) -> None:
    """Append ``tokens`` after the sequence's slots: K = token id, V = -token id, then commit."""
    start = seq.num_slots
    cache.reserve(seq, len(tokens))
    plan = cache.plan_writes([seq], [len(tokens)], torch.arange(start, start + len(tokens)))
    values = torch.tensor(tokens, dtype=torch.float32)[None, :, None, None]
    cache.kv_flat[:, plan.k_index] = values
    cache.kv_flat[:, plan.v_index] = -values
    cache.commit(seq, len(tokens))


def compute(cache: KVCache, tokens: list[int]) -> tuple[SeqKV, int]:
    """Share the longest cached prefix (never the last token) and compute the rest; returns the
    sequence and the tokens it shared."""
    seq = SeqKV()
    start = cache.attach(seq, cache.match(tokens, (len(tokens) - 1) // BS), len(tokens))
    write(cache, seq, tokens[start:])
    return seq, start


def admit(cache: KVCache, tokens: list[int]) -> SeqKV:
    """``compute``, then register the sequence's full blocks (a request without retention)."""
    seq, _ = compute(cache, tokens)
    cache.register(seq, tokens)
    return seq


def serve(cache: KVCache, tokens: list[int]) -> int:
    """One whole request; returns the prompt tokens served from the cache."""
    seq, hit = compute(cache, tokens)
    cache.register(seq, tokens)
    cache.free(seq)
    return hit


def contents(cache: KVCache, seq: SeqKV) -> tuple[list[int], list[int]]:
    """(K, V) of the sequence's slots as token ids, read through its block tables (layer 0)."""
    slots = torch.arange(seq.num_slots)
    k = cache.kv_flat[0, cache.slot_index(seq.k_blocks, slots), 0, 0]
    v = cache.kv_flat[0, cache.slot_index(seq.v_blocks, slots), 0, 0]
    return [int(x) for x in k], [int(-x) for x in v]


def spy_victims(cache: KVCache) -> list[bytes]:
    """Record every key the eviction policy hands out as a victim."""
    victims: list[bytes] = []
    choose = cache.eviction.victim

    def victim() -> bytes | None:
        key = choose()
        if key is not None:
            victims.append(key)  # type: ignore[arg-type]
        return key  # type: ignore[return-value]

    cache.eviction.victim = victim  # type: ignore[method-assign]
    return victims


def keys_of(cache: KVCache, tokens: list[int]) -> list[bytes]:
    return prefix_module.chain_keys(tokens, BS, cache.prefix.salt)


HOT = list(range(100, 108))  # two full blocks shared by every "hot" request


def test_exact_block_ids_and_refcounts_through_register_match_attach_free() -> None:
    cache = make_cache(9)  # block 0 is the null block; 1..8 are handed out
    assert cache.null_block == 0 and cache.num_blocks == 8
    ref = cache.pool.ref_count

    a = SeqKV()
    assert cache.attach(a, cache.match(HOT + [1], 2), 9) == 0
    write(cache, a, HOT + [1])
    assert (a.k_blocks, a.v_blocks) == ([1, 2, 3], [4, 5, 6])
    assert cache.register(a, HOT + [1]) == 2  # the partial third block is not registered
    assert [ref(b) for b in range(1, 9)] == [2, 2, 1, 2, 2, 1, 0, 0]
    assert cache.num_cached_blocks == 4 and len(cache.eviction) == 0
    cache.free(a)
    assert [ref(b) for b in range(1, 9)] == [1, 1, 0, 1, 1, 0, 0, 0]
    assert cache.pool.free_block_ids() == [7, 8, 3, 6]
    k0, k1 = keys_of(cache, HOT)
    assert cache.eviction.evictable() == [k1, k0]  # the chain's tail goes first
    assert cache.num_free == 4 + 4 and cache.used_bytes == 4 * SPEC.block_bytes

    b = SeqKV()
    hits = cache.match(HOT + [2], 2)
    assert [(e.k_block, e.v_block) for e in hits] == [(1, 4), (2, 5)]
    assert cache.evictable_among(hits) == 4
    assert cache.attach(b, hits, 9) == 8
    assert [ref(x) for x in (1, 2, 4, 5)] == [2, 2, 2, 2] and len(cache.eviction) == 0
    write(cache, b, [2])
    assert (b.k_blocks, b.v_blocks) == ([1, 2, 7], [4, 5, 8])
    assert contents(cache, b) == (HOT + [2], HOT + [2])
    assert cache.register(b, HOT + [2]) == 0 and b.block_keys == [k0, k1]
    cache.free(b)
    assert [ref(x) for x in range(1, 9)] == [1, 1, 0, 1, 1, 0, 0, 0]
    assert cache.pool.free_block_ids() == [3, 6, 7, 8]
    assert cache.eviction.evictable() == [k1, k0] and cache.hits.hit == 8 and cache.hits.queried == 18


def test_two_sharers_release_the_entry_only_when_the_last_one_frees() -> None:
    cache = make_cache(13)
    serve(cache, HOT + [1])
    b, c = admit(cache, HOT + [2]), admit(cache, HOT + [3])
    assert b.k_blocks[:2] == c.k_blocks[:2] and cache.pool.ref_count(b.k_blocks[0]) == 3
    cache.free(b)
    assert len(cache.eviction) == 0 and cache.pool.ref_count(c.k_blocks[0]) == 2
    cache.free(c)
    assert len(cache.eviction) == 2 and cache.num_free == cache.num_blocks


def test_an_entry_is_evicted_with_its_k_and_v_block_together() -> None:
    cache = make_cache(9)  # 8 usable blocks
    serve(cache, HOT + [1])  # entries (k1, v4), (k2, v5); free list 7, 8, 3, 6
    victims = spy_victims(cache)
    k0, k1 = keys_of(cache, HOT)
    seq = SeqKV()
    cache.reserve(seq, 6 * BS // 2 + 1)  # 4 blocks per table = 8 blocks: 4 free, 4 evicted
    assert victims == [k1, k0] and len(cache.prefix) == 0
    assert sorted(seq.k_blocks + seq.v_blocks) == list(range(1, 9))
    # The pairs went back together, tail entry first: (2, 5) then (1, 4).
    assert seq.k_blocks + seq.v_blocks == [7, 8, 3, 6, 2, 5, 1, 4]
    evicted_k_slots = [b * BS + i for b in (1, 2) for i in range(BS)]
    assert bool((cache.pos[:, evicted_k_slots] == -1).all())  # evicted K blocks hold no positions


def test_only_the_pair_needed_is_evicted_and_the_rest_stays_cached() -> None:
    cache = make_cache(9)
    serve(cache, HOT + [1])
    victims = spy_victims(cache)
    k0, k1 = keys_of(cache, HOT)
    seq = SeqKV()
    cache.reserve(seq, 3 * BS)  # 6 blocks: 4 free + one evicted pair
    cache.commit(seq, 3 * BS)
    assert victims == [k1] and len(cache.prefix) == 1 and k0 in cache.prefix
    assert 2 in seq.k_blocks + seq.v_blocks and 5 in seq.k_blocks + seq.v_blocks
    assert cache.pool.ref_count(1) == cache.pool.ref_count(4) == 1
    with pytest.raises(NoFreeBlocks):
        cache.reserve(seq, 2 * BS)  # 4 more blocks; 2 are left (the last cached pair)
    assert len(cache.prefix) == 1  # a failed reservation evicts nothing


def test_pinned_blocks_are_never_evicted() -> None:
    cache = make_cache(9)
    serve(cache, HOT + [1])
    b = admit(cache, HOT + [2])  # holds both entries and 2 private blocks
    assert cache.num_free == 2  # blocks 3 and 6; nothing is evictable while b holds the entries
    with pytest.raises(NoFreeBlocks):
        cache.reserve(SeqKV(), 3 * BS)
    assert len(cache.prefix) == 2 and contents(cache, b) == (HOT + [2], HOT + [2])


def scan_trace() -> tuple[list[list[int]], list[int]]:
    """Requests of 9 tokens (2 full blocks + 1): a hot prefix twice, two one-off scans, then the
    hot prefix again. Returns (trace, hot)."""
    scan1, scan2 = list(range(200, 208)), list(range(300, 308))
    return [HOT + [1], HOT + [2], scan1 + [3], scan2 + [4], HOT + [5]], HOT


@pytest.mark.parametrize(("k", "victim_prefix", "final_hit"), [(1, "hot", 0), (2, "scan1", 8)])
def test_a_scan_flushes_the_hot_prefix_under_lru_but_not_under_lru2(
        k: int, victim_prefix: str, final_hit: int) -> None:
    # 10 usable blocks: two cached entries (4 blocks) + one request (6) fit; the second scan
    # needs 6 with only 2 free, so exactly two entries (one request's chain) are evicted.
    cache = make_cache(11, k=k)
    trace, hot = scan_trace()
    victims = spy_victims(cache)
    hits = [serve(cache, t) for t in trace[:4]]
    assert hits == [0, 8, 0, 0]
    expected = {"hot": keys_of(cache, hot), "scan1": keys_of(cache, trace[2][:8])}[victim_prefix]
    assert victims == expected[::-1]  # the chain's tail first, then its head
    assert serve(cache, trace[4]) == final_hit
    assert cache.hits.hit == 8 + final_hit and cache.hits.queried == 45


def test_lru2_orders_by_the_second_most_recent_reference() -> None:
    # a: referenced at ticks 1, 2; b: at 3, 4; c: at 5 only. LRU evicts a (oldest last reference);
    # LRU-2 evicts c (one reference), then a (older second reference), then b.
    a, b, c = [list(range(s, s + 4)) + [0] for s in (10, 20, 30)]
    orders = {}
    for k in (1, 2):
        cache = make_cache(30, k=k)
        for t in (a, a, b, b, c):
            serve(cache, t)
        orders[k] = cache.eviction.evictable()
        assert len(cache.prefix) == 3
    ka, kb, kc = (keys_of(cache, t)[0] for t in (a, b, c))
    assert orders[1] == [ka, kb, kc] and orders[2] == [kc, ka, kb]


def test_set_eviction_k_live_keeps_every_cached_block_and_its_history() -> None:
    cache = make_cache(11, k=1)
    trace, hot = scan_trace()
    for t in trace[:3]:
        serve(cache, t)
    hot_keys, scan_keys = keys_of(cache, hot), keys_of(cache, trace[2][:8])
    before = {key: cache.prefix.get(key) for key in hot_keys + scan_keys}
    assert cache.eviction.evictable() == hot_keys[::-1] + scan_keys[::-1]  # LRU: hot is older
    cache.set_eviction_k(2)
    assert {key: cache.prefix.get(key) for key in before} == before and cache.num_cached_blocks == 8
    # The hot prefix's two references from before the change count at once under LRU-2.
    assert cache.eviction.evictable() == scan_keys[::-1] + hot_keys[::-1]
    victims = spy_victims(cache)
    serve(cache, trace[3])
    assert victims == scan_keys[::-1]
    assert serve(cache, trace[4]) == 8
    with pytest.raises(ValueError, match="k must be between"):
        cache.set_eviction_k(0)


def test_a_hash_collision_never_serves_another_prefix(monkeypatch) -> None:
    def colliding(parent: bytes | None, salt: bytes, tokens: tuple[int, ...]) -> bytes:
        return b"\x00" * 16  # every block of every prefix has the same key

    monkeypatch.setattr(prefix_module, "block_key", colliding)
    monkeypatch.setattr(prefix_cache_module, "block_key", colliding)
    cache = make_cache(20)
    first = [7, 7, 7, 7, 1, 2, 3, 4, 9]
    assert serve(cache, first) == 0
    assert len(cache.prefix) == 1  # the second block's key is taken: it stays private
    # Different tokens under the same key: no hit.
    assert cache.match([8, 8, 8, 8, 1, 2, 3, 4, 9], 2) == []
    # Same tokens as the cached block but one block later (another parent): only block 0 matches.
    second = [7, 7, 7, 7, 7, 7, 7, 7, 9]
    hits = cache.match(second, 2)
    assert [e.tokens for e in hits] == [(7, 7, 7, 7)]
    seq = admit(cache, second)
    assert seq.num_slots == 9 and contents(cache, seq) == (second, second)
    cache.free(seq)


def test_a_different_salt_never_shares() -> None:
    cache = make_cache(20)
    serve(cache, HOT + [1])
    other = KVCache(SPEC, 20, prefix_salt=b"other-model")
    assert keys_of(other, HOT) != keys_of(cache, HOT)
    off = KVCache(SPEC, 20, prefix_salt=None)
    assert off.match(HOT + [1], 2) == [] and off.register(SeqKV(), HOT) == 0


def test_blocks_shared_with_a_prefix_are_never_rewritten() -> None:
    cache = make_cache(20)
    serve(cache, HOT + [1])
    seq, shared_slots = compute(cache, HOT + list(range(50, 58)) + [60])  # not registered: private
    assert shared_slots == 8 and seq.num_slots == 17
    shared = [cache.kv[:, b].clone() for b in seq.k_blocks[:2] + seq.v_blocks[:2]]
    n = seq.num_slots
    keep_all = torch.arange(n).expand(SPEC.num_layers, SPEC.num_kv_heads, n)
    with pytest.raises(ValueError, match="private blocks"):
        cache.rewrite(seq, keep_all, 0, base=0)  # would rewrite the shared blocks
    with pytest.raises(ValueError, match="private blocks"):
        cache.rewrite(seq, keep_all, 0, base=2)  # not a whole number of blocks
    # After the prefix it works: drop slots 8..11 (one private block), keep the rest.
    keep = torch.tensor(list(range(8)) + list(range(12, n))).expand(SPEC.num_layers, 1, n - 4)
    assert cache.rewrite(seq, keep, 0, base=8) == 2
    for before, b in zip(shared, seq.k_blocks[:2] + seq.v_blocks[:2], strict=True):
        assert torch.equal(cache.kv[:, b], before)
    assert contents(cache, seq) == (HOT + [54, 55, 56, 57, 60],) * 2
    assert cache.match(HOT + [1], 2) != [] and cache.store.ref(seq.k_blocks[0]) > 1
    cache.free(seq)
    assert cache.num_free == cache.num_blocks


def test_hit_counter_window_ratio() -> None:
    hits = HitCounter(window=10.0)
    assert hits.window_ratio(now=0.0) is None
    hits.record(100, 50, now=0.0)
    hits.record(100, 100, now=5.0)
    assert hits.window_ratio(now=5.0) == pytest.approx(0.75)
    assert hits.window_ratio(now=12.0) == pytest.approx(1.0)  # the first lookup left the window
    assert hits.window_ratio(now=16.0) is None
    assert (hits.queried, hits.hit) == (200, 150)  # cumulative counters keep everything


def test_the_cache_counts_hits_in_prompt_tokens() -> None:
    cache = make_cache(20)
    serve(cache, HOT + [1])
    serve(cache, HOT + [2, 3, 4])
    assert (cache.hits.queried, cache.hits.hit) == (9 + 11, 8)
    assert cache.hits.window_ratio() == pytest.approx(8 / 20)
