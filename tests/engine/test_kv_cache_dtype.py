"""``confkv.kvCacheDtype``: the pool stores K/V at the cache dtype, attention reads them in the model's.

The embedded SmolLM2-135M (fp32 weights) served with a float32, bfloat16, float16, fp8 and int8 cache:
the pool's bytes are the spec's exact numbers, greedy output stays sane and the prompt's
perplexity stays close to the fp32 cache's.
"""

from __future__ import annotations

import math

import pytest
import torch

from confkv_api.config import load_config
from confkv_engine.cache.kv_cache import CacheSpec, KVCache, SeqKV
from confkv_engine.cache.layout import FP8_MAX, resolve_cache_dtype
from confkv_engine.cache.readback import ChainLink, ChainLoad
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import LoadedModel, load_model

torch.set_num_threads(1)
CPU = torch.device("cpu")
# SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64, blocks of 16 tokens; a block is K (or V) of
# all layers plus the 4-byte position of every (slot, layer, head) (and an int8 pool's fp16 scale).
SMOLLM2 = (30, 3, 64, 16)
BLOCK_BYTES = {"float32": 30 * 3 * 16 * (64 * 4 + 4), "bfloat16": 30 * 3 * 16 * (64 * 2 + 4),
               "float16": 30 * 3 * 16 * (64 * 2 + 4), "fp8": 30 * 3 * 16 * (64 + 4),
               "int8": 30 * 3 * 16 * (64 + 2 + 4)}
DTYPES = tuple(BLOCK_BYTES)


def test_block_bytes_are_the_cache_dtype_s() -> None:
    for name, expected in BLOCK_BYTES.items():
        dtype = resolve_cache_dtype(name, torch.float32)
        spec = CacheSpec(*SMOLLM2, dtype, CPU, compute_dtype=torch.float32)
        assert spec.block_bytes == expected
    assert BLOCK_BYTES == {"float32": 374_400, "bfloat16": 190_080, "float16": 190_080, "fp8": 97_920,
                           "int8": 100_800}
    assert resolve_cache_dtype("auto", torch.bfloat16) == torch.bfloat16


def test_a_spec_refuses_what_the_pool_cannot_store_or_attention_cannot_compute() -> None:
    with pytest.raises(ValueError, match="stores"):
        CacheSpec(*SMOLLM2, torch.int16, CPU)
    with pytest.raises(ValueError, match="computes"):
        CacheSpec(*SMOLLM2, torch.float8_e4m3fn, CPU)  # fp8 needs a compute dtype


def _small_cache(dtype: torch.dtype, salt: bytes | None = None) -> tuple[KVCache, SeqKV]:
    cache = KVCache(CacheSpec(2, 2, 8, 4, dtype, CPU, compute_dtype=torch.float32), 16, prefix_salt=salt)
    seq = SeqKV()
    cache.reserve(seq, 6)
    return cache, seq


@pytest.mark.parametrize(("dtype", "rel"), [(torch.bfloat16, 2**-8), (torch.float16, 2**-11),
                                            (torch.float8_e4m3fn, 2**-4), (torch.int8, 0.0)])
def test_writes_cast_to_the_pool_and_reads_come_back_in_the_compute_dtype(dtype, rel) -> None:
    cache, seq = _small_cache(dtype)
    k = torch.randn(6, 2, 8) * 10
    v = torch.randn(6, 2, 8)
    k[0, 0, 0], k[1, 1, 1] = 1000.0, -3000.0  # beyond fp8's 448
    plan = cache.plan_writes([seq], [6], torch.arange(6))
    for layer in range(2):
        cache.write(layer, plan, k, v)
    cache.commit(seq, 6)
    assert cache.kv.dtype == dtype
    keys = cache.read_table(seq.k_blocks, 1, 6)
    vals = cache.read_table(seq.v_blocks, 1, 6)
    assert keys.dtype == vals.dtype == torch.float32
    if dtype == torch.int8:  # within half a step of each (token, head) row's own scale
        for got, x in ((keys, k), (vals, v)):
            half_step = x.abs().amax(-1, keepdim=True) / 254
            assert ((got - x).abs() <= half_step * (1 + 2**-9) + 1e-6).all()
        return
    expected = k.clamp(-FP8_MAX, FP8_MAX) if dtype == torch.float8_e4m3fn else k
    assert torch.allclose(keys, expected, rtol=rel, atol=1e-3)  # fp8 saturates, never inf or nan
    assert torch.allclose(vals, v, rtol=rel, atol=1e-3 if dtype != torch.float8_e4m3fn else 2**-6)


