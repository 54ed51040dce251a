"""Pure builder of the PrometheusRule for one ConfKVDeployment, from its ``alerts`` section.

The expressions mirror the agent's own rules (same thresholds, ``for``, latency signal and quantile,
and the CPU latency threshold for a deployment without GPUs), so Alertmanager and the agent agree on
what is firing. Series are selected by the ``namespace`` and ``service`` labels the ServiceMonitor
gives them (``service`` is the CR's name), so same-named deployments in two namespaces keep their own
alerts. Rates span 5m (several scrapes); the agent, which samples every few seconds, uses shorter windows.
"""

from __future__ import annotations

from typing import Any

from confkv_api import metrics as m
from confkv_api.alerts import alerts_for_device
from confkv_api.config import LATENCY_QUANTILE, AlertRule, AlertsSection, LatencyRule

_SIGNALS = {  # latencyMs signal -> (histogram, what the summary calls it)
    "ttft": (m.TIME_TO_FIRST_TOKEN_SECONDS, "time to first token"),
    "tpot": (m.TIME_PER_OUTPUT_TOKEN_SECONDS, "time per output token"),
    "e2e": (m.REQUEST_LATENCY_SECONDS, "end-to-end request latency"),
}
_SUMMARY = {
    "vram": "GPU memory above {threshold:.0%}",
    "latencyMs": "p{quantile:.0f} {signal} above {threshold:g} ms",
    "hitRate": "prefix cache hit rate below {threshold:.0%}",
    "oomPerHour": "more than {threshold:g} out-of-memory errors in the last hour",
}
_ALERT_NAMES = {
    "vram": "ConfKVHighVRAM", "latencyMs": "ConfKVHighLatency",
    "hitRate": "ConfKVLowCacheHitRate", "oomPerHour": "ConfKVFrequentOOM",
}


def alert_expr(key: str, rule: AlertRule, service: str, namespace: str | None = None) -> str:
    """PromQL for one of the four rules, scoped to one deployment (its namespace, when given)."""
    scope = f'namespace="{namespace}", ' if namespace else ""
    sel = f'{{{scope}service="{service}"}}'
    if key == "vram":
        return (f"max({m.DEVICE_MEMORY_EFFECTIVE_USED_BYTES}{sel} / {m.DEVICE_MEMORY_TOTAL_BYTES}{sel}) "
                f"> {rule.threshold:g}")
    if key == "latencyMs":
        buckets = f"sum by (le) (rate({_SIGNALS[_signal(rule)][0]}_bucket{sel}[5m]))"
        return f"1000 * histogram_quantile({LATENCY_QUANTILE:g}, {buckets}) > {rule.threshold:g}"
    if key == "hitRate":
        hits, queried = m.PREFIX_CACHE_HIT_TOKENS, m.PREFIX_CACHE_QUERIED_TOKENS
        return (f"sum(rate({hits}_total{sel}[5m])) / sum(rate({queried}_total{sel}[5m])) "
                f"< {rule.threshold:g}")
    if key == "oomPerHour":
        return f"sum(increase({m.OOM_ERRORS}_total{sel}[1h])) > {rule.threshold:g}"
    raise ValueError(f"unknown alert {key!r}")


def _signal(rule: AlertRule) -> str:
    return rule.signal if isinstance(rule, LatencyRule) else "e2e"


def _summary(key: str, rule: AlertRule) -> str:
    signal = _SIGNALS[_signal(rule)][1]
    return _SUMMARY[key].format(threshold=rule.threshold, signal=signal, quantile=100 * LATENCY_QUANTILE)


def build_alert_rules(name: str, alerts: AlertsSection, namespace: str | None = None) -> list[dict[str, Any]]:
    rules = []
    for field, info in AlertsSection.model_fields.items():
        key = info.alias or field
        rule: AlertRule = getattr(alerts, field)
        if not rule.enabled:
            continue
        rules.append({
            "alert": _ALERT_NAMES[key],
            "expr": alert_expr(key, rule, name, namespace),
            "for": rule.for_,
            "labels": {"severity": "warning", "confkv_deployment": name},
            "annotations": {"summary": f"{name}: " + _summary(key, rule)},
        })
    return rules


def build_prometheus_rule(name: str, alerts: AlertsSection, on_cpu: bool = False,
                          namespace: str | None = None) -> dict[str, Any]:
    """``on_cpu``: the deployment's engine runs on CPU (no GPU requested), as the agent will see it."""
    alerts = alerts_for_device(alerts, on_cpu)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name},
        "spec": {"groups": [{"name": f"confkv-{name}", "rules": build_alert_rules(name, alerts, namespace)}]},
    }
