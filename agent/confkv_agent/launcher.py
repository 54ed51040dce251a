"""Run the agent next to a local engine (``confkv serve --with-agent``, ``make run``): a supervised child
process pointed at the engine's control socket, which lives exactly as long as the engine.

- Dies with the engine, however the engine ends (SIGKILL and OOM kills included): the child's stdin is
  a pipe only the engine holds open, and the agent (``--stdin-lifeline``) stops when it reads EOF. The
  kernel closes the pipe when the engine dies, so this needs no signal handler in the engine and no
  ``prctl`` (which would fire when the launching *thread* exits, not the process), and works on
  every platform.
- No file outlives it: an effective-config snapshot (flags that changed the policy) goes down the same
  pipe (``--config -``, one JSON line) instead of into a temporary file.
- A crashed agent (a non-zero status, or killed by a signal) is started again after 0.5 s, 1 s,
  2 s... (at most 30 s between tries); the count resets once an agent has run for a minute, and the
  supervisor gives up after 8 quick crashes in a row, or at once when the agent refuses its config
  (exit 2: it would refuse it again). An agent that exits 0 was asked to stop (SIGTERM) and stays
  stopped. A new engine on the same port therefore gets its agent even while the old agent is still
  releasing the agent's port (the new one fails to bind, exits 1, and is started again).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("confkv.agent.launcher")

EXIT_BAD_CONFIG = 2  # confkv-agent's exit status for a config it refuses


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    healthy_after_s: float = 60.0  # an agent that ran this long was not crash-looping
    max_quick_crashes: int = 8

    def delay(self, quick_crashes: int) -> float:
        """Seconds to wait before the restart that follows the ``quick_crashes``-th crash in a row."""
        return min(self.max_delay_s, self.first_delay_s * 2 ** max(quick_crashes - 1, 0))


def agent_command(socket: str, config_path: str | None, port: int | None, interval: str | None) -> list[str]:
    # The script next to this interpreter (a venv need not be on PATH), else the module.
    script = Path(sys.executable).with_name("confkv-agent")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "confkv_agent.main"]
    cmd += ["--socket", socket, "--interval", interval or os.environ.get("CONFKV_AGENT_INTERVAL", "5s"),
            "--stdin-lifeline"]
    if config_path:
        cmd += ["--config", config_path]
    if port is not None:
        cmd += ["--port", str(port)]
    return cmd


class AgentProcess:
    """One supervised ``confkv-agent``; ``config_json`` (a whole document) is handed over on stdin,
    else ``config_path`` is passed (the agent then follows live edits of that file)."""

    def __init__(self, socket: str, config_path: str | None = None, port: int | None = None,
                 interval: str | None = None, config_json: str | None = None,
                 policy: RestartPolicy | None = None) -> None:
        if config_json is not None and config_path is not None:
            raise ValueError("give the agent a config file or a config document, not both")
        self.cmd = agent_command(socket, "-" if config_json is not None else config_path, port, interval)
        self._stdin_payload = (config_json.replace("\n", " ") + "\n").encode() if config_json else b""
        self.policy = policy or RestartPolicy()
        self.restarts = 0
        self._socket = socket
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.proc = self._spawn()
        self._supervisor = threading.Thread(target=self._supervise, name="confkv-agent-supervisor",
                                            daemon=True)
        self._supervisor.start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        # The agent logs to this terminal; it waits (engine "down") until the model has loaded.
        # Its own session: Ctrl-C in the terminal reaches the engine only, which then stops the agent
        # (otherwise the agent would quit first and the engine would restart it while draining).
        proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, start_new_session=True)
        try:
            if proc.stdin is not None and self._stdin_payload:
                proc.stdin.write(self._stdin_payload)
                proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died already; the supervisor sees the exit
        # proc.stdin stays open, unwritten: the agent's lifeline, closed when this process ends.
        log.info("confkv-agent started (pid %d) on %s", proc.pid, self._socket)
        return proc

    def _supervise(self) -> None:
        quick_crashes = 0
        while True:
            proc, started = self.proc, time.monotonic()
            code = proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
            if self._stopping.is_set():
                return
            if code == 0:
                log.info("confkv-agent (pid %d) was stopped; not restarting it", proc.pid)
                return
            if code == EXIT_BAD_CONFIG:
                log.error("confkv-agent refused its config (exit %d); not restarting it", code)
                return
            ran = time.monotonic() - started
            quick_crashes = 1 if ran >= self.policy.healthy_after_s else quick_crashes + 1
            if quick_crashes > self.policy.max_quick_crashes:
                log.error("confkv-agent crashed %d times in a row; not restarting it", quick_crashes - 1)
                return
            delay = self.policy.delay(quick_crashes)
            log.warning("confkv-agent (pid %d) exited with %s after %.1fs; restarting in %.1fs",
                        proc.pid, code, ran, delay)
            if self._stopping.wait(delay):
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self.proc = self._spawn()
                self.restarts += 1

    @property
    def supervising(self) -> bool:
        """False once the supervisor gave up (or was stopped): no agent will be started again."""
        return self._supervisor.is_alive()

    def join_supervisor(self, timeout: float | None = None) -> None:
        self._supervisor.join(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop the agent (closing its lifeline, then SIGTERM, then SIGKILL) and its supervisor."""
        with self._lock:
            self._stopping.set()
            proc = self.proc
        if proc.stdin is not None:
            proc.stdin.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._supervisor.join(timeout=timeout)
        return proc.returncode
