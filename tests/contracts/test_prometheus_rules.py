"""The operator's PrometheusRule through the real promtool: `check rules`, then `test rules` with input
series that make each of the four alerts fire (after its ``for``) and series that must not fire, for
each latency signal and for a CPU deployment; and the agent's quantile against PromQL's
``histogram_quantile`` on the same buckets.

Series values and evaluation times are derived from the AlertsSection thresholds and ``for`` durations,
so changing a default keeps the test meaningful instead of silently passing.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from contract_tools import REPO, require_tool, run

from confkv_api import metrics as m
from confkv_api.alerts import CPU_LATENCY_MS, alerts_for_device
from confkv_api.config import LATENCY_QUANTILE, AlertsSection
from confkv_api.histograms import quantile
from confkv_api.units import parse_duration

sys.path.insert(0, str(REPO / "operator"))

from confkv_operator.monitoring import build_prometheus_rule  # noqa: E402

SERVICE = "demo"
STEP_MIN = 1  # one sample per minute


def _minutes(duration: str) -> int:
    return math.ceil(parse_duration(duration) / 60)


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    body = ", ".join(f'{k}="{v}"' for k, v in {"service": SERVICE, **labels}.items())
    return {"series": f"{name}{{{body}}}", "values": values}


def _counter(per_min: float, length: int) -> str:
    return f"0+{per_min:g}x{length}"


Series = list[dict[str, str]]


HISTOGRAMS = {"ttft": m.TIME_TO_FIRST_TOKEN_SECONDS, "tpot": m.TIME_PER_OUTPUT_TOKEN_SECONDS,
              "e2e": m.REQUEST_LATENCY_SECONDS}


def _histogram(name: str, bounds: list[float], per_min: list[float], length: int) -> Series:
    """Cumulative ``_bucket`` counters: ``per_min[i]`` observations a minute in bucket ``i``."""
    series, total = [], 0.0
    for bound, n in zip([*bounds, math.inf], per_min, strict=True):
        total += n
        series.append(_series(f"{name}_bucket", _counter(total, length), le="+Inf" if math.isinf(bound)
                              else f"{bound:g}"))
    return series


def _latency(signal: str, threshold_ms: float, length: int) -> tuple[Series, Series]:
    """60 requests a minute, all in (t, 2t] (p95 1.95 t: fires) or all in (0.4 t, 0.8 t] (p95 0.78 t)."""
    t = threshold_ms / 1000.0
    bounds = [0.4 * t, 0.8 * t, t, 2 * t]
    name = HISTOGRAMS[signal]
    return (_histogram(name, bounds, [0, 0, 0, 60, 0], length),
            _histogram(name, bounds, [0, 60, 0, 0, 0], length))


def _inputs(alerts: AlertsSection, length: int) -> dict[str, tuple[Series, Series]]:
    """alert name -> (series that fire, series that stay quiet) for one deployment's Service."""
    vram, hit = alerts.vram.threshold, alerts.hit_rate.threshold
    total = 80e9
    oom = alerts.oom_per_hour.threshold
    used = m.DEVICE_MEMORY_EFFECTIVE_USED_BYTES  # the pool's reclaimable bytes are not "used"
    return {
        "ConfKVHighVRAM": (
            [_series(used, f"{total * min(1.0, vram + 0.05):.0f}x{length}", device="0"),
             _series(m.DEVICE_MEMORY_TOTAL_BYTES, f"{total:.0f}x{length}", device="0")],
            [_series(used, f"{total * (vram - 0.05):.0f}x{length}", device="0"),
             _series(m.DEVICE_MEMORY_TOTAL_BYTES, f"{total:.0f}x{length}", device="0")],
        ),
        "ConfKVHighLatency": _latency(alerts.latency_ms.signal, alerts.latency_ms.threshold, length),
        "ConfKVLowCacheHitRate": (
            [_series(f"{m.PREFIX_CACHE_HIT_TOKENS}_total", _counter(1000 * (hit - 0.2), length)),
             _series(f"{m.PREFIX_CACHE_QUERIED_TOKENS}_total", _counter(1000, length))],
            [_series(f"{m.PREFIX_CACHE_HIT_TOKENS}_total", _counter(1000 * min(1.0, hit + 0.1), length)),
             _series(f"{m.PREFIX_CACHE_QUERIED_TOKENS}_total", _counter(1000, length))],
        ),
        "ConfKVFrequentOOM": (  # twice the allowed OOMs within the first ten minutes
            [_series(f"{m.OOM_ERRORS}_total", _counter(math.ceil(2 * (oom + 1) / 10), length))],
            # exactly the threshold, reached and then flat: "more than N per hour" must stay quiet
            [_series(f"{m.OOM_ERRORS}_total",
                     " ".join(str(min(i, math.floor(oom))) for i in range(length + 1)))],
        ),
    }


