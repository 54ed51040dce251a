"""Retention state storage: appends and rewrites go into capacity-backed buffers in place, growth is
geometric (O(log N) reallocations over N appends), and the views hold what concatenation would."""

from __future__ import annotations

import math

import pytest
import torch

from confkv_engine.cache.kv_cache import CacheSpec, KVCache
from confkv_engine.retention.manager import RetentionManager
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import RetentionState
from confkv_engine.retention.slots import QueryRing
from confkv_engine.retention.tiers import TierConfig

LAYERS, HEADS = 2, 2


def _state(shared: int = 0) -> RetentionState:
    cache = KVCache(CacheSpec(LAYERS, HEADS, 16, 16, torch.float32, torch.device("cpu")), 64)
    cfg = RetentionConfig(policy="conf-kv", tiers=TierConfig(window=32), budget=0.25)
    state = RetentionManager(cache, 4, cfg, 32).new_state(cfg, shared_slots=shared)
    assert state is not None
    return state


def test_appends_reuse_the_buffers_and_grow_logarithmically() -> None:
    state = _state(shared=16)
    steps = 2000
    ptrs = {state.pos.data_ptr()}
    for t in range(16, 16 + steps):
        before, cap = state.pos.data_ptr(), state.slots.capacity
        state.on_append(torch.tensor([t]))
        if state.num_slots <= cap:  # room left: written in place, nothing reallocated
            assert state.pos.data_ptr() == before
        ptrs.add(state.pos.data_ptr())
    n = 16 + steps
    assert state.num_slots == n
    assert len(ptrs) <= math.ceil(math.log2(n)) + 1
    assert state.slots.reallocations <= math.ceil(math.log2(n)) + 1
    assert state.slots.capacity < 2 * n
    assert torch.equal(state.pos, torch.arange(n).expand(LAYERS, HEADS, n))
    assert not state.tiers.any() and not state.acc.any() and not state.norm.any()


def test_a_rewrite_stays_in_the_buffers_and_fresh_slots_start_clean() -> None:
    state = _state()
    state.on_append(torch.arange(40))
    state.acc.copy_(torch.rand(LAYERS, HEADS, 40))  # in-place writes through the views reach the state
    state.norm.fill_(2.0)
    pos, acc = state.pos.clone(), state.acc.clone()
    new = torch.zeros_like(state.tiers)
    new[..., 10:20] = 1
    order = torch.arange(39, -1, -3).expand(LAYERS, HEADS, -1)  # keep 14 slots, reversed
    ptr = state.acc.data_ptr()
    state.keep_slots(order, new)
    assert state.acc.data_ptr() == ptr and state.num_slots == order.shape[-1]
    assert torch.equal(state.pos, pos.gather(-1, order))
    assert torch.equal(state.acc, acc.gather(-1, order))
    assert torch.equal(state.tiers, new.gather(-1, order))
    state.on_append(torch.tensor([40, 41]))  # over columns that held old values: zeroed
    assert torch.equal(state.pos[..., -2:], torch.tensor([40, 41]).expand(LAYERS, HEADS, 2))
    fresh = (state.acc[..., -2:], state.norm[..., -2:], state.tiers[..., -2:])
    assert not any(bool(x.any()) for x in fresh)


def test_the_query_ring_returns_what_was_recorded_and_refuses_a_missing_layer() -> None:
    ring = QueryRing(num_layers=2, interval=32)
    steps = [torch.randn(t, 3, 4) for t in (32, 1, 1, 1)]
    for q in steps[:1]:
        ring.add_positions(torch.arange(q.shape[0]))
        for layer in range(2):
            ring.add(layer, q + layer)
    queries, pos = ring.take()
    assert torch.equal(queries[1], steps[0] + 1) and torch.equal(pos, torch.arange(32))
    ptr, allocs = queries[0].data_ptr(), ring.reallocations
    for i, q in enumerate(steps[1:]):  # decode steps after a decision: the ring's room is reused
        ring.add_positions(torch.tensor([32 + i]))
        for layer in range(2):
            ring.add(layer, q)
    queries, pos = ring.take()
    assert queries[0].data_ptr() == ptr and ring.reallocations == allocs
    assert torch.equal(queries[0], torch.cat(steps[1:])) and torch.equal(pos, torch.tensor([32, 33, 34]))
    assert ring.take() is None
    ring.add_positions(torch.tensor([35]))
    ring.add(0, steps[1])
    with pytest.raises(RuntimeError, match="out of step"):
        ring.take()
