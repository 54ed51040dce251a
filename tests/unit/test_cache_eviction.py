"""LRU-K eviction order: exact victims for K = 1, 2, 3, chain history, correlated periods, retention."""

from __future__ import annotations

import random

import pytest

from confkv_engine.cache.eviction import LRUK
from testkit.traces import TraceConfig, block_keys, make_trace, simulate


def run_cache(policy: LRUK, refs: list[str], capacity: int) -> tuple[list[str], list[str]]:
    """Reference ``refs`` one per tick through a cache of ``capacity``; returns (evicted, hits)."""
    cached: set[str] = set()
    evicted: list[str] = []
    hits: list[str] = []
    for now, key in enumerate(refs, start=1):
        if key in cached:
            hits.append(key)
            assert policy.acquire(key)
        else:
            if len(cached) == capacity:
                victim = policy.victim()
                assert victim is not None
                cached.discard(victim)
                policy.forget(victim)
                evicted.append(victim)
            cached.add(key)
        policy.touch(key, now)
        policy.release(key)
    return evicted, hits


def three_keys(policy: LRUK) -> LRUK:
    """a referenced at 1, 2, 3; b at 4, 5; c at 6; all released in the order a, b, c."""
    for now, key in enumerate("aaabbc", start=1):
        policy.touch(key, now)
    for key in "abc":
        policy.release(key)
    return policy


@pytest.mark.parametrize(("k", "order"), [(1, ["a", "b", "c"]), (2, ["c", "a", "b"]), (3, ["b", "c", "a"])])
def test_exact_order_for_k_1_2_3(k: int, order: list[str]) -> None:
    policy = three_keys(LRUK(k=k))
    assert policy.evictable() == order
    assert [policy.victim() for _ in range(4)] == [*order, None]
    assert len(policy) == 0


def prefix_tree(policy: LRUK) -> LRUK:
    """A hot prompt h (ticks 1, 2, 3) with a question q (tick 2) and a two-block chat turn x -> y
    (tick 3) appended to it, then a two-block one-off prompt s -> s2 (tick 4); released q, y, x, h,
    s2, s (each request's chain from its tail).

    Chain history: q is h's first child, HIST(q) = (2, 2 - 1 * (2 - 1)) = (2, 1); x its second,
    HIST(x) = (3, 3 - 2 * (3 - 2), 3 - 2 * (3 - 1)) = (3, 1, -1); y is x's first child, so it takes
    x's (3, 1, -1). s has a single reference, so s2 inherits nothing."""
    policy.touch("h", 1)
    policy.touch("h", 2)
    policy.touch("q", 2, parent="h")
    policy.touch("h", 3)
    policy.touch("x", 3, parent="h")
    policy.touch("y", 3, parent="x")
    policy.touch("s", 4)
    policy.touch("s2", 4, parent="s")
    for key in ("q", "y", "x", "h", "s2", "s"):
        policy.release(key)
    return policy


def test_chain_history_inherits_the_parents_older_references_split_among_its_children() -> None:
    policy = prefix_tree(LRUK(k=2))
    assert policy.history("h") == (3, 2, 1)
    assert policy.history("q") == (2, 1)
    assert policy.history("x") == (3, 1, -1) and policy.history("y") == (3, 1, -1)
    assert policy.history("s") == (4,) and policy.history("s2") == (4,)
    assert [policy.uses(key) for key in ("h", "q", "x", "s2", "unknown")] == [3, 1, 1, 1, 0]


@pytest.mark.parametrize(("k", "order"), [
    (1, ["q", "y", "x", "h", "s2", "s"]),  # LRU on HIST(1), ties: the earlier release
    (2, ["s2", "s", "q", "y", "x", "h"]),  # s, s2: one reference; then HIST(2) q = y = x = 1 < h = 2
    (3, ["q", "s2", "s", "y", "x", "h"]),  # q has two references; HIST(3) y = x = -1 < h = 1
])
def test_exact_order_for_k_1_2_3_on_a_prefix_tree(k: int, order: list[str]) -> None:
    policy = prefix_tree(LRUK(k=k))
    assert policy.evictable() == order
    assert [policy.victim() for _ in range(7)] == [*order, None]


def test_without_chain_history_new_blocks_start_cold_as_in_the_paper() -> None:
    policy = prefix_tree(LRUK(k=2, chain_history=False))
    assert policy.history("q") == (2,) and policy.history("y") == (3,)
    # Every new block has one reference: the chat turn goes before the one-off prompt (older LAST).
    assert policy.evictable() == ["q", "y", "x", "s2", "s", "h"]


