"""The agent's remediation planner: playbook order, cooldowns, unavailable steps, allowedActions,
dry-run and revert after sustained health, with injected time (exact sequences)."""

from __future__ import annotations

from typing import Any

from confkv_agent.planner import BATCH, CACHE_SIZE, HIGH, LRU_K, MEDIUM, Action, Planner, PolicyView
from confkv_agent.rules import AlertState
from confkv_api.config import RemediationSection

OK, P, F = AlertState.INACTIVE, AlertState.PENDING, AlertState.FIRING
VIEW = PolicyView(max_batch_size=64, lru_k=2, high=0.9, medium=0.7, kv_bytes_total=1000)
BASE: dict[str, Any] = {BATCH: 64, LRU_K: 2, CACHE_SIZE: None, HIGH: 0.9, MEDIUM: 0.7}


def _planner(**remediation: Any) -> Planner:
    return Planner(RemediationSection.model_validate({"cooldown": "60s", **remediation}))


def _names(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.alert, a.describe()) for a in actions]


def test_latency_playbook_with_cooldown_and_verification() -> None:
    p = _planner()
    firing = {"latencyMs": F}
    first = p.plan(0, firing, VIEW, BASE)
    assert _names(first) == [("latencyMs", "smallerBatches(engine.maxBatchSize=48)")]
    p.record(0, first[0], "applied")
    assert p.plan(30, firing, VIEW, BASE) == []  # cooling down
    second = p.plan(60, firing, VIEW, BASE)  # still firing after the cooldown: next step
    assert _names(second) == [("latencyMs", "recommendScaleOut")]
    p.record(60, second[0], "recommended")
    assert p.plan(500, firing, VIEW, BASE) == []  # playbook exhausted
    assert p.overrides() == {BATCH: 48}


def test_unavailable_steps_are_skipped_at_once() -> None:
    p = _planner()
    vram = {"vram": F}
    a = p.plan(0, vram, VIEW, BASE)
    assert _names(a) == [("vram", "compress")]
    p.record(0, a[0], "unavailable")
    b = p.plan(0, vram, VIEW, BASE)  # same instant: no cooldown was consumed
    assert _names(b) == [("vram", f"lowerMaxCacheSize({CACHE_SIZE}=800)")]
    p.record(0, b[0], "unavailable")
    c = p.plan(0, vram, VIEW, BASE)
    assert _names(c) == [("vram", f"stricterThresholds({HIGH}=0.92, {MEDIUM}=0.75)")]
    p.record(0, c[0], "applied")
    assert p.plan(1000, vram, VIEW, BASE) == []


def test_oom_halves_then_compresses_and_hit_rate_raises_k_once() -> None:
    p = _planner()
    a = p.plan(0, {"oomPerHour": F, "hitRate": F}, VIEW, BASE)
    assert _names(a) == [("oomPerHour", "halveBatchSize(engine.maxBatchSize=32)"),
                         ("hitRate", f"raiseLruK({LRU_K}=3)")]
    for action in a:
        p.record(0, action, "applied")
    raised = PolicyView(32, 3, 0.9, 0.7, 1000)
    b = p.plan(60, {"oomPerHour": F, "hitRate": F}, raised, BASE)
    assert _names(b) == [("oomPerHour", "compress"), ("hitRate", "warmup")]


def test_steps_that_change_nothing_are_skipped() -> None:
    p = _planner()
    at_max = PolicyView(max_batch_size=1, lru_k=3, high=0.9, medium=0.7, kv_bytes_total=1000)
    assert _names(p.plan(0, {"hitRate": F, "latencyMs": F}, at_max, BASE)) == [
        ("latencyMs", "recommendScaleOut"), ("hitRate", "warmup")]


def test_allowed_actions_filter() -> None:
    p = _planner(allowedActions=["recommendScaleOut", "compress"])
    assert _names(p.plan(0, {"latencyMs": F, "oomPerHour": F}, VIEW, BASE)) == [
        ("oomPerHour", "compress"), ("latencyMs", "recommendScaleOut")]


def test_dry_run_proposes_and_advances_but_records_no_override() -> None:
    p = _planner(dryRun=True)
    a = p.plan(0, {"latencyMs": F}, VIEW, BASE)
    assert a[0].dry_run and a[0].name == "smallerBatches"
    p.record(0, a[0], "dry-run")
    assert p.overrides() == {}
    assert _names(p.plan(60, {"latencyMs": F}, VIEW, BASE)) == [("latencyMs", "recommendScaleOut")]
    # Healthy for the revert period: the track resets without a revert (nothing was changed).
    assert p.plan(100, {"latencyMs": OK}, VIEW, BASE) == []
    assert p.plan(160, {"latencyMs": OK}, VIEW, BASE) == []
    again = p.plan(161, {"latencyMs": F}, VIEW, BASE)
    assert _names(again) == [("latencyMs", "smallerBatches(engine.maxBatchSize=48)")]


def test_disabled_remediation_plans_nothing_and_drops_overrides() -> None:
    assert _planner(enabled=False).plan(0, {"latencyMs": F, "vram": F}, VIEW, BASE) == []
    p = _planner()
    p.record(0, p.plan(0, {"latencyMs": F}, VIEW, BASE)[0], "applied")
    assert p.overrides() == {BATCH: 48}
    p.configure(RemediationSection.model_validate({"enabled": False}))
    assert p.overrides() == {} and p.plan(100, {"latencyMs": F}, VIEW, BASE) == []