@pytest.mark.parametrize(("dtype", "bits", "compressed"), [
    (torch.bfloat16, 8, 4), (torch.float8_e4m3fn, 4, 4),
    (torch.float8_e4m3fn, 8, 0),  # int8 codes plus parameters outgrow an fp8 block: left alone
    (torch.int8, 4, 0),  # an int8 pool holds codes already
])
def test_compressed_blocks_of_a_low_precision_pool_read_back_in_the_compute_dtype(
        dtype: torch.dtype, bits: int, compressed: int) -> None:
    cache = KVCache(CacheSpec(2, 2, 32, 16, dtype, CPU, compute_dtype=torch.float32), 16)
    seq = SeqKV()
    cache.reserve(seq, 32)
    gen = torch.Generator().manual_seed(bits)
    plan = cache.plan_writes([seq], [32], torch.arange(32))
    for layer in range(2):
        cache.write(layer, plan, torch.randn(32, 2, 32, generator=gen), torch.randn(32, 2, 32, generator=gen))
    cache.commit(seq, 32)
    before = [cache.read_table(t, 1, 32) for t in (seq.k_blocks, seq.v_blocks)]
    assert cache.compress_tables([seq], [2], bits, 64, limit=8).blocks == compressed
    assert sum(b < 0 for b in seq.k_blocks + seq.v_blocks) == compressed
    for table, ref in zip((seq.k_blocks, seq.v_blocks), before, strict=True):
        got = cache.read_table(table, 1, 32)
        assert got.dtype == torch.float32
        assert (got - ref).abs().max() <= (ref.max() - ref.min()) / ((1 << bits) - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_a_cached_block_pair_leaves_and_comes_back_as_the_same_bytes(dtype: torch.dtype) -> None:
    caches = [KVCache(CacheSpec(2, 2, 8, 4, dtype, CPU, compute_dtype=torch.float32), 16, prefix_salt=b"m")
              for _ in range(2)]
    seq = SeqKV()
    caches[0].reserve(seq, 4)
    plan = caches[0].plan_writes([seq], [4], torch.arange(4))
    for layer in range(2):
        caches[0].write(layer, plan, torch.randn(4, 2, 8) * 3, torch.randn(4, 2, 8))
    caches[0].commit(seq, 4)
    caches[0].register(seq, [1, 2, 3, 4])
    entry = caches[0].prefix.get(seq.block_keys[0])
    payload = caches[0].entry_payload(entry)
    scales = 2 * 2 * 4 * 2 * 2 if dtype == torch.int8 else 0  # 2 blocks x [L, bs, Hkv] fp16
    assert len(payload) == 2 * 2 * 4 * 2 * 8 * caches[0].kv.element_size() + scales
    spec = caches[1].spec
    shape = (2, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
    link = ChainLink(entry.key, None, entry.tokens, False)
    load = ChainLoad([link], shape, spec.dtype, None if caches[1].scale is None else shape[:-1])
    decoded = load.decode(payload)
    assert decoded is not None
    load.pairs[entry.key] = decoded  # what the disk store's reader thread does
    assert caches[1].install_load(load) == 1
    back = caches[1].prefix.get(entry.key)
    for a, b in ((entry.k_block, back.k_block), (entry.v_block, back.v_block)):
        assert torch.equal(caches[0].kv[:, a].view(torch.uint8), caches[1].kv[:, b].view(torch.uint8))
        assert torch.equal(caches[0].read_table([a], 1, 4), caches[1].read_table([b], 1, 4))


def test_the_prefix_key_names_the_storage_and_the_compute_dtype() -> None:
    tokens = list(range(4))
    keys = set()
    for storage, compute in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                             (torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.float32)):
        cache = KVCache(CacheSpec(2, 2, 8, 4, storage, CPU, compute_dtype=compute), 16, prefix_salt=b"m")
        seq = SeqKV()
        cache.reserve(seq, 4)
        cache.commit(seq, 4)
        cache.register(seq, tokens)
        keys.add(seq.block_keys[0])
    assert len(keys) == 4


# ---- the embedded model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model("builtin:smollm2-135m", dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def pydoc_prompt(loaded: LoadedModel) -> list[int]:
    from pydoc_data.topics import topics

    return loaded.tokenizer.encode(topics["assignment"], add_bos=False)[:160]


def _engine(loaded: LoadedModel, dtype: str) -> LLMEngine:
    return LLMEngine(loaded, load_config({"confkv": {"maxCacheSize": "64Mi", "kvCacheDtype": dtype}}))


def _run(engine: LLMEngine, tokens: list[int], params: SamplingParams):
    engine.add_request("r", tokens, params)
    while True:
        for out in engine.step():
            if out.finished:
                return out


@pytest.fixture(scope="module")
def runs(loaded: LoadedModel, pydoc_prompt: list[int]) -> dict[str, dict]:
    tok = loaded.tokenizer
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = tok.encode(tok.apply_chat_template(question))
    out = {}
    for dtype in DTYPES:
        engine = _engine(loaded, dtype)
        scoring = SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0)
        scored = _run(engine, pydoc_prompt, scoring)
        nll = -sum(e.logprob for e in scored.prompt_logprobs[1:]) / (len(pydoc_prompt) - 1)
        answer = _run(engine, chat, SamplingParams(max_tokens=16, temperature=0.0))
        out[dtype] = {"engine": engine, "ppl": math.exp(nll), "peak": scored.kv_usage.peak_kv_bytes,
                      "answer": tok.decode(answer.output_token_ids)}
        engine.close()
    return out


