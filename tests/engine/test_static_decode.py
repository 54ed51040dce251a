"""The static-buffer decode path (``core.graph_runner``: CUDA graphs on CUDA) run eagerly on this CPU
against the eager engine: the same greedy tokens and the same logprobs, on tiny random models of
several architectures (a sliding window included) and on the embedded SmolLM2 with requests of
different lengths decoding in one batch; decode batches run at the padded sizes, and padding rows
write nothing but the null block's scratch slot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.graph_runner import padded_size, padded_sizes
from confkv_engine.core.parts import build_parts
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.tiny_models import make_tiny_hf_model

NEW = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=3)


def _config(**engine: object) -> ConfKVConfig:
    return ConfKVConfig.model_validate({"engine": {"prefillChunk": 32, "maxBatchSize": 8, **engine},
                                        "confkv": {"maxCacheSize": "16Mi"}})


def _engine(loaded, static: bool, config: ConfKVConfig | None = None) -> LLMEngine:
    config = config or _config()
    return LLMEngine(loaded, config, parts=build_parts(loaded, config, static_decode=static))


def _outputs(loaded, prompts: list[list[int]], static: bool):
    engine = _engine(loaded, static)
    outs = engine.generate(prompts, PARAMS)
    runner = engine.decode_runner
    assert (runner is not None and runner.steps > 0) == static  # the path under test really ran
    return outs


def _assert_same(static, eager) -> None:
    for s, e in zip(static, eager, strict=True):
        assert s.output_token_ids == e.output_token_ids
        assert len(s.logprobs) == len(e.logprobs) == NEW
        for a, b in zip(s.logprobs, e.logprobs, strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


def test_padded_sizes() -> None:
    assert padded_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert padded_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert padded_sizes(3) == [1, 2, 3] and padded_sizes(1) == [1] and padded_sizes(16) == [1, 2, 4, 8, 16]
    assert [padded_size(n, padded_sizes(64)) for n in (1, 3, 5, 9, 17, 33, 64)] == [1, 4, 8, 16, 32, 48, 64]
    with pytest.raises(ValueError, match="larger than"):
        padded_size(65, padded_sizes(64))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_static_decode_equals_eager_on_tiny_models(arch: str, tmp_path: Path) -> None:
    _, model_dir = make_tiny_hf_model(arch, tmp_path)
    loaded = load_model(str(model_dir))
    prompts = [[5 + i] * n for i, n in enumerate((3, 17, 40))]  # 3 rows: padded size 4
    _assert_same(_outputs(loaded, prompts, True), _outputs(loaded, prompts, False))


def test_static_decode_equals_eager_on_the_embedded_model() -> None:
    loaded = load_model("builtin:smollm2-135m", dtype=torch.float32, device="cpu")
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived "
             "an old fisherman who", "def fibonacci(n):"]
    prompts = [loaded.tokenizer.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 3
    _assert_same(_outputs(loaded, prompts, True), _outputs(loaded, prompts, False))


def test_a_batch_of_three_runs_at_four_and_padding_touches_no_real_block(tmp_path: Path) -> None:
    _, model_dir = make_tiny_hf_model("llama", tmp_path)
    engine = _engine(load_model(str(model_dir)), True)
    for i in range(3):
        engine.add_request(f"r{i}", [7 + i] * (5 + 9 * i), PARAMS)
    engine.step()  # the prefills (eager)
    runner, cache = engine.decode_runner, engine.cache
    assert runner is not None and runner.steps == 0
    bs = cache.spec.block_size
    seqs = [s for s in engine.scheduler.running]
    real = {(s.kv.k_blocks[s.kv.num_slots // bs], s.kv.num_slots % bs) for s in seqs}
    real |= {(s.kv.v_blocks[s.kv.num_slots // bs], s.kv.num_slots % bs) for s in seqs}
    before = cache.kv.clone()
    cache.kv[:, cache.null_block] = 0
    engine.step()
    assert runner.steps == 1 and runner.last_size == 4
    changed = (cache.kv != before).flatten(3).any(-1).any(0).nonzero().tolist()  # (block, slot)
    touched = {(b, s) for b, s in changed}
    assert touched - {(cache.null_block, 0)} <= real and real <= touched  # the 3 rows wrote their slots
    assert (cache.null_block, 0) in touched  # the padding row wrote the scratch slot, nothing else


def _stepped(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]],
             resize_at: int | None = None) -> list:
    """Outputs by request, stepping by hand; the pool grows (a new tensor) before step ``resize_at``."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    final, k = {}, 0
    while len(final) < len(requests):
        if k == resize_at:
            engine.cache.resize(2 * engine.cache.num_blocks)
        final.update({o.request_id: o for o in engine.step() if o.finished})
        k += 1
    return [final[f"r{i}"] for i in range(len(requests))]


def test_static_decode_across_a_pool_resize(tmp_path: Path) -> None:
    """A live pool resize reallocates the pool tensor between two decode steps (a CUDA graph would
    be captured again): the static path keeps giving the eager path's tokens."""
    _, model_dir = make_tiny_hf_model("llama", tmp_path)
    loaded = load_model(str(model_dir))
    requests = [([5 + i] * n, PARAMS) for i, n in enumerate((3, 17, 40))]
    static_engine = _engine(loaded, True)
    pool_before = static_engine.cache.kv.data_ptr()
    static = _stepped(static_engine, requests, resize_at=5)
    assert static_engine.cache.kv.data_ptr() != pool_before and static_engine.decode_runner.steps >= NEW - 2
    _assert_same(static, _stepped(_engine(loaded, False), requests, resize_at=5))


def test_a_retained_sequence_sends_its_batch_down_the_eager_path(tmp_path: Path) -> None:
    """A conf-kv request records queries and positions on the host every step, so steps it is part of
    run eagerly; once it finishes, the full-policy ones go back to the static path."""
    _, model_dir = make_tiny_hf_model("llama", tmp_path)
    loaded = load_model(str(model_dir))
    retained = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, kv_policy="conf-kv",
                              kv_budget=0.5)
    requests = [([5] * 17, PARAMS), ([6] * 40, PARAMS), ([7] * 33, retained)]
    engine = _engine(loaded, True)
    static = _stepped(engine, requests)
    assert 0 < engine.decode_runner.steps <= NEW - 4  # only the steps after the retained one finished
    eager = _stepped(_engine(loaded, False), requests)
    _assert_same(static[:2], eager[:2])
    assert static[2].output_token_ids == eager[2].output_token_ids


def test_who_gets_a_runner(tmp_path: Path) -> None:
    """CPU serving keeps the eager path unless asked (cudaGraphs is about CUDA); a pool no kernel
    reads in place (int8) gets no runner even when asked."""
    _, model_dir = make_tiny_hf_model("llama", tmp_path)
    loaded = load_model(str(model_dir))
    assert LLMEngine(loaded, _config()).decode_runner is None
    assert _engine(loaded, True).decode_runner is not None
    int8 = ConfKVConfig.model_validate({"engine": {"prefillChunk": 32, "maxBatchSize": 8},
                                        "confkv": {"maxCacheSize": "16Mi", "kvCacheDtype": "int8"}})
    assert _engine(loaded, True, int8).decode_runner is None
