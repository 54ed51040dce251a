"""The engine's gRPC control plane over a real Unix socket, with a stand-in engine that implements
the control protocol (``EngineControlTarget``: a batch size to change and a stats snapshot), driven by
the agent's client; then the agent's loop ticking against it with injected time. Retention's live
fields run against a real ``LLMEngine`` on a tiny random model; the real engine and agent processes
are covered by tests/integration/test_control_grpc.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from confkv_agent.apply import EngineClient, EngineError
from confkv_agent.kube import KubeRecorder
from confkv_agent.loop import Agent
from confkv_api.config import load_config
from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc
from confkv_engine.control.policy import PolicyInvalid, PolicyNotLive, PolicyStore
from confkv_engine.control.servicer import MAX_WATCH_STREAMS, ControlPlane, ControlPlaneError, socket_path
from confkv_engine.core.control_api import BATCH_FIELD, EngineStats


class FakeEngine:
    """``EngineControlTarget`` with a batch size only, and counters a test can move."""

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(max_batch_size=8)
        self.oom = 0
        self.waiting = 2

    def live_fields(self) -> list[str]:
        return [BATCH_FIELD]

    def capabilities(self) -> list[str]:
        return []

    @property
    def max_batch_size(self) -> int:
        return self.scheduler.max_batch_size

    def apply_policy(self, confkv: Any, max_batch_size: int, changed: list[str]) -> None:
        if BATCH_FIELD in changed:
            self.scheduler.max_batch_size = max_batch_size

    def stats(self) -> EngineStats:
        return EngineStats(num_running=1, num_waiting=self.waiting, num_total_blocks=100, num_free_blocks=60,
                           block_size=16,
                           kv_bytes_used=4000, kv_bytes_total=10000, kv_bytes_full=4000, kv_bytes_key_only=0,
                           num_preemptions=3, num_oom=self.oom, prompt_tokens_total=50,
                           generated_tokens_total=70, num_requests_finished=4)


class FakeLatency:
    """A registry-like source of the latency histogram's sum and count."""

    def __init__(self) -> None:
        self.count, self.total = 0, 0.0

    def get_sample_value(self, name: str) -> float:
        return self.count if name.endswith("_count") else self.total


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[tuple[ControlPlane, FakeEngine, FakeLatency, str]]:
    sock = str(tmp_path / "engine.sock")
    cp = ControlPlane(load_config({"engine": {"grpcSocket": sock, "maxBatchSize": 8}}))
    cp.start()
    engine, latency = FakeEngine(), FakeLatency()
    cp.attach(engine, engine.stats, latency, "cpu", "tiny")
    try:
        yield cp, engine, latency, sock
    finally:
        cp.stop()


def test_status_reports_the_engine(plane: Any) -> None:
    cp, engine, latency, sock = plane
    latency.count, latency.total = 4, 2.0
    client = EngineClient(sock)
    s = client.status()
    assert (s.model, s.num_running, s.num_waiting) == ("tiny", 1, 2)
    assert (s.kv_blocks_total, s.kv_blocks_free) == (100, 60)
    assert (s.kv_bytes_used, s.kv_bytes_total, s.preemptions_total, s.oom_total) == (4000, 10000, 3, 0)
    assert (s.latency_count, s.latency_seconds_sum, s.avg_latency_seconds) == (4, 2.0, 0.5)
    assert s.policy_version == 1 and json.loads(s.policy_json)["engine"]["maxBatchSize"] == 8
    assert s.device_memory.device == "cpu" and s.device_memory.total_bytes > 0
    assert not s.prefix_cache_enabled
    client.close()