def test_revert_after_sustained_health() -> None:
    p = _planner()
    a = p.plan(0, {"latencyMs": F}, VIEW, BASE)
    p.record(0, a[0], "applied")
    assert p.plan(10, {"latencyMs": OK}, VIEW, BASE) == []  # healthy since 10
    assert p.plan(40, {"latencyMs": P}, VIEW, BASE) == []  # pending again: not healthy
    assert p.plan(50, {"latencyMs": OK}, VIEW, BASE) == []  # healthy since 50
    assert p.plan(109, {"latencyMs": OK}, VIEW, BASE) == []
    revert = p.plan(110, {"latencyMs": OK}, VIEW, BASE)
    assert _names(revert) == [("latencyMs", "revert(engine.maxBatchSize=64)")]
    p.record(110, revert[0], "applied")
    assert p.overrides() == {}
    assert p.plan(500, {"latencyMs": OK}, VIEW, BASE) == []
    # Firing again starts the playbook from its first step.
    assert p.plan(501, {"latencyMs": F}, VIEW, BASE)[0].name == "smallerBatches"


def test_revert_keeps_another_alerts_override_and_combines_conservatively() -> None:
    p = _planner()
    lat = p.plan(0, {"latencyMs": F}, VIEW, BASE)[0]
    p.record(0, lat, "applied")  # 48
    oom = p.plan(1, {"latencyMs": F, "oomPerHour": F}, PolicyView(48, 2, 0.9, 0.7, 1000), BASE)[0]
    assert oom.describe() == "halveBatchSize(engine.maxBatchSize=24)"
    p.record(1, oom, "applied")
    assert p.overrides() == {BATCH: 24}
    p.plan(100, {"latencyMs": OK, "oomPerHour": F}, VIEW, BASE)
    revert = p.plan(160, {"latencyMs": OK, "oomPerHour": F}, VIEW, BASE)
    assert _names(revert) == [("oomPerHour", "compress"), ("latencyMs", "revert(engine.maxBatchSize=24)")]


def test_failed_actions_are_retried_after_the_cooldown() -> None:
    p = _planner()
    a = p.plan(0, {"latencyMs": F}, VIEW, BASE)[0]
    p.record(0, a, "failed")
    assert p.plan(59, {"latencyMs": F}, VIEW, BASE) == []
    assert p.plan(60, {"latencyMs": F}, VIEW, BASE)[0].name == "smallerBatches"


def test_latency_cause_follows_the_signal_the_queue_and_preemptions() -> None:
    from confkv_agent.planner import latency_cause

    assert latency_cause("ttft", mean_waiting=0, preemptions=0) == "prefill"
    assert latency_cause("ttft", mean_waiting=3, preemptions=0) == "queueing"
    assert latency_cause("ttft", mean_waiting=0.1, preemptions=0) == "prefill"  # a step's wait now and then
    assert latency_cause("e2e", mean_waiting=3, preemptions=0) == "queueing"
    assert latency_cause("e2e", mean_waiting=0, preemptions=0) == "decode"
    assert latency_cause("tpot", mean_waiting=3, preemptions=0) == "decode"
    assert latency_cause("ttft", mean_waiting=3, preemptions=2) == "preemption"


def _incident(p: Planner, cause: str, results: list[str]) -> list[str]:
    """The steps proposed while latencyMs fires, one cooldown apart, fed the given results."""
    steps = []
    for i, result in enumerate(results):
        actions = p.plan(60.0 * i, {"latencyMs": F}, VIEW, BASE, {"latencyMs": cause})
        if not actions:
            break
        steps.append(actions[0].describe())
        p.record(60.0 * i, actions[0], result)  # type: ignore[arg-type]
    return steps


def test_a_queue_gets_a_scale_out_recommendation_not_smaller_batches() -> None:
    p = _planner()
    assert _incident(p, "queueing", ["recommended", "recommended"]) == ["recommendScaleOut"]
    assert p.overrides() == {}


def test_an_empty_queue_warms_the_prefix_cache_then_names_the_long_prompts() -> None:
    p = _planner()
    first = p.plan(0, {"latencyMs": F}, VIEW, BASE, {"latencyMs": "prefill"})
    assert _names(first) == [("latencyMs", "warmup")] and first[0].cause == "prefill"
    p.record(0, first[0], "unavailable")  # no prefix cache: the next step at once
    second = p.plan(0, {"latencyMs": F}, VIEW, BASE, {"latencyMs": "prefill"})
    assert _names(second) == [("latencyMs", "recommendPrefillTuning")]
    assert p.overrides() == {}


def test_the_cause_is_fixed_for_the_whole_incident_and_chosen_again_for_the_next() -> None:
    p = _planner()
    a = p.plan(0, {"latencyMs": F}, VIEW, BASE, {"latencyMs": "decode"})
    assert a[0].name == "smallerBatches"
    p.record(0, a[0], "applied")
    b = p.plan(60, {"latencyMs": F}, VIEW, BASE, {"latencyMs": "queueing"})
    assert _names(b) == [("latencyMs", "recommendScaleOut")] and b[0].cause == "decode"
    p.record(60, b[0], "recommended")
    p.plan(100, {"latencyMs": OK}, VIEW, BASE)
    revert = p.plan(160, {"latencyMs": OK}, VIEW, BASE)
    p.record(160, revert[0], "applied")
    again = p.plan(200, {"latencyMs": F}, VIEW, BASE, {"latencyMs": "prefill"})
    assert _names(again) == [("latencyMs", "warmup")]
