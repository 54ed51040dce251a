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
- ``latencyMs``: the p95 of its ``signal`` (time to first token by default, or time per output token,
  or end to end) over the requests finished in the last ``latency`` seconds, in ms, from the increase
  of the engine's histogram buckets (``histogram_quantile`` of ``rate(..._bucket)``). An engine without
  that histogram gives no data, except for ``e2e``, which falls back to the window's average latency
  (the engine's latency count and sum);
- ``hitRate``: prefix-cache hit tokens / queried tokens in the last ``hit_rate`` seconds;
- ``oomPerHour``: out-of-memory errors in the last hour.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from confkv_api.config import LATENCY_QUANTILE, AlertsSection
from confkv_api.histograms import quantile
from confkv_api.units import parse_duration

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
    signal: str = ""  # latencyMs only: ttft, tpot or e2e

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
    return {name: RuleSpec(name, rule.threshold, parse_duration(rule.for_), rule.enabled,
                           getattr(rule, "signal", ""))
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
class Buckets:
    """One cumulative histogram as the engine reports it (seconds; the last bound is +Inf)."""

    upper_bounds: tuple[float, ...]
    cumulative: tuple[float, ...]


class HistogramWindow:
    """The increase of each bucket over the window; a new set of bounds starts the window again."""

    def __init__(self, span: float) -> None:
        self._window = CounterWindow(span)
        self._bounds: tuple[float, ...] | None = None

    def add(self, now: float, buckets: Buckets | None) -> None:
        if buckets is None:
            return
        if buckets.upper_bounds != self._bounds:
            self._window = CounterWindow(self._window.span)
            self._bounds = buckets.upper_bounds
        self._window.add(now, *buckets.cumulative)

    def quantile(self, q: float) -> float | None:
        increase = self._window.increase()
        if increase is None or self._bounds is None:
            return None
        return quantile(q, self._bounds, increase)


class GaugeWindow:
    """The mean of a gauge's samples in the last ``span`` seconds."""

    def __init__(self, span: float) -> None:
        self.span = span
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float) -> None:
        self._samples.append((now, value))
        while self._samples and self._samples[0][0] < now - self.span:
            self._samples.popleft()

    def mean(self) -> float:
        return sum(v for _, v in self._samples) / len(self._samples) if self._samples else 0.0


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
    ttft: Buckets | None = None
    tpot: Buckets | None = None
    e2e: Buckets | None = None
    num_waiting: float = 0
    preemptions_total: float = 0


@dataclass(frozen=True)
class WindowSpans:
    latency: float = 60.0
    hit_rate: float = 300.0
    oom: float = 3600.0


@dataclass(frozen=True)
class LatencyContext:
    """What the latency rule's window saw besides the signal: the cause of a breach (planner)."""

    signal: str
    mean_waiting: float  # requests waiting in the queue, averaged over the window's samples
    preemptions: float  # sequences preempted (their KV recomputed later)


class AlertEvaluator:
    """All rules, their windows and their states."""

    def __init__(self, alerts: AlertsSection, spans: WindowSpans | None = None) -> None:
        spans = spans or WindowSpans()
        self.rules = {name: Rule(spec) for name, spec in rule_specs(alerts).items()}
        self._latency = CounterWindow(spans.latency)
        self._signals = {s: HistogramWindow(spans.latency) for s in ("ttft", "tpot", "e2e")}
        self._waiting = GaugeWindow(spans.latency)
        self._preemptions = CounterWindow(spans.latency)
        self._hits = CounterWindow(spans.hit_rate)
        self._oom = CounterWindow(spans.oom)

    def configure(self, alerts: AlertsSection) -> None:
        """New thresholds, ``for`` durations, signal or enablement; states and windows carry over."""
        for name, spec in rule_specs(alerts).items():
            self.rules[name].spec = spec

    def _latency_ms(self, signal: str) -> float | None:
        p95 = self._signals[signal].quantile(LATENCY_QUANTILE)
        if p95 is not None:
            return p95 * 1000.0
        window = self._latency.increase()
        if signal == "e2e" and window and window[0] > 0:  # an engine without the e2e histogram
            return window[1] / window[0] * 1000.0
        return None

    def values(self, now: float, obs: Observation) -> dict[str, float | None]:
        self._latency.add(now, obs.latency_count, obs.latency_seconds_sum)
        for signal, buckets in (("ttft", obs.ttft), ("tpot", obs.tpot), ("e2e", obs.e2e)):
            self._signals[signal].add(now, buckets)
        self._waiting.add(now, obs.num_waiting)
        self._preemptions.add(now, obs.preemptions_total)
        self._oom.add(now, obs.oom_total)
        if obs.prefix_cache:
            self._hits.add(now, obs.prefix_queried_tokens, obs.prefix_hit_tokens)
        hits, oom = self._hits.increase(), self._oom.increase()
        return {
            "vram": obs.vram_fraction,
            "latencyMs": self._latency_ms(self.rules["latencyMs"].spec.signal or "ttft"),
            "hitRate": hits[1] / hits[0] if obs.prefix_cache and hits and hits[0] > 0 else None,
            "oomPerHour": oom[0] if oom is not None else None,
        }

    def latency_context(self) -> LatencyContext:
        preempted = self._preemptions.increase()
        return LatencyContext(self.rules["latencyMs"].spec.signal or "ttft", self._waiting.mean(),
                              preempted[0] if preempted else 0.0)

    def evaluate(self, now: float, obs: Observation) -> list[Transition]:
        values = self.values(now, obs)
        transitions = [self.rules[name].evaluate(now, values[name]) for name in ALERTS]
        return [t for t in transitions if t is not None]

    def states(self) -> dict[str, AlertState]:
        return {name: rule.state for name, rule in self.rules.items()}

    def value(self, name: str) -> float | None:
        return self.rules[name].value
