"""Compression through LLMEngine on the embedded SmolLM2-135M (fp32, CPU): forced int8 compression of
running requests keeps greedy decoding, frees pool blocks, a prefix hit on compressed cached blocks
serves the same answer, the worker compresses cold cached blocks and stops, live config is checked."""

from __future__ import annotations

import time

import pytest
import torch

from confkv_api.config import ConfKVConfig, ConfKVSection
from confkv_engine.core.control_api import PolicyRejected
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.model.loader import LoadedModel, load_model

MAX_NEW = 20
# A top-2 gap (logprob of the chosen token minus the runner-up) below this is a near tie that int8
# noise on the keys and values may flip.
NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("builtin:smollm2-135m", dtype=torch.float32, device="cpu")


def make_engine(loaded: LoadedModel, **compression) -> LLMEngine:
    cfg = ConfKVConfig.model_validate({"engine": {"prefillChunk": 64, "maxNumBatchedTokens": 256},
                                       "confkv": {"maxCacheSize": "64Mi", "compression": compression}})
    return LLMEngine(loaded, cfg)


def prompts(loaded: LoadedModel) -> list[list[int]]:
    tok = loaded.tokenizer
    questions = ["Explain in a few sentences why the sky is blue during the day and red at sunset.",
                 "Write a short story about a robot who learns to paint landscapes in the mountains."]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, ignore_eos=True)


def run(eng: LLMEngine, batch: list[list[int]], compress_after: int | None = None):
    """Greedy outputs; with ``compress_after``, forced int8 compression once every request has
    generated that many tokens. Returns (outputs, compression result or None)."""
    ids = [f"r{i}" for i in range(len(batch))]
    for rid, p in zip(ids, batch, strict=True):
        eng.add_request(rid, p, GREEDY)
    final, result, produced = {}, None, {}
    while len(final) < len(ids):
        for out in eng.step():
            produced[out.request_id] = len(out.output_token_ids)
            if out.finished:
                final[out.request_id] = out
        ready = len(produced) == len(ids) and min(produced.values()) >= (compress_after or 0)
        if compress_after is not None and result is None and ready:
            result = eng.compress(bits=8, force=True)
    return [final[r] for r in ids], result


def assert_same_or_near_tie(ref, got) -> None:
    """Equal tokens, or the first difference is where the reference's top-2 gap is tiny."""
    for i, (a, b) in enumerate(zip(ref.output_token_ids, got.output_token_ids, strict=True)):
        if a != b:
            top = ref.logprobs[i].top
            gap = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
            assert gap < NEAR_TIE, f"token {i} differs ({a} vs {b}) with a top-2 gap of {gap:.3f}"
            return


def test_forced_int8_keeps_greedy_decoding_and_frees_pool_blocks(loaded) -> None:
    batch = prompts(loaded)
    reference, _ = run(make_engine(loaded), batch)
    eng = make_engine(loaded)
    outputs, result = run(eng, batch, compress_after=4)
    assert result is not None and result.blocks > 0 and result.pool_blocks_freed > 0
    assert result.bytes_freed == result.pool_blocks_freed * eng.cache.spec.block_bytes
    for ref, got in zip(reference, outputs, strict=True):
        assert_same_or_near_tie(ref, got)
    stats = eng.stats()
    assert stats.kv_blocks_compressed == len(eng.cache.store) > 0  # cached after the requests
    assert stats.kv_bytes_compressed > 0


def test_prefix_hit_on_compressed_cached_blocks(loaded) -> None:
    batch = prompts(loaded)[:1]
    eng = make_engine(loaded)
    first, _ = run(eng, batch)
    cached = len(eng.cache.eviction)
    assert cached > 0
    result = eng.compress(force=True)  # nothing runs: every cached block is evictable
    assert result.blocks == 2 * cached and len(eng.cache.store) == 2 * cached
    hits_before = eng.cache.hits.hit
    again, _ = run(eng, batch)
    assert eng.cache.hits.hit - hits_before >= eng.cache.spec.block_size * (len(batch[0]) // 16 - 1)
    assert_same_or_near_tie(first[0], again[0])


def test_worker_compresses_cold_cached_blocks_and_stops(loaded) -> None:
    eng = make_engine(loaded, coldAfterSeconds=0)
    run(eng, prompts(loaded)[:1])
    eng.start_compression()
    try:
        deadline = time.monotonic() + 120
        while eng.stats().kv_blocks_compressed < 2 * len(eng.cache.eviction) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.stats().kv_blocks_compressed == 2 * len(eng.cache.eviction) > 0
    finally:
        eng.stop_compression()
    assert not eng.compression_control.running


def test_live_compression_config(loaded) -> None:
    eng = make_engine(loaded, enabled=False)
    eng.start_compression()
    assert not eng.compression_control.running  # disabled: no thread
    section = ConfKVSection.model_validate({"compression": {"enabled": True, "bits": 4}})
    eng.apply_policy(section, eng.max_batch_size, ["confkv.compression.enabled", "confkv.compression.bits"])
    assert eng.compression_control.running and eng.compression.bits == 4
    bad = ConfKVSection.model_validate({"compression": {"groupSize": 48}})
    with pytest.raises(PolicyRejected, match="groupSize 48 must divide head_dim 64"):
        eng.apply_policy(bad, eng.max_batch_size, ["confkv.compression.groupSize"])
    assert eng.compression.bits == 4 and eng.compression_control.running  # nothing changed
    off = ConfKVSection.model_validate({"compression": {"enabled": False}})
    eng.apply_policy(off, eng.max_batch_size, ["confkv.compression.enabled"])
    assert not eng.compression_control.running
    eng.stop_compression()
    with pytest.raises(InvalidRequest, match="bits must be 8 or 4"):
        eng.compress(bits=2)
    assert "confkv.compression" in eng.live_fields() and "compress" in eng.capabilities()
