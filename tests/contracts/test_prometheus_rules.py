"""The operator's PrometheusRule through the real promtool: `check rules`, then `test rules` with input
series that make each of the four alerts fire (after its ``for``) and series that must not fire.

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
from confkv_api.config import AlertsSection, parse_duration

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


def _inputs(alerts: AlertsSection, length: int) -> dict[str, tuple[Series, Series]]:
    """alert name -> (series that fire, series that stay quiet) for one deployment's Service."""
    lat = m.REQUEST_LATENCY_SECONDS
    vram, hit = alerts.vram.threshold, alerts.hit_rate.threshold
    latency = alerts.latency_ms.threshold / 1000.0
    total = 80e9
    oom = alerts.oom_per_hour.threshold
    return {
        "ConfKVHighVRAM": (
            [_series(m.DEVICE_MEMORY_USED_BYTES, f"{total * min(1.0, vram + 0.05):.0f}x{length}", device="0"),
             _series(m.DEVICE_MEMORY_TOTAL_BYTES, f"{total:.0f}x{length}", device="0")],
            [_series(m.DEVICE_MEMORY_USED_BYTES, f"{total * (vram - 0.05):.0f}x{length}", device="0"),
             _series(m.DEVICE_MEMORY_TOTAL_BYTES, f"{total:.0f}x{length}", device="0")],
        ),
        "ConfKVHighLatency": (  # 60 requests a minute, average latency 1.2x / 0.8x the threshold
            [_series(f"{lat}_sum", _counter(60 * latency * 1.2, length)),
             _series(f"{lat}_count", _counter(60, length))],
            [_series(f"{lat}_sum", _counter(60 * latency * 0.8, length)),
             _series(f"{lat}_count", _counter(60, length))],
        ),
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


def _write(tmp: Path, alerts: AlertsSection) -> tuple[Path, Path, dict[str, Any]]:
    rule = build_prometheus_rule(SERVICE, alerts)
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    rules = tmp / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule["spec"]))  # promtool reads the CR's spec: {groups: [...]}
    tests = tmp / "rules_test.yaml"
    tests.write_text(yaml.safe_dump(_unit_tests(rule, alerts, rules.name), sort_keys=False))
    return rules, tests, rule


ALERT_SETS = {
    "defaults": AlertsSection(),
    "custom": AlertsSection.model_validate({
        "vram": {"threshold": 0.6, "for": "2m"}, "latencyMs": {"threshold": 200, "for": "3m"},
        "hitRate": {"threshold": 0.5, "for": "1m"}, "oomPerHour": {"threshold": 5, "for": "0s"},
    }),
}


@pytest.mark.parametrize("name", ALERT_SETS)
def test_promtool_check_and_test_rules(promtool: str, tmp_path: Path, name: str) -> None:
    alerts = ALERT_SETS[name]
    rules, tests, rule = _write(tmp_path, alerts)
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
