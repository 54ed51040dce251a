"""The HTTP edge of a real ``confkv serve`` on the embedded model, over real sockets: framing and
header rules tested with raw bytes (smuggling, oversized and slow heads), routes and auth
(no redirects, the OpenAPI document behind the key), strict JSON types and finite numbers, the chat
default of ``engine.maxTokensDefault``, and a misnamed disk-store file through the control socket's
RebuildIndex. Every refusal is an OpenAI error body, and the process stays up and keeps serving.

The server runs with a 1 s header-read deadline (``--header-timeout``) so that the slow-header
cases end quickly; nothing here asserts how long anything took.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from engine_server import EngineServer, running_server

from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(600)

API_KEY = "framing-key"
MAX_TOKENS_DEFAULT = 5
HEADER_TIMEOUT_S = 1.0
MAX_HEAD_BYTES = 16 * 1024


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("framing")


@pytest.fixture(scope="module")
def server(workdir: Path) -> Iterator[EngineServer]:
    (workdir / "confkv.json").write_text(json.dumps({"engine": {"maxTokensDefault": MAX_TOKENS_DEFAULT}}))
    with running_server(workdir, "--config", str(workdir / "confkv.json"), "--max-model-len", "256",
                        "--header-timeout", str(HEADER_TIMEOUT_S), "--cache-dir", str(workdir / "kv"),
                        "--grpc-socket", str(workdir / "c.sock"), api_key=API_KEY) as srv:
        yield srv


def exchange(server: EngineServer, data: bytes, read_s: float = 5.0) -> tuple[bytes, bool]:
    """Send raw bytes on a new connection; (everything read, whether the server closed it)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_s) as sock:
        sock.sendall(data)
        return read_until_closed(sock)


def read_until_closed(sock: socket.socket) -> tuple[bytes, bool]:
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        return received, False
    except ConnectionResetError:
        pass
    return received, True


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """(status, headers, body) of each response in ``raw`` (bodies framed by Content-Length)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", len(rest)))
        out.append((int(lines[0].split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return out


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int, code: str) -> str:
    assert status == expected, body
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error["message"]


def request(method: str, path: str, body: bytes = b"", host: str = "127.0.0.1", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Authorization: Bearer {API_KEY}",
             *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    if body and "Content_Length" not in headers and "Transfer_Encoding" not in headers:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def assert_serving(server: EngineServer) -> None:
    resp = httpx.post(f"{server.url}/v1/completions", headers=server.headers, timeout=60,
                      json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200, resp.text


# ---- framing ---------------------------------------------------------------------------------------

def test_content_length_with_transfer_encoding_is_refused_and_closed(server: EngineServer) -> None:
    smuggled = request("GET", "/metrics")
    raw, closed = exchange(server, request("POST", "/v1/completions", b"0\r\n\r\n" + smuggled,
                                           Content_Length="4", Transfer_Encoding="chunked"))
    answers = responses(raw)
    assert closed and len(answers) == 1, raw  # the trailing GET /metrics is never served
    message = assert_openai_error(*answers[0], 400, "invalid_http_request")
    assert "Content-Length and Transfer-Encoding" in message
    assert answers[0][1]["connection"] == "close"
    assert_serving(server)


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS hello on the plain port
])
def test_malformed_requests_get_an_openai_400_and_a_close(server: EngineServer, head: bytes) -> None:
    raw, closed = exchange(server, head)
    (answer,) = responses(raw)
    assert_openai_error(*answer, 400, "invalid_http_request")
    assert closed


@pytest.mark.parametrize("in_pieces", [False, True])
def test_an_oversized_head_is_431_in_the_openai_format(server: EngineServer, in_pieces: bool) -> None:
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 100) + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        if in_pieces:  # the head arrives over several reads (h11's own bound applies)...
            for i in range(0, len(head), 4096):
                sock.sendall(head[i:i + 4096])
        else:  # ...or all at once (one read: h11 alone would parse it whatever its size)
            sock.sendall(head)
        raw, closed = read_until_closed(sock)
    (answer,) = responses(raw)
    assert_openai_error(*answer, 431, "headers_too_large")
    assert closed
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_a_head_just_under_the_bound_is_served(server: EngineServer) -> None:
    padding = MAX_HEAD_BYTES - 200
    raw, _ = exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Pad: "
                      + b"a" * padding + b"\r\n\r\n")
    assert responses(raw)[0][0] == 200


def test_slow_heads_are_closed_with_408_while_health_answers(server: EngineServer) -> None:
    """Many clients that send part of a head and stop: each gets 408 and is closed by the server."""
    count = 64
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(count)]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" if i % 2 else b"")  # half send nothing
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        results = [read_until_closed(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert all(closed for _, closed in results)
    for raw, _ in results:
        (answer,) = responses(raw)
        assert_openai_error(*answer, 408, "request_timeout")


def test_a_slow_head_after_a_kept_alive_request_is_closed_too(server: EngineServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")  # a second head that stalls
        raw, closed = read_until_closed(sock)
    first, second = responses(raw)
    assert first[0] == 200 and closed
    assert_openai_error(*second, 408, "request_timeout")


def test_a_trickled_head_cannot_outlive_the_deadline(server: EngineServer) -> None:
    """A byte every 0.2 s resets no timer: the deadline counts from the head's first byte."""
    stop = threading.Event()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        def trickle() -> None:
            for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000:
                if stop.wait(0.2):
                    return
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    return
        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        raw, closed = read_until_closed(sock)
        stop.set()
        sender.join()
    assert closed
    assert_openai_error(*responses(raw)[0], 408, "request_timeout")


