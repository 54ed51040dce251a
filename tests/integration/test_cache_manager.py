"""The cache manager through real processes: ``confkv serve`` on the embedded model with a cache
directory; the prefix cache reports hits per request and in GetStatus, Warmup prefills a prompt the
next request hits, raising maxCacheSize over UpdatePolicy grows the pool while a request streams
(same greedy answer, prefix hits kept), and after a restart on the same directory the prefix comes
back from disk."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from engine_server import EngineServer, wait_for

from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(600)

SYSTEM = ("You are a careful assistant for a team of engineers who run a fleet of inference servers. "
          "Answer in one short sentence, name the component you mean, and never guess a number. ") * 3


def _status(sock: Path) -> pb.EngineStatus:
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        return pb_grpc.EngineControlStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)


def _control(sock: Path, method: str, request: object) -> pb.ActionResponse:
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        return getattr(pb_grpc.EngineControlStub(channel), method)(request, timeout=120)


def _complete(srv: EngineServer, prompt: str, max_tokens: int = 4, ignore_eos: bool = False) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}
    resp = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cm")


def _serve(workdir: Path, port: int | None = None) -> EngineServer:
    cfg = workdir / "confkv.json"
    engine = {"grpcSocket": str(workdir / "e.sock"), "cacheDir": str(workdir / "nvme")}
    # fp32 weights: answers are compared with and without a hit, and the quantized kernels are chosen
    # per row count (a hit leaves fewer prompt rows to compute, so their rounding would differ).
    cfg.write_text(json.dumps({"model": {"weights": "fp32"}, "engine": engine,
                               "confkv": {"maxCacheSize": "64Mi"}}))
    srv = EngineServer(workdir, "--config", str(cfg), **({"port": port} if port else {}))
    srv.wait_ready()
    return srv


@pytest.fixture(scope="module")
def server(workdir: Path) -> Iterator[EngineServer]:
    srv = _serve(workdir)
    try:
        yield srv
    finally:
        srv.stop()


def test_a_shared_system_prompt_is_a_hit_with_the_same_answer(server: EngineServer, workdir: Path) -> None:
    cold = _complete(server, SYSTEM + "Which component schedules requests?")
    before = _status(workdir / "e.sock")
    warm = _complete(server, SYSTEM + "Which component schedules requests?")
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    want = 16 * (cold["usage"]["prompt_tokens"] // 16 - 1)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= want  # reported per request
    # GetStatus reads the engine's snapshot taken after each step: it may lag the HTTP answer a step.
    after = wait_for(lambda: (s := _status(workdir / "e.sock")).prefix_hit_tokens - before.prefix_hit_tokens
                     >= want and s, "the hit in GetStatus")
    assert after.prefix_cache_enabled
    assert "prefix-cache" in after.capabilities and "rebuild-index" in after.capabilities


def test_warmup_prefills_what_the_next_request_hits(server: EngineServer, workdir: Path) -> None:
    prompt = "The deployment guide says: keep the hot prefixes warm, and evict the cold ones first. " * 4
    resp = _control(workdir / "e.sock", "Warmup", pb.WarmupRequest(prompts=[prompt]))
    assert "warmed 1 prompt" in resp.message and resp.blocks_affected > 0
    before = _status(workdir / "e.sock").prefix_hit_tokens
    _complete(server, prompt + " Why?")
    wait_for(lambda: _status(workdir / "e.sock").prefix_hit_tokens - before >= 64, "the warmed prefix's hit")


def test_forced_compression_frees_kv_bytes_and_keeps_answers(server: EngineServer, workdir: Path) -> None:
    sock = workdir / "e.sock"
    prompt = SYSTEM + "Name the component that compresses cold blocks."
    plain = _complete(server, prompt)["choices"][0]["text"]
    before = _status(sock)
    resp = _control(sock, "Compress", pb.CompressRequest(strategy="int8", force=True))
    after = wait_for(lambda: (s := _status(sock)).kv_blocks_compressed > 0 and s, "compressed blocks")
    assert resp.blocks_affected > 0 and "pool blocks" in resp.message
    assert after.kv_bytes_used < before.kv_bytes_used  # the freed blocks are usable by anyone now
    again = _complete(server, prompt)  # a hit on the compressed prefix, dequantized inside attention
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["text"] == plain


def test_bad_warmup_and_rebuild_requests(server: EngineServer, workdir: Path) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _control(workdir / "e.sock", "Warmup", pb.WarmupRequest(top_k=-1))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    resp = _control(workdir / "e.sock", "RebuildIndex", pb.RebuildIndexRequest())
    assert "rebuilt the disk index" in resp.message
    assert _status(workdir / "e.sock").num_running == 0  # still serving


def _update(sock: Path, confkv: dict) -> pb.UpdatePolicyResponse:
    with grpc.insecure_channel(f"unix://{sock}") as channel:
        request = pb.UpdatePolicyRequest(confkv_json=json.dumps(confkv), reason="integration test")
        return pb_grpc.EngineControlStub(channel).UpdatePolicy(request, timeout=120)


def _stream_during(srv: EngineServer, prompt: str, max_tokens: int, change: Callable[[], object]) -> str:
    """Stream a greedy completion; run ``change`` once its first text arrived; the whole text."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    texts: list[str] = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[len("data: "):]).get("choices") or [{}]
            texts.append(choices[0].get("text", ""))
            if len(texts) == 1:
                change()
    return "".join(texts)


