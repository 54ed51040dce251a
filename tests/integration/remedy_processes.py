"""``confkv serve`` and ``confkv-agent`` as processes for the remedy tests: the engine with its config
file, control socket and a grpcio client; the agent with JSON logs, so that the times of its
transitions and remediations can be read back."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import engine_server
import grpc
import httpx
from engine_server import MODEL, EngineServer, free_port

from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc

INTERVAL = "0.2"
FOR = "500ms"
OFF = {"enabled": False, "threshold": 1}
ALL_OFF = {"vram": OFF, "latencyMs": OFF, "hitRate": OFF, "oomPerHour": OFF}


def log(message: str) -> None:
    print(f"REMEDY {message}", flush=True)


def wait_for(check: Callable[[], Any], what: str, deadline_s: float = 60.0,
             tail: Callable[[], str] = str) -> Any:
    return engine_server.wait_for(check, what, deadline_s, tail,
                                  errors=(grpc.RpcError, httpx.TransportError))


def write_config(path: Path, sock: Path, alerts: dict[str, Any], remediation: dict[str, Any],
                 confkv: dict[str, Any], batch: int = 8) -> None:
    # fp32 weights: the cache's block bytes (hence maxCacheSize in blocks) and the greedy references
    # stay those of the fp32 model whatever the CPU's kernels are.
    path.write_text(json.dumps({"model": {"weights": "fp32"},
                                "engine": {"grpcSocket": str(sock), "maxBatchSize": batch},
                                "confkv": confkv, "alerts": {**ALL_OFF, **alerts},
                                "remediation": remediation}))


class Agent:
    """One ``confkv-agent`` process (JSON logs, so its transition and remediation times can be read)."""

    def __init__(self, workdir: Path, config: Path, name: str) -> None:
        self.port = free_port()
        self.log_path = workdir / f"agent-{name}.log"
        script = Path(sys.executable).with_name("confkv-agent")
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "confkv_agent.main"]
        env = {k: v for k, v in os.environ.items() if k not in ("POD_NAME", "KUBECONFIG")}
        args = ["--config", str(config), "--interval", INTERVAL, "--port", str(self.port),
                "--log-format", "json"]
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen([*cmd, *args], stdout=out, stderr=subprocess.STDOUT, env=env)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_up(self) -> None:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).json()["engine"]
                 == "up", "agent connected to the engine", tail=self.tail)

    def records(self) -> list[dict[str, Any]]:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def time_of(self, message_start: str, **fields: Any) -> float | None:
        """The time of the first log record whose message starts with ``message_start``."""
        for rec in self.records():
            if rec["message"].startswith(message_start) and all(rec.get(k) == v for k, v in fields.items()):
                return dt.datetime.strptime(rec["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                    tzinfo=dt.UTC).timestamp()
        return None

    def remediations(self, alert: str, action: str) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text
        key = f'confkv_agent_remediations_total{{action="{action}",alert="{alert}",result="applied"}}'
        for line in text.splitlines():
            if line.startswith(key):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=30) == 0, self.tail()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def report(self, alert: str, action: str, seen_at: float, rule_for: str = FOR) -> None:
        """Log breach -> remedy: from the rule's first breached evaluation (its pending transition, or
        firing for ``for: 0s``) to the applied remediation, and to the test seeing it in GetStatus."""
        breach = self.time_of(f"alert {alert}: inactive ->")
        applied = self.time_of(f"remediation {action}", alert=alert, result="applied")
        assert breach is not None and applied is not None, self.tail()
        log(f"{alert} -> {action}: breach -> applied {applied - breach:.3f}s, breach -> seen by the test "
            f"{seen_at - breach:.3f}s (rule for {rule_for}, interval {INTERVAL}s)")


class Engine:
    def __init__(self, workdir: Path, name: str, confkv: dict[str, Any], env: dict[str, str] | None = None,
                 batch: int = 8) -> None:
        self.sock = workdir / f"{name}.sock"
        self.config = workdir / f"{name}.json"
        self.confkv, self.batch = confkv, batch
        self.prompt_tokens_answered = 0  # prompt tokens of the requests answered so far
        self._lock = threading.Lock()
        write_config(self.config, self.sock, {}, {"enabled": False}, confkv, batch)
        self.server = EngineServer(workdir, "--config", str(self.config), env=env)
        self.server.wait_ready()
        self.channel = grpc.insecure_channel(f"unix://{self.sock}")
        self.stub = pb_grpc.EngineControlStub(self.channel)
        wait_for(self.status, "GetStatus", tail=self.server.log_tail)

    def status(self) -> pb.EngineStatus:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=5)

    def settled_status(self) -> pb.EngineStatus:
        """GetStatus once its snapshot includes every answered request: the engine refreshes the
        snapshot right after the step that answered, so a read just after an answer may miss it."""
        return wait_for(lambda: (s := self.status()).prompt_tokens_total >= self.prompt_tokens_answered
                        and s, "a stats snapshot with every answered request")

    def policy(self) -> dict[str, Any]:
        return json.loads(self.status().policy_json)

    def agent_config(self, path: Path, alerts: dict[str, Any], remediation: dict[str, Any]) -> Path:
        write_config(path, self.sock, alerts, remediation, self.confkv, self.batch)
        return path

    def complete(self, prompt: list[int], max_tokens: int, logprobs: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": 0, "ignore_eos": True}
        if logprobs is not None:
            body["logprobs"] = logprobs
        r = httpx.post(f"{self.server.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        with self._lock:
            self.prompt_tokens_answered += len(prompt)
        return r.json()["choices"][0]

    def close(self) -> None:
        self.channel.close()
        self.server.stop()
