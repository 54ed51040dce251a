"""Compression encodes without the engine lock (``core.compression``, ``cache.compress``): while an
encode is held inside the codec, the lock is free and the engine steps; a block freed and handed to
another request meanwhile is not swapped in (its encoding is discarded) and that request's output
equals an uncompressed run. A tiny random Llama on CPU, where the same code runs with no streams.

The encoder is held by a real ``threading.Event`` handshake around the codec's ``encode_rows``;
nothing waits on a sleep."""

from __future__ import annotations

import threading

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.cache import compress as compress_module
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.test_engine import prompt
from tests.engine.tiny_models import make_tiny_hf_model

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
WAIT = 120  # seconds a handshake may take on a loaded machine before the test fails (never sleeps)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    _, model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))
    return load_model(str(model_dir), dtype=torch.float32, device="cpu")


def make_engine(loaded, blocks: int = 22) -> LLMEngine:
    """A pool of ``blocks`` usable blocks, no prefix cache: a finished or aborted request's blocks go
    straight back to the free queue, where the next request takes them."""
    args = loaded.model.args
    block_bytes = args.num_layers * args.num_kv_heads * (args.head_dim * 4 + 4) * 16
    cfg = ConfKVConfig.model_validate({
        "engine": {"prefillChunk": 32},
        "confkv": {"maxCacheSize": str((blocks + 1) * block_bytes), "prefixCache": {"enabled": False}}})
    return LLMEngine(loaded, cfg)


class HeldEncoder:
    """Wraps the codec's ``encode_rows``: the first call signals ``entered`` and waits for ``release``."""

    def __init__(self, real) -> None:
        self.real, self.entered, self.release, self.calls = real, threading.Event(), threading.Event(), 0

    def __call__(self, x, spec):
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            if not self.release.wait(WAIT):
                raise RuntimeError("the test never released the encoder")
        return self.real(x, spec)


def running(eng: LLMEngine, request_id: str):
    return next(s for s in eng.scheduler.running if s.request_id == request_id)


def computed(eng: LLMEngine, request_id: str) -> int:
    """Tokens the request has computed; -1 while it is not running."""
    seqs = [s for s in eng.scheduler.running if s.request_id == request_id]
    return seqs[0].num_computed if seqs else -1


def test_steps_run_while_a_block_is_encoded_and_a_reused_block_is_not_swapped_in(loaded, monkeypatch) -> None:
    (expected_r2,) = make_engine(loaded).generate([prompt(64, 2)], GREEDY)
    eng = make_engine(loaded)
    for i in range(2):
        eng.add_request(f"r{i}", prompt(64, i), GREEDY)
    while min((len(s.output_token_ids) for s in eng.scheduler.running), default=0) < 2:
        eng.step()
    r0 = running(eng, "r0")
    r0_blocks = set(r0.kv.k_blocks[:3] + r0.kv.v_blocks[:3])  # the blocks forced compression takes
    encoder = HeldEncoder(compress_module.encode_rows)
    monkeypatch.setattr(compress_module, "encode_rows", encoder)
    results = []
    worker = threading.Thread(target=lambda: results.append(eng.compress(bits=8, force=True)))
    worker.start()
    try:
        assert encoder.entered.wait(WAIT)
        # The encode is in progress: the engine lock is free, and the engine steps.
        assert eng.lock.acquire(timeout=WAIT)
        eng.lock.release()
        eng.abort_request("r0")  # its blocks go back to the pool mid-encode...
        eng.add_request("r2", prompt(64, 2), GREEDY)
        while computed(eng, "r2") < 64:
            eng.step()  # ...and r2 takes them and writes its own keys and values there
        r2 = running(eng, "r2")
        assert r0_blocks & set(r2.kv.k_blocks + r2.kv.v_blocks)
    finally:
        encoder.release.set()
        worker.join(WAIT)
    (result,) = results
    assert result.discarded == 6 and result.blocks == 6  # r0's blocks discarded, r1's swapped in
    assert all(b >= 0 for b in r2.kv.k_blocks + r2.kv.v_blocks)  # none of r2's blocks became a handle
    final = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert final["r2"].output_token_ids == expected_r2.output_token_ids
    assert final["r1"].finish_reason == "length"
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks
