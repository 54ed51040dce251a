"""The latency rule inside the agent's loop: the histograms an engine reports (built here with the real
``prometheus_client`` and ``histogram_message``, as the engine does), the CPU thresholds the agent
takes when the engine runs on CPU, and a remedy that fits the cause. The engine is a stand-in client
that answers GetStatus and records UpdatePolicy/Warmup calls; the gRPC path is covered by
test_control_plane.py and the integration tests."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, Histogram

from confkv_agent.apply import EngineError
from confkv_agent.collect import NvmlReader, buckets
from confkv_agent.kube import KubeRecorder
from confkv_agent.loop import Agent
from confkv_api import metrics as names
from confkv_api.alerts import CPU_LATENCY_MS, GUIDE_LATENCY_MS, alerts_for_device
from confkv_api.config import AlertsSection, load_config
from confkv_api.histograms import histogram_message
from confkv_api.v1 import control_pb2 as pb

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
POLICY = {"confkv": load_config({}).confkv.model_dump(mode="json", by_alias=True),
          "engine": {"maxBatchSize": 8}}


class StandInEngine:
    """GetStatus from a real registry's histograms; UpdatePolicy changes maxBatchSize; no prefix cache."""

    target = "unix:///stand-in.sock"

    def __init__(self, device: str = "cuda:0") -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(names.TIME_TO_FIRST_TOKEN_SECONDS, "ttft", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.tpot = Histogram(names.TIME_PER_OUTPUT_TOKEN_SECONDS, "tpot", buckets=TTFT_BUCKETS,
                              registry=self.registry)
        self.device, self.waiting, self.batch = device, 0, 8
        self.calls: list[str] = []

    def status(self) -> pb.EngineStatus:
        policy = {**POLICY, "engine": {"maxBatchSize": self.batch}}
        return pb.EngineStatus(
            num_waiting=self.waiting, policy_version=1, policy_json=json.dumps(policy),
            startup_policy_json=json.dumps(POLICY), kv_bytes_total=1000,
            device_memory=pb.DeviceMemory(device=self.device, used_bytes=1, total_bytes=100),
            time_to_first_token=histogram_message(self.registry, names.TIME_TO_FIRST_TOKEN_SECONDS),
            time_per_output_token=histogram_message(self.registry, names.TIME_PER_OUTPUT_TOKEN_SECONDS))

    def update_policy(self, confkv_patch: Any = None, *, max_batch_size: int | None = None,
                      **kw: Any) -> pb.UpdatePolicyResponse:
        self.calls.append(f"UpdatePolicy(maxBatchSize={max_batch_size})")
        if max_batch_size is not None:
            self.batch = max_batch_size
        policy = {**POLICY, "engine": {"maxBatchSize": self.batch}}
        return pb.UpdatePolicyResponse(version=2, policy_json=json.dumps(policy), message="ok")

    def warmup(self, top_k: int = 0) -> pb.ActionResponse:
        self.calls.append("Warmup")
        raise EngineError(grpc.StatusCode.FAILED_PRECONDITION, "missing capability: prefix cache")

    def compress(self, strategy: str = "", force: bool = True) -> pb.ActionResponse:
        raise EngineError(grpc.StatusCode.FAILED_PRECONDITION, "missing capability: compression")


class NoNvml(NvmlReader):
    def __init__(self) -> None:
        self.reason, self._nvml, self._count = "no GPU here", None, 0


def _agent(engine: StandInEngine, alerts: dict[str, Any]) -> Agent:
    config = load_config({"alerts": alerts, "remediation": {"cooldown": "30s"}})
    return Agent(config, engine, kube=KubeRecorder({}), nvml=NoNvml())  # type: ignore[arg-type]


def _remediations(agent: Agent) -> dict[tuple[str, str], float]:
    out = {}
    for metric in agent.metrics.registry.collect():
        for s in metric.samples:
            if s.name == f"{names.AGENT_REMEDIATIONS}_total" and s.value:
                out[(s.labels["action"], s.labels["result"])] = s.value
    return out


def test_histogram_message_carries_the_registry_buckets() -> None:
    engine = StandInEngine()
    for seconds in (0.02, 0.3, 0.3, 7.0):
        engine.ttft.observe(seconds)
    got = buckets(engine.status(), "time_to_first_token")
    assert got is not None and got.upper_bounds == (*TTFT_BUCKETS, float("inf"))
    assert got.cumulative[TTFT_BUCKETS.index(0.025)] == 1 and got.cumulative[-1] == 4
    assert histogram_message(engine.registry, "confkv_no_such_histogram") is None
    assert buckets(pb.EngineStatus(), "time_to_first_token") is None


def test_on_cpu_a_default_latency_rule_takes_the_cpu_threshold_and_an_explicit_one_stays() -> None:
    default = AlertsSection()
    assert alerts_for_device(default, on_cpu=False) == default
    on_cpu = alerts_for_device(default, on_cpu=True).latency_ms
    assert (on_cpu.threshold, on_cpu.signal) == (CPU_LATENCY_MS["ttft"], "ttft")
    tpot = AlertsSection.model_validate({"latencyMs": {"threshold": GUIDE_LATENCY_MS, "signal": "tpot"}})
    assert alerts_for_device(tpot, on_cpu=True).latency_ms.threshold == CPU_LATENCY_MS["tpot"]
    mine = AlertsSection.model_validate({"latencyMs": {"threshold": 800}})
    assert alerts_for_device(mine, on_cpu=True) == mine


def test_a_cpu_engine_serving_long_prompts_alone_is_left_alone() -> None:
    """The embedded demo: first tokens of 0.3-8 s with an empty queue fire the guide's 500 ms, not the
    CPU threshold; and even over the guide's threshold the agent never shrinks the batch for it."""
    for device, threshold, fires in (("cpu", CPU_LATENCY_MS["ttft"], False), ("cuda:0", 500.0, True)):
        engine = StandInEngine(device)
        agent = _agent(engine, {"latencyMs": {"threshold": GUIDE_LATENCY_MS, "for": "0s"}})
        agent.tick(0)
        for seconds in (0.3, 0.3, 2.5, 7.9):
            engine.ttft.observe(seconds)
        agent.tick(10)
        assert agent.evaluator.rules["latencyMs"].spec.threshold == threshold
        assert (agent.evaluator.states()["latencyMs"] == "firing") is fires
        agent.tick(11)
        assert engine.batch == 8
        expected = ({("warmup", "unavailable"): 1, ("recommendPrefillTuning", "recommended"): 1} if fires
                    else {})
        assert _remediations(agent) == expected
        assert engine.calls == (["Warmup"] if fires else [])


def test_a_queue_is_a_scale_out_recommendation_and_slow_decoding_shrinks_the_batch() -> None:
    engine = StandInEngine()
    agent = _agent(engine, {"latencyMs": {"threshold": 200, "for": "0s"}})
    agent.tick(0)
    engine.waiting = 5
    for _ in range(10):
        engine.ttft.observe(2.0)
    agent.tick(10)
    assert engine.batch == 8 and _remediations(agent) == {("recommendScaleOut", "recommended"): 1}
    engine = StandInEngine()
    agent = _agent(engine, {"latencyMs": {"threshold": 200, "for": "0s", "signal": "tpot"}})
    agent.tick(0)
    engine.waiting = 5
    for _ in range(10):
        engine.tpot.observe(0.4)
    agent.tick(10)
    assert engine.batch == 6 and _remediations(agent) == {("smallerBatches", "applied"): 1}


@pytest.mark.parametrize("signal", ["ttft", "tpot", "e2e"])
def test_every_signal_is_a_valid_config(signal: str) -> None:
    rule = load_config({"alerts": {"latencyMs": {"threshold": 500, "signal": signal}}}).alerts.latency_ms
    assert rule.signal == signal


def test_an_unknown_signal_is_a_clear_error() -> None:
    from confkv_api.config import ConfigError

    with pytest.raises(ConfigError, match="alerts.latencyMs.signal"):
        load_config({"alerts": {"latencyMs": {"threshold": 500, "signal": "p99"}}})


def _scale_out(agent: Agent) -> float:
    return agent.metrics.registry.get_sample_value(names.AGENT_SCALE_OUT_RECOMMENDED, {"alert": "latencyMs"})


def test_a_scale_out_recommendation_is_a_gauge_the_autoscaler_reads_until_the_alert_resolves() -> None:
    engine = StandInEngine()
    agent = _agent(engine, {"latencyMs": {"threshold": 200, "for": "0s"}})
    agent.tick(0)
    assert _scale_out(agent) == 0.0
    engine.waiting = 5
    for _ in range(10):
        engine.ttft.observe(2.0)
    agent.tick(10)
    assert _scale_out(agent) == 1.0
    engine.waiting = 0
    now = 10.0
    while agent.evaluator.states()["latencyMs"] == "firing" and now < 3600:
        for _ in range(50):
            engine.ttft.observe(0.01)
        now += 30
        agent.tick(now)
    assert agent.evaluator.states()["latencyMs"] != "firing"
    assert _scale_out(agent) == 0.0
