"""Peer policies as selection functions: exact slots kept by streaming, h2o and conf-kv."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from confkv_engine.retention.policies import RetentionConfig, SlotView, select, tokens_that_fit
from confkv_engine.retention.scorer import ScorerConfig
from confkv_engine.retention.tiers import KVAccounting, Tier, TierConfig

ACCT = KVAccounting(block_size=1, half_block_bytes=10)
F, K, D, I4 = Tier.FULL, Tier.KEY_ONLY, Tier.DISCARD, Tier.INT4


def _view(att: list[list[float]], length: int) -> SlotView:
    u, n = len(att), len(att[0])
    return SlotView(
        pos=torch.arange(n).expand(u, n).clone(), tiers=torch.zeros(u, n, dtype=torch.int8),
        acc=torch.tensor(att), norm=torch.ones(u, n), c_samp=torch.full((u, n), 0.5),
        length=length, prev_length=0, group=1)


def _kept(tiers: torch.Tensor) -> list[list[int]]:
    return [[i for i, t in enumerate(row) if t != D] for row in tiers.tolist()]


def test_tokens_that_fit_matches_accounting() -> None:
    acct = KVAccounting(block_size=4, half_block_bytes=100, meta_bytes_per_slot=3, fixed_bytes=10)
    n = tokens_that_fit(1000, acct)
    assert acct.held_bytes(n, n) <= 1000 < acct.held_bytes(n + 1, n + 1)


def test_streaming_keeps_sinks_and_recent() -> None:
    cfg = RetentionConfig(policy="streaming", tiers=TierConfig(sinks=2, window=2), budget=0.5)
    out = select(_view([[0.0] * 10], 10), cfg, ACCT, target=6 * 20)
    assert _kept(out) == [[0, 1, 6, 7, 8, 9]]


def test_h2o_half_recent_half_heavy_per_unit() -> None:
    cfg = RetentionConfig(policy="h2o", budget=0.5)
    att = [[0.9, 0.1, 0.8, 0.0, 0.3, 0.0, 0.0, 0.0], [0.0, 0.7, 0.0, 0.6, 0.0, 0.5, 0.0, 0.0]]
    out = select(_view(att, 8), cfg, ACCT, target=4 * 20)
    # 4 tokens fit: the 2 most recent (6, 7) plus each unit's own 2 heavy hitters.
    assert _kept(out) == [[0, 2, 6, 7], [1, 3, 6, 7]]


def test_conf_kv_with_and_without_key_only() -> None:
    tiers = TierConfig(sinks=1, window=2, window_fraction=0.0)
    scfg = ScorerConfig(mode="attention", scale=1.0)
    # Attention relative to uniform over 8 tokens: 1 - exp(-8 a) -> 0.99, 0.8, 0.1 for 0.6, 0.2, 0.013.
    view = _view([[0.0, 0.6, 0.2, 0.013, 0.2, 0.6, 0.0, 0.0]], 8)
    with_key = select(view, RetentionConfig(policy="conf-kv", tiers=tiers, scorer=scfg), ACCT, 10**9)
    no_key = select(view, RetentionConfig(policy="conf-kv-discard", tiers=tiers, scorer=scfg), ACCT, 10**9)
    assert with_key.tolist() == [[F, F, K, D, K, F, F, F]]
    assert no_key.tolist() == [[F, F, F, D, F, F, F, F]]


def test_full_policy_keeps_everything_and_config_is_validated() -> None:
    view = _view([[0.0] * 5], 5)
    assert select(view, RetentionConfig(), ACCT, 0).tolist() == [[F] * 5]
    with pytest.raises(ValueError, match="unknown kv policy"):
        RetentionConfig(policy="lru")
    with pytest.raises(ValueError, match="needs a budget"):
        RetentionConfig(policy="h2o")


def test_peers_keep_their_own_window_under_the_default_precision_chain() -> None:
    # conf-kv's default tiers are a precision chain; streaming and h2o given the same tiers (a server
    # default, a request switching policy) keep their 32-token window and floor, not the chain's.
    chain = TierConfig(window=32, key_only=False, precisions=("int4", "int2"))
    for policy in ("streaming", "h2o"):
        peer = RetentionConfig(policy=policy, tiers=chain, budget=0.25)
        assert peer.tiers.chain == () and not peer.uses_precision
        assert (peer.tiers.min_window, peer.tiers.floor_tokens) == (32, 36)
        # The chain stays configured: a request switching back to conf-kv gets it.
        back = replace(peer, policy="conf-kv")
        assert back.uses_precision and back.tiers.chain == ("int4", "int2") and back.tiers.min_window == 2
    full = RetentionConfig(tiers=chain)  # the server's default policy
    assert not full.uses_precision and replace(full, policy="conf-kv", budget=0.25).uses_precision
    own = RetentionConfig(policy="conf-kv", tiers=chain, budget=0.25)
    assert own.uses_precision and own.tiers.min_window == TierConfig.precision_window


def test_the_precision_chain_weighs_the_sampling_signal_with_its_own_weight() -> None:
    chain = TierConfig(key_only=False, precisions=("int4", "int2"))
    default = RetentionConfig(policy="conf-kv", tiers=chain, budget=0.25)
    assert default.sampling_weight == ScorerConfig.precision_sampling_weight > 0
    assert default.scores_attention
    # The FULL / KEY_ONLY chain keeps the scorer's mode (attention only by default); peers read none.
    assert RetentionConfig(policy="conf-kv", budget=0.25).sampling_weight == 0.0
    assert RetentionConfig(policy="h2o", tiers=chain, budget=0.25).sampling_weight == 0.0
    samp_only = replace(default, scorer=ScorerConfig(precision_sampling_weight=1.0))
    assert samp_only.sampling_weight == 1.0 and not samp_only.scores_attention


def test_the_precision_chain_drops_the_predicted_token_before_the_surprising_one() -> None:
    # Sink 0, window 5..6 (FULL); tokens 1..4 equally attended. The model predicted token 2 almost
    # surely (c_samp 0.02: the context can stand in for it) and could not predict the others. With the
    # sampling signal weighed, the budget walk drops token 2; attention alone cannot tell them apart.
    chain = TierConfig(sinks=1, window=2, window_fraction=0.0, key_only=False, precisions=("int4", "int2"))
    acct = KVAccounting(block_size=1, half_block_bytes=50, pair_bytes=((Tier.INT4, 30), (Tier.INT2, 20)))
    view = _view([[0.1, 0.1, 0.1, 0.1, 0.1, 0.0, 0.0]], 7)
    view.c_samp = torch.tensor([[0.5, 0.9, 0.02, 0.9, 0.9, 0.5, 0.5]])
    cfg = RetentionConfig(policy="conf-kv", tiers=chain, budget=0.5)
    attention_only = replace(cfg, scorer=ScorerConfig(precision_sampling_weight=0.0))
    target = 300 + 90  # sink and window FULL, three tokens at int4
    assert select(view, cfg, acct, target).tolist() == [[F, I4, D, I4, I4, F, F]]
    assert select(view, attention_only, acct, target).tolist() == [[F, I4, I4, I4, D, F, F]]


def test_conf_kv_memory_keeps_the_once_attended_token_under_a_budget() -> None:
    # Sink 0, window 4..5; one of tokens 1..3 fits (4 FULL tokens x 20 bytes). Token 2 has the
    # highest decayed mean now; token 1 was attended far more once (its remembered peak).
    tiers = TierConfig(sinks=1, window=2, window_fraction=0.0, high=0.01, medium=0.0)
    view = _view([[0.0, 0.02, 0.1, 0.01, 0.0, 0.0]], 6)
    view.peak = torch.tensor([[0.0, 3.0, 0.5, 0.0, 0.0, 0.0]])
    plain = RetentionConfig(policy="conf-kv-discard", tiers=tiers, scorer=ScorerConfig(scale=1.0), budget=0.5)
    remember = replace(plain, scorer=ScorerConfig(scale=1.0, memory=1.0))
    assert remember.remembers and not plain.remembers
    assert _kept(select(view, plain, ACCT, 80)) == [[0, 2, 4, 5]]
    assert _kept(select(view, remember, ACCT, 80)) == [[0, 1, 4, 5]]


def test_state_keeps_the_peak_only_when_remembering_and_moves_it_with_its_slot() -> None:
    from confkv_engine.retention.runtime import RetentionState

    probs = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0], [0.2, 0.2, 0.6, 0.0],
                           [0.1, 0.1, 0.1, 0.7]]])
    peaks = []
    for memory in (0.0, 1.0):
        cfg = RetentionConfig(policy="conf-kv", scorer=ScorerConfig(memory=memory, memory_distance=2))
        state = RetentionState(cfg=cfg, acct=ACCT, num_layers=1, num_kv_heads=1, head_dim=4, group=1,
                               interval=4)
        state.on_append(torch.arange(4))
        state.on_attention(0, probs, torch.arange(4))
        peaks.append(state.peak[0, 0].tolist())
    assert peaks[0] == [0.0] * 4
    assert peaks[1] == pytest.approx([0.5, 0.4, 0.0, 0.0], rel=1e-3)  # stored in fp16
    state.keep_slots(torch.tensor([[[1, 3]]]))  # the peak travels with its slot, as acc and norm do
    assert state.peak[0, 0].tolist() == pytest.approx([0.4, 0.0], rel=1e-3)
    assert state.pos[0, 0].tolist() == [1, 3]


def test_the_remembered_peak_is_counted_in_the_budget() -> None:
    from types import SimpleNamespace

    from confkv_engine.cache.layout import CacheSpec
    from confkv_engine.retention.runtime import accounting

    cache = SimpleNamespace(spec=CacheSpec(3, 2, 8, 16, torch.bfloat16, torch.device("cpu")))
    plain = accounting(cache, RetentionConfig(policy="conf-kv", budget=0.25))  # type: ignore[arg-type]
    remember = accounting(cache, RetentionConfig(policy="conf-kv", budget=0.25,  # type: ignore[arg-type]
                                                 scorer=ScorerConfig(memory=1.0)))
    assert remember.meta_bytes_per_slot - plain.meta_bytes_per_slot == 3 * 2 * 2  # fp16 per unit
    h2o = RetentionConfig(policy="h2o", budget=0.25, scorer=ScorerConfig(memory=1.0))
    assert not h2o.remembers  # the peers never keep it


def test_state_fades_the_peak_by_the_query_positions_between_decisions() -> None:
    from confkv_engine.retention.runtime import RetentionState

    cfg = RetentionConfig(policy="conf-kv", scorer=ScorerConfig(memory=1.0, memory_distance=0,
                                                                memory_decay=0.5))
    state = RetentionState(cfg=cfg, acct=ACCT, num_layers=1, num_kv_heads=1, head_dim=4, group=1, interval=4)
    state.on_append(torch.arange(2))
    state.on_attention(0, torch.tensor([[[1.0, 0.0], [0.5, 0.5]]]), torch.arange(2))
    assert state.peak[0, 0].tolist() == pytest.approx([1.0, 1.0])  # (1 x 1 + 0.5 x 2) / 2; 0.5 x 2
    # Two positions later (last query 1 -> 3) the old peak is a quarter; this query gives 0.2 and 1.8.
    state.on_attention(0, torch.tensor([[[0.1, 0.9]]]), torch.tensor([3]))
    assert state.peak[0, 0].tolist() == pytest.approx([0.25, 1.8], rel=1e-3)