def _unit_tests(rule: dict[str, Any], alerts: AlertsSection, rules_file: str) -> dict[str, Any]:
    by_alert = {r["alert"]: r for r in rule["spec"]["groups"][0]["rules"]}
    longest_for = max(_minutes(r["for"]) for r in by_alert.values())
    length = longest_for + 20
    tests = []
    for alert, (firing, quiet) in _inputs(alerts, length).items():
        spec = by_alert[alert]
        fire_at = _minutes(spec["for"]) + 11  # rate()/increase() windows (5m) filled, `for` elapsed
        expected = [{"exp_labels": spec["labels"], "exp_annotations": spec["annotations"]}]
        checks = [{"eval_time": f"{fire_at}m", "alertname": alert, "exp_alerts": expected}]
        pending_until = _minutes(spec["for"])
        if pending_until >= 2:  # still pending one minute before `for` has elapsed
            checks.append({"eval_time": f"{pending_until - 1}m", "alertname": alert, "exp_alerts": []})
        tests.append({"name": f"{alert} fires", "interval": f"{STEP_MIN}m", "input_series": firing,
                      "alert_rule_test": checks})
        tests.append({"name": f"{alert} stays quiet", "interval": f"{STEP_MIN}m", "input_series": quiet,
                      "alert_rule_test": [{"eval_time": f"{t}m", "alertname": alert, "exp_alerts": []}
                                          for t in (fire_at, length)]})
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}


@pytest.fixture(scope="module")
def promtool() -> str:
    return require_tool("promtool")


def _write(tmp: Path, alerts: AlertsSection, on_cpu: bool = False) -> tuple[Path, Path, dict[str, Any]]:
    rule = build_prometheus_rule(SERVICE, alerts, on_cpu=on_cpu)
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    rules = tmp / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule["spec"]))  # promtool reads the CR's spec: {groups: [...]}
    tests = tmp / "rules_test.yaml"
    effective = alerts_for_device(alerts, on_cpu)  # the thresholds the rule holds
    tests.write_text(yaml.safe_dump(_unit_tests(rule, effective, rules.name), sort_keys=False))
    return rules, tests, rule


ALERT_SETS = {  # name -> (alerts, on_cpu)
    "defaults": (AlertsSection(), False),
    "defaults-on-cpu": (AlertsSection(), True),
    "custom-tpot": (AlertsSection.model_validate({
        "vram": {"threshold": 0.6, "for": "2m"},
        "latencyMs": {"threshold": 200, "for": "3m", "signal": "tpot"},
        "hitRate": {"threshold": 0.5, "for": "1m"}, "oomPerHour": {"threshold": 5, "for": "0s"},
    }), False),
    "e2e-on-cpu": (AlertsSection.model_validate({"latencyMs": {"threshold": 500, "signal": "e2e"}}), True),
}


@pytest.mark.parametrize("name", ALERT_SETS)
def test_promtool_check_and_test_rules(promtool: str, tmp_path: Path, name: str) -> None:
    alerts, on_cpu = ALERT_SETS[name]
    rules, tests, rule = _write(tmp_path, alerts, on_cpu)
    assert {r["alert"] for r in rule["spec"]["groups"][0]["rules"]} == {
        "ConfKVHighVRAM", "ConfKVHighLatency", "ConfKVLowCacheHitRate", "ConfKVFrequentOOM"}
    out = run([promtool, "check", "rules", str(rules)])
    assert "4 rules found" in out.stdout, out.stdout
    run([promtool, "test", "rules", str(tests)])


def test_promtool_test_can_fail(promtool: str, tmp_path: Path) -> None:
    """Guard against a vacuous unit test: swapped inputs (quiet series expected to fire) must fail."""
    alerts = AlertsSection()
    rules, tests, _ = _write(tmp_path, alerts)
    doc = yaml.safe_load(tests.read_text())
    for i in range(0, len(doc["tests"]), 2):
        doc["tests"][i]["input_series"] = doc["tests"][i + 1]["input_series"]
    tests.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = run([promtool, "test", "rules", str(tests)], check=False)
    assert proc.returncode != 0
    assert proc.stdout.count("FAILED") + proc.stderr.count("FAILED") >= 1