def test_chain_history_applies_only_to_a_block_without_history() -> None:
    policy = LRUK(k=2, retained_history=4)
    for now, key in ((1, "p"), (2, "c"), (3, "r"), (5, "p")):
        policy.touch(key, now)
    policy.touch("c", 6, parent="p")  # c already has history: its parent changes nothing
    assert policy.history("c") == (6, 2)
    policy.release("r")
    assert policy.victim() == "r"
    policy.forget("r")
    policy.touch("r", 7, parent="p")  # re-admitted: its retained history wins over the parent's
    assert policy.history("r") == (7, 3)
    policy.touch("n", 7, parent="p")  # p's first child (c and r were not new)
    assert policy.history("n") == (7, 7 - (7 - 1))


def test_k1_is_lru_with_release_order_breaking_ties() -> None:
    policy = LRUK(k=1)
    for key in ("b0", "b1", "b2"):  # one request touches its chain at one tick
        policy.touch(key, 1)
    policy.touch("x", 2)
    policy.touch("b0", 3)
    for key in ("x", "b2", "b1", "b0"):  # a request's blocks are released last-to-first
        policy.release(key)
    assert policy.evictable() == ["b2", "b1", "x", "b0"]


def test_k1_evicts_exactly_like_a_free_queue_appended_on_release() -> None:
    """vLLM's prefix cache: freed blocks go to the queue's tail, evictions take its head."""
    rng = random.Random(3)
    policy = LRUK(k=1)
    queue: dict[int, None] = {}  # insertion-ordered evictable keys, the reference LRU
    cached: set[int] = set()
    for now in range(1, 400):
        chain = [rng.randrange(60) for _ in range(rng.randint(1, 6))]
        chain = list(dict.fromkeys(chain))
        for key in chain:
            if key in cached:
                assert policy.acquire(key) == (key in queue)
                queue.pop(key, None)
            elif len(cached) == 20:
                expected = next(iter(queue))
                del queue[expected]
                assert policy.victim() == expected
                policy.forget(expected)
                cached.discard(expected)
            cached.add(key)
            policy.touch(key, now)
        for key in reversed(chain):
            policy.release(key)
            queue[key] = None
        assert policy.evictable() == list(queue)


def test_scan_flushes_hot_set_under_lru_but_not_lru2() -> None:
    refs = ["h1", "h2", "h1", "h2", "s1", "s2", "s3", "s4", "h1", "h2"]
    evicted, hits = run_cache(LRUK(k=1), refs, capacity=4)
    assert evicted == ["h1", "h2", "s1", "s2"] and hits == ["h1", "h2"]
    evicted, hits = run_cache(LRUK(k=2), refs, capacity=4)
    assert evicted == ["s1", "s2"] and hits == ["h1", "h2", "h1", "h2"]


def test_acquire_removes_and_release_restores_with_new_history() -> None:
    policy = three_keys(LRUK(k=2))
    assert policy.acquire("c") and not policy.acquire("c")
    assert "c" not in policy and policy.evictable() == ["a", "b"]
    policy.touch("c", 7)  # second reference: c now has a K-distance (HIST(2) = 6)
    policy.release("c")
    assert policy.evictable() == ["a", "b", "c"]


def test_touch_of_an_evictable_key_reprioritises_it() -> None:
    policy = three_keys(LRUK(k=1))
    policy.touch("a", 7)
    assert policy.evictable() == ["b", "c", "a"]
    assert [policy.victim(), policy.victim(), policy.victim(), policy.victim()] == ["b", "c", "a", None]


def test_correlated_references_collapse_into_one_and_shift_history() -> None:
    policy = LRUK(k=2, correlated_period=2)
    for now in (1, 2, 3):  # each within 2 ticks of the previous: one burst starting at 1
        policy.touch("a", now)
    assert policy.history("a") == (1,)
    policy.touch("a", 10)  # uncorrelated: older history shifts by the burst length 3 - 1
    assert policy.history("a") == (10, 3)
    uncorrelated = LRUK(k=2)
    for now in (1, 2, 3, 10):
        uncorrelated.touch("a", now)
    assert uncorrelated.history("a") == (10, 3, 2, 1)


def test_correlated_burst_does_not_earn_a_k_distance() -> None:
    policy = LRUK(k=2, correlated_period=2)
    policy.touch("a", 1)
    policy.touch("a", 5)  # two real references: HIST(2) = 1
    policy.touch("b", 6)
    policy.touch("b", 7)  # correlated with 6: still one reference, infinite distance
    policy.release("a")
    policy.release("b")
    assert policy.evictable() == ["b", "a"]
    plain = LRUK(k=2)
    for now, key in ((1, "a"), (5, "a"), (6, "b"), (7, "b")):
        plain.touch(key, now)
    plain.release("a")
    plain.release("b")
    assert plain.evictable() == ["a", "b"]  # HIST(2): a = 1 < b = 6


def test_same_tick_repeat_is_correlated_even_with_period_zero() -> None:
    policy = LRUK(k=2)
    policy.touch("a", 5)
    policy.touch("a", 5)
    assert policy.history("a") == (5,)


