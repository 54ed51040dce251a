"""The agent's HTTP port: ``/metrics`` for Prometheus and ``/health`` (also ``/healthz``, ``/ready``)
for the kubelet's probes. The standard library's threading server is enough for a scrape and a probe
every few seconds, and keeps the sidecar free of a web framework."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from .metrics import AgentMetrics

HEALTH_PATHS = ("/health", "/healthz", "/ready")


def serve_http(host: str, port: int, metrics: AgentMetrics,
               health: Callable[[], tuple[bool, dict[str, Any]]]) -> ThreadingHTTPServer:
    """``/metrics`` and ``/health`` in a daemon thread; ``server_address`` of the result has the port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._send(200, metrics.render(), CONTENT_TYPE_LATEST)
            elif path in HEALTH_PATHS:
                ok, body = health()
                self._send(200 if ok else 503, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b'{"error": "not found"}', "application/json")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - probes are not news
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="confkv-agent-http", daemon=True).start()
    return server
