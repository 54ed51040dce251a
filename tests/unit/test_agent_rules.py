"""The agent's alert rules: Prometheus pending/firing/resolved semantics and sliding windows, with
injected time (exact sequences)."""

from __future__ import annotations

import pytest

from confkv_agent.main import next_tick
from confkv_agent.rules import (
    AlertEvaluator,
    AlertState,
    Buckets,
    CounterWindow,
    HistogramWindow,
    Observation,
    Rule,
    RuleSpec,
    WindowSpans,
    rule_specs,
)
from confkv_api.config import AlertsSection
from confkv_api.histograms import quantile

OK, P, F = AlertState.INACTIVE, AlertState.PENDING, AlertState.FIRING


def _run(rule: Rule, series: list[tuple[float, float | None]]) -> list[AlertState]:
    states = []
    for t, v in series:
        rule.evaluate(t, v)
        states.append(rule.state)
    return states


def test_defaults_come_from_the_deployment_guide() -> None:
    specs = rule_specs(AlertsSection())
    assert (specs["vram"].threshold, specs["vram"].for_seconds) == (0.85, 300.0)
    assert (specs["latencyMs"].threshold, specs["latencyMs"].signal) == (500.0, "ttft")
    assert specs["hitRate"].threshold == 0.70 and specs["hitRate"].fires_below
    assert (specs["oomPerHour"].threshold, specs["oomPerHour"].for_seconds) == (3.0, 0.0)


def test_pending_then_firing_after_for_then_resolved() -> None:
    rule = Rule(RuleSpec("vram", 0.85, for_seconds=300))
    series = [(0, 0.5), (10, 0.9), (200, 0.95), (309, 0.9), (310, 0.9), (400, 0.86), (410, 0.80), (420, 0.9)]
    assert _run(rule, series) == [OK, P, P, P, F, F, OK, P]


def test_resolution_is_reported_as_a_transition() -> None:
    rule = Rule(RuleSpec("latencyMs", 500, for_seconds=0))
    assert rule.evaluate(0, 100) is None
    fired = rule.evaluate(5, 600)
    assert fired is not None and (fired.old, fired.new, fired.resolved) == (OK, F, False)
    assert rule.evaluate(6, 700) is None
    resolved = rule.evaluate(7, 400)
    assert resolved is not None and resolved.resolved and resolved.at == 7 and resolved.value == 400


def test_pending_that_clears_never_fires_and_the_for_clock_restarts() -> None:
    rule = Rule(RuleSpec("vram", 0.85, for_seconds=60))
    series = [(0, 0.9), (59, 0.9), (60, 0.5), (61, 0.9), (120, 0.9), (121, 0.9)]
    assert _run(rule, series) == [P, P, OK, P, P, F]


def test_threshold_is_strict_and_hit_rate_fires_below() -> None:
    assert _run(Rule(RuleSpec("vram", 0.85, 0)), [(0, 0.85), (1, 0.8501)]) == [OK, F]
    assert _run(Rule(RuleSpec("hitRate", 0.7, 0)), [(0, 0.7), (1, 0.69), (2, 0.9)]) == [OK, F, OK]


def test_no_data_and_disabled_rules_never_fire() -> None:
    assert _run(Rule(RuleSpec("latencyMs", 500, 0)), [(0, 900), (1, None)]) == [F, OK]
    assert _run(Rule(RuleSpec("vram", 0.85, 0, enabled=False)), [(0, 1.0)]) == [OK]


def test_counter_window_increase_drops_old_samples_and_survives_resets() -> None:
    w = CounterWindow(span=60)
    w.add(0, 0)
    assert w.increase() is None
    w.add(30, 2)
    w.add(60, 5)
    assert w.increase() == (5,)
    w.add(90, 6)  # base is now the sample at t=30
    assert w.increase() == (4,)
    w.add(100, 1)  # counter went down: the engine restarted
    assert w.increase() is None
    w.add(110, 3)
    assert w.increase() == (2,)


def _obs(count: float, total: float, oom: float = 0, vram: float | None = 0.1, **kw: float) -> Observation:
    return Observation(vram_fraction=vram, latency_count=count, latency_seconds_sum=total, oom_total=oom,
                       **kw)


