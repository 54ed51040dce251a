"""The agent's own Prometheus metrics (names from ``confkv_api.metrics``), in a private registry so a
test or a second agent in one process never collides with the default one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from confkv_api import metrics as names

from .rules import ALERTS, AlertState


def _suffixless(name: str) -> str:
    return name.removesuffix("_total")  # prometheus_client adds _total to counters itself


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.alert_state = Gauge(names.AGENT_ALERT_STATE, "1 for each alert's current state.",
                                 ["alert", "state"], registry=r)
        self.alert_value = Gauge(names.AGENT_ALERT_VALUE, "The value each rule last compared.", ["alert"],
                                 registry=r)
        self.remediations = Counter(_suffixless(names.AGENT_REMEDIATIONS), "Remediation steps by result.",
                                    ["alert", "action", "result"], registry=r)
        self.vram = Gauge(names.AGENT_VRAM_USED_RATIO, "Used VRAM fraction (fullest GPU) and its source.",
                          ["source", "device"], registry=r)
        self.engine_up = Gauge(names.AGENT_ENGINE_UP, "1 when the engine's control socket answers.",
                               registry=r)
        self.policy_version = Gauge(names.AGENT_POLICY_VERSION, "The engine's live policy version.",
                                    registry=r)
        self.config_reloads = Counter(_suffixless(names.AGENT_CONFIG_RELOADS), "Config file reloads.",
                                      ["result"], registry=r)
        self.scale_out = Gauge(names.AGENT_SCALE_OUT_RECOMMENDED,
                               "1 while a scale-out recommendation stands (read by the autoscaler).",
                               ["alert"], registry=r)
        for alert in ALERTS:
            self.set_state(alert, AlertState.INACTIVE)
            self.scale_out.labels(alert=alert).set(0)

    def set_state(self, alert: str, state: AlertState) -> None:
        for s in AlertState:
            self.alert_state.labels(alert=alert, state=s.value).set(1 if s is state else 0)

    def set_value(self, alert: str, value: float | None) -> None:
        if value is not None:
            self.alert_value.labels(alert=alert).set(value)
            return
        try:
            self.alert_value.remove(alert)  # no data: no sample (a 0 would read as a real value)
        except KeyError:
            pass

    def set_vram(self, source: str, device: str, fraction: float | None) -> None:
        self.vram.clear()
        if fraction is not None:
            self.vram.labels(source=source, device=device).set(fraction)

    def render(self) -> bytes:
        return generate_latest(self.registry)
