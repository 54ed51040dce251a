"""``confkv serve --with-agent`` as a user runs it: the agent lives exactly as long as its engine.

A real engine on the embedded model is SIGKILLed (no handler of it runs), then started again on the
same port: its own agent, and only that one, serves the agent's port and reaches the new engine; the
old agent is gone and no temporary config file is left behind.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import engine_server
import httpx
import psutil
import pytest
from engine_server import EngineServer, free_port

pytestmark = pytest.mark.timeout(600)


def wait_for(check: Callable[[], Any], what: str, deadline_s: float, log: Callable[[], str]) -> Any:
    return engine_server.wait_for(check, what, deadline_s, log,
                                  errors=(httpx.TransportError, psutil.Error, ValueError))


def agents_on(sock: Path) -> list[psutil.Process]:
    """Live ``confkv-agent`` processes pointed at ``sock`` (zombies are not running)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmd = proc.info["cmdline"] or []
        is_agent = any(part.endswith(("confkv-agent", "confkv_agent.main")) for part in cmd)
        if is_agent and str(sock) in cmd and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # dead, not yet reaped by its new parent
    except psutil.NoSuchProcess:
        return True


def one_connected_agent(server: EngineServer, sock: Path, agent_port: int) -> psutil.Process | None:
    running = agents_on(sock)
    if len(running) != 1 or running[0].ppid() != server.proc.pid:
        return None
    health = httpx.get(f"http://127.0.0.1:{agent_port}/health", timeout=2).json()
    return running[0] if health["engine"] == "up" else None


def test_sigkilled_engine_restarted_on_its_port_has_exactly_one_agent(tmp_path: Path) -> None:
    sock, tmpdir, agent_port = tmp_path / "e.sock", tmp_path / "tmp", free_port()
    tmpdir.mkdir()
    env = {"TMPDIR": str(tmpdir), "CONFKV_AGENT_PORT": str(agent_port), "CONFKV_AGENT_INTERVAL": "0.2"}
    # A policy flag: the agent is handed the effective config (once a temporary file).
    flags = ("--with-agent", "--grpc-socket", str(sock), "--max-cache-size", "64Mi")
    first = EngineServer(tmp_path, *flags, env=env)
    try:
        first.wait_ready()
        old_agent = wait_for(lambda: one_connected_agent(first, sock, agent_port), "the first agent",
                             60.0, first.log_tail)
        first.proc.kill()
    finally:
        first.stop()
    second = EngineServer(tmp_path, *flags, port=first.port, env=env)
    try:
        second.wait_ready()
        new_agent = wait_for(lambda: one_connected_agent(second, sock, agent_port),
                             "exactly one agent, the new engine's, connected", 10.0, second.log_tail)
        assert new_agent.pid != old_agent.pid and gone(old_agent)
        assert second.stop() == 0
    finally:
        second.stop()
    wait_for(lambda: not agents_on(sock), "no agent after the engine stopped", 30.0, second.log_tail)
    assert list(tmpdir.iterdir()) == []
