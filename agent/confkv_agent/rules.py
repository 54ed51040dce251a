"""Alert rules with Prometheus semantics, as a pure state machine (time is always passed in).

Each rule compares one observed value with its threshold (``hitRate`` fires *below* it, the others
above). A breached rule is ``pending`` until it has been breached for its ``for`` duration, then
``firing``; ``for: 0s`` fires at once. When the condition stops holding the rule goes back to
``inactive`` (from ``firing`` that is a *resolution*). No data (``None``) never fires: an idle engine
has no average latency, an engine without a prefix cache has no hit rate.

Values come from sliding windows over the engine's cumulative counters, like PromQL's
``rate(sum)/rate(count)`` and ``increase(oom[1h])`` (no extrapolation; a counter that goes down means
the engine restarted, and the window starts again from that sample):

- ``vram``: used fraction of device memory (a gauge: the latest sample);
- ``latencyMs``: average end-to-end latency of the requests finished in the last ``latency`` seconds;
- ``hitRate``: prefix-cache hit tokens / queried tokens in the last ``hit_rate`` seconds;
- ``oomPerHour``: out-of-memory errors in the last hour.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from confkv_api.config import AlertsSection, parse_duration

ALERTS: tuple[str, ...] = ("vram", "latencyMs", "hitRate", "oomPerHour")
_BELOW = frozenset({"hitRate"})


class AlertState(StrEnum):
    INACTIVE = "inactive"
    PENDING = "pending"
    FIRING = "firing"


@dataclass(frozen=True)
class RuleSpec:
    name: str
    threshold: float
    for_seconds: float
    enabled: bool = True

    @property
    def fires_below(self) -> bool:
        return self.name in _BELOW

    def breached(self, value: float | None) -> bool:
        if not self.enabled or value is None:
            return False
        return value < self.threshold if self.fires_below else value > self.threshold


def rule_specs(alerts: AlertsSection) -> dict[str, RuleSpec]:
    """The four rules of an ``alerts`` section, keyed by their camelCase name."""
    fields = {"vram": alerts.vram, "latencyMs": alerts.latency_ms, "hitRate": alerts.hit_rate,
              "oomPerHour": alerts.oom_per_hour}
    return {name: RuleSpec(name, rule.threshold, parse_duration(rule.for_), rule.enabled)
            for name, rule in fields.items()}


@dataclass(frozen=True)
class Transition:
    alert: str
    old: AlertState
    new: AlertState
    at: float
    value: float | None

    @property
    def resolved(self) -> bool:
        return self.old is AlertState.FIRING and self.new is AlertState.INACTIVE


class Rule:
    """One alert's state machine."""

    def __init__(self, spec: RuleSpec) -> None:
        self.spec = spec
        self.state = AlertState.INACTIVE
        self.active_since: float | None = None  # when the current breach began
        self.value: float | None = None

    def evaluate(self, now: float, value: float | None) -> Transition | None:
        self.value = value
        old = self.state
        if not self.spec.breached(value):
            self.state, self.active_since = AlertState.INACTIVE, None
        elif self.active_since is None:
            self.active_since = now
            self.state = AlertState.FIRING if self.spec.for_seconds <= 0 else AlertState.PENDING
        elif self.state is AlertState.PENDING and now - self.active_since >= self.spec.for_seconds:
            self.state = AlertState.FIRING
        return Transition(self.spec.name, old, self.state, now, value) if self.state is not old else None


class CounterWindow:
    """Samples of cumulative counters over the last ``span`` seconds (plus one older base sample)."""

    def __init__(self, span: float) -> None:
        self.span = span
        self._samples: deque[tuple[float, tuple[float, ...]]] = deque()

    def add(self, now: float, *values: float) -> None:
        if self._samples and any(v < p for v, p in zip(values, self._samples[-1][1], strict=True)):
            self._samples.clear()  # counter reset: the engine restarted
        self._samples.append((now, values))
        # Keep the newest sample at or before the window start as the base of the increase.
        while len(self._samples) >= 2 and self._samples[1][0] <= now - self.span:
            self._samples.popleft()

    def increase(self) -> tuple[float, ...] | None:
        """Increase of each counter over the window; None before there are two samples."""
        if len(self._samples) < 2:
            return None
        first, last = self._samples[0][1], self._samples[-1][1]
        return tuple(b - a for a, b in zip(first, last, strict=True))


@dataclass(frozen=True)
class Observation:
    """What the collector saw at one instant (cumulative counters as the engine reports them)."""

    vram_fraction: float | None
    latency_count: float
    latency_seconds_sum: float
    oom_total: float
    prefix_cache: bool = False
    prefix_queried_tokens: float = 0
    prefix_hit_tokens: float = 0


@dataclass(frozen=True)
class WindowSpans:
    latency: float = 60.0
    hit_rate: float = 300.0
    oom: float = 3600.0


class AlertEvaluator:
    """All rules, their windows and their states."""

    def __init__(self, alerts: AlertsSection, spans: WindowSpans | None = None) -> None:
        spans = spans or WindowSpans()
        self.rules = {name: Rule(spec) for name, spec in rule_specs(alerts).items()}
        self._latency = CounterWindow(spans.latency)
        self._hits = CounterWindow(spans.hit_rate)
        self._oom = CounterWindow(spans.oom)

    def configure(self, alerts: AlertsSection) -> None:
        """New thresholds, ``for`` durations or enablement; states and windows carry over."""
        for name, spec in rule_specs(alerts).items():
            self.rules[name].spec = spec

    def values(self, now: float, obs: Observation) -> dict[str, float | None]:
        self._latency.add(now, obs.latency_count, obs.latency_seconds_sum)
        self._oom.add(now, obs.oom_total)
        if obs.prefix_cache:
            self._hits.add(now, obs.prefix_queried_tokens, obs.prefix_hit_tokens)
        latency, hits, oom = self._latency.increase(), self._hits.increase(), self._oom.increase()
        return {
            "vram": obs.vram_fraction,
            "latencyMs": latency[1] / latency[0] * 1000.0 if latency and latency[0] > 0 else None,
            "hitRate": hits[1] / hits[0] if obs.prefix_cache and hits and hits[0] > 0 else None,
            "oomPerHour": oom[0] if oom is not None else None,
        }

    def evaluate(self, now: float, obs: Observation) -> list[Transition]:
        values = self.values(now, obs)
        transitions = [self.rules[name].evaluate(now, values[name]) for name in ALERTS]
        return [t for t in transitions if t is not None]

    def states(self) -> dict[str, AlertState]:
        return {name: rule.state for name, rule in self.rules.items()}

    def value(self, name: str) -> float | None:
        return self.rules[name].value