def test_the_pool_holds_the_cache_dtype_and_its_bytes(runs: dict[str, dict],
                                                      pydoc_prompt: list[int]) -> None:
    blocks = 2 * -(-len(pydoc_prompt) // 16)  # K and V tables
    for dtype, run in runs.items():
        cache = run["engine"].cache
        assert cache.kv.dtype == resolve_cache_dtype(dtype, torch.float32)
        assert cache.spec.block_bytes == BLOCK_BYTES[dtype]
        assert run["peak"] == blocks * BLOCK_BYTES[dtype]
        assert cache.num_blocks == 64 * 2**20 // BLOCK_BYTES[dtype] - 1  # the same budget, more blocks
    # K/V data halves at 16 bits and quarters at fp8; the positions (4 bytes a slot) do not shrink.
    data = {d: BLOCK_BYTES[d] - 30 * 3 * 16 * 4 for d in DTYPES}
    assert data["bfloat16"] * 2 == data["float16"] * 2 == data["fp8"] * 4 == data["float32"]


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8", "int8"])
def test_retention_rewrites_a_low_precision_pool(loaded: LoadedModel, pydoc_prompt: list[int],
                                                 runs: dict[str, dict], dtype: str) -> None:
    """conf-kv at half the bytes moves, merges and drops slots of a bf16 / fp8 / int8 pool: the request
    completes below its full-cache bytes, with a perplexity near the full cache's."""
    config = load_config({"confkv": {"maxCacheSize": "64Mi", "kvCacheDtype": dtype, "kvPolicy": "conf-kv",
                                     "budget": 0.5, "window": 32}})
    engine = LLMEngine(loaded, config)
    scored = _run(engine, pydoc_prompt, SamplingParams(max_tokens=0, prompt_logprobs=0, temperature=0.0))
    engine.close()
    nll = -sum(e.logprob for e in scored.prompt_logprobs[1:]) / (len(pydoc_prompt) - 1)
    usage = scored.kv_usage
    assert usage.tokens_discarded > 0  # the budget acted
    assert usage.peak_kv_bytes < runs[dtype]["peak"]
    assert math.exp(nll) < 1.3 * runs[dtype]["ppl"]


def test_greedy_output_and_perplexity_stay_sane(runs: dict[str, dict]) -> None:
    ref = runs["float32"]
    assert "Paris" in ref["answer"]
    limits = {"bfloat16": 0.01, "float16": 0.002, "fp8": 0.15, "int8": 0.02}  # relative increase
    for dtype, limit in limits.items():
        assert "Paris" in runs[dtype]["answer"], (dtype, runs[dtype]["answer"])
        assert abs(runs[dtype]["ppl"] / ref["ppl"] - 1) < limit, (dtype, runs[dtype]["ppl"], ref["ppl"])
    assert runs["bfloat16"]["ppl"] != ref["ppl"]  # the cache really is stored at lower precision
