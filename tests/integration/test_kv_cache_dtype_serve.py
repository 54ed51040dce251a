"""``confkv serve --kv-cache-dtype fp8`` as a real process: the pool's capacity in /metrics and
GetStatus is counted at one byte per K/V element, requests report bytes at that size, answers stay
right."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import pytest
from engine_server import EngineServer

from confkv_api import metrics as names
from confkv_api.v1 import control_pb2 as pb
from confkv_api.v1 import control_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(600)

# SmolLM2-135M, blocks of 16: K (or V) of 30 layers x 3 KV heads x 64 at one byte, plus the 4-byte
# position of every (slot, layer, head).
FP8_BLOCK_BYTES = 30 * 3 * 16 * (64 + 4)
POOL = 64 * 2**20


def test_an_fp8_cache_is_counted_at_its_bytes_and_still_answers(tmp_path: Path) -> None:
    sock = tmp_path / "e.sock"
    srv = EngineServer(tmp_path, "--weights", "fp32", "--kv-cache-dtype", "fp8",
                       "--max-cache-size", str(POOL), "--no-prefix-cache", "--grpc-socket", str(sock))
    try:
        srv.wait_ready()
        usable = POOL // FP8_BLOCK_BYTES - 1  # less the null block
        assert srv.metrics()[names.KV_CACHE_CAPACITY_BYTES] == usable * FP8_BLOCK_BYTES
        with grpc.insecure_channel(f"unix://{sock}") as channel:
            status = pb_grpc.EngineControlStub(channel).GetStatus(pb.GetStatusRequest(), timeout=10)
        assert status.kv_bytes_total == usable * FP8_BLOCK_BYTES
        body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        resp = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        assert "Paris" in data["choices"][0]["text"]
        assert data["usage"]["peak_kv_bytes"] == 2 * FP8_BLOCK_BYTES  # 9 tokens: one K and one V block
    finally:
        srv.stop()