# ---- routes and auth -------------------------------------------------------------------------------

@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"), ("GET", "/v1/models/"),
    ("GET", "/health/")])
def test_a_trailing_slash_is_never_redirected(server: EngineServer, method: str, path: str) -> None:
    raw, _ = exchange(server, request(method, path, b"{}" if method == "POST" else b"", host="evil.example",
                                      Connection="close"))
    status, headers, body = responses(raw)[0]
    assert "location" not in headers and status == 404, raw
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_without_the_key_only_the_probes_and_metrics_are_open(server: EngineServer) -> None:
    open_paths = {p: httpx.get(f"{server.url}{p}", timeout=30).status_code
                  for p in ("/health", "/ready", "/metrics")}
    assert open_paths == {"/health": 200, "/ready": 200, "/metrics": 200}
    for path in ("/openapi.json", "/v1/models", "/tokenizer_info"):
        resp = httpx.get(f"{server.url}{path}", timeout=30)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"]["code"] == "invalid_api_key"
    doc = httpx.get(f"{server.url}/openapi.json", headers=server.headers, timeout=30)
    assert doc.status_code == 200 and "/v1/completions" in doc.json()["paths"]
    for page in ("/docs", "/redoc"):
        assert httpx.get(f"{server.url}{page}", headers=server.headers, timeout=30).status_code == 404


# ---- strict types and finite numbers -----------------------------------------------------------------

COMPLETION = {"prompt": "Hi", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
NOT_INTEGERS = ["7", True, 7.0]


def post_raw(server: EngineServer, path: str, text: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=text, timeout=60,
                      headers={**server.headers, "Content-Type": "application/json"})


@pytest.mark.parametrize("bad", NOT_INTEGERS)
@pytest.mark.parametrize(("path", "base", "field"), [
    *(("/v1/completions", COMPLETION, f) for f in ("max_tokens", "n", "best_of", "logprobs", "top_k", "seed",
                                                   "min_tokens")),
    ("/v1/chat/completions", CHAT, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, "top_logprobs"),
])
def test_integer_fields_take_only_json_integers(server: EngineServer, path: str, base: dict, field: str,
                                                bad: object) -> None:
    resp = post_raw(server, path, json.dumps({**base, field: bad}))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field and resp.json()["error"]["code"] == "invalid_value"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/detokenize", {"tokens": [True, "5", 1.0]}, "tokens.0"),
    ("/detokenize", {"tokens": [5, 1.0]}, "tokens.1"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, True]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stream": "true"}, "stream"),
    ("/v1/completions", {**COMPLETION, "echo": 1}, "echo"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [2.0]}, "stop_token_ids.0"),
    ("/v1/completions", {**COMPLETION, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"5": "1"}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, "logprobs"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
])
def test_other_fields_take_only_their_json_type(server: EngineServer, path: str, body: dict,
                                                param: str) -> None:
    resp = post_raw(server, path, json.dumps(body))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "Infinity"), ("presence_penalty", "NaN"),
    ("frequency_penalty", "-Infinity"), ("min_p", "NaN"), ("repetition_penalty", "Infinity")])
def test_non_finite_numbers_are_refused_as_not_finite(server: EngineServer, field: str, value: str) -> None:
    resp = post_raw(server, "/v1/completions", f'{{"prompt": "Hi", "max_tokens": 1, "{field}": {value}}}')
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and "must be a finite number" in error["message"], error


def test_a_non_finite_logit_bias_is_refused_as_not_finite(server: EngineServer) -> None:
    resp = post_raw(server, "/v1/completions", '{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": NaN}}')
    assert resp.status_code == 400 and "finite" in resp.json()["error"]["message"], resp.text


def test_valid_types_still_work(server: EngineServer) -> None:
    body = {**COMPLETION, "temperature": 0, "top_p": 1, "seed": 7, "logit_bias": {"5": 1},
            "prompt": [504, 3575], "stream": False, "n": None}
    resp = post_raw(server, "/v1/completions", json.dumps(body))
    assert resp.status_code == 200, resp.text


# ---- defaults ----------------------------------------------------------------------------------------

def test_a_chat_without_max_tokens_gets_the_configured_default(server: EngineServer) -> None:
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "ignore_eos": True}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == MAX_TOKENS_DEFAULT
    explicit = httpx.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=120,
                          json={**body, "max_tokens": MAX_TOKENS_DEFAULT + 2})
    assert explicit.json()["usage"]["completion_tokens"] == MAX_TOKENS_DEFAULT + 2  # explicit values win


# ---- the disk store's directory through the control socket ----------------------------------------------

def test_rebuild_index_deletes_and_counts_a_misnamed_record_file(server: EngineServer, workdir: Path) -> None:
    folder = workdir / "kv" / "blocks" / "00"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "garbage.blk").write_bytes(b"not a record")
    (folder / "notes.txt").write_text("not the store's")
    with grpc.insecure_channel(f"unix://{workdir / 'c.sock'}") as channel:
        reply = pb_grpc.EngineControlStub(channel).RebuildIndex(pb.RebuildIndexRequest(), timeout=60)
    assert re.search(r"\b1 torn or corrupt skipped", reply.message), reply.message
    assert not (folder / "garbage.blk").exists() and (folder / "notes.txt").exists()
