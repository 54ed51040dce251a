"""The engine's gRPC control plane and the agent sidecar as real processes: ``confkv serve`` on the
embedded model with its control socket in a temporary directory, a grpcio client, and ``confkv-agent``
remediating the engine live over that socket (one server per module)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import engine_server
import grpc
import httpx
import pytest
from engine_server import EngineServer, free_port

from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(600)

START_BATCH = 8
CONFIG: dict[str, Any] = {
    "engine": {"maxBatchSize": START_BATCH},
    # Every finished request is "slow" end to end: the latency rule fires as soon as two have finished,
    # and with an empty queue its remedy is smaller batches.
    "alerts": {"latencyMs": {"threshold": 1, "for": "0s", "signal": "e2e"}},
    "remediation": {"cooldown": "1h", "allowedActions": ["smallerBatches", "compress"]},
}


def wait_for(check: Callable[[], Any], what: str, deadline_s: float = 60.0,
             log: Callable[[], str] = str) -> Any:
    return engine_server.wait_for(check, what, deadline_s, log, errors=(grpc.RpcError, httpx.TransportError))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A short path: a Unix socket address holds at most 107 bytes.
    return tmp_path_factory.mktemp("ctl")


@pytest.fixture(scope="module")
def config_file(workdir: Path) -> Path:
    path = workdir / "confkv.json"
    engine = {**CONFIG["engine"], "grpcSocket": str(workdir / "e.sock")}
    path.write_text(json.dumps({**CONFIG, "engine": engine}))
    return path


@pytest.fixture(scope="module")
def server(workdir: Path, config_file: Path) -> Iterator[EngineServer]:
    srv = EngineServer(workdir, "--config", str(config_file))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def stub(server: EngineServer, workdir: Path) -> Iterator[pb_grpc.EngineControlStub]:
    channel = grpc.insecure_channel(f"unix://{workdir / 'e.sock'}")
    stub = pb_grpc.EngineControlStub(channel)
    wait_for(lambda: stub.GetStatus(pb.GetStatusRequest(), timeout=5), "GetStatus", log=server.log_tail)
    yield stub
    channel.close()


def samples(text: str) -> dict[tuple[str, frozenset[str]], float]:
    """Prometheus exposition -> {(name, {"label=value", ...}): value}."""
    out = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$", line)
        if match:
            pairs = re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")
            labels = frozenset(f"{k}={v}" for k, v in pairs)
            out[(match.group(1), labels)] = float(match.group(3))
    return out


def policy(stub: pb_grpc.EngineControlStub) -> tuple[int, dict[str, Any]]:
    status = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
    return status.policy_version, json.loads(status.policy_json)


def test_socket_is_owner_only_and_status_reports_the_engine(stub: pb_grpc.EngineControlStub,
                                                            workdir: Path) -> None:
    assert oct((workdir / "e.sock").stat().st_mode & 0o777) == oct(0o600)
    s = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
    assert s.model and s.kv_blocks_total > 0 and s.kv_bytes_total > 0 and s.block_size == 16
    assert s.policy_version >= 1 and json.loads(s.policy_json)["engine"]["maxBatchSize"] == START_BATCH
    assert s.device_memory.total_bytes > 0 and s.device_memory.used_bytes > 0


def test_update_policy_valid_then_invalid(stub: pb_grpc.EngineControlStub) -> None:
    version, _ = policy(stub)
    req = pb.UpdatePolicyRequest(confkv_json='{"confidenceThresholds": {"high": 0.95}}', max_batch_size=5,
                                 reason="integration test")
    resp = stub.UpdatePolicy(req, timeout=5)
    # The engine holds a retention manager, so thresholds are live (for new sequences) too.
    assert resp.version == version + 1
    assert sorted(resp.live_fields) == ["confkv.confidenceThresholds.high", "engine.maxBatchSize"]
    now_version, doc = policy(stub)
    assert now_version == version + 1 and doc["engine"]["maxBatchSize"] == 5
    assert doc["confkv"]["confidenceThresholds"]["high"] == 0.95
    for bad in (pb.UpdatePolicyRequest(confkv_json='{"confidenceThresholds": {"high": 0.1}}'),
                pb.UpdatePolicyRequest(confkv_json="{not json"),
                pb.UpdatePolicyRequest(max_batch_size=0)):
        with pytest.raises(grpc.RpcError) as err:
            stub.UpdatePolicy(bad, timeout=5)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert policy(stub) == (now_version, doc)


def test_missing_capabilities_answer_failed_precondition(stub: pb_grpc.EngineControlStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.RebuildIndex(pb.RebuildIndexRequest(), timeout=5)  # started without a cache directory
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "engine.cacheDir" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Compress(pb.CompressRequest(strategy="int3"), timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # No prompts and no disk store remembering hot prefixes: nothing to do, and it says so.
    assert "nothing to warm up" in stub.Warmup(pb.WarmupRequest(), timeout=30).message


def test_watch_status_streams(stub: pb_grpc.EngineControlStub) -> None:
    stream = stub.WatchStatus(pb.WatchStatusRequest(interval_seconds=0.1), timeout=30)
    first, second = next(stream), next(stream)
    stream.cancel()
    assert second.timestamp > first.timestamp


@pytest.fixture(scope="module")
def agent(server: EngineServer, config_file: Path, workdir: Path) -> Iterator[tuple[str, Path]]:
    port = free_port()
    log_path = workdir / "agent.log"
    script = Path(sys.executable).with_name("confkv-agent")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "confkv_agent.main"]
    with open(log_path, "wb") as log:
        env = {k: v for k, v in os.environ.items() if k not in ("POD_NAME", "KUBECONFIG")}
        args = ["--config", str(config_file), "--interval", "0.2", "--port", str(port)]
        proc = subprocess.Popen([*cmd, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield f"http://127.0.0.1:{port}", log_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0, log_path.read_text()
        except subprocess.TimeoutExpired:
            proc.kill()
            raise


def test_agent_remediates_latency_and_pushes_config_edits(
        server: EngineServer, stub: pb_grpc.EngineControlStub, agent: tuple[str, Path],
        config_file: Path) -> None:
    url, log_path = agent

    def agent_log() -> str:
        return log_path.read_text(errors="replace")[-4000:]

    health = wait_for(lambda: httpx.get(f"{url}/health", timeout=2).json(), "agent health", log=agent_log)
    wait_for(lambda: httpx.get(f"{url}/health", timeout=2).json()["engine"] == "up", "engine up",
             log=agent_log)
    assert health["alerts"]["latencyMs"] in ("inactive", "firing")
    # The agent reconciles the engine to the configured policy (undoing the previous test's change).
    wait_for(lambda: policy(stub)[1]["engine"]["maxBatchSize"] == START_BATCH, "policy reset", log=agent_log)
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                       json={"model": "builtin:smollm2-135m", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
    smaller = START_BATCH - START_BATCH // 4
    wait_for(lambda: policy(stub)[1]["engine"]["maxBatchSize"] == smaller, "smallerBatches", log=agent_log)
    metrics = samples(httpx.get(f"{url}/metrics", timeout=5).text)
    assert metrics[("confkv_agent_remediations_total",
                    frozenset({"alert=latencyMs", "action=smallerBatches", "result=applied"}))] == 1
    assert metrics[("confkv_agent_alert_state", frozenset({"alert=latencyMs", "state=firing"}))] == 1
    assert ("confkv_agent_vram_used_ratio", frozenset({"source=engine", "device=cpu"})) in metrics
    # A policy edit in the mounted file reaches the running engine through the agent.
    doc = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**doc, "confkv": {"eviction": {"k": 3}}}))
    wait_for(lambda: policy(stub)[1]["confkv"]["eviction"]["k"] == 3, "config push", log=agent_log)
    assert policy(stub)[1]["engine"]["maxBatchSize"] == smaller  # the remediation override stays
