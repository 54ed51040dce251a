"""Peer policies as selection functions: exact slots kept by streaming, h2o and conf-kv."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.retention.policies import RetentionConfig, SlotView, select, tokens_that_fit
from confkv_engine.retention.scorer import ScorerConfig
from confkv_engine.retention.tiers import KVAccounting, Tier, TierConfig

ACCT = KVAccounting(block_size=1, half_block_bytes=10)
F, K, D = Tier.FULL, Tier.KEY_ONLY, Tier.DISCARD


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
        assert peer.tiers.precisions == () and not peer.uses_precision
        assert (peer.tiers.min_window, peer.tiers.floor_tokens) == (32, 36)
    own = RetentionConfig(policy="conf-kv", tiers=chain, budget=0.25)
    assert own.uses_precision and own.tiers.min_window == TierConfig.precision_window