def test_disabled_alert_is_omitted() -> None:
    alerts = AlertsSection.model_validate({"oomPerHour": {"threshold": 3, "enabled": False}})
    names = {r["alert"] for r in build_prometheus_rule(SERVICE, alerts)["spec"]["groups"][0]["rules"]}
    assert "ConfKVFrequentOOM" not in names and len(names) == 3


def test_the_rule_reads_the_signals_histogram_and_the_cpu_threshold() -> None:
    def latency_rule(alerts: AlertsSection, on_cpu: bool) -> dict[str, Any]:
        rules = build_prometheus_rule(SERVICE, alerts, on_cpu=on_cpu)["spec"]["groups"][0]["rules"]
        return next(r for r in rules if r["alert"] == "ConfKVHighLatency")

    gpu = latency_rule(AlertsSection(), on_cpu=False)
    assert f"{m.TIME_TO_FIRST_TOKEN_SECONDS}_bucket" in gpu["expr"] and gpu["expr"].endswith("> 500")
    assert "p95 time to first token above 500 ms" in gpu["annotations"]["summary"]
    cpu = latency_rule(AlertsSection(), on_cpu=True)
    assert cpu["expr"].endswith(f"> {CPU_LATENCY_MS['ttft']:g}")
    mine = AlertsSection.model_validate({"latencyMs": {"threshold": 750, "signal": "tpot"}})
    tpot = latency_rule(mine, on_cpu=True)
    assert f"{m.TIME_PER_OUTPUT_TOKEN_SECONDS}_bucket" in tpot["expr"] and tpot["expr"].endswith("> 750")


def test_the_agents_quantile_equals_promql_histogram_quantile(promtool: str, tmp_path: Path) -> None:
    """Buckets with observations spread over several of them (and some in +Inf): the p95 the agent
    computes from the increase equals what Prometheus computes from rate() of the same series."""
    bounds = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
    cases = {"spread": [5, 20, 30, 25, 12, 6, 2], "in-inf": [0, 1, 0, 0, 0, 0, 40],
             "one-bucket": [0, 0, 7, 0, 0, 0, 0]}
    tests = []
    for label, per_min in cases.items():
        cumulative = [sum(per_min[: i + 1]) for i in range(len(per_min))]
        expected = quantile(LATENCY_QUANTILE, [*bounds, math.inf], cumulative)
        assert expected is not None
        series = _histogram(m.TIME_TO_FIRST_TOKEN_SECONDS, bounds, per_min, 20)
        promql = (f"histogram_quantile({LATENCY_QUANTILE:g}, sum by (le) "
                  f"(rate({m.TIME_TO_FIRST_TOKEN_SECONDS}_bucket[5m])))")
        expr = f"abs({promql} - {expected!r}) < bool 1e-9"  # equal up to floating-point rounding
        tests.append({"name": label, "interval": "1m", "input_series": series,
                      "promql_expr_test": [{"expr": expr, "eval_time": "10m",
                                            "exp_samples": [{"labels": "{}", "value": 1}]}]})
    rules = tmp_path / "empty.yaml"
    rules.write_text(yaml.safe_dump({"groups": []}))
    spec = tmp_path / "quantile_test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False))
    run([promtool, "test", "rules", str(spec)])


def test_the_operator_gives_a_deployment_without_gpus_the_cpu_threshold() -> None:
    from confkv_api.deployment import load_deployment_spec
    from confkv_operator.builders import build_children
    from confkv_operator.settings import OperatorSettings

    def threshold(spec: dict[str, Any]) -> str:
        children = build_children("demo", "ns", load_deployment_spec(spec), OperatorSettings(),
                                  frozenset({"PrometheusRule"}))
        (rule,) = [c for c in children if c["kind"] == "PrometheusRule"]
        (latency,) = [r for r in rule["spec"]["groups"][0]["rules"] if r["alert"] == "ConfKVHighLatency"]
        return latency["expr"].rsplit(" ", 1)[-1]

    cpu = f"{CPU_LATENCY_MS['ttft']:g}"
    assert threshold({}) == cpu  # the embedded model on CPU
    assert threshold({"resources": {"gpusPerPod": 1}}) == "500"
    assert threshold({"resources": {"gpusPerPod": 1}, "engine": {"device": "cpu"}}) == cpu
