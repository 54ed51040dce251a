"""Run the agent next to a local engine (``confkv serve --with-agent``, ``make run``): a child process
pointed at the engine's control socket, stopped with the engine."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("confkv.agent.launcher")


class AgentProcess:
    def __init__(self, socket: str, config_path: str | None = None, port: int | None = None,
                 interval: str | None = None, remove_on_stop: str | None = None) -> None:
        self.remove_on_stop = remove_on_stop  # a config snapshot written for this agent
        # The script next to this interpreter (a venv need not be on PATH), else the module.
        script = Path(sys.executable).with_name("confkv-agent")
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "confkv_agent.main"]
        cmd += ["--socket", socket, "--interval", interval or os.environ.get("CONFKV_AGENT_INTERVAL", "5s")]
        if config_path:
            cmd += ["--config", config_path]
        if port is not None:
            cmd += ["--port", str(port)]
        # The agent logs to this terminal; it waits (engine "down") until the model has loaded.
        self.proc = subprocess.Popen(cmd)
        log.info("confkv-agent started (pid %d) on %s", self.proc.pid, socket)

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.remove_on_stop:
            Path(self.remove_on_stop).unlink(missing_ok=True)
        return self.proc.returncode
