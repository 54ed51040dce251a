"""The attention mass a decision folds, computed from the scores in one native pass
(``retention.native_mass``, ``_mass.c``), equals the PyTorch path: the softmax over the keys
each query sees, summed per KV head (``scoring.softmax_probs``), reduced by ``scorer.attention_mass``;
and a decision's whole fold (``scoring.score_batch``) leaves the same accumulators and peak either way."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.cache.kv_cache import KVCache, SeqKV
from confkv_engine.cache.layout import CacheSpec
from confkv_engine.retention import native_mass, scorer, scoring
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.runtime import RetentionState
from confkv_engine.retention.scorer import PeakFilter, ScorerConfig
from confkv_engine.retention.tiers import KVAccounting

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not native_mass.available(), reason="the native library was not built here")


def _case(units: int, group: int, t: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Scores [U, G*T, n] with a wide range; key positions a different permutation per unit, the last
    few later than the first queries (so some keys are hidden from some queries)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(units, group * t, n, generator=gen) * 4
    key_pos = torch.stack([torch.randperm(n, generator=gen) for _ in range(units)])
    query_pos = torch.arange(n - t, n)
    return scores, key_pos, query_pos


def _reference(scores: torch.Tensor, group: int, key_pos: torch.Tensor, query_pos: torch.Tensor,
               weights: torch.Tensor, peak: PeakFilter | None) -> scorer.AttentionMass:
    u, _, n = scores.shape
    t = query_pos.numel()
    hidden = (key_pos[:, None, :] > query_pos[None, :, None])[None]  # [1, U, T, n]: units as KV heads
    probs = scoring.softmax_probs(scores.clone(), u, t, hidden, 0)[0]  # [U, T, n]
    return scorer.attention_mass(probs, key_pos, query_pos, weights, peak)


@pytest.mark.parametrize(("units", "group", "t", "n"), [(3, 1, 5, 37), (4, 3, 16, 200), (2, 8, 3, 1000)])
@pytest.mark.parametrize("peak", [None, PeakFilter(1), PeakFilter(4, 20)], ids=["no-peak", "peak", "reach"])
def test_native_mass_equals_the_softmax_reduced_in_pytorch(units, group, t, n, peak) -> None:
    scores, key_pos, query_pos = _case(units, group, t, n, seed=units * n + t)
    weights = scorer.query_weights(query_pos, 0.9)
    want = _reference(scores, group, key_pos, query_pos, weights, peak)
    got = native_mass.attention_mass(scores.clone(), group, key_pos, query_pos, weights, peak)
    for name in ("mass", "seen", "peak_sum", "peak_count"):
        a, b = getattr(got, name), getattr(want, name)
        if peak is None:
            assert a is None and b is None if name.startswith("peak") else a.shape == b.shape
        if a is not None:
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-6, msg=name)
    assert bool((got.mass > 0).any())
    hidden = key_pos > query_pos[0]  # hidden from the first query: it adds nothing to seen there
    assert torch.allclose(got.seen[hidden], want.seen[hidden])


def test_native_mass_refuses_scores_of_another_shape_or_dtype() -> None:
    scores, key_pos, query_pos = _case(2, 2, 3, 10, seed=0)
    weights = torch.ones(3)
    with pytest.raises(ValueError, match="contiguous fp32"):
        native_mass.attention_mass(scores[:, :5], 2, key_pos, query_pos, weights, None)
    with pytest.raises(ValueError, match="contiguous fp32"):
        native_mass.attention_mass(scores.double(), 2, key_pos, query_pos, weights, None)


def _recorded(remember: bool) -> tuple[KVCache, SeqKV, RetentionState]:
    """A 3-layer cache of 64 tokens and a state that recorded 64 queries (a prefill chunk of 56, then 8
    decode steps), as the engine records them."""
    cache = KVCache(CacheSpec(3, 2, 32, 16, torch.float32, CPU), 12)
    seq = SeqKV()
    cache.reserve(seq, 64)
    gen = torch.Generator().manual_seed(5)
    plan = cache.plan_writes([seq], [64], torch.arange(64))
    for layer in range(3):
        cache.write(layer, plan, torch.randn(64, 2, 32, generator=gen), torch.randn(64, 2, 32, generator=gen))
    cache.commit(seq, 64)
    cfg = RetentionConfig(policy="conf-kv", scorer=ScorerConfig(memory=1.0 if remember else 0.0,
                                                                memory_distance=2, memory_decay=0.5))
    state = RetentionState(cfg=cfg, acct=KVAccounting(block_size=16, half_block_bytes=10), num_layers=3,
                           num_kv_heads=2, head_dim=32, group=3, interval=16)
    for chunk in (range(0, 56), *[range(p, p + 1) for p in range(56, 64)]):
        state.on_append(torch.tensor(list(chunk)))
        for layer in range(3):
            state.on_queries(layer, torch.randn(len(chunk), 6, 32, generator=gen) * 2)
    return cache, seq, state


@pytest.mark.parametrize("remember", [False, True])
def test_a_decision_folds_the_same_accumulators_natively_and_in_pytorch(monkeypatch, remember: bool) -> None:
    cache, seq, native = _recorded(remember)
    _, _, torch_path = _recorded(remember)
    scoring.score_batch(cache, [(seq, native)])
    monkeypatch.setattr(native_mass, "applies", lambda device: False)
    scoring.score_batch(cache, [(seq, torch_path)])
    assert native.last_query == torch_path.last_query == [63, 63, 63]
    torch.testing.assert_close(native.acc, torch_path.acc, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(native.norm, torch_path.norm, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(native.peak.float(), torch_path.peak.float(), rtol=1e-3, atol=1e-4)
    assert remember == bool(native.peak.float().abs().sum() > 0)
    assert bool((native.acc[..., :24] > 0).all())  # the oldest keys, seen by every query