def test_update_policy_is_validated_versioned_and_live(plane: Any) -> None:
    cp, engine, _, sock = plane
    client = EngineClient(sock)
    resp = client.update_policy({"confidenceThresholds": {"high": 0.95}}, max_batch_size=4, reason="test")
    assert resp.version == 2 and engine.scheduler.max_batch_size == 4
    assert list(resp.changed_fields) == ["confkv.confidenceThresholds.high", "engine.maxBatchSize"]
    assert list(resp.live_fields) == ["engine.maxBatchSize"]
    assert list(resp.deferred_fields) == ["confkv.confidenceThresholds.high"]
    before = client.status().policy_json
    for bad in ({"confidenceThresholds": {"high": 0.5}}, {"nope": 1}, {"eviction": {"k": 0}}):
        with pytest.raises(EngineError) as err:
            client.update_policy(bad, max_batch_size=2)
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(EngineError) as err:
        client.update_policy(None, max_batch_size=0)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT and "maxBatchSize" in str(err.value)
    with pytest.raises(EngineError) as err:
        client.update_policy({"eviction": {"k": 3}}, max_batch_size=2, require_live=True)
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and "confkv.eviction.k" in str(err.value)
    with pytest.raises(EngineError) as err:
        client.update_policy(None, max_batch_size=2, expected_version=1)
    assert err.value.code is grpc.StatusCode.ABORTED
    after = client.status()
    assert after.policy_json == before and after.policy_version == 2 and engine.scheduler.max_batch_size == 4
    client.close()


def test_missing_capabilities_are_failed_precondition(plane: Any) -> None:
    _, _, _, sock = plane
    client = EngineClient(sock)
    with pytest.raises(EngineError) as err:
        client.warmup()
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION and "prefix cache" in str(err.value)
    client.close()


def test_socket_paths_are_unix_only_and_single_owner(plane: Any, tmp_path: Path) -> None:
    _, _, _, sock = plane
    assert socket_path(f"unix://{sock}") == sock
    for bad in ("127.0.0.1:50051", "relative.sock", "/" + "x" * 200):
        with pytest.raises(ControlPlaneError):
            socket_path(bad)
    # A second engine on a live socket does not steal it.
    with pytest.raises(ControlPlaneError, match="another process is serving"):
        ControlPlane(load_config({"engine": {"grpcSocket": sock}})).start()
    assert EngineClient(sock).status().model == "tiny"


def test_policy_store_rejects_and_keeps_state() -> None:
    applied = []
    store = PolicyStore(load_config({}).confkv, 64, ["engine.maxBatchSize"],
                        lambda s, live: applied.append(live))
    with pytest.raises(PolicyInvalid):
        store.update({"budget": 0.5, "budgetTokens": 64})
    assert store.current.version == 1 and applied == []
    store.update({"budget": 0.5}, replace=True)
    assert store.current.confkv.budget == 0.5 and applied == []  # nothing live changed
    store.update({"budget": None})  # merge-patch null: back to the default
    assert store.current.confkv.budget is None and store.current.version == 3


def test_agent_applies_smaller_batches_and_reverts_after_health(plane: Any, tmp_path: Path) -> None:
    cp, engine, latency, sock = plane
    cfg_path = tmp_path / "confkv.json"
    # End-to-end latency (the stand-in keeps no histograms: the window average) with an empty queue:
    # the answers' length, which smaller batches shorten.
    engine.waiting = 0
    doc = {"engine": {"grpcSocket": sock},
           "alerts": {"latencyMs": {"threshold": 100, "for": "0s", "signal": "e2e"}},
           "remediation": {"cooldown": "30s", "allowedActions": ["smallerBatches", "compress"]}}
    cfg_path.write_text(json.dumps(doc))
    agent = Agent(load_config(doc), EngineClient(sock), config_path=str(cfg_path), kube=KubeRecorder({}))
    agent.tick(0)
    latency.count, latency.total = 2, 1.0  # 500 ms average
    agent.tick(1)
    assert agent.evaluator.states()["latencyMs"] == "firing"
    assert engine.scheduler.max_batch_size == 6  # 8 - 8 // 4
    labels = {"alert": "latencyMs", "action": "smallerBatches", "result": "applied"}
    assert agent.metrics.registry.get_sample_value("confkv_agent_remediations_total", labels) == 1
    latency.count, latency.total = 4, 1.1  # the next two took 50 ms each
    agent.tick(62)  # the window (60 s) now only holds the fast ones
    assert agent.evaluator.states()["latencyMs"] == "inactive"
    agent.tick(91)
    assert engine.scheduler.max_batch_size == 6  # healthy for 29 s only
    agent.tick(92)
    assert engine.scheduler.max_batch_size == 8  # reverted after 30 s of health
    # A config edit reaches the engine through the agent (policy reconciliation).
    cfg_path.write_text(json.dumps({**doc, "confkv": {"eviction": {"k": 3}}}))
    agent.tick(93)
    status = EngineClient(sock).status()
    assert json.loads(status.policy_json)["confkv"]["eviction"]["k"] == 3
    assert agent.metrics.registry.get_sample_value("confkv_agent_policy_version") == status.policy_version


