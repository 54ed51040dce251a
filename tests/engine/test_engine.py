"""LLMEngine on a tiny random Llama: validation, admission, abort, OOM recovery, sampling options."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams
from confkv_engine.model.llama import DenseAttention
from confkv_engine.model.loader import load_model
from tests.engine.tiny_models import make_tiny_hf_model

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    _, model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))
    return load_model(str(model_dir), dtype=torch.float32, device="cpu")


def make_engine(loaded, blocks: int | None = None, **engine) -> LLMEngine:
    args = loaded.model.args
    block_bytes = args.num_layers * args.num_kv_heads * (args.head_dim * 4 + 4) * engine.get("blockSize", 16)
    size = str((blocks + 1) * block_bytes) if blocks else "8Mi"  # + the null block the cache reserves
    cfg = ConfKVConfig.model_validate({"engine": {"prefillChunk": 32, **engine},
                                       "confkv": {"maxCacheSize": size}})
    return LLMEngine(loaded, cfg)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 250 for i in range(n)]


def test_invalid_requests_are_rejected(loaded) -> None:
    eng = make_engine(loaded, blocks=8)  # 8 blocks = 4 K + 4 V = 64 tokens
    cases = [
        ([], GREEDY, "prompt"),
        ([999], GREEDY, "prompt"),
        (prompt(600), GREEDY, "prompt"),  # over max_model_len (512)
        (prompt(500), SamplingParams(max_tokens=20), "max_tokens"),
        (prompt(60), SamplingParams(max_tokens=5), "max_tokens"),  # 65 tokens never fit the pool
    ]
    for ids, params, param in cases:
        with pytest.raises(InvalidRequest) as err:
            eng.add_request("r", ids, params)
        assert err.value.param == param
    eng.add_request("ok", prompt(60), SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequest):
        eng.add_request("ok", prompt(3), GREEDY)
    assert eng.stats().num_waiting == 1


def test_admission_by_free_blocks_and_batch_size(loaded) -> None:
    eng = make_engine(loaded, blocks=12)  # room for 12 K/V blocks
    for i in range(4):
        eng.add_request(f"r{i}", prompt(40, i), GREEDY)  # first chunk of 32 needs 2 K + 2 V blocks
    eng.step()
    s = eng.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (3, 1, 0)
    eng2 = make_engine(loaded, maxBatchSize=2)
    for i in range(4):
        eng2.add_request(f"r{i}", prompt(10, i), GREEDY)
    eng2.step()
    assert (eng2.stats().num_running, eng2.stats().num_waiting) == (2, 2)


def test_prefill_chunks_end_on_block_boundaries(loaded) -> None:
    eng = make_engine(loaded, prefillChunk=32, maxNumBatchedTokens=40)
    eng.add_request("a", prompt(3), GREEDY)
    eng.add_request("b", prompt(100, 1), GREEDY)
    sched = eng.scheduler.schedule()
    # 'a' takes 3 tokens, leaving 37: 'b' gets 32 (a whole chunk), never a 37-token unaligned one.
    assert [(s.request_id, n) for s, n in sched.scheduled] == [("a", 3), ("b", 32)]
    eng2 = make_engine(loaded, prefillChunk=32, maxNumBatchedTokens=40)
    for i in range(10):
        eng2.add_request(f"d{i}", prompt(2, i), SamplingParams(temperature=0, max_tokens=1))
    eng2.add_request("long", prompt(100, 1), GREEDY)
    sched = eng2.scheduler.schedule()
    assert dict((s.request_id, n) for s, n in sched.scheduled)["long"] == 16  # 20 left -> 16


def test_abort_frees_blocks_at_once(loaded) -> None:
    eng = make_engine(loaded)
    total = eng.stats().num_free_blocks
    eng.add_request("a", prompt(50), SamplingParams(temperature=0, max_tokens=30))
    eng.step()
    assert eng.stats().num_free_blocks < total
    eng.abort_request("a")
    assert eng.stats().num_free_blocks == total and eng.stats().num_running == 0
    (out,) = eng.step()
    assert out.finished and out.finish_reason == "abort"
    assert not eng.has_unfinished()


class _OomOnce:
    """Test double standing in for a CUDA OOM (no GPU here): raises torch.OutOfMemoryError on the
    first ``failures`` forward calls, then delegates to the real model."""

    def __init__(self, model, failures: int) -> None:
        self.model, self.failures, self.calls = model, failures, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls <= self.failures:
            raise torch.OutOfMemoryError("injected")
        return self.model(*args, **kwargs)


def test_oom_is_counted_and_requests_are_recomputed(loaded) -> None:
    prompts = [prompt(20, i) for i in range(3)]
    expected = [o.output_token_ids for o in make_engine(loaded).generate(prompts, GREEDY)]
    eng = make_engine(loaded)
    eng.model = _OomOnce(loaded.model, failures=1)
    outs = eng.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    assert eng.stats().num_oom == 1 and eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_repeated_oom_fails_requests_cleanly(loaded) -> None:
    eng = make_engine(loaded)
    eng.model = _OomOnce(loaded.model, failures=10**6)
    outs = eng.generate([prompt(20)], GREEDY)
    assert outs[0].finish_reason == "error" and outs[0].error
    assert eng.stats().num_oom == 3 and not eng.has_unfinished()


def test_echo_prompt_logprobs_with_zero_max_tokens(loaded) -> None:
    ids = prompt(75)
    eng = make_engine(loaded)  # prefill chunks of 32 < 75
    (out,) = eng.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=2))
    assert out.finish_reason == "length" and out.output_token_ids == []
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), DenseAttention())
        ref = torch.log_softmax(loaded.model.compute_logits(hidden), -1)
    for i in range(1, len(ids)):
        assert lps[i].token_id == ids[i]
        assert abs(lps[i].logprob - ref[i - 1, ids[i]].item()) < 1e-4
        assert len(lps[i].top) == 2 and lps[i].top[0][0] == int(ref[i - 1].argmax())


def test_stop_conditions(loaded) -> None:
    eng = make_engine(loaded)
    base = eng.generate([prompt(10)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.output_token_ids) == 12
    # The last sampled token is never run through the model: 10 + 12 - 1 cached, in 2 K + 2 V blocks.
    assert base.kv_usage.tokens_full == 21
    assert base.kv_usage.peak_kv_bytes == 4 * eng.cache.spec.block_bytes
    first, third = base.output_token_ids[0], base.output_token_ids[2]
    out = eng.generate([prompt(10)], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(third,)))[0]
    assert out.finish_reason == "stop" and out.output_token_ids == base.output_token_ids[:3]
    # min_tokens masks a stop id until reached: the first token can no longer be `first`.
    out = eng.generate([prompt(10)], SamplingParams(temperature=0, max_tokens=12, min_tokens=2,
                                                    stop_token_ids=(first,)))[0]
    assert out.output_token_ids[0] != first and len(out.output_token_ids) >= 2
    if len(base.text) >= 4:
        stop = base.text[2:4]
        out = eng.generate([prompt(10)], SamplingParams(temperature=0, max_tokens=12, stop=(stop,)))[0]
        assert out.finish_reason == "stop" and out.text == base.text[:base.text.index(stop)]


def test_seeded_sampling_does_not_depend_on_the_batch(loaded) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True, logprobs=1)
    alone = make_engine(loaded).generate([prompt(15)], params)[0]
    others = [dataclasses.replace(params, seed=s) for s in (1, 2)]
    batch = make_engine(loaded).generate([prompt(30, 1), prompt(15), prompt(5, 2)],
                                         [others[0], params, others[1]])
    assert batch[1].output_token_ids == alone.output_token_ids
    assert len(alone.logprobs) == 10 and alone.logprobs[0].token_id == alone.output_token_ids[0]


def test_preemption_keeps_echo_logprobs_and_tokens(loaded) -> None:
    prompts = [prompt(40 + 9 * i, i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)
    ref = make_engine(loaded).generate(prompts, params)
    eng = make_engine(loaded, blocks=12)  # 96 tokens of K+V: at most two of these at a time
    outs = eng.generate(prompts, params)
    s = eng.stats()
    assert s.num_preemptions > 0 and s.num_free_blocks == s.num_total_blocks
    assert s.prompt_tokens_total == sum(len(p) for p in prompts) and s.generated_tokens_total == 4 * 24
    for a, b in zip(outs, ref, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs)
        assert [e and e.token_id for e in a.prompt_logprobs] == [e and e.token_id for e in b.prompt_logprobs]
    assert sum(o.num_preemptions for o in outs) == s.num_preemptions


def test_max_batch_size_changes_live(loaded) -> None:
    eng = make_engine(loaded)
    for i in range(4):
        eng.add_request(f"r{i}", prompt(10, i), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.set_max_batch_size(1)
    eng.step()
    assert (eng.stats().num_running, eng.stats().num_waiting) == (1, 3)
    with pytest.raises(InvalidRequest):
        eng.set_max_batch_size(0)