def test_e2e_without_a_histogram_is_the_window_average_not_the_lifetime_average() -> None:
    alerts = {"latencyMs": {"threshold": 500, "for": "0s", "signal": "e2e"}}
    ev = AlertEvaluator(AlertsSection.model_validate(alerts), WindowSpans(latency=60))
    assert ev.values(0, _obs(100, 10.0))["latencyMs"] is None  # one sample: no window yet
    assert ev.values(30, _obs(102, 12.0))["latencyMs"] == pytest.approx(1000.0)  # 2 requests, 2 s
    assert ev.values(60, _obs(102, 12.0))["latencyMs"] == pytest.approx(1000.0)  # t=0 is still the base
    assert ev.values(90, _obs(102, 12.0))["latencyMs"] is None  # nothing finished in the last minute
    assert ev.values(100, _obs(104, 12.5))["latencyMs"] == pytest.approx(250.0)


def test_oom_per_hour_counts_the_last_hour_and_fires_above_three() -> None:
    ev = AlertEvaluator(AlertsSection())
    seq = [(0, 0), (600, 2), (1200, 4), (3000, 4), (4300, 4)]
    out = []
    for t, oom in seq:
        ev.evaluate(t, _obs(0, 0, oom=oom))
        out.append((ev.value("oomPerHour"), ev.states()["oomPerHour"]))
    assert out == [(None, OK), (2, OK), (4, F), (4, F), (2, OK)]


def test_hit_rate_needs_a_prefix_cache() -> None:
    ev = AlertEvaluator(AlertsSection.model_validate({"hitRate": {"threshold": 0.7, "for": "0s"}}))
    ev.evaluate(0, _obs(0, 0))
    ev.evaluate(10, _obs(0, 0))
    assert ev.value("hitRate") is None and ev.states()["hitRate"] is OK
    ev2 = AlertEvaluator(AlertsSection.model_validate({"hitRate": {"threshold": 0.7, "for": "0s"}}))
    ev2.evaluate(0, _obs(0, 0, prefix_cache=True, prefix_queried_tokens=0, prefix_hit_tokens=0))
    transitions = ev2.evaluate(10, _obs(0, 0, prefix_cache=True, prefix_queried_tokens=100,
                                        prefix_hit_tokens=40))
    assert ev2.value("hitRate") == pytest.approx(0.4)
    assert [(t.alert, t.new) for t in transitions] == [("hitRate", F)]


def test_vram_rule_end_to_end_and_reconfiguration_keeps_state() -> None:
    ev = AlertEvaluator(AlertsSection())  # vram > 0.85 for 5m
    assert ev.evaluate(0, _obs(0, 0, vram=0.9))[0].new is P
    assert ev.evaluate(299, _obs(0, 0, vram=0.9)) == []
    assert ev.evaluate(300, _obs(0, 0, vram=0.9))[0].new is F
    ev.configure(AlertsSection.model_validate({"vram": {"threshold": 0.95, "for": "5m"}}))
    resolved = ev.evaluate(310, _obs(0, 0, vram=0.9))
    assert [(t.alert, t.resolved) for t in resolved] == [("vram", True)]


BOUNDS = (0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))


def _hist(*per_bucket: float) -> Buckets:
    """Cumulative buckets from per-bucket counts (one per bound of BOUNDS)."""
    counts, total = [], 0.0
    for n in per_bucket:
        total += n
        counts.append(total)
    return Buckets(BOUNDS, tuple(counts))


def _lat(ttft: Buckets | None = None, tpot: Buckets | None = None, waiting: float = 0,
         preempted: float = 0) -> Observation:
    return Observation(vram_fraction=None, latency_count=0, latency_seconds_sum=0, oom_total=0, ttft=ttft,
                       tpot=tpot, num_waiting=waiting, preemptions_total=preempted)


