"""vLLM / OpenAI sampling features over HTTP with the ``openai`` client: n, best_of, penalties,
logit_bias, min_p, structured output; vLLM's /tokenize, /detokenize, model aliases."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from engine_server import EngineServer, running_server

pytestmark = pytest.mark.timeout(900)

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # PROMPT under SmolLM2's tokenizer
NAMES = ("smol", "alias-a", "alias-b")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("engine-sampling")
    # fp32 weights: choices are compared across batchings, and the quantized kernels are chosen per
    # row count (their rounding depends on how many rows a step has).
    with running_server(workdir, "--weights", "fp32", "--max-batch-size", "8", "--served-model-name", *NAMES,
                        "--grpc-socket", str(workdir / "control.sock")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _post(server: EngineServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=300)


def _complete(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("model", NAMES[0])
    kwargs.setdefault("prompt", PROMPT)
    return client.completions.create(**kwargs)


# ---- n and best_of ------------------------------------------------------------------------------

def test_n_choices_are_the_seeded_single_requests(client: openai.OpenAI) -> None:
    many = _complete(client, n=3, max_tokens=8, temperature=1.0, seed=77, extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):  # choice i uses seed + i
        single = _complete(client, max_tokens=8, temperature=1.0, seed=77 + i,
                           extra_body={"ignore_eos": True})
        assert choice.text == single.choices[0].text
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.completion_tokens == 3 * 8 and many.usage.prompt_tokens == len(PROMPT_IDS)
    assert many.usage.total_tokens == many.usage.prompt_tokens + 24


def test_n_streaming_chat_carries_each_choice_index(client: openai.OpenAI) -> None:
    kwargs = dict(model=NAMES[0], messages=[{"role": "user", "content": "Tell me a story."}], n=2,
                  max_tokens=10, temperature=0.9, seed=5)
    whole = client.chat.completions.create(**kwargs)
    streamed = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    texts, reasons = ["", ""], [None, None]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.completion_tokens == 20 or any(r == "stop" for r in reasons)


def test_n_streaming_completion_with_echo_and_logprobs(client: openai.OpenAI) -> None:
    args = dict(n=2, max_tokens=6, temperature=1.0, seed=21, echo=True, logprobs=1,
                extra_body={"ignore_eos": True})
    whole = _complete(client, **args)
    texts, tokens = ["", ""], [[], []]
    for chunk in _complete(client, stream=True, **args):
        (choice,) = chunk.choices
        texts[choice.index] += choice.text
        tokens[choice.index] += choice.logprobs.tokens
    assert texts == [c.text for c in whole.choices] and texts[0].startswith(PROMPT)
    assert tokens == [c.logprobs.tokens for c in whole.choices]


def test_best_of_returns_the_highest_mean_logprob_choices(client: openai.OpenAI) -> None:
    args = dict(max_tokens=6, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    pool = _complete(client, n=4, logprobs=0, **args).choices
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in pool]
    expected = [pool[i].text for i in sorted(range(4), key=lambda i: -means[i])[:2]]
    best = _complete(client, n=2, best_of=4, **args)
    assert [c.text for c in best.choices] == expected and [c.index for c in best.choices] == [0, 1]
    assert best.choices[0].logprobs is None  # not asked for: used internally only
    assert best.usage.completion_tokens == 4 * 6  # every generated token is billed


def test_best_of_bad_combinations_are_400(server: EngineServer) -> None:
    for body in ({"prompt": PROMPT, "n": 3, "best_of": 2}, {"prompt": PROMPT, "best_of": 3, "stream": True}):
        resp = _post(server, "/v1/completions", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "best_of", resp.text


# ---- penalties, logit_bias, min_p ---------------------------------------------------------------------

def _steps(choice) -> list[tuple[str, float, dict[str, float]]]:
    lp = choice.logprobs
    return list(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))


def test_frequency_and_presence_penalties_pick_the_penalised_argmax(client: openai.OpenAI) -> None:
    fp, pp = 1.0, 0.5
    resp = _complete(client, max_tokens=24, temperature=0, logprobs=5, frequency_penalty=fp,
                     presence_penalty=pp, extra_body={"ignore_eos": True})
    counts: Counter[str] = Counter()
    changed = 0
    for token, raw, top in _steps(resp.choices[0]):
        def score(t: str, value: float) -> float:
            return value - fp * counts[t] - pp * (counts[t] > 0)
        assert score(token, raw) >= max(score(t, v) for t, v in top.items()) - 1e-4
        changed += token != max(top, key=top.get)  # logprobs stay raw: the raw argmax may differ
        counts[token] += 1
    assert changed > 0


def test_repetition_penalty_changes_a_repetitive_greedy_run(client: openai.OpenAI) -> None:
    def run(**extra):
        return _complete(client, prompt="1, 2, 1, 2, 1, 2,", max_tokens=16, temperature=0,
                         extra_body={"ignore_eos": True, **extra}).choices[0].text
    base = run()
    assert run(repetition_penalty=1.0) == base
    penalised = run(repetition_penalty=1.8)
    assert penalised != base
    assert penalised.count(" 1,") < base.count(" 1,")


def test_logit_bias_forces_and_bans_tokens(server: EngineServer, client: openai.OpenAI) -> None:
    paris = _post(server, "/tokenize", {"prompt": " Paris"}).json()["tokens"]
    assert len(paris) == 1
    forced = _complete(client, max_tokens=3, temperature=0.8, seed=1, logit_bias={str(paris[0]): 100})
    assert forced.choices[0].text == " Paris" * 3
    base = _complete(client, max_tokens=1, temperature=0, logprobs=5).choices[0]
    first = base.logprobs.tokens[0]
    first_id = _post(server, "/tokenize", {"prompt": first}).json()["tokens"][0]
    banned = _complete(client, max_tokens=1, temperature=0, logprobs=5, logit_bias={str(first_id): -100})
    others = {t: v for t, v in base.logprobs.top_logprobs[0].items() if t != first}
    assert banned.choices[0].text == max(others, key=others.get)


def test_logit_bias_bad_token_id_is_400(server: EngineServer) -> None:
    for bias in ({"999999": 5}, {"abc": 1}, {"5": 150}):
        resp = _post(server, "/v1/completions", {"prompt": PROMPT, "logit_bias": bias})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "logit_bias", resp.text


def test_min_p_keeps_only_tokens_near_the_best(client: openai.OpenAI) -> None:
    min_p = 0.3
    resp = _complete(client, prompt="Once upon a time", n=4, max_tokens=12, temperature=1.0, seed=3,
                     logprobs=1, extra_body={"min_p": min_p, "ignore_eos": True})
    for choice in resp.choices:
        for _, raw, top in _steps(choice):  # temperature 1: raw logprobs are the sampled distribution
            assert raw >= math.log(min_p) + max(top.values()) - 1e-4


# ---- structured output -------------------------------------------------------------------------------

# Nested objects, enums and arrays; shared with bench/micro/grammar_mask_cost.py.
PET_SCHEMA = json.loads((Path(__file__).with_name("pet_schema.json")).read_text())


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=NAMES[0], messages=[{"role": "user", "content": "Describe a pet as JSON."}], n=2,
        max_tokens=160, temperature=0.7, seed=9,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET_SCHEMA}})
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PET_SCHEMA)


def test_json_object_on_completions(client: openai.OpenAI) -> None:
    resp = _complete(client, prompt="A JSON object describing Paris:", max_tokens=120, temperature=0,
                     extra_body={"response_format": {"type": "json_object"}})
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].text), dict)


def test_unusable_schema_is_400_naming_the_problem(server: EngineServer) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    body = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    resp = _post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "response_format"
    assert "look-around" in resp.json()["error"]["message"]


# ---- vLLM extras ---------------------------------------------------------------------------------------

def test_tokenize_and_detokenize(server: EngineServer, client: openai.OpenAI) -> None:
    body = _post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == PROMPT_IDS and body["count"] == 5 and body["max_model_len"] >= 2048
    assert body["token_strs"][1] == "Ġcapital"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = _post(server, "/tokenize", {"messages": messages}).json()
    usage = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens and chat["token_strs"] is None
    assert _post(server, "/detokenize", {"tokens": PROMPT_IDS}).json() == {"prompt": PROMPT}
    resp = _post(server, "/detokenize", {"tokens": [10**9]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "tokens"
    bad = (({}, "prompt"), ({"prompt": "x", "bogus": 1}, "bogus"), ({"messages": []}, "messages"))
    for body, param in bad:
        resp = _post(server, "/tokenize", body)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=30).json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"]


def test_served_name_aliases(server: EngineServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == list(NAMES)
    assert client.models.retrieve("alias-b").id == "alias-b"
    resp = _complete(client, model="alias-a", max_tokens=2)
    assert resp.model == NAMES[0]  # responses carry the primary name
    assert httpx.get(f"{server.url}/v1/models/other", timeout=30).status_code == 404


def test_usage_reports_prompt_tokens_details(client: openai.OpenAI) -> None:
    usage = _complete(client, max_tokens=2).usage
    assert usage.prompt_tokens_details.cached_tokens == 0
