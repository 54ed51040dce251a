"""Precision tiers (pure): thresholds onto the chain, the budget walk's order, per-unit assignment,
byte accounting with staged and frozen blocks, whole-block demotion of frozen blocks, config."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from confkv_api.config import ConfKVSection
from confkv_engine.retention.precision import (
    assign_chain,
    decide_precision,
    held_bytes,
    last_tier_cap,
    refund,
    step_weights,
    threshold_chain,
    walk,
)
from confkv_engine.retention.tiers import KVAccounting, Tier, TierConfig, chain_from_names

F, I4, I2, D, K42 = Tier.FULL, Tier.INT4, Tier.INT2, Tier.DISCARD, Tier.K4V2
KEPT = [F, I4, I2]
# The walk's arithmetic below is checked with int2 cheap enough to beat dropping (loss 0.3) and the
# thresholds sending tokens under 0.7 straight to int2; the defaults are checked on their own.
CFG = TierConfig(sinks=1, window=2, key_only=False, precisions=("int4", "int2"),
                 precision_loss=(0.002, 0.02, 0.1, 0.3), last_tier_below=0.7)
# One token per block: a FULL pair costs 100 bytes, int4 30, int2 20 (no metadata).
ACCT1 = KVAccounting(block_size=1, half_block_bytes=50, pair_bytes=((I4, 30), (I2, 20)))


def test_thresholds_map_onto_the_chain_and_never_discard() -> None:
    conf = torch.tensor([0.95, 0.9, 0.8, 0.7, 0.69, 0.0])
    assert threshold_chain(conf, CFG).tolist() == [0, 0, 1, 1, 2, 2]  # FULL, FULL, int4, int4, int2, int2
    one = TierConfig(key_only=False, precisions=("int4",))
    assert threshold_chain(conf, one).tolist() == [0, 0, 1, 1, 1, 1]
    # Default: nothing goes below the first precision tier by threshold, only by the budget walk.
    default = TierConfig(key_only=False, precisions=("int4", "int2"))
    assert threshold_chain(conf, default).tolist() == [0, 0, 1, 1, 1, 1]


def test_default_losses_drop_a_token_before_putting_tokens_at_int2() -> None:
    # With int2 at 0.8 of a drop, int4 -> int2 (0.78 for 10 bytes) costs more per byte than
    # int2 -> DISCARD (0.2 for 20) and int4 -> DISCARD through int2 (0.98 for 30): under a tight budget
    # the walk drops the least confident int4 tokens and keeps the rest at int4.
    cfg = TierConfig(sinks=1, window=2, key_only=False, precisions=("int4", "int2"))
    assert step_weights(cfg, ACCT1) == pytest.approx([0.02 / 70, 0.78 / 10, 0.2 / 20])
    conf = [0.0, 0.95, 0.9, 0.8, 0.5, 0.0, 0.0]
    out = decide_precision(torch.arange(7)[None], torch.full((1, 7), F, dtype=torch.int8),
                           torch.tensor([conf]), 7, 0, cfg, ACCT1, 300 + 60, None, 0, 0)
    assert out[0].tolist() == [F, I4, I4, D, D, F, F]  # CFG's losses: three at int2 ([F, I2, I2, I2, D])


def test_k4v2_sits_between_int4_and_dropping_in_the_walk() -> None:
    # int4 30 bytes, k4v2 (int4 keys, int2 values) 25, DISCARD 0; losses 0.02, 0.05 (then 1):
    # int4 -> k4v2 costs 0.03 / 5 per byte, k4v2 -> DISCARD 0.95 / 25, so a tight budget moves tokens
    # to k4v2 before it drops any.
    acct = KVAccounting(block_size=1, half_block_bytes=50, pair_bytes=((I4, 30), (K42, 25)))
    cfg = TierConfig(sinks=1, window=2, key_only=False, precisions=("int4", "k4v2"),
                     precision_loss=(0.002, 0.02, 0.05, 0.8))
    assert step_weights(cfg, acct) == pytest.approx([0.02 / 70, 0.03 / 5, 0.95 / 25])
    conf = [0.0, 0.95, 0.9, 0.8, 0.5, 0.0, 0.0]

    def decide(tiers: TierConfig) -> list[int]:
        return decide_precision(torch.arange(7)[None], torch.full((1, 7), F, dtype=torch.int8),
                                torch.tensor([conf]), 7, 0, tiers, acct, 300 + 105, None, 0, 0)[0].tolist()

    assert decide(cfg) == [F, I4, K42, K42, K42, F, F]  # 30 + 3 x 25; without k4v2 one is dropped
    # The default k4v2 loss (0.15): int4 -> k4v2 0.13 / 5, k4v2 -> DISCARD 0.85 / 25 per byte: the 0.5
    # token goes to k4v2 (0.013), then is dropped (0.017) before the 0.8 one moves (0.021).
    default = replace(cfg, precision_loss=TierConfig.precision_loss)
    assert step_weights(default, acct) == pytest.approx([0.02 / 70, 0.13 / 5, 0.85 / 25])
    assert decide(default) == [F, I4, I4, I4, D, F, F]


def test_precision_chain_has_its_own_window_fraction() -> None:
    tiers = TierConfig(window=32, window_fraction=0.5, key_only=False, precisions=("int4",),
                       precision_window_fraction=0.25)
    assert tiers.effective_window(512, 16) == 128
    assert TierConfig(window=32, window_fraction=0.5).effective_window(512, 16) == 256
    # Its minimal window is its own (``precision_window``, may be under the decision interval).
    assert TierConfig(window=32, key_only=False, precisions=("int4",)).effective_window(512, 16) == 2
    interval = TierConfig(window=32, key_only=False, precisions=("int4",), precision_window=None)
    assert interval.effective_window(512, 16) == 32 and interval.min_window == 32  # None: ``window``
    assert TierConfig(window=32).min_window == 32  # not a precision chain
    with pytest.raises(ValueError, match="windows >= 1"):
        TierConfig(key_only=False, precisions=("int4",), precision_window=0)
    with pytest.raises(ValueError, match="precision_window_fraction"):
        TierConfig(precision_window_fraction=1.0)
    with pytest.raises(ValueError, match="last_tier_below"):
        TierConfig(last_tier_below=0.95)


def test_step_weights_are_loss_per_byte_saved() -> None:
    # FULL -> int4 saves 70 bytes for 0.02, int4 -> int2 10 for 0.28, int2 -> DISCARD 20 for 0.7.
    assert step_weights(CFG, ACCT1) == pytest.approx([0.02 / 70, 0.28 / 10, 0.7 / 20])


def test_walk_demotes_the_cheapest_step_until_it_fits() -> None:
    profile = [0.9, 0.8, 0.5, 0.2]
    weights = [0.02 / 70, 0.28 / 10, 0.7 / 20]

    def under(target: int):
        return lambda c, blocks: 100 * c[0] + 30 * c[1] + 20 * c[2] <= target

    def counts(target: int) -> list[int]:
        return walk(profile, [4, 0, 0], weights, under(target))[0]

    assert counts(400) == [4, 0, 0]
    assert counts(330) == [3, 1, 0]  # the lowest FULL to int4 first
    assert counts(120) == [0, 4, 0]
    assert counts(110) == [0, 3, 1]
    # Then the least confident is dropped rather than int2 for everyone: 0.2 x 0.035 < 0.5 x 0.028,
    # and 0.5 x 0.035 < 0.8 x 0.028: the two most confident stay at int4.
    assert counts(60) == [0, 2, 0]
    assert counts(0) == [0, 0, 0]


def test_walk_refunds_the_steps_a_later_one_made_unneeded() -> None:
    # FULL 100 bytes, int4 30, int2 20. The int4 token of confidence 0.004 is the cheapest step
    # (0.004 x 0.028), then dropping it (0.004 x 0.035 < 0.5 x 0.02 / 70), then the 0.5 token to int4:
    # 330 -> 320 -> 300 -> 230 <= 270. The last step freed 70 where 30 more were needed, so the drop
    # and then the int2 step are undone, latest first: [2, 1, 1] 250, [2, 2, 0] 260.
    profile, weights = [0.9, 0.8, 0.5, 0.004], [0.02 / 70, 0.28 / 10, 0.35 / 10]

    def fits(c: list[int], blocks: list[int]) -> bool:
        return 100 * c[0] + 30 * c[1] + 20 * c[2] <= 270

    assert walk(profile, [3, 1, 0], weights, fits) == ([2, 2, 0], [])
    assert refund([1, 2, 0], [2, 1, 0], [], fits) == ([2, 2, 0], [])
    # A step whose token a later kept step moved on is not undone; a block step is undone as a block.
    assert refund([1], [0, 1, 0], [], lambda c, b: True) == ([0, 1, 0], [])
    assert refund([3], [0, 1, 0], [2], lambda c, b: True) == ([0, 1, 0], [1])
    # With a rule on the walk (``allow``), nothing is refunded.
    assert walk(profile, [3, 1, 0], weights, fits, allow=lambda j, c, b: True) == ([2, 1, 0], [])


def test_last_tier_share_caps_the_walk_into_int2() -> None:
    # int2 cheaper per byte than dropping (int4 -> int2 0.1 / 10, int2 -> DISCARD 0.9 / 20): uncapped,
    # the walk fills int2; capped at half the kept tokens, it drops once int2 holds half.
    profile, weights = [0.9, 0.8, 0.5, 0.2], [0.02 / 70, 0.1 / 10, 0.9 / 20]
    capped = TierConfig(key_only=False, precisions=("int4", "int2"), last_tier_share=0.5)

    def counts(target: int, cfg: TierConfig | None) -> list[int]:
        def fits(c: list[int], blocks: list[int]) -> bool:
            return 100 * c[0] + 30 * c[1] + 20 * c[2] <= target
        allow = last_tier_cap(cfg, 3, 1) if cfg is not None else None
        return walk(profile, [4, 0, 0], weights, fits, allow=allow)[0]

    assert counts(100, None) == counts(100, capped) == [0, 2, 2]  # at the cap, not over it
    assert counts(90, None) == [0, 1, 3]
    assert counts(90, capped) == [0, 2, 1]  # int2 may not exceed half: the 0.2 token is dropped
    assert counts(60, None) == [0, 0, 3]
    assert counts(60, capped) == [0, 1, 1]
    # Frozen int2 blocks count toward the share (blocks of 4: one int2 block among 8 kept tokens).
    allow = last_tier_cap(capped, 3, 4)
    assert allow is not None and not allow(1, [0, 4, 0], [2])
    assert allow(1, [0, 5, 0], [2]) and allow(2, [0, 4, 0], [2])  # 4 of 9; a drop is never capped
    assert last_tier_cap(TierConfig(key_only=False, precisions=("int4",), last_tier_share=0.5), 2, 4) is None
    assert last_tier_cap(replace(capped, last_tier_share=None), 3, 4) is None
    with pytest.raises(ValueError, match="last_tier_share"):
        TierConfig(last_tier_share=1.5)


def test_walk_demotes_a_frozen_block_when_it_is_the_cheapest_step() -> None:
    weights = [0.02 / 70, 0.28 / 10, 0.7 / 20]

    def under(target: int):
        return lambda c, blocks: 100 * c[0] + 30 * c[1] + sum((30, 20, 0)[j - 1] for j in blocks) <= target

    # One int4 candidate (confidence 0.9) and one frozen int4 block (mean 0.1): the block goes to int2
    # (0.1 x 0.028 < 0.9 x 0.028), then it is dropped (0.1 x 0.035) before the candidate moves.
    assert walk([0.9], [0, 1, 0], weights, under(50), (0.1,), (1,)) == ([0, 1, 0], [2])
    assert walk([0.9], [0, 1, 0], weights, under(30), (0.1,), (1,)) == ([0, 1, 0], [3])


def test_assignment_is_by_rank_per_unit_and_one_way() -> None:
    conf = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.7, 0.9]])
    tiers = torch.tensor([[F, F, F, F], [F, I4, F, F]], dtype=torch.int8)
    out = assign_chain(conf, tiers, torch.ones(2, 4, dtype=torch.bool), [1, 2, 0], KEPT)
    # Unit 0: its best FULL, then the next two. Unit 1: token 1 is the second best but already int4,
    # so the best FULL-eligible ones are 3 (FULL) and then 1, 2 (int4); token 0 is dropped.
    assert out.tolist() == [[F, D, I4, I4], [D, I4, I4, F]]


def _assign_by_ranks(conf, tiers, eligible, counts, kept):
    """The assignment as first written: one rank per tier over its pool (``rank_desc``)."""
    from confkv_engine.retention.precision import chain_index
    from confkv_engine.retention.tiers import rank_desc

    out, cur, placed = tiers.clone(), chain_index(tiers, kept), torch.zeros_like(eligible)
    for j, t in enumerate(kept):
        pool = eligible & ~placed & (cur <= j)
        pick = pool & (rank_desc(conf, pool) < counts[j])
        out[pick] = t
        placed |= pick
    out[eligible & ~placed] = D
    return out


def test_one_sort_assigns_as_one_rank_per_tier_did() -> None:
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = 24
        conf = (torch.rand(3, n, generator=gen) * 4).round() / 4  # ties, broken by slot in both
        tiers = torch.tensor([F, I4, I2, D], dtype=torch.int8)[torch.randint(0, 4, (3, n), generator=gen)]
        eligible = torch.rand(3, n, generator=gen) < 0.8
        counts = torch.randint(-1, 9, (3,), generator=gen).tolist()
        got = assign_chain(conf, tiers, eligible, counts, KEPT)
        assert torch.equal(got, _assign_by_ranks(conf, tiers, eligible, counts, KEPT)), trial


def test_held_bytes_counts_staged_remainders_at_full_and_whole_blocks_at_codec_size() -> None:
    acct = KVAccounting(block_size=2, half_block_bytes=100, meta_bytes_per_slot=1,
                        pair_bytes=((I4, 60), (I2, 40)))
    # Frozen: one int4 block (and a dropped one). 3 FULL + 3 staged int4 (one block + 1) + 1 int2:
    # pool slots 3 + 1 + 1 = 5 -> 3 blocks of K and V; codec 60 + 60; metadata for 2 + 7 slots.
    assert held_bytes(acct, 0, [I4, D], 3, [3, 1], [I4, I2]) == 2 * 3 * 100 + 120 + 9
    # A shared prefix of 2 slots is one more pair of pool blocks.
    assert held_bytes(acct, 2, [], 2, [0, 0], [I4, I2]) == 2 * 2 * 100 + 4


def _decide(conf, tiers, target, length=7, prev=0, pos=None, frozen_end=0, acct=ACCT1):
    n = len(conf)
    pos = torch.arange(n)[None] if pos is None else torch.tensor([pos])
    out = decide_precision(pos, torch.tensor([tiers], dtype=torch.int8), torch.tensor([conf]), length, prev,
                           CFG, acct, target, None, 0, frozen_end)
    return out[0].tolist()


def test_exiting_tokens_take_threshold_tiers_sinks_and_window_stay_full() -> None:
    conf = [0.0, 0.95, 0.95, 0.8, 0.5, 0.0, 0.0]
    # Sink 0 and window 5, 6 are FULL; tokens 1..4 leave the window: FULL, FULL, int4, int2.
    assert _decide(conf, [F] * 7, target=10**6) == [F, F, F, I4, I2, F, F]
    assert _decide(conf, [F] * 7, target=550) == [F, F, F, I4, I2, F, F]  # 300 + 200 + 30 + 20


def test_budget_walk_on_exact_bytes() -> None:
    conf = [0.0, 0.95, 0.95, 0.8, 0.5, 0.0, 0.0]
    # 480: one FULL goes to int4 (the cheapest step); equal confidences: the later slot goes.
    assert _decide(conf, [F] * 7, target=480) == [F, F, I4, I4, I2, F, F]
    # 330 = the protected 300 + 30: int2 is cheaper per byte than dropping, so the walk puts slot 1
    # at int2 before it drops the others; once they are dropped, int2 was not needed (int4 fits the
    # 30 bytes exactly) and the refund gives slot 1 its int4 back.
    assert _decide(conf, [F] * 7, target=330) == [F, I4, D, D, D, F, F]


def test_frozen_blocks_are_demoted_whole_by_mean_confidence() -> None:
    # Slots 0, 1 are frozen int4 blocks (positions 2, 3); then sink 0, candidate 1, window 4, 5.
    pos = [2, 3, 0, 1, 4, 5]
    tiers = [I4, I4, F, F, F, F]
    conf = [0.6, 0.4, 0.0, 0.9, 0.0, 0.0]
    kw = {"length": 6, "prev": 6, "pos": pos, "frozen_end": 2}
    assert _decide(conf, tiers, target=460, **kw) == tiers  # 3 x 100 protected + 100 + 2 x 30 frozen
    # 380: the candidate goes to int4 (cheapest), then the frozen block with the lowest mean confidence
    # (slot 1, 0.4) to int2 before the 0.9 candidate would: 0.4 x 0.028 < 0.9 x 0.028.
    assert _decide(conf, tiers, target=380, **kw) == [I4, I2, F, I4, F, F]
    # 350: slot 1 again (int2 -> DISCARD: 0.4 x 0.035), then slot 0 (0.6 x 0.028) before the candidate.
    assert _decide(conf, tiers, target=350, **kw) == [I2, D, F, I4, F, F]


def test_chain_names_and_config_validation() -> None:
    assert chain_from_names(["full", "int4", "int2"]) == (False, ("int4", "int2"))
    assert chain_from_names(["full", "key_only"]) == (True, ())
    assert chain_from_names(["full"]) == (False, ())
    for bad in (["int4"], ["full", "int2", "int4"], ["full", "key_only", "int4"], ["full", "int4", "int4"],
                ["full", "int2", "int4", "full"], ["full", "full"]):  # the fuzzer's find: 'full' again
        with pytest.raises(ValueError):
            chain_from_names(bad)
    assert ConfKVSection.model_validate({"tiers": ["full", "int8", "int2"]}).tiers == ["full", "int8", "int2"]
    assert chain_from_names(["full", "int4", "k4v2", "int2"]) == (False, ("int4", "k4v2", "int2"))
    with pytest.raises(ValueError, match="highest first"):
        ConfKVSection.model_validate({"tiers": ["full", "int2", "int8"]})
    for bad in (["full", "k4v2", "int4"], ["full", "int2", "k4v2"]):  # k4v2 sits between int4 and int2
        with pytest.raises(ValueError, match="highest first"):
            chain_from_names(bad)
        with pytest.raises(ValueError, match="highest first"):
            TierConfig(key_only=False, precisions=tuple(bad[1:]))
    with pytest.raises(ValueError, match="only precision tiers"):
        ConfKVSection.model_validate({"tiers": ["full", "int4", "full"]})
    with pytest.raises(ValueError, match="precision tier"):
        TierConfig(key_only=False, precisions=("int3",))
    with pytest.raises(ValueError, match="precision_loss"):
        TierConfig(key_only=False, precisions=("int4",), precision_loss=(0.1, 0.05, 0.2, 0.3))
    with pytest.raises(ValueError, match="precision_loss"):  # one per tier: int8, int4, k4v2, int2
        TierConfig(key_only=False, precisions=("int4",), precision_loss=(0.002, 0.02, 0.8))


def test_room_for_the_next_interval_is_taken_against_the_budget_ahead() -> None:
    from confkv_engine.retention.policies import RetentionConfig
    from confkv_engine.retention.runtime import RetentionState

    # Blocks of 4 tokens, a FULL block pair 100 bytes, per-length budget 0.5, interval 4, no floor.
    acct = KVAccounting(block_size=4, half_block_bytes=50, pair_bytes=((I4, 30), (I2, 20)))
    tiers = TierConfig(sinks=1, window=4, key_only=False, precisions=("int4", "int2"), precision_window=4,
                       precision_floor=None)
    state = RetentionState(cfg=RetentionConfig(policy="conf-kv", tiers=tiers, budget=0.5), acct=acct,
                           num_layers=1, num_kv_heads=1, head_dim=4, group=1, interval=4)
    # At 64 tokens the budget is 800 bytes; from 65 on 850 (17 blocks' worth). Any of the next 4
    # tokens takes one new block (100), so the decision may keep 850 - 100 = 750, not 800 - 100.
    assert [state.target_bytes(64 + k, False) for k in range(5)] == [800, 850, 850, 850, 850]
    assert state.decision_target(64, False) == 750
    # At 66 the budget steps up only at 69: 850 - 100 binds (k = 1), not 900 - 100.
    assert state.decision_target(66, False) == 750
    for length in range(32, 200, 2):  # above the floor: never over the budget the interval passes
        kept = state.decision_target(length, False)
        for k in range(1, 5):
            assert kept + acct.held_bytes(k, k) <= state.target_bytes(length + k, False), (length, k)


def test_precision_floor_holds_the_other_chains_bytes_and_keeps_early_tokens_quantized() -> None:
    from confkv_engine.retention.policies import RetentionConfig
    from confkv_engine.retention.runtime import RetentionState

    # Blocks of 4 tokens: a FULL pair 100 bytes, int4 30, int2 20. Sink 1, window 4, the floor holds
    # the bytes of 8 recent tokens (with the sink: 9 -> 3 blocks, 300), the minimal window's 200.
    acct = KVAccounting(block_size=4, half_block_bytes=50, pair_bytes=((I4, 30), (I2, 20)))
    tiers = TierConfig(sinks=1, window=4, key_only=False, precisions=("int4", "int2"), precision_window=4,
                       precision_floor=8)
    assert tiers.floor_tokens == 9
    assert replace(tiers, precision_floor=None).floor_tokens == 5
    assert replace(tiers, precision_floor=2).floor_tokens == 5  # never under sinks + window
    assert TierConfig(sinks=4, window=32, precision_floor=48).floor_tokens == 36  # FULL chains: their own
    state = RetentionState(cfg=RetentionConfig(policy="conf-kv", tiers=tiers, budget=0.125), acct=acct,
                           num_layers=1, num_kv_heads=1, head_dim=4, group=1, interval=4)
    # At 16 tokens f x full is 100 bytes: the floor binds, and no room is taken for the next interval.
    assert state.decision_target(16, False) == 300
    old = RetentionState(cfg=RetentionConfig(policy="conf-kv", tiers=replace(tiers, precision_floor=None),
                                             budget=0.125), acct=acct, num_layers=1, num_kv_heads=1,
                         head_dim=4, group=1, interval=4)
    assert old.decision_target(16, False) == 200
    conf = torch.tensor([[0.0] + [0.5, 0.6, 0.7, 0.8, 0.3, 0.2, 0.4, 0.1, 0.85, 0.55, 0.65] + [0.0] * 4])

    def decide(target: int) -> list[int]:
        full = torch.full((1, 16), F, dtype=torch.int8)
        out = decide_precision(torch.arange(16)[None], full, conf, 16, 0, tiers, acct, target, 4, 0, 0)
        return out[0].tolist()

    # 300: tokens 1..11 leave the window at int4: two whole int4 blocks (60) and 3 staged beside the
    # 5 FULL (2 pool blocks, 200): 260 fits, nothing is dropped.
    assert decide(300) == [F] + [I4] * 11 + [F] * 4
    # 200 (the floor of sinks + window alone): the walk drops the least confident until 3 int4 tokens
    # are left, staged beside the FULL ones in the same 2 pool blocks.
    assert decide(200) == [F, D, D, I4, I4, D, D, D, D, I4, D, D, F, F, F, F]
