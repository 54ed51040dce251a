"""The sampling signal through LLMEngine: what the default precision chain records for every token
equals the surprise computed from one forward pass of the whole sequence, for two sequences stepped
together, with the step's rows cut into signal slices across them and the generated tokens included
(tiny random Llama, fp32)."""

from __future__ import annotations

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.core import step_signal
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from confkv_engine.retention.policies import RetentionConfig
from confkv_engine.retention.scorer import NEUTRAL_SAMPLING
from confkv_engine.retention.tiers import TierConfig
from tests.engine.tiny_models import make_tiny_hf_model

pytest.importorskip("transformers")

CHUNK = 80
SLICE_ROWS = 24  # signal slices of 24 rows: a chunk spans several, and one slice spans both sequences


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-signal"))[1]


def reference_surprise(model_dir, tokens: list[int]) -> list[float]:
    """1 - p(token j | tokens before j) for j >= 1, from the HF model over the whole sequence."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([tokens])).logits[0].float()
    p = logits[:-1].softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return (1.0 - p).tolist()


def test_the_precision_chain_records_every_token_s_surprise(model_dir, monkeypatch) -> None:
    loaded = load_model(str(model_dir), dtype=torch.float32, device="cpu")
    cfg = ConfKVConfig.model_validate({
        "engine": {"prefillChunk": CHUNK, "maxNumBatchedTokens": 256},
        "confkv": {"maxCacheSize": "8Mi", "window": 32}})
    # No budget and every threshold FULL: the cache stays exact, so the engine's logits are the
    # reference's and the recorded signal can be compared with it token by token.
    retention = RetentionConfig(policy="conf-kv",
                                tiers=TierConfig(key_only=False, precisions=("int4", "int2"),
                                                 high=1e-6, medium=0.0))
    assert retention.sampling_weight > 0
    eng = LLMEngine(loaded, cfg, retention=retention)
    monkeypatch.setattr(step_signal, "SIGNAL_BYTES", 4 * eng.vocab_size * SLICE_ROWS)
    prompts = {"a": [(i * 31 + 3) % 250 for i in range(200)], "b": [(i * 17 + 5) % 250 for i in range(150)]}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    recorded: dict[str, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for out in eng.step():
            outputs[out.request_id] = out.output_token_ids
        for seq in eng.scheduler.running:
            recorded[seq.request_id] = list(seq.policy_state.c_samp)
    for rid, p in prompts.items():
        tokens, got = p + outputs[rid], recorded[rid]
        # Token 0 has no predictor; every later one up to the last sampled before the final step.
        assert got[0] == NEUTRAL_SAMPLING and len(got) == len(tokens) - 1
        assert got[1:] == pytest.approx(reference_surprise(model_dir, tokens)[: len(got) - 1], abs=1e-4)


def run_counting_head_rows(model_dir, share: bool, monkeypatch) -> tuple[dict, dict, int, int]:
    """Outputs and logprobs of a greedy and a seeded sampled request under the precision chain, the
    rows the LM head ran over, and the tokens sampled; ``share=False`` keeps the sampler off the
    signal's logits (the head runs twice over a sampled row)."""
    loaded = load_model(str(model_dir), dtype=torch.float32, device="cpu")
    cfg = ConfKVConfig.model_validate({"engine": {"prefillChunk": CHUNK}, "confkv": {"maxCacheSize": "8Mi"}})
    eng = LLMEngine(loaded, cfg)
    assert eng.retention.config_for("conf-kv", None, None).sampling_weight > 0  # the default chain's
    if not share:
        monkeypatch.setattr(eng.signal, "sampled_logits", lambda rows: None)
    head, rows = eng.model.lm_head, [0]

    def counted(x: torch.Tensor) -> torch.Tensor:
        rows[0] += x.shape[0]
        return torch.nn.functional.linear(x, head.weight, head.bias)

    monkeypatch.setattr(head, "forward", counted)
    eng.add_request("greedy", [(i * 31 + 3) % 250 for i in range(120)],
                    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, kv_policy="conf-kv"))
    eng.add_request("sampled", [(i * 17 + 5) % 250 for i in range(90)],
                    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8, logprobs=2,
                                   ignore_eos=True, kv_policy="conf-kv"))
    outputs, logprobs = {}, {}
    while eng.has_unfinished():
        for out in eng.step():
            outputs[out.request_id], logprobs[out.request_id] = out.output_token_ids, out.logprobs
    return outputs, logprobs, rows[0], sum(len(v) for v in outputs.values())


def test_the_sampler_reads_the_signal_s_logits(model_dir, monkeypatch) -> None:
    shared, shared_lps, shared_rows, sampled = run_counting_head_rows(model_dir, True, monkeypatch)
    alone, alone_lps, alone_rows, _ = run_counting_head_rows(model_dir, False, monkeypatch)
    assert shared == alone and shared_lps == alone_lps  # the same tokens and logprobs either way
    assert sampled == 16 and alone_rows - shared_rows == sampled  # each sampled row through the head once
