"""Admission rules of the cache manager, on a tiny random Llama (no download): requests whose prompts
share blocks still being prefilled wait one step and share them; a request's retention config is
fixed at admission, so a live policy change never alters a running request."""

from __future__ import annotations

import pytest
import torch

from confkv_api.config import ConfKVConfig, load_config
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.tiny_models import make_tiny_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    _, model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny-admit"))
    return load_model(str(model_dir), dtype=torch.float32, device="cpu")


def _engine(loaded, confkv: dict | None = None) -> LLMEngine:
    cfg = ConfKVConfig.model_validate({"engine": {"prefillChunk": 32, "maxNumBatchedTokens": 256},
                                       "confkv": {"maxCacheSize": "8Mi", **(confkv or {})}})
    return LLMEngine(loaded, cfg)


def test_requests_with_one_prompt_submitted_together_share_its_blocks(loaded) -> None:
    prompt = [(7 * i) % 200 + 3 for i in range(90)]  # 5 full blocks and a partial one
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    eng = _engine(loaded)
    for i in range(3):  # as the n choices of one request arrive
        eng.add_request(f"c{i}", prompt, params)
    eng.step()  # only the first is admitted: the others wait for its blocks
    assert [s.request_id for s in eng.scheduler.running] == ["c0"]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert [outs[f"c{i}"].num_cached_tokens for i in range(3)] == [0, 80, 80]
    alone = _engine(loaded, {"prefixCache": {"enabled": False}}).generate([prompt], params)[0]
    assert all(outs[f"c{i}"].output_token_ids == alone.output_token_ids for i in range(3))


def test_a_live_policy_change_never_alters_a_running_request(loaded) -> None:
    eng = _engine(loaded, {"kvPolicy": "conf-kv", "budget": 0.5})
    prompt = list(range(3, 200))
    eng.add_request("old", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    eng.step()
    running = eng.scheduler.running[0]
    before = (running.retention, eng.retention.reserved_headroom(running),
              eng.retention.chunk_alignment(running))
    section = load_config({"confkv": {"kvPolicy": "h2o", "budget": 0.25, "decisionInterval": 64,
                                      "window": 64}}).confkv
    eng.apply_policy(section, eng.max_batch_size, ["confkv.kvPolicy", "confkv.budget", "confkv.window"])
    assert eng.retention.defaults.policy == "h2o"
    after = (running.retention, eng.retention.reserved_headroom(running),
             eng.retention.chunk_alignment(running))
    assert after[0] is before[0] and after[2] == before[2] and after[1] <= before[1]  # only consumed
    eng.add_request("new", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert eng._seqs["new"].retention.policy == "h2o" and running.retention.policy == "conf-kv"
    while eng.has_unfinished():
        eng.step()
