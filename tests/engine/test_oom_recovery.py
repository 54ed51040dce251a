"""Out of memory inside a step (``core.oom``) on a tiny random Llama, driven by the engine's own fault
switches (``core.faults``; no GPU here, so the OOM is injected before the model runs, exactly where
the engine catches a real one): the fewest sequences leave the step, the most recently admitted
first, the rest retry at once, every output equals a run without the fault, and only a sequence that
runs out of memory alone fails."""

from __future__ import annotations

import pytest
import torch

from confkv_api.config import ConfKVConfig
from confkv_engine.core.engine import LLMEngine
from confkv_engine.core.faults import OOM_EVERY_ENV, OOM_TOKENS_ENV
from confkv_engine.core.oom import ALONE_ERROR, leavers
from confkv_engine.core.sampling_params import SamplingParams
from confkv_engine.model.loader import load_model
from tests.engine.test_engine import prompt
from tests.engine.tiny_models import make_tiny_hf_model

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    _, model_dir = make_tiny_hf_model("llama", tmp_path_factory.mktemp("tiny"))
    return load_model(str(model_dir), dtype=torch.float32, device="cpu")


def make_engine(loaded, policy: str = "full") -> LLMEngine:
    cfg = ConfKVConfig.model_validate({"engine": {"prefillChunk": 32},
                                       "confkv": {"maxCacheSize": "8Mi", "kvPolicy": policy}})
    return LLMEngine(loaded, cfg)


def run(eng: LLMEngine, prompts: list[list[int]]) -> dict[str, object]:
    """Generate with ids r0, r1, ... (added in that order) and return their final outputs."""
    ids = [f"r{i}" for i in range(len(prompts))]
    return dict(zip(ids, eng.generate(prompts, GREEDY), strict=True))


def run_with_fault(loaded, monkeypatch, variable: str, value: str, prompts: list[list[int]]) -> list:
    """Outputs under the fault switch ``variable=value``, checked equal to a run without it, all
    finished by length; and the engine."""
    expected = [o.output_token_ids for o in make_engine(loaded).generate(prompts, GREEDY)]
    monkeypatch.setenv(variable, value)
    eng = make_engine(loaded)
    outs = eng.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks
    return outs, eng


def test_one_oom_preempts_only_the_newest_sequence_and_outputs_are_unchanged(loaded, monkeypatch) -> None:
    # Pass 1 prefills all three, passes 2-5 decode them, pass 6 (their last decode) OOMs once.
    outs, eng = run_with_fault(loaded, monkeypatch, OOM_EVERY_ENV, "6", [prompt(12, i) for i in range(3)])
    assert eng.num_oom == 1
    assert [o.num_preemptions for o in outs] == [0, 0, 1]  # only the last admitted left the step


def test_a_step_that_fits_only_without_two_sequences_preempts_exactly_those(loaded, monkeypatch) -> None:
    """A bound of 12 tokens: pass 1 (3 prefills of 10) sheds r2, then r1; the next step (r0's decode,
    r1's and r2's prefills) sheds r2 again; then r0 and r1 decode beside r2's prefill (12 tokens)."""
    outs, eng = run_with_fault(loaded, monkeypatch, OOM_TOKENS_ENV, "12", [prompt(10, i) for i in range(3)])
    assert [o.num_preemptions for o in outs] == [0, 1, 2] and eng.num_oom == 3


def test_a_sequence_that_ooms_even_alone_fails_clearly_and_the_others_finish(loaded, monkeypatch) -> None:
    long_prompt, short = prompt(40, 9), [prompt(8, i) for i in range(2)]
    expected = [o.output_token_ids for o in make_engine(loaded).generate(short, GREEDY)]
    monkeypatch.setenv(OOM_TOKENS_ENV, "24")  # the long prompt's first chunk (32 tokens) never fits
    eng = make_engine(loaded)
    outs = run(eng, [long_prompt, *short])
    assert outs["r0"].finish_reason == "error" and outs["r0"].error == ALONE_ERROR
    assert [outs["r1"].output_token_ids, outs["r2"].output_token_ids] == expected
    assert outs["r1"].finish_reason == outs["r2"].finish_reason == "length"
    assert not eng.has_unfinished()
    assert eng.stats().num_free_blocks == eng.stats().num_total_blocks


def test_an_oom_before_the_model_keeps_retained_sequences_in_the_retry(loaded, monkeypatch) -> None:
    prompts = [prompt(12, i) for i in range(3)]
    expected = [o.output_token_ids for o in make_engine(loaded, "conf-kv").generate(prompts, GREEDY)]
    monkeypatch.setenv(OOM_EVERY_ENV, "6")  # raised before the model: no scoring state was touched
    eng = make_engine(loaded, "conf-kv")
    outs = eng.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in outs] == expected
    assert eng.num_oom == 1 and [o.num_preemptions for o in outs] == [0, 0, 1]


class _OomOver:
    """Test double standing in for a CUDA OOM inside the forward pass (no GPU here): the model raises
    torch.OutOfMemoryError for a pass of more than ``tokens`` tokens, after the attention backend
    began the step (so retained sequences' scoring state took the pass's appends)."""

    def __init__(self, model, tokens: int) -> None:
        self.model, self.tokens = model, tokens

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, *args, **kwargs):
        if input_ids.numel() > self.tokens:
            raise torch.OutOfMemoryError(f"a pass of {input_ids.numel()} tokens (test double)")
        return self.model(input_ids, *args, **kwargs)


def test_retained_sequences_of_a_failed_forward_go_back_and_replay_exactly(loaded) -> None:
    """Three retained prompts of 12 tokens, a forward pass over 14 tokens fails: the first pass
    sheds two (fresh sequences, newest first); then the running one's decode beside a prefill fails
    in the model, the retained running one must go back too, and when a whole pass must go the
    scheduler admits fewer at a time. Every request still finishes with the fault-free output."""
    prompts = [prompt(12, i) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = [o.output_token_ids for o in make_engine(loaded, "conf-kv").generate(prompts, params)]
    eng = make_engine(loaded, "conf-kv")
    eng.model = _OomOver(loaded.model, 14)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    final = {}
    for _ in range(200):  # bounded: a livelock fails the test instead of hanging it
        final.update({o.request_id: o for o in eng.step() if o.finished})
        if not eng.has_unfinished():
            break
    assert [final[f"r{i}"].output_token_ids for i in range(3)] == expected
    assert all(o.finish_reason == "length" for o in final.values()) and eng.num_oom >= 2


class _Seq:
    """A stand-in with only what ``leavers`` reads."""

    def __init__(self, name: str, slots: int = 5, computed: int = 5, retained: bool = False) -> None:
        self.name, self.num_computed = name, computed
        self.kv = type("KV", (), {"num_slots": slots})()
        self.policy_state = object() if retained else None


def test_leavers_are_the_newest_admitted_or_the_sequences_the_pass_changed() -> None:
    a, b, c = _Seq("a"), _Seq("b"), _Seq("c")
    assert [s.name for s in leavers([c, a, b], [a, b, c])] == ["c"]
    committed, retained = _Seq("d", slots=6, computed=5), _Seq("e", retained=True)
    admitted = [a, committed, b, retained]
    assert [s.name for s in leavers([a, committed, b, retained], admitted)] == ["e", "d"]
