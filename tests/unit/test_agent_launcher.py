"""``confkv serve --with-agent``'s supervisor with the real ``confkv-agent``: restarts after a crash,
the agent's lifeline (it stops when its launcher dies, SIGKILL included) and the config on stdin.
No engine runs: the agent reports it down, which is enough to see it alive."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from confkv_agent.launcher import AgentProcess, RestartPolicy

pytestmark = pytest.mark.timeout(120)
FAST = RestartPolicy(first_delay_s=0.05, max_delay_s=0.2)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check: Callable[[], Any], what: str, deadline_s: float = 60.0) -> Any:
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (httpx.TransportError, psutil.Error) as err:
            last = err
        else:
            if last:
                return last
        time.sleep(0.05)
    raise TimeoutError(f"{what} not seen within {deadline_s}s (last: {last!r})")


def health(port: int) -> dict[str, Any]:
    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.stop()


def test_restart_delays_double_up_to_the_cap() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=30.0)
    assert [policy.delay(n) for n in range(1, 9)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


def test_crashed_agent_is_restarted_and_stop_ends_it(tmp_path: Path, agents: list[AgentProcess]) -> None:
    port = free_port()
    agent = AgentProcess(str(tmp_path / "e.sock"), port=port, interval="0.1", policy=FAST,
                         config_json=json.dumps({"engine": {"maxBatchSize": 3}}))
    agents.append(agent)
    first = agent.proc.pid
    assert "-" in agent.cmd and not any(arg.endswith(".json") for arg in agent.cmd)  # no config file
    wait_for(lambda: health(port)["engine"] == "down", "first agent's health")
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: agent.proc.pid != first and health(port)["engine"] == "down", "restarted agent")
    assert agent.restarts == 1
    second = agent.proc.pid
    assert agent.stop() is not None
    assert not psutil.pid_exists(second) or psutil.Process(second).status() == psutil.STATUS_ZOMBIE


def test_agent_refusing_its_config_is_not_restarted(tmp_path: Path, agents: list[AgentProcess]) -> None:
    agent = AgentProcess(str(tmp_path / "e.sock"), port=free_port(), policy=FAST,
                         config_json=json.dumps({"engine": {"maxBatchSise": 3}}))
    agents.append(agent)
    assert agent.proc.wait(timeout=60) == 2
    agent.join_supervisor(timeout=10)
    assert agent.restarts == 0 and not agent.supervising


def test_agent_stopped_with_sigterm_stays_stopped(tmp_path: Path, agents: list[AgentProcess]) -> None:
    port = free_port()
    agent = AgentProcess(str(tmp_path / "e.sock"), port=port, interval="0.1", policy=FAST)
    agents.append(agent)
    wait_for(lambda: health(port)["engine"] == "down", "agent health")
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(timeout=30) == 0
    agent.join_supervisor(timeout=10)
    assert agent.restarts == 0 and not agent.supervising


HOST = """
import sys, time
from confkv_agent.launcher import AgentProcess
agent = AgentProcess(sys.argv[1], port=int(sys.argv[2]), interval="0.1")
print(agent.proc.pid, flush=True)
time.sleep(600)
"""


def test_agent_stops_when_its_launcher_is_sigkilled(tmp_path: Path) -> None:
    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", HOST, str(tmp_path / "e.sock"), str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None
        agent = psutil.Process(int(host.stdout.readline()))
        wait_for(lambda: health(port)["engine"] == "down", "agent health")
        host.kill()
        host.wait()
        agent.wait(timeout=30)  # psutil.TimeoutExpired if it outlived its launcher
        assert not agent.is_running()
    finally:
        if host.poll() is None:
            host.kill()
