"""logit_bias, repetition / frequency / presence penalties, min_p and grammar masks, each against
a distribution computed by hand."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from tokenizers.pre_tokenizers import ByteLevel

from confkv_engine.core.sampling import make_generator, processed_logits, sample
from confkv_engine.core.sampling_params import InvalidRequest, SamplingParams, StructuredOutput
from confkv_engine.core.structured_output import (
    GrammarState,
    apply_grammar_masks,
    check,
    spec_from_response_format,
)
from testkit.gpt2_bytes import gpt2_byte_map

EOS = 256


def _probs(logits: torch.Tensor) -> list[float]:
    return torch.softmax(logits, dim=-1).tolist()


def _process(logits: list[float], params: SamplingParams, prompt: list[int] = (),
             output: list[int] = ()) -> torch.Tensor:
    return processed_logits(torch.tensor([logits]), [params], [list(prompt)], [list(output)], [])[0]


def _frequencies(logits: list[float], params: SamplingParams, draws: int = 20_000) -> list[float]:
    """Empirical distribution of ``sample`` over many seeded rows of the same logits."""
    batch = torch.tensor([logits]).expand(draws, -1).contiguous()
    chosen = sample(batch, [params] * draws, [make_generator(i) for i in range(draws)])
    return (torch.bincount(chosen, minlength=len(logits)).float() / draws).tolist()


def test_logit_bias_adds_to_the_raw_logits() -> None:
    params = SamplingParams(logit_bias=((2, math.log(3.0)), (9999, 5.0)))  # out-of-vocab id ignored
    assert _probs(_process([0.0, 0.0, 0.0, 0.0], params)) == pytest.approx([1 / 6, 1 / 6, 1 / 2, 1 / 6])


def test_logit_bias_minus_100_bans_a_token_even_greedy() -> None:
    params = SamplingParams(temperature=0.0, logit_bias=((0, -100.0),))
    out = sample(_process([5.0, 1.0, 0.0], params)[None], [params], [None])
    assert out.tolist() == [1]


def test_frequency_and_presence_count_output_tokens_only() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    got = _process([0.0, 0.0, 0.0, 0.0], params, prompt=[0, 0, 3], output=[1, 1, 2])
    # token 1: 0.5 * 2 + 1 = 2; token 2: 0.5 * 1 + 1 = 1.5; prompt-only tokens 0 and 3 untouched
    assert got.tolist() == pytest.approx([0.0, -2.0, -1.5, 0.0])


def test_negative_presence_penalty_encourages_repeats() -> None:
    got = _process([0.0, 0.0], SamplingParams(presence_penalty=-1.0), output=[1])
    assert _probs(got) == pytest.approx([1 / (1 + math.e), math.e / (1 + math.e)])


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output() -> None:
    got = _process([2.0, -1.0, 1.0, 0.5], SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert got.tolist() == pytest.approx([1.0, -2.0, 1.0, 0.5])


def test_penalties_steer_greedy_choice() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    logits = _process([3.0, 2.0, 0.0], params, output=[0])
    assert sample(logits[None], [params], [None]).tolist() == [1]


def test_min_p_keeps_tokens_within_a_fraction_of_the_best() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]  # min_p 0.2 -> threshold 0.1: the last token goes
    freq = _frequencies([math.log(p) for p in probs], SamplingParams(min_p=0.2))
    assert freq == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], abs=0.015)
    assert freq[3] == 0.0


def test_min_p_applies_to_the_tempered_distribution() -> None:
    # temperature 2 flattens [0.64, 0.32, 0.04] to sqrt -> [0.8, 0.566, 0.2] relative; min_p 0.3 of 0.8
    # = 0.24 keeps the first two only (untempered, 0.04 < 0.3 * 0.64 would go too; 0.32 would stay).
    logits = [math.log(0.64), math.log(0.32), math.log(0.04)]
    freq = _frequencies(logits, SamplingParams(temperature=2.0, min_p=0.3))
    kept = [math.sqrt(0.64), math.sqrt(0.32)]
    assert freq == pytest.approx([kept[0] / sum(kept), kept[1] / sum(kept), 0.0], abs=0.015)


def test_min_p_composes_with_top_k() -> None:
    probs = [0.4, 0.3, 0.2, 0.1]  # min_p 0.3 drops 0.1; top_k 2 then drops 0.2
    freq = _frequencies([math.log(p) for p in probs], SamplingParams(min_p=0.3, top_k=2))
    assert freq == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0], abs=0.015)


def test_unprocessed_rows_are_untouched_and_input_is_not_modified() -> None:
    raw = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = processed_logits(raw, [SamplingParams(), SamplingParams(presence_penalty=1.0)],
                           [[0], [0]], [[1], [1]], [])
    assert out[0].tolist() == [1.0, 2.0] and out[1].tolist() == [3.0, 3.0]
    assert raw.tolist() == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
    ("min_p", 1.5), ("logit_bias", ((5, 101.0),)), ("logit_bias", ((-1, 1.0),)),
])
def test_bad_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


# ---------------------------------------------------------------- structured output


@pytest.fixture(scope="module")
def byte_tok() -> SimpleNamespace:
    """Byte-level tokenizer, one token per byte (256 = <eos>), in the shape the engine passes."""
    byte_map = gpt2_byte_map()
    tok = Tokenizer(models.BPE(vocab={byte_map[b]: b for b in range(256)} | {"<eos>": EOS}, merges=[]))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return SimpleNamespace(backend=tok)


def _allowed(state: GrammarState, vocab: int = EOS + 1) -> set[int]:
    logits = apply_grammar_masks(torch.zeros(1, vocab), [state])
    return set(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())


def test_grammar_mask_allows_exactly_the_schema_continuations(byte_tok: SimpleNamespace) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": ["ab", "ac"]}}, "required": ["k"],
              "additionalProperties": False}
    spec = spec_from_response_format({"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    state = GrammarState(spec, byte_tok, EOS + 1, [EOS])
    for byte in b'{"k":"a':
        assert _allowed(state) == {byte}, chr(byte)
        assert state.accept(byte)
    assert _allowed(state) == {ord("b"), ord("c")}  # the enum's two branches
    for byte in b'c"}':
        state.accept(byte)
    assert _allowed(state) == {EOS}  # document complete: only EOS


def test_json_object_mode_starts_with_a_brace(byte_tok: SimpleNamespace) -> None:
    state = GrammarState(StructuredOutput("json_object"), byte_tok, EOS + 1, [EOS])
    assert _allowed(state) == {ord("{")}


def test_grammar_rows_only_are_masked(byte_tok: SimpleNamespace) -> None:
    state = GrammarState(StructuredOutput("json_object"), byte_tok, EOS + 1, [EOS])
    logits = apply_grammar_masks(torch.zeros(2, EOS + 1), [None, state])
    assert bool(torch.isfinite(logits[0]).all()) and int(torch.isfinite(logits[1]).sum()) == 1


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
    {"type": "yaml"},
])
def test_bad_response_formats_name_the_problem(byte_tok: SimpleNamespace, response_format: dict) -> None:
    with pytest.raises(InvalidRequest) as err:
        spec = spec_from_response_format(response_format)
        check(spec, byte_tok, EOS + 1, [EOS])
    assert err.value.param == "response_format" and str(err.value)


def test_schema_text_is_canonical() -> None:
    a = spec_from_response_format({"type": "json_schema", "json_schema": {"schema": {"b": 1, "a": 2}}})
    assert json.loads(a.schema) == {"a": 2, "b": 1} and a.schema == '{"a":2,"b":1}'


def test_grammar_end_wins_over_min_tokens(byte_tok: SimpleNamespace) -> None:
    state = GrammarState(StructuredOutput("json_object"), byte_tok, EOS + 1, [EOS])
    for byte in b"{}":
        state.accept(byte)
    params = SamplingParams(temperature=0.0, min_tokens=10)  # would ban EOS for 8 more tokens
    out = processed_logits(torch.zeros(1, EOS + 1), [params], [[1]], [[123, 125]], [EOS], [state])
    assert sample(out, [params], [None]).tolist() == [EOS]