def test_retained_history_survives_eviction_and_readmission() -> None:
    def readmitted_order(retained: int) -> list[str]:
        policy = LRUK(k=2, retained_history=retained)
        policy.touch("a", 1)
        policy.touch("a", 2)
        policy.release("a")
        assert policy.victim() == "a"
        policy.forget("a")
        assert policy.history("a") == ((2, 1) if retained else ())
        policy.touch("a", 5)  # re-admitted: a miss, a new reference
        policy.touch("n", 6)
        policy.release("n")
        policy.release("a")
        return policy.evictable()

    assert readmitted_order(retained=4) == ["n", "a"]  # a remembers HIST(2) = 2
    assert readmitted_order(retained=0) == ["a", "n"]  # both single references; a older


def test_retained_history_is_bounded_dropping_oldest_last_reference() -> None:
    policy = LRUK(k=2, retained_history=2)
    for now, key in ((3, "z"), (1, "x"), (2, "y")):
        policy.touch(key, now)
    for key in ("z", "x", "y"):  # forgotten in another order than their last references
        policy.forget(key)
    assert policy.num_retained == 2
    assert policy.history("x") == () and policy.history("y") == (2,) and policy.history("z") == (3,)


def test_history_depth_is_bounded_by_max_k() -> None:
    policy = LRUK(k=2, max_k=3)
    for now in range(1, 10):
        policy.touch("a", now)
    assert policy.history("a") == (9, 8, 7)


def test_set_k_live_reorders_without_dropping_anything() -> None:
    policy = three_keys(LRUK(k=2))
    assert policy.evictable() == ["c", "a", "b"]
    policy.set_k(3)  # uses a's third reference, recorded while K was 2
    assert policy.evictable() == ["b", "c", "a"] and len(policy) == 3
    policy.set_k(1)
    assert policy.evictable() == ["a", "b", "c"]
    assert policy.history("a") == (3, 2, 1)
    assert [policy.victim() for _ in range(3)] == ["a", "b", "c"]


def test_bad_arguments_are_rejected_clearly() -> None:
    with pytest.raises(ValueError, match="k must be between 1 and max_k=8"):
        LRUK(k=0)
    policy = three_keys(LRUK(k=2))
    with pytest.raises(ValueError, match="max_k"):
        policy.set_k(9)
    assert policy.k == 2
    with pytest.raises(KeyError, match="never touched"):
        policy.release("unknown")
    with pytest.raises(ValueError, match="released twice"):
        policy.release("a")
    with pytest.raises(ValueError, match="time went backwards"):
        policy.touch("a", 2)
    with pytest.raises(ValueError, match="correlated_period"):
        LRUK(correlated_period=-1)


def test_heap_victims_match_sorted_order_under_random_churn() -> None:
    rng = random.Random(7)
    policy = LRUK(k=2, correlated_period=1, retained_history=8)
    resident: set[int] = set()
    now = 0
    for _ in range(3000):
        now += rng.randint(0, 2)
        key = rng.randrange(40)
        action = rng.random()
        if action < 0.5:
            resident.add(key)
            policy.acquire(key)
            policy.touch(key, now)
            policy.release(key)
        elif action < 0.7 and len(policy):
            expected = policy.evictable()[0]
            assert policy.victim() == expected
            policy.forget(expected)
            resident.discard(expected)
        elif action < 0.8 and key in resident:
            policy.acquire(key)
        elif action < 0.85:
            policy.set_k(rng.randint(1, 3))
        assert len(policy._heap) <= 2 * len(policy) + 17  # lazy deletion stays bounded
        assert policy.num_retained <= 8


def test_block_keys_chain_prefixes() -> None:
    shared = list(range(40))
    a = block_keys(shared + [1] * 10, 16)
    b = block_keys(shared + [2] * 10, 16)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert block_keys([9] * 16 + shared[:16], 16)[1] != block_keys(shared[:16], 16)[0]


def test_simulator_counts_token_hits_like_a_prefix_cache() -> None:
    prompt = list(range(40))  # 2 full blocks + 8 tokens
    result = simulate([prompt, prompt, prompt[:32]], 8, lambda: LRUK(k=1))
    # 1st: cold. 2nd: 2 blocks hit. 3rd: fully cached, the last token is recomputed (31).
    assert (result.hit_tokens, result.prompt_tokens, result.evictions) == (32 + 31, 112, 0)
    assert result.hit_rate == pytest.approx(63 / 112)


def test_traces_are_deterministic_and_lru2_resists_scans_in_simulation() -> None:
    cfg = TraceConfig(requests=400, chat_share=0.3, scan_burst_prob=0.03)
    trace = make_trace(cfg, seed=1)
    assert trace == make_trace(cfg, seed=1) and trace != make_trace(cfg, seed=2)
    assert len(trace) == 400
    lru = simulate(trace, 512, lambda: LRUK(k=1))
    lru2 = simulate(trace, 512, lambda: LRUK(k=2))
    assert lru.prompt_tokens == lru2.prompt_tokens
    assert lru2.hit_rate > lru.hit_rate