def test_latency_is_the_p95_of_time_to_first_token_over_the_window() -> None:
    ev = AlertEvaluator(AlertsSection.model_validate({"latencyMs": {"threshold": 500, "for": "0s"}}),
                        WindowSpans(latency=60))
    ev.evaluate(0, _lat(_hist(1000, 0, 0, 0, 0, 0)))  # a fast past: not in any window below
    assert ev.value("latencyMs") is None
    # 100 new requests: 90 under 100 ms, 10 between 0.5 s and 1 s. p95 is rank 95 of 100: half way
    # into the (0.5, 1] bucket (Prometheus interpolates linearly): 750 ms.
    transitions = ev.evaluate(30, _lat(_hist(1090, 0, 0, 10, 0, 0)))
    assert ev.value("latencyMs") == pytest.approx(750.0)
    assert [(t.alert, t.new) for t in transitions] == [("latencyMs", F)]
    # (Over the lifetime histogram the p95 would be under 100 ms: the window is what counts.)
    ev.evaluate(61, _lat(_hist(1190, 0, 0, 10, 0, 0)))  # base still t=0: 190 fast, 10 slow
    assert ev.value("latencyMs") == pytest.approx(100.0)
    ev.evaluate(95, _lat(_hist(1290, 0, 0, 10, 0, 0)))  # base t=30: 200 fast, none slow
    assert ev.value("latencyMs") == pytest.approx(95.0) and ev.states()["latencyMs"] is OK
    ev.evaluate(200, _lat(_hist(1290, 0, 0, 10, 0, 0)))  # nothing finished in the window: no data
    assert ev.value("latencyMs") is None


def test_the_signal_selects_the_histogram_and_ttft_without_one_is_no_data() -> None:
    tpot = AlertsSection.model_validate({"latencyMs": {"threshold": 200, "for": "0s", "signal": "tpot"}})
    ev = AlertEvaluator(tpot)
    ev.evaluate(0, _lat(ttft=_hist(0, 0, 0, 0, 0, 0), tpot=_hist(0, 0, 0, 0, 0, 0)))
    ev.evaluate(10, _lat(ttft=_hist(0, 0, 0, 0, 100, 0), tpot=_hist(0, 100, 0, 0, 0, 0)))
    assert 100 < (ev.value("latencyMs") or 0) <= 250 and ev.states()["latencyMs"] is F
    no_hist = AlertEvaluator(AlertsSection.model_validate({"latencyMs": {"threshold": 1, "for": "0s"}}))
    for t in (0, 10):
        no_hist.evaluate(t, Observation(vram_fraction=None, latency_count=t, latency_seconds_sum=9.0 * t,
                                        oom_total=0))
    assert no_hist.value("latencyMs") is None and no_hist.states()["latencyMs"] is OK


def test_new_bucket_bounds_start_the_window_again() -> None:
    w = HistogramWindow(span=60)
    w.add(0, Buckets((1.0, float("inf")), (5, 5)))
    w.add(10, Buckets((1.0, float("inf")), (6, 6)))
    assert w.quantile(0.5) == pytest.approx(0.5)
    w.add(20, Buckets((0.5, 1.0, float("inf")), (1, 1, 1)))  # the engine restarted with other buckets
    assert w.quantile(0.5) is None


def test_latency_context_sees_the_queue_and_preemptions_of_the_window() -> None:
    ev = AlertEvaluator(AlertsSection(), WindowSpans(latency=60))
    ev.evaluate(0, _lat(waiting=4, preempted=7))
    ev.evaluate(30, _lat(waiting=0, preempted=7))
    ctx = ev.latency_context()
    assert (ctx.signal, ctx.mean_waiting, ctx.preemptions) == ("ttft", 2, 0)
    ev.evaluate(70, _lat(waiting=1, preempted=9))  # the queue at t=0 is out of the window
    ctx = ev.latency_context()
    assert (ctx.mean_waiting, ctx.preemptions) == (0.5, 2)


def test_prometheus_quantile_edges() -> None:
    inf = float("inf")
    assert quantile(0.95, (1.0, inf), (0, 0)) is None  # empty: no data
    assert quantile(0.5, (1.0, 2.0, inf), (0, 10, 10)) == pytest.approx(1.5)
    assert quantile(0.95, (1.0, 2.0, inf), (0, 0, 10)) == 2.0  # in +Inf: the largest finite bound
    assert quantile(0.25, (1.0, inf), (4, 4)) == pytest.approx(0.25)  # the first bucket starts at 0
    with pytest.raises(ValueError):
        quantile(0.95, (1.0, 2.0), (1, 2))


def test_ticks_keep_a_fixed_rate_and_never_catch_up_after_an_overrun() -> None:
    assert next_tick(10.0, 10.05, 0.2) == pytest.approx(10.2)  # a 50 ms tick does not delay the next
    assert next_tick(10.0, 10.5, 0.2) == 10.5  # overran by 0.3 s: the next tick starts now, no burst
