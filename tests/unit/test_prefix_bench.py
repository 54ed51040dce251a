"""The prefix-cache replay (``testkit.prefix_replay``, what the cache benchmark reports) drives the
real cache manager: exact hits on a scan that LRU lets flush a hot prefix and LRU-2 does not, and
the same hit rate as the eviction simulator when nothing is evicted and no prompt ends on a block
boundary."""

from __future__ import annotations

import pytest

from confkv_engine.cache.eviction import LRUK
from testkit.prefix_replay import replay
from testkit.traces import TraceConfig, make_trace, simulate

HOT = list(range(100, 108))
SCAN_TRACE = [HOT + [1], HOT + [2], list(range(200, 208)) + [3], list(range(300, 308)) + [4], HOT + [5]]


@pytest.mark.parametrize(("k", "hit_tokens", "registered", "evictions"), [(1, 8, 8, 4), (2, 16, 6, 2)])
def test_replay_counts_exact_hits_and_evictions(k: int, hit_tokens: int, registered: int,
                                               evictions: int) -> None:
    # 5 cached block pairs: the hot prefix and one scan fit with a running request, two scans do not.
    result = replay(SCAN_TRACE, cache_blocks=5, k=k, block_size=4)
    assert (result.hit_tokens, result.prompt_tokens) == (hit_tokens, 45)
    assert (result.registered, result.evictions) == (registered, evictions)


def test_replay_agrees_with_the_simulator_without_eviction() -> None:
    cfg = TraceConfig(requests=120, prefixes=6, prefix_tokens=(40, 120), active_chats=4)
    trace = [t for t in make_trace(cfg, seed=3) if len(t) % 16]  # the engine recomputes a last full block
    result = replay(trace, cache_blocks=100_000, k=2)
    assert result.evictions == 0 and result.hit_tokens > 0
    assert result.hit_tokens == simulate(trace, 100_000, lambda: LRUK(k=2)).hit_tokens
