"""Budget schedule from uncertainty: the running account holds the average and targets stay in bounds."""

from __future__ import annotations

import random

import pytest
import torch

from confkv_engine.retention.budget import BudgetSchedule, ScheduleState, uncertainty
from confkv_engine.retention.policies import RetentionConfig, SlotView, select, window_limit
from confkv_engine.retention.scorer import sampling_signal
from confkv_engine.retention.tiers import KVAccounting, Tier, TierConfig

FLOOR = 500


def _simulate(schedule: BudgetSchedule, steps: int, alive_cap: float | None = None, seed: int = 0):
    """Decisions every interval: fixed grows with the length; the policy meets the target exactly,
    or (``alive_cap``) cannot grow past ``alive_cap`` x fixed (dropped tokens never come back)."""
    rng = random.Random(seed)
    state = ScheduleState()
    rows = []
    for t in range(1, steps + 1):
        fixed = 1000 * t
        state.observe([rng.random() ** 3 for _ in range(32)])
        target = state.target(schedule, fixed, FLOOR)
        held = target if alive_cap is None else min(target, int(alive_cap * fixed))
        state.record(fixed, held)
        rows.append((fixed, target, held, state.credit))
    return rows


@pytest.mark.parametrize("strength", [0.5, -0.5, 0.9])
@pytest.mark.parametrize("slack", [0.0, 1.0, 3.0])
def test_running_total_stays_within_the_slack_of_the_fixed_schedule(strength: float, slack: float) -> None:
    schedule = BudgetSchedule(strength=strength, slack=slack)
    total_fixed = total_held = 0
    varied = False
    for fixed, target, held, credit in _simulate(schedule, 200):
        total_fixed += fixed
        total_held += held
        assert abs(total_fixed - total_held) <= slack * fixed + 1  # int() rounding of the target
        assert credit == total_fixed - total_held
        assert (1 - abs(strength)) * fixed - 1 <= target <= (1 + abs(strength)) * fixed
        varied |= target != fixed
    assert varied or slack == 0.0
    # The average over the decisions: the fixed schedule's within slack / decisions.
    assert abs(total_held / total_fixed - 1) <= slack * 200_000 / total_fixed + 1e-6


def test_slack_zero_is_the_fixed_budget() -> None:
    rows = _simulate(BudgetSchedule(slack=0.0), 50)
    assert all(target == fixed for fixed, target, _, _ in rows)


def test_constant_uncertainty_gives_exactly_the_fixed_budget() -> None:
    state, schedule = ScheduleState(), BudgetSchedule(strength=0.8, slack=2.0)
    for t in range(1, 30):
        state.observe([0.3] * 32)
        assert state.target(schedule, 1000 * t, FLOOR) == 1000 * t
        state.record(1000 * t, 1000 * t)


def test_budget_grows_on_an_uncertain_interval_and_the_inverse_control_shrinks() -> None:
    intervals = [0.1, 0.2, 0.1, 0.2, 0.1, 0.15, 0.9]
    for strength in (0.5, -0.5):
        state, schedule = ScheduleState(), BudgetSchedule(strength=strength, slack=2.0)
        ratios = []
        for t, u in enumerate(intervals, start=1):
            state.observe([u] * 32)
            ratios.append(state.target(schedule, 1000 * t, FLOOR) / (1000 * t))
            state.record(1000 * t, int(ratios[-1] * 1000 * t))
        assert ratios[0] == 1.0  # one interval: no spread to compare it with
        if strength > 0:
            assert min(ratios[:6]) < 1.0 < ratios[6] <= 1.5
        else:
            assert 0.5 <= ratios[6] < 1.0 < max(ratios[:6])


def test_floor_holds_and_reference_below_fixed_moves_around_the_fixed_target() -> None:
    low = ScheduleState()
    for t in range(1, 10):
        low.observe([0.01 if t < 9 else 0.0] * 32)
        assert low.target(BudgetSchedule(strength=0.9, slack=5.0), 600, FLOOR) >= FLOOR
        low.record(600, 600)
    # With a reference under the fixed target (block rounding), g = 1 still gives the fixed target.
    flat = ScheduleState()
    flat.observe([0.3] * 32)
    assert flat.target(BudgetSchedule(), 1000, FLOOR, reference=900) == 1000


def test_one_way_demotion_keeps_the_account_bounded_from_above() -> None:
    total_fixed = total_held = 0
    for fixed, _, held, _ in _simulate(BudgetSchedule(strength=0.9, slack=1.0), 100, alive_cap=1.1):
        total_fixed, total_held = total_fixed + fixed, total_held + held
        assert total_held <= total_fixed + fixed
@pytest.mark.parametrize("kwargs", [{"signal": "nope"}, {"strength": 0.0}, {"strength": 1.0},
                                    {"strength": -1.5}, {"slack": -0.1}])
def test_schedule_config_errors_are_clear(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="budget schedule"):
        BudgetSchedule(**kwargs)


def test_uncertainty_signals_are_in_unit_range_and_ordered() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    sig = sampling_signal(logits, torch.tensor([0, 0]))
    for kind in ("entropy", "margin", "surprise"):
        u = uncertainty(sig, kind)
        assert bool(((u >= 0) & (u <= 1)).all())
        assert float(u[0]) < float(u[1])  # the flat distribution is the uncertain one


def test_a_target_that_jumps_up_does_not_pull_tiered_tokens_back_into_the_window() -> None:
    # Two units that kept as many tokens before the last window ([200, 232) at length 232) but not
    # the same ones. A target that jumps up (a scheduled budget) widens the window to 80 tokens:
    # uncapped its start 184 would protect 16 more slots in unit 0 than in unit 1.
    middle = {0: range(100, 200), 1: range(80, 180)}
    pos = torch.stack([torch.tensor([*range(4), *middle[u], *range(200, 264)]) for u in (0, 1)])
    n = pos.shape[1]
    view = SlotView(pos=pos, tiers=torch.zeros(2, n, dtype=torch.int8),
                    acc=torch.rand(2, n, generator=torch.Generator().manual_seed(0)), norm=torch.ones(2, n),
                    c_samp=torch.zeros(2, n), length=264, prev_length=232, group=1, prev_window=32, heads=2)
    cfg = RetentionConfig(policy="conf-kv-discard", tiers=TierConfig(window=32), budget=0.5)
    acct = KVAccounting(16, 1000)
    target = acct.held_bytes(160, 160)
    assert cfg.recent_window(acct, target) == 80
    assert window_limit(264, 232, 32) == 64 and cfg.recent_window(acct, target, 64) == 64
    kept = (select(view, cfg, acct, target) != Tier.DISCARD).sum(-1)
    assert kept[0] == kept[1] <= 160
