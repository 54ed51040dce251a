"""Tier decisions and budget enforcement (exact slots, one-way demotion, byte accounting)."""

from __future__ import annotations

import pytest
import torch

from confkv_engine.retention.tiers import (
    KVAccounting,
    Tier,
    TierConfig,
    budget_target,
    decide_tiers,
    fit_counts,
    is_decision_point,
    threshold_tiers,
)

F, K, D = Tier.FULL, Tier.KEY_ONLY, Tier.DISCARD
ACCT = KVAccounting(block_size=2, half_block_bytes=100)


def test_accounting_counts_k_and_v_blocks_separately() -> None:
    assert ACCT.held_bytes(5, 3) == (3 + 2) * 100
    assert ACCT.full_bytes(5) == 2 * 3 * 100
    meta = KVAccounting(block_size=2, half_block_bytes=100, meta_bytes_per_slot=7, fixed_bytes=50)
    assert meta.held_bytes(4, 2) == (2 + 1) * 100 + 4 * 7 + 50


def test_budget_target_floor_and_tokens() -> None:
    assert budget_target(ACCT, 20, 0.5, None, protected_tokens=4) == 1000
    assert budget_target(ACCT, 20, 0.1, None, protected_tokens=4) == ACCT.held_bytes(4, 4)
    assert budget_target(ACCT, 20, None, 6, protected_tokens=4) == ACCT.full_bytes(6)
    # No budget: never below what all 20 tokens hold with their metadata (nothing is forced out).
    assert budget_target(ACCT, 20, None, None, protected_tokens=0) >= ACCT.held_bytes(20, 20)


def test_threshold_tiers_with_and_without_key_only() -> None:
    conf = torch.tensor([0.95, 0.9, 0.8, 0.7, 0.69])
    assert threshold_tiers(conf, TierConfig()).tolist() == [F, F, K, K, D]
    assert threshold_tiers(conf, TierConfig(key_only=False)).tolist() == [F, F, F, F, D]


def test_decision_points_are_block_aligned() -> None:
    assert [n for n in range(1, 70) if is_decision_point(n, 32)] == [32, 64]


def test_fit_counts_demotion_order() -> None:
    # 2 protected + 3 FULL + 2 KEY_ONLY: K slots 7 (4 blocks), V slots 5 (4 - 1 blocks) = 700 bytes.
    assert fit_counts(2, 3, 2, 700, ACCT) == (3, 2)
    assert fit_counts(2, 3, 2, 600, ACCT) == (3, 1)  # lowest KEY_ONLY discarded first
    # Then FULL -> KEY_ONLY -> DISCARD one token at a time: (2, 1) would still hold 3 + 3 blocks
    # because its single KEY_ONLY slot shares a V block with a FULL one.
    assert fit_counts(2, 3, 2, 500, ACCT) == (2, 0)
    assert fit_counts(2, 3, 2, 300, ACCT) == (0, 0)


def test_key_only_frees_only_whole_v_blocks() -> None:
    acct = KVAccounting(block_size=4, half_block_bytes=1)
    assert acct.held_bytes(8, 8) == 4
    assert acct.held_bytes(8, 6) == 4  # 2 KEY_ONLY slots: their V block still holds 2 FULL values
    assert acct.held_bytes(8, 4) == 3
    assert acct.held_bytes(8, 0) == 2


def _decide(conf, tiers, length, prev, cfg, target, acct=ACCT):
    pos = torch.arange(len(conf))[None]
    return decide_tiers(pos, torch.tensor([tiers], dtype=torch.int8), torch.tensor([conf]), length, prev,
                        cfg, acct, target)[0].tolist()


def test_tokens_leaving_window_get_threshold_tiers_sinks_and_window_stay_full() -> None:
    cfg = TierConfig(sinks=2, window=2)
    conf = [0.0, 0.0, 0.95, 0.8, 0.1, 0.0, 0.0]
    out = _decide(conf, [F] * 7, length=7, prev=0, cfg=cfg, target=10**9)
    assert out == [F, F, F, K, D, F, F]


def test_already_decided_tokens_are_not_rethresholded() -> None:
    cfg = TierConfig(sinks=1, window=2)
    # Token 1 left the window at the previous decision (length 4) and stays FULL although its
    # confidence dropped; token 2..3 leave now.
    out = _decide([0.0, 0.1, 0.95, 0.75, 0.0, 0.0], [F] * 6, length=6, prev=4, cfg=cfg, target=10**9)
    assert out == [F, F, F, K, F, F]