def test_retention_settings_are_live_in_a_real_engine(tmp_path: Path) -> None:
    import torch

    from confkv_engine.core.engine import LLMEngine
    from confkv_engine.model.loader import load_model
    from tests.engine.tiny_models import make_tiny_hf_model

    _, model_dir = make_tiny_hf_model("llama", tmp_path / "tiny")
    # The FULL / KEY_ONLY chain: its window may not be shorter than a prefill chunk (a precision
    # chain's may, so the refusal below is this chain's).
    config = load_config({"engine": {"grpcSocket": str(tmp_path / "r.sock"), "prefillChunk": 64},
                          "confkv": {"kvPolicy": "conf-kv", "window": 64, "decisionInterval": 64,
                                     "tiers": ["full", "key_only"], "maxCacheSize": "4Mi"}})
    engine = LLMEngine(load_model(str(model_dir), dtype=torch.float32, device="cpu"), config)
    cp = ControlPlane(config)
    cp.attach(engine, engine.stats, None, "cpu", "tiny")
    assert cp.store is not None
    change = cp.store.update({"confidenceThresholds": {"high": 0.95, "medium": 0.8}}, max_batch_size=4,
                             require_live=True)
    assert change.deferred == [] and engine.retention.defaults.tiers.high == 0.95
    assert engine.max_batch_size == 4
    # A window smaller than a prefill chunk is refused before anything changes.
    with pytest.raises(PolicyInvalid, match="prefill chunk"):
        cp.store.update({"window": 32}, max_batch_size=2)
    assert engine.max_batch_size == 4 and engine.retention.defaults.tiers.window == 64
    change = cp.store.update({"eviction": {"k": 3}}, require_live=True)  # LRU-K's K is live too
    assert change.deferred == [] and engine.cache.eviction.k == 3
    with pytest.raises(PolicyNotLive):
        cp.store.update({"prefixCache": {"enabled": False}}, require_live=True)


def test_bad_config_edits_keep_the_previous_config_and_are_reported_once(plane: Any, tmp_path: Path) -> None:
    _, engine, _, sock = plane
    cfg_path = tmp_path / "confkv.json"
    doc = {"engine": {"grpcSocket": sock}, "alerts": {"latencyMs": {"threshold": 100, "for": "0s"}}}
    cfg_path.write_text(json.dumps(doc))
    agent = Agent(load_config(doc), EngineClient(sock), config_path=str(cfg_path), kube=KubeRecorder({}))
    reloads = agent.metrics.registry.get_sample_value
    for text in ('{"alerts": {"latencyMs": {"threshold": "fast"}}}', "{broken", None):
        if text is None:
            cfg_path.unlink()
        else:
            cfg_path.write_text(text)
        agent.tick(1)
        agent.tick(2)  # the same problem again: not counted twice
    assert reloads("confkv_agent_config_reloads_total", {"result": "invalid"}) == 3
    assert agent.config.alerts.latency_ms.threshold == 100
    cfg_path.write_text(json.dumps({**doc, "alerts": {"latencyMs": {"threshold": 250, "for": "0s"}}}))
    agent.tick(3)
    assert agent.evaluator.rules["latencyMs"].spec.threshold == 250
    assert reloads("confkv_agent_config_reloads_total", {"result": "applied"}) == 1


