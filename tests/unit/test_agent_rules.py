"""The agent's alert rules: Prometheus pending/firing/resolved semantics and sliding windows, with
injected time (exact sequences)."""

from __future__ import annotations

import pytest

from confkv_agent.rules import (
    AlertEvaluator,
    AlertState,
    CounterWindow,
    Observation,
    Rule,
    RuleSpec,
    WindowSpans,
    rule_specs,
)
from confkv_api.config import AlertsSection

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
    assert specs["latencyMs"].threshold == 500.0
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


def test_latency_is_the_window_average_not_the_lifetime_average() -> None:
    ev = AlertEvaluator(AlertsSection.model_validate({"latencyMs": {"threshold": 500, "for": "0s"}}),
                        WindowSpans(latency=60))
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
