"""The alert rules in effect for the device an engine runs on.

The deployment guide's latency threshold (500 ms) is a GPU number: on a CPU the embedded model takes
longer than that to prefill a long prompt, so the rule would fire on every such prompt and the agent
would remediate an engine that is doing what a CPU can do. ``alerts_for_device`` replaces a
``latencyMs`` rule left at that default with the CPU threshold of its signal; a threshold the user
set (anything but 500) is theirs and stays. Agent (from the device the engine reports) and operator
(from the CR's GPU request) apply the same function, so both sides compare the same numbers.
"""

from __future__ import annotations

from confkv_api.config import AlertsSection

#: The deployment guide's latency threshold (ms), the default whatever the signal.
GUIDE_LATENCY_MS = 500.0

#: Latency thresholds (ms) for an engine on CPU, per signal (p95 over the rule's window). The embedded
#: model on 2 busy cores took 0.2-0.3 s to a first token for a short chat, 2.5 s for a 600-token
#: prompt, 8 s for a 2k-token one, and 75-150 ms per output token: these fire on a queue or a stall,
#: not on a long prompt served alone.
CPU_LATENCY_MS: dict[str, float] = {"ttft": 10000.0, "tpot": 250.0, "e2e": 60000.0}


def alerts_for_device(alerts: AlertsSection, on_cpu: bool) -> AlertsSection:
    """``alerts`` as they apply to an engine on CPU (``on_cpu``) or on a GPU (unchanged)."""
    rule = alerts.latency_ms
    if not on_cpu or rule.threshold != GUIDE_LATENCY_MS:
        return alerts
    cpu_rule = rule.model_copy(update={"threshold": CPU_LATENCY_MS[rule.signal]})
    return alerts.model_copy(update={"latency_ms": cpu_rule})


def engine_on_cpu(device: str) -> bool:
    """The device an engine reports in its status (``device_memory.device``): ``cpu`` or ``cuda:N``."""
    return device.strip().lower() == "cpu"