def test_without_a_config_file_the_engine_start_up_policy_is_the_baseline(plane: Any) -> None:
    cp, engine, latency, sock = plane
    client = EngineClient(sock)
    client.update_policy({"eviction": {"k": 5}})  # someone changed it by hand: not the agent's business
    engine.waiting = 0
    doc = {"alerts": {"latencyMs": {"threshold": 100, "for": "0s", "signal": "e2e"}},
           "remediation": {"cooldown": "10s"}}
    agent = Agent(load_config(doc), client, config_path=None, kube=KubeRecorder({}))
    agent.tick(0)
    assert json.loads(client.status().policy_json)["confkv"]["eviction"]["k"] == 5  # no file: nothing pushed
    latency.count, latency.total = 1, 1.0
    agent.tick(1)
    assert engine.scheduler.max_batch_size == 6
    latency.count, latency.total = 2, 1.01
    agent.tick(70)  # healthy from here
    agent.tick(80)
    assert engine.scheduler.max_batch_size == 8  # back to what the engine started with


def _raw_stub(sock: str) -> tuple[grpc.Channel, pb_grpc.EngineControlStub]:
    channel = grpc.insecure_channel(f"unix://{sock}")
    return channel, pb_grpc.EngineControlStub(channel)


@pytest.mark.parametrize("text", [
    '{"window":' * 5000 + "1" + "}" * 5000,  # RecursionError in the JSON parser
    '{"eviction": {"k": true}}', '{"confidenceThresholds": {"high": "0.95"}}',
    '{"window": 1' + "0" * 30 + "}", '{"maxCacheSize": "1' + "0" * 400 + '"}', '{"sinks": NaN}',
    '{"sinks": ' + "7" * 5000 + "}",
])
def test_hostile_policy_patches_are_invalid_argument(plane: Any, text: str) -> None:
    cp, _, _, sock = plane
    channel, stub = _raw_stub(sock)
    with pytest.raises(grpc.RpcError) as err:
        stub.UpdatePolicy(pb.UpdatePolicyRequest(confkv_json=text, reason="hostile"), timeout=10)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert cp.store is not None and cp.store.current.version == 1
    channel.close()


def _open_stream(stub: pb_grpc.EngineControlStub) -> tuple[Any, Any]:
    """A WatchStatus stream and its first status, or the RpcError that refused it."""
    stream = stub.WatchStatus(pb.WatchStatusRequest(interval_seconds=3600), timeout=30)
    try:
        return stream, next(stream)
    except grpc.RpcError as err:
        return stream, err


def test_many_watch_streams_never_starve_the_unary_rpcs(plane: Any) -> None:
    _, engine, _, sock = plane
    channel, stub = _raw_stub(sock)
    opened = [_open_stream(stub) for _ in range(40)]
    refused = [o for _, o in opened if isinstance(o, grpc.RpcError)]
    assert len(opened) - len(refused) == MAX_WATCH_STREAMS
    assert {err.code() for err in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    # Every stream's worker is taken; the unary RPCs still have theirs.
    for _ in range(3 * MAX_WATCH_STREAMS):
        assert stub.GetStatus(pb.GetStatusRequest(), timeout=10).model == "tiny"
    stub.UpdatePolicy(pb.UpdatePolicyRequest(max_batch_size=4, reason="while watched"), timeout=10)
    assert engine.scheduler.max_batch_size == 4
    # A stream that goes away frees its slot at once, not after its hour-long interval.
    for stream, _ in opened:
        stream.cancel()

    def reopened() -> bool:
        stream, first = _open_stream(stub)
        stream.cancel()
        return isinstance(first, pb.EngineStatus)

    deadline = time.monotonic() + 20
    while not reopened():
        assert time.monotonic() < deadline, "no WatchStatus slot came free after the streams ended"
        time.sleep(0.1)
    channel.close()
