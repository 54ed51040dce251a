"""SIGTERM on a real ``confkv serve`` with requests in flight: the server keeps listening while it
drains. ``/ready`` answers 503 ("draining"), a new completion gets 503 in OpenAI's error format
(with ``Connection: close``), the stream and the plain request that were running finish whole (the
stream ends with ``data: [DONE]``), and the process then exits 0 and stops listening. With a drain
deadline shorter than the work left, the stragglers' streams end with an in-band error and [DONE]
and the process still exits 0.

Each test ends its server, so each starts its own.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from engine_server import EngineServer

from confkv_api import metrics as names

pytestmark = pytest.mark.timeout(600)

API_KEY = "drain-key"
STREAMED_TOKENS = 300
PLAIN_TOKENS = 100


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    servers: list[EngineServer] = []

    def started(*flags: str) -> EngineServer:
        srv = EngineServer(tmp_path, "--max-model-len", "512", "--grpc-socket", str(tmp_path / "c.sock"),
                           *flags, api_key=API_KEY)
        servers.append(srv)
        srv.wait_ready()
        return srv

    yield started
    for srv in servers:
        srv.stop()


class InFlight:
    """One streamed and one plain completion, each read to its end on its own thread."""

    def __init__(self, server: EngineServer) -> None:
        self.server = server
        self.events: list[str] = []
        self.plain: httpx.Response | None = None
        self.errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._guard, args=(f,)) for f in (self._stream, self._post)]
        for thread in self._threads:
            thread.start()

    def _guard(self, fn: Any) -> None:
        try:
            fn()
        except Exception as err:  # reported by the test's assertions
            self.errors.append(err)

    def _stream(self) -> None:
        body = {"prompt": "Tell me a story.", "max_tokens": STREAMED_TOKENS, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{self.server.url}/v1/completions", json=body, headers=self.server.headers,
                          timeout=300) as resp:
            assert resp.status_code == 200
            self.events = [line.removeprefix("data: ") for line in resp.iter_lines()
                           if line.startswith("data: ")]

    def _post(self) -> None:
        body = {"prompt": "Count to a hundred:", "max_tokens": PLAIN_TOKENS, "ignore_eos": True}
        self.plain = httpx.post(f"{self.server.url}/v1/completions", json=body, headers=self.server.headers,
                                timeout=300)

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=300)
        assert not self.errors, self.errors


def test_sigterm_drains_while_listening_then_exits_zero(start: Any) -> None:
    server = start()
    work = InFlight(server)
    server.wait_metric(names.REQUESTS_RUNNING, lambda v: v == 2)
    server.proc.send_signal(signal.SIGTERM)

    ready = httpx.get(f"{server.url}/ready", timeout=30)  # a new connection: still accepted
    assert (ready.status_code, ready.json()) == (503, {"status": "draining"})
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    refused = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=30,
                         json={"prompt": "Hello", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["connection"] == "close", refused.text
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("service_unavailable", "draining"), error
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=30,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "draining", chat.text

    work.join()
    assert work.events[-1] == "[DONE]", work.events[-3:]
    chunks = [json.loads(e) for e in work.events[:-1]]
    assert all("error" not in c for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == STREAMED_TOKENS  # nothing was cut
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert work.plain is not None and work.plain.status_code == 200, work.plain
    assert work.plain.json()["usage"]["completion_tokens"] == PLAIN_TOKENS
    assert server.proc.wait(timeout=120) == 0, server.log_tail()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
    assert "Traceback" not in server.log_tail(200_000)


def test_a_drain_deadline_ends_stragglers_with_an_error_and_done(start: Any) -> None:
    server = start("--drain-timeout", "0.5")
    work = InFlight(server)
    server.wait_metric(names.REQUESTS_RUNNING, lambda v: v == 2)
    server.proc.send_signal(signal.SIGTERM)
    work.join()
    assert work.events[-1] == "[DONE]", work.events[-3:]
    last = json.loads(work.events[-2])
    assert last.get("error", {}).get("type") == "server_error", last  # told in-band, not cut off
    assert work.plain is not None and work.plain.status_code in (500, 503), work.plain.text
    assert work.plain.json()["error"]["message"]
    assert server.proc.wait(timeout=120) == 0, server.log_tail()