def test_raising_max_cache_size_live_grows_the_pool(server: EngineServer, workdir: Path) -> None:
    sock = workdir / "e.sock"
    prompt = SYSTEM + "Which component grows the pool?"
    first = _complete(server, prompt)  # its prefix is cached before the grow
    counting = "Count the ships:"  # under one block: no prefix hit, the same rows every time
    reference = _complete(server, counting, 64, ignore_eos=True)["choices"][0]["text"]
    before = _status(sock)
    block = before.kv_bytes_total // (before.kv_blocks_total + 1)  # the total includes the null block
    _update(sock, {"maxCacheSize": str(before.kv_bytes_total)})  # the size in effect: nothing changes
    assert _status(sock).kv_blocks_total == before.kv_blocks_total
    seen: list[pb.EngineStatus] = []

    def grow() -> None:
        _update(sock, {"maxCacheSize": "96Mi"})
        seen.append(wait_for(lambda: (s := _status(sock)).kv_blocks_total > before.kv_blocks_total and s,
                             "the grown pool"))

    assert _stream_during(server, counting, 64, grow) == reference
    grown = seen[0]
    assert grown.num_running >= 1  # the streaming request was still running after the grow landed
    size = 96 << 20
    assert grown.kv_blocks_total == size // block - 1 and grown.kv_bytes_total == size // block * block
    again = _complete(server, prompt)  # a hit on blocks cached before the grow
    want = 16 * (first["usage"]["prompt_tokens"] // 16 - 1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= want
    assert again["choices"][0]["text"] == first["choices"][0]["text"]

    with pytest.raises(grpc.RpcError) as err:
        _update(sock, {"maxCacheSize": "1000Ti"})
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert "more than this machine can hold now" in err.value.details() and "bytes" in err.value.details()
    assert _status(sock).kv_blocks_total == grown.kv_blocks_total
    # The agent's lowerMaxCacheSize asks for 80% of kv_bytes_total: exactly that, in whole blocks.
    _update(sock, {"maxCacheSize": str(int(grown.kv_bytes_total * 0.8))})
    wait_for(lambda: _status(sock).kv_bytes_total == int(grown.kv_bytes_total * 0.8) // block * block,
             "the 20% cut")


def test_after_a_restart_the_prefix_comes_back_from_disk(workdir: Path) -> None:
    disk = workdir / "restart"
    disk.mkdir()
    first = _serve(disk)
    try:
        answer = _complete(first, SYSTEM + "What restarts the engine?")["choices"][0]["text"]
        _complete(first, SYSTEM + "What restarts the engine?")  # used twice: it deserves the disk
    finally:
        assert first.stop() == 0  # a clean shutdown writes the cached blocks to the cache directory
    second = _serve(disk)
    try:
        status = _status(disk / "e.sock")
        assert status.prefix_hit_tokens == 0
        again = _complete(second, SYSTEM + "What restarts the engine?")
        assert again["choices"][0]["text"] == answer
        wait_for(lambda: _status(disk / "e.sock").prefix_hit_tokens > 0, "a hit served from disk")
    finally:
        second.stop()


def test_start_up_warmup_is_cached_before_readiness(workdir: Path) -> None:
    home = workdir / "warm"
    home.mkdir()
    prompt = "Warm prefixes are prefilled before the pod reports ready, so the first users hit them. " * 3
    engine = {"grpcSocket": str(home / "e.sock")}
    cfg = home / "confkv.json"
    cfg.write_text(json.dumps({"model": {"weights": "fp32"}, "engine": engine,
                               "confkv": {"warmup": {"prompts": [prompt]}}}))
    srv = EngineServer(home, "--config", str(cfg))
    try:
        srv.wait_ready()  # readiness comes after the warm-up
        first = _complete(srv, prompt + " Who benefits?")
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
    finally:
        srv.stop()
