"""Budget schedule from uncertainty: the per-decision budget follows the model's next-token uncertainty.

The fixed budget holds ``f x full bytes`` at every decision point. A schedule lets the target of a
decision grow while the model's predictions over the last interval were uncertain and shrink while
they were confident, within the request's average:

    u_t    = mean uncertainty of the predictions made since the last decision
             (normalised entropy ``H / log V``, or ``1 - top-2 margin``, or the surprise ``1 - p``)
    z_t    = (u_t - running mean of u) / running std of u      (over this sequence's intervals so far)
    g_t    = 1 + strength x tanh(z_t)                           (in [1 - |strength|, 1 + |strength|])
    target = fixed_t + (g_t - 1) x ref_t, clamped to the running account below

``ref_t`` is what the fixed budget would hold after this decision (the whole tokens that fit
``fixed_t``, or all tokens while they fit), so neither block rounding nor an early phase with
nothing to evict counts as saving. ``credit`` is what the sequence
saved so far, ``sum_s (ref_s - held_s)`` over its decisions, and the schedule keeps it within
``+-slack x ref_t``: the held bytes summed over the decisions differ from the fixed budget's by at
most ``slack`` decisions' worth, so the *average* over ``T`` decisions is the fixed budget's within
``slack / T`` (up to the one block by which a target and what fits it can differ, which the next
decision pays back). The account is two-sided on purpose. Demotion is one-way: a growing budget
means *demoting less at this decision* (keeping more of the interval just appended, at most one
interval's worth per decision), never bringing a dropped token back, while shrinking is immediate;
an account that could only spend what was saved first ends below the budget (measured: 5-6% under
on average), i.e. it compares a smaller cache. With ``g = 1`` the target is exactly the fixed one.

The running normalisation makes ``g`` average about 1 without knowing the sequence's end, and a
sequence whose uncertainty never varies gets exactly the fixed budget. The peak a sequence can
reach is ``(1 + |strength|) x fixed``: admission reserves that (``peak_factor``). A negative
strength (shrink when uncertain) is accepted as the measured control.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from confkv_engine.retention import scorer
from confkv_engine.retention.scorer import SamplingSignal

UNCERTAINTY_SIGNALS = ("entropy", "margin", "surprise")


@dataclass(frozen=True)
class BudgetSchedule:
    """How the per-decision budget follows the sampling signal (see the module docstring)."""

    signal: str = "entropy"
    strength: float = 0.5
    slack: float = 0.25  # the account stays within +-slack x the fixed budget's bytes

    def __post_init__(self) -> None:
        if self.signal not in UNCERTAINTY_SIGNALS:
            raise ValueError(f"budget schedule signal must be one of {', '.join(UNCERTAINTY_SIGNALS)}, "
                             f"got {self.signal!r}")
        if not -1.0 < self.strength < 1.0 or self.strength == 0.0:
            raise ValueError(f"budget schedule strength must be in (-1, 1) and non-zero, got {self.strength}")
        if self.slack < 0:
            raise ValueError(f"budget schedule slack must be >= 0, got {self.slack}")

    @property
    def peak_factor(self) -> float:
        """Largest target over the fixed one (what admission must reserve)."""
        return 1.0 + abs(self.strength)


def uncertainty(signal: SamplingSignal, kind: str) -> Tensor:
    """Per prediction, in [0, 1]; higher means the model was less sure of the next token."""
    if kind not in ("entropy", "margin"):
        return 1.0 - signal.prob
    entropy, margin = scorer.spread_of(signal)
    return entropy if kind == "entropy" else 1.0 - margin


@dataclass
class ScheduleState:
    """One sequence's running account (bytes) and uncertainty statistics."""

    credit: float = 0.0
    intervals: int = 0
    u_mean: float = 0.0
    u_m2: float = 0.0
    u_sum: float = 0.0  # predictions since the last decision
    u_count: int = 0

    def observe(self, values: list[float]) -> None:
        """Uncertainties of predictions made since the last decision."""
        self.u_sum += sum(values)
        self.u_count += len(values)

    def _interval_z(self) -> float:
        """z-score of this interval's mean uncertainty against the intervals so far (itself included)."""
        if self.u_count == 0:
            return 0.0
        u = self.u_sum / self.u_count
        self.u_sum, self.u_count = 0.0, 0
        self.intervals += 1
        delta = u - self.u_mean
        self.u_mean += delta / self.intervals
        self.u_m2 += delta * (u - self.u_mean)
        if self.intervals < 2 or self.u_m2 <= 0:
            return 0.0
        return (u - self.u_mean) / math.sqrt(self.u_m2 / (self.intervals - 1))

    def target(self, schedule: BudgetSchedule, fixed: int, floor: int, reference: int | None = None) -> int:
        """Byte target of this decision. ``fixed``: the fixed budget's target; ``reference``: what the
        fixed budget would hold after this decision (default ``fixed``; less when block rounding or
        a sequence with nothing to evict leaves it under its target); ``floor``: the policy's floor.
        The schedule moves the target by ``(g - 1) x reference``, within the account's caps."""
        ref = fixed if reference is None else reference
        gain = 1.0 + schedule.strength * math.tanh(self._interval_z())
        bound = abs(schedule.strength) * ref
        spend_cap = min(bound, self.credit + schedule.slack * ref)  # never owe more than the slack
        save_cap = max(-bound, self.credit - schedule.slack * ref)  # never save more than the slack
        delta = min(spend_cap, max(save_cap, (gain - 1.0) * ref))
        return int(max(floor, fixed + delta))

    def record(self, reference: int, held: int) -> None:
        """After a decision: the sequence holds ``held`` bytes where the fixed budget would hold
        ``reference``."""
        self.credit += reference - held
