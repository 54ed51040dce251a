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
