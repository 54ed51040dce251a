"""``confkv-agent``: the sidecar's entry point.

    confkv-agent --config /etc/confkv/confkv.json      # as the operator's pod template runs it

Reads the mounted config (a file, or the directory holding ``confkv.json``), serves ``/metrics`` and
``/health`` on ``CONFKV_AGENT_PORT`` (9100), connects to the engine's control socket
(``engine.grpcSocket`` of the config unless ``--socket``) and runs the control loop every
``--interval`` (``CONFKV_AGENT_INTERVAL``, default 10s) until SIGTERM. Without ``--config`` it uses
the default rules and takes the policy baseline from the engine itself (``confkv serve --with-agent``).

Under ``confkv serve --with-agent`` (``launcher.py``) stdin is the agent's lifeline: with
``--stdin-lifeline`` it stops when stdin closes, which happens when the engine ends however it ends;
``--config -`` reads the engine's effective config as the first line of that stdin instead of a file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

from confkv_api.config import ConfigError, ConfKVConfig, load_config, load_config_file
from confkv_api.units import parse_duration

from .apply import EngineClient
from .endpoint import serve_http
from .logs import JsonFormatter, TextFormatter
from .loop import Agent
from .metrics import AgentMetrics

log = logging.getLogger("confkv.agent")
EXIT_BAD_CONFIG = 2


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = parse_duration(text)
    if value <= 0:
        raise ValueError(f"must be positive, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    in_pod = bool(env("POD_NAME"))
    parser = argparse.ArgumentParser(prog="confkv-agent", description="CONF-KV sidecar agent")
    add = parser.add_argument
    add("--config", default=env("CONFKV_CONFIG"),
        help="confkv.json, or the directory holding it; '-' reads one JSON line from stdin")
    add("--socket", default=env("CONFKV_GRPC_SOCKET"),
        help="engine control socket (default: engine.grpcSocket of the config)")
    add("--interval", default=env("CONFKV_AGENT_INTERVAL", "10s"), help="loop interval, e.g. 10s or 0.5")
    add("--host", default=env("CONFKV_AGENT_HOST", "0.0.0.0" if in_pod else "127.0.0.1"),
        help="metrics/health listen address (default: 0.0.0.0 in a pod, else 127.0.0.1)")
    add("--port", type=int, default=int(env("CONFKV_AGENT_PORT", "9100")), help="metrics/health port")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add("--log-format", default=env("CONFKV_LOG_FORMAT", "json" if in_pod else "text"),
        choices=["json", "text"])
    add("--stdin-lifeline", action="store_true",
        help="stop when stdin closes (the process that started the agent has ended)")
    return parser


def next_tick(due: float, now: float, interval: float) -> float:
    """When the tick after the one that was ``due`` starts: ticks keep a fixed rate (a rule's ``for``
    plus one interval bounds breach -> remedy, whatever a tick costs); after an overrun the next
    tick starts at once and the rate restarts from there (missed ticks are not made up)."""
    due += interval
    return due if due > now else now


def _configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _read_config(source: str | None) -> ConfKVConfig:
    if source != "-":
        return load_config_file(source) if source else ConfKVConfig()
    line = sys.stdin.buffer.readline()
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(f"the config on stdin is not one line of JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError("the config on stdin must be a JSON object")
    return load_config(data)


def _watch_lifeline(stop: threading.Event) -> None:
    """Set ``stop`` once stdin reaches EOF: nothing is written after the config line, so EOF means
    the launcher's end of the pipe is closed (it stopped the agent, or it died)."""
    fd = sys.stdin.fileno()

    def watch() -> None:
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered reader aborts the
        # interpreter's shutdown when the agent stops for another reason (SIGTERM).
        while os.read(fd, 4096):
            pass
        log.info("the process that started this agent has ended; stopping")
        stop.set()

    threading.Thread(target=watch, name="confkv-agent-lifeline", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = _read_config(args.config)
        interval = _seconds(args.interval)
    except (ConfigError, ValueError) as err:
        print(f"confkv-agent: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    _configure_logging(args.log_level, args.log_format)
    client = EngineClient(args.socket or config.engine.control_socket)
    config_path = None if args.config == "-" else args.config  # a document on stdin is not watched
    agent = Agent(config, client, config_path=config_path, metrics=AgentMetrics())
    try:
        http = serve_http(args.host, args.port, agent.metrics, lambda: agent.health(time.time(), interval))
    except OSError as err:
        print(f"confkv-agent: cannot listen on {args.host}:{args.port}: {err}", file=sys.stderr)
        return 1
    log.info("confkv-agent: engine %s, metrics http://%s:%d/metrics, every %gs", client.target, args.host,
             http.server_address[1], interval)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.stdin_lifeline:
        _watch_lifeline(stop)
    due = time.monotonic()
    while not stop.is_set():
        try:
            agent.tick(time.time())
        except Exception:  # a bug in one tick must not take the sidecar down; it is logged in full
            log.exception("agent tick failed")
        due = next_tick(due, time.monotonic(), interval)
        stop.wait(max(0.0, due - time.monotonic()))
    http.shutdown()
    client.close()
    log.info("confkv-agent stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