def test_budget_demotes_lowest_confidence_one_way() -> None:
    cfg = TierConfig(sinks=1, window=2)
    acct = KVAccounting(block_size=1, half_block_bytes=10)
    tiers = [F, F, F, K, F, F, F]
    conf = [0.0, 0.99, 0.5, 0.99, 0.95, 0.0, 0.0]
    # Protected: 0, 5, 6. Candidates FULL {1, 2, 4}, KEY_ONLY {3}: 7 K + 6 V slots = 130 bytes.
    assert _decide(conf, tiers, 7, 7, cfg, 130, acct) == tiers
    # 110: the lowest-confidence token (2, FULL) goes to KEY_ONLY and, still lowest, is discarded;
    # token 3 outranks it but stays KEY_ONLY (a tier never rises).
    assert _decide(conf, tiers, 7, 7, cfg, 110, acct) == [F, F, D, K, F, F, F]
    assert _decide(conf, tiers, 7, 7, cfg, 100, acct) == [F, F, D, D, F, F, F]


def test_per_unit_choices_with_shared_counts() -> None:
    cfg = TierConfig(sinks=0, window=1)
    pos = torch.arange(4).expand(2, 4)
    conf = torch.tensor([[0.95, 0.1, 0.1, 0.0], [0.1, 0.1, 0.95, 0.0]])
    tiers = torch.zeros(2, 4, dtype=torch.int8)
    out = decide_tiers(pos, tiers, conf, 4, 0, cfg, ACCT, 10**9)
    # Each unit keeps its own best token as FULL; the count is the same in both units.
    assert out.tolist() == [[F, D, D, F], [D, D, F, F]]


def test_tier_config_validation() -> None:
    with pytest.raises(ValueError, match="medium"):
        TierConfig(high=0.5, medium=0.7)


def test_window_grows_with_the_budget_in_whole_blocks() -> None:
    cfg = TierConfig(window=32, window_fraction=0.5)
    assert cfg.effective_window(budget_tokens=40, block_size=16) == 32
    assert cfg.effective_window(budget_tokens=300, block_size=16) == 144
    with pytest.raises(ValueError, match="window_fraction"):
        TierConfig(window_fraction=1.0)


def test_tokens_leaving_a_shrunk_window_are_tiered_once() -> None:
    # Previous decision at length 8 had a window of 4 (tokens 4..7 protected); now the window is 2.
    cfg = TierConfig(sinks=1, window=2)
    pos = torch.arange(10)[None]
    conf = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.95, 0.8, 0.1, 0.0, 0.0, 0.0]])
    tiers = torch.tensor([[F, F, F, F, F, F, F, F, F, F]], dtype=torch.int8)
    out = decide_tiers(pos, tiers, conf, 10, 8, cfg, ACCT, 10**9, prev_window=4)
    assert out[0].tolist() == [F, F, F, F, F, K, D, D, F, F]


def test_shared_demotion_keeps_a_key_only_share() -> None:
    from confkv_engine.retention.tiers import fit_counts_shared

    acct = KVAccounting(block_size=1, half_block_bytes=1)
    # 10 FULL candidates, none KEY_ONLY; the budget holds 16 half-blocks beyond nothing protected.
    f, k = fit_counts_shared(0, 10, 0, 16, acct, share=0.5)
    assert (f, k) == (6, 4) and acct.held_bytes(f + k, f) <= 16
    assert fit_counts_shared(0, 10, 0, 100, acct, share=0.5) == (10, 0)  # fits: nothing moves


def test_share_confidence_by_granularity() -> None:
    from confkv_engine.retention.tiers import share_confidence

    conf = torch.tensor([[0.1, 0.9], [0.3, 0.5], [0.6, 0.0], [0.2, 0.4]])  # 2 layers x 2 heads
    assert torch.equal(share_confidence(conf, "head", 2), conf)
    torch.testing.assert_close(share_confidence(conf, "layer", 2),
                               torch.tensor([[0.2, 0.7], [0.2, 0.7], [0.4, 0.2], [0.4, 0.2]]))
    torch.testing.assert_close(share_confidence(conf, "token", 2), torch.tensor([[0.3, 0.45]]).expand(4, 2))
    with pytest.raises(ValueError, match="granularity"):
        TierConfig(granularity="block")
