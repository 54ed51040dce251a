"""Start ``confkv serve`` as a real subprocess on a free port and talk to it (integration tests)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

MODEL = "builtin:smollm2-135m"
READY_DEADLINE_S = 240.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(check: Callable[[], Any], what: str, deadline_s: float = 60.0, log: Callable[[], str] = str,
             errors: tuple[type[BaseException], ...] = (httpx.TransportError,)) -> Any:
    """Poll ``check`` until it returns something truthy; TimeoutError with the last answer and ``log()``."""
    deadline = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except errors as err:
            last = err
        else:
            if last:
                return last
        time.sleep(0.1)
    raise TimeoutError(f"{what} not seen within {deadline_s}s (last: {last!r})\n{log()}")


def _confkv_command() -> list[str]:
    script = Path(sys.executable).with_name("confkv")
    return [str(script)] if script.exists() else [sys.executable, "-m", "confkv_engine.cli"]


class EngineServer:
    """One ``confkv serve`` process; its output goes to a log file (a full pipe would block it)."""

    def __init__(self, log_dir: Path, *flags: str, api_key: str | None = None, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = log_dir / f"confkv-{self.port}.log"
        cmd = [*_confkv_command(), "serve", "--model", MODEL, "--host", "127.0.0.1",
               "--port", str(self.port), *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        env = {**os.environ, "CONFKV_THREADS": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop(); a restart appends
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_ready(self, deadline_s: float = READY_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {deadline_s}s:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as ``{'name{labels}': value}``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10.0).text
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)$", line)
            if match:
                samples[match.group(1)] = float(match.group(2))
        return samples

    def wait_metric(self, name: str, predicate, deadline_s: float = 60.0) -> float:
        deadline = time.monotonic() + deadline_s
        value = None
        while time.monotonic() < deadline:
            value = self.metrics().get(name)
            if value is not None and predicate(value):
                return value
            time.sleep(0.05)
        raise TimeoutError(f"{name} = {value} did not satisfy the condition within {deadline_s}s")

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@contextmanager
def running_server(log_dir: Path, *flags: str, api_key: str | None = None) -> Iterator[EngineServer]:
    """A started and ready server, stopped on exit (for module fixtures)."""
    srv = EngineServer(log_dir, *flags, api_key=api_key)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()
