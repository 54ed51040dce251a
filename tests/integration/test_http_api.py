"""The OpenAI-compatible HTTP API of a real ``confkv serve`` process on the embedded model.

One server for the module (a model load is the expensive part), driven by the ``openai`` client
for the happy paths and by ``httpx`` for bad inputs. It runs with an API key, so auth is exercised
by every request, and with ``--max-batch-size 1 --max-waiting 1`` so that the queue-full test can
fill the queue with two requests; the other tests send one request at a time. The SIGTERM test
ends the server and therefore comes last.
"""

from __future__ import annotations

import json
import math
import signal
import threading

import httpx
import openai
import pytest
from engine_server import MODEL, EngineServer

from confkv_api import metrics as names

pytestmark = pytest.mark.timeout(600)

API_KEY = "test-key-123"
PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # PROMPT under SmolLM2's tokenizer (the input of the id test)
SERVER_FLAGS = ("--weights", "fp32", "--max-batch-size", "1", "--max-waiting", "1", "--prefill-chunk", "32")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("engine")
    # Prefill chunks of 32 and a 32-token recent window: the settings of bench/quality/kv_quality.py, so
    # per-request retention can be compared with the benchmark's in-process values.
    (workdir / "confkv.json").write_text(json.dumps({"confkv": {"window": 32}}))
    # fp32 weights: echo logprobs are compared with the in-process fp32 benchmark, and the quantized
    # kernels are chosen per row count, so their rounding depends on how a prompt is chunked.
    srv = EngineServer(workdir, *SERVER_FLAGS, "--config", str(workdir / "confkv.json"),
                       "--grpc-socket", str(workdir / "control.sock"), api_key=API_KEY)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def post(server: EngineServer, path: str, body: dict | str, headers: dict | None = None) -> httpx.Response:
    hdrs = {**server.headers, "Content-Type": "application/json", **(headers or {})}
    content = body if isinstance(body, str) else None
    return httpx.post(f"{server.url}{path}", content=content, json=None if content else body,
                      headers=hdrs, timeout=120)


def assert_error(resp: httpx.Response, status: int, param: str | None = None,
                 code: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


# ---- happy paths through the openai client -------------------------------------------------------

def test_models_lists_the_served_model(server: EngineServer, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "smollm2-135m"
    assert models[0].max_model_len >= 2048  # extra field of the model card
    assert client.models.retrieve(models[0].id).id == models[0].id


def test_chat_completion_answers(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    choice = resp.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.completion_tokens >= 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.model_extra["peak_kv_bytes"] > 0 and "kv_tokens_key_only" in usage.model_extra


def test_streaming_chat_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, messages=[{"role": "user", "content": "Name three colours."}],
                  max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        # greedy: the chosen token is the most likely one
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-5)


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_token_id_prompt_equals_string_prompt(client: openai.OpenAI, model: str) -> None:
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    for prompt in (PROMPT_IDS, [PROMPT_IDS], [PROMPT]):
        resp = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True)
        assert resp.choices[0].text == PROMPT + by_text.choices[0].text
        assert resp.usage.prompt_tokens == by_text.usage.prompt_tokens == len(PROMPT_IDS)


def test_echo_logprobs_with_zero_max_tokens(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPT and resp.usage.completion_tokens == 0
    assert len(lp.tokens) == resp.usage.prompt_tokens >= 4
    assert "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0.0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[token] == value and 2 <= len(top) <= 3  # the chosen token is always listed


def test_echo_logprobs_cover_generated_tokens(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                     logprobs=1)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == resp.usage.prompt_tokens + 3
    assert resp.choices[0].text == "".join(lp.tokens)
    for value, top in zip(lp.token_logprobs[-3:], lp.top_logprobs[-3:], strict=True):
        assert value == max(top.values())  # greedy picks the argmax


def test_seed_reproducibility(client: openai.OpenAI, model: str) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                         temperature=1.0, seed=seed).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_stop_string_truncates(client: openai.OpenAI, model: str) -> None:
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base.strip()[2:5]
    assert stop, base
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == base[:base.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_min_tokens_and_ignore_eos_extra_fields(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True, "min_tokens": 8, "top_k": 5})
    assert resp.usage.completion_tokens == 8 and resp.choices[0].finish_reason == "length"


# ---- probes and metrics ----------------------------------------------------------------------------

def test_health_ready_and_metrics_names(server: EngineServer, client: openai.OpenAI, model: str) -> None:
    client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    engine_names = [v for k, v in vars(names).items() if k.isupper() and not k.startswith("AGENT")]
    missing = [n for n in engine_names if n not in text]
    assert not missing, missing
    samples = server.metrics()
    assert samples["confkv_prompt_tokens_total"] > 0 and samples["confkv_generation_tokens_total"] > 0
    assert samples[f'{names.KV_CACHE_BYTES}{{tier="total"}}'] > 0
    assert samples[f'{names.DEVICE_MEMORY_TOTAL_BYTES}{{device="cpu"}}'] > 0


def test_disconnect_mid_stream_aborts_and_health_answers_while_busy(server: EngineServer, model: str) -> None:
    aborted = server.metrics()['confkv_requests_finished_total{reason="abort"}']
    body = {"model": model, "prompt": "Write a very long story.", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            received = [line for _, line in zip(range(6), lines, strict=False)]
            assert any(line.startswith("data: {") for line in received)
            # The engine is decoding this request right now; the server still answers.
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            assert server.metrics()[names.REQUESTS_RUNNING] == 1
    # Connection closed mid-stream: the request is aborted and its blocks freed long before 2000 tokens.
    server.wait_metric(names.REQUESTS_RUNNING, lambda v: v == 0, deadline_s=30)
    assert server.metrics()['confkv_requests_finished_total{reason="abort"}'] == aborted + 1
    server.wait_metric(names.KV_CACHE_USAGE_RATIO, lambda v: v == 0.0, deadline_s=30)


def test_echo_logprobs_under_retention_equal_the_benchmark_in_process(server: EngineServer) -> None:
    import torch

    from confkv_engine.model.loader import load_model
    from testkit import kv_runs as kvq

    loaded = load_model("builtin:smollm2-135m", torch.float32, "cpu")
    tokens = kvq.pydoc_tokens(loaded.tokenizer)[:300]
    # The benchmark's conf-kv (FULL / KEY_ONLY) under the server's budget basis.
    cfg = kvq.make_config("conf-kv", 0.5, kvq.parse_args(["--budget-basis", "final"]))
    ref = kvq.EngineRunner(loaded, "float32").run(cfg, tokens)  # the server caches at auto = fp32
    body = {"prompt": tokens, "max_tokens": 0, "echo": True, "logprobs": 1,
            "kv_policy": "conf-kv", "kv_budget": 0.5, "kv_tiers": ["full", "key_only"]}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    got = torch.tensor(data["choices"][0]["logprobs"]["token_logprobs"][1:], dtype=torch.float64)
    assert got.shape == ref["logprobs"].shape == (299,)
    assert torch.allclose(got, ref["logprobs"].double(), atol=1e-4, rtol=0)
    usage, kv = data["usage"], ref["usage"]
    assert usage["kv_tokens_discarded"] == kv.tokens_discarded > 0  # the budget really acted
    assert (usage["kv_tokens_full"], usage["kv_tokens_key_only"]) == (kv.tokens_full, kv.tokens_key_only)
    assert usage["peak_kv_bytes"] == kv.peak_kv_bytes > 0


def test_echo_logprobs_with_precision_tiers_equal_the_engine_in_process(
        server: EngineServer, client: openai.OpenAI, model: str) -> None:
    """``kv_tiers`` over HTTP: the prompt's logprobs while retention freezes int4 / int2 blocks equal an
    in-process engine's built from the server's own flags, for the same request fields."""
    from pydoc_data.topics import topics

    import torch

    from confkv_engine.cli import build_config, build_parser
    from confkv_engine.core.engine import LLMEngine
    from confkv_engine.core.sampling_params import SamplingParams
    from confkv_engine.model.loader import load_model

    server_config = server.log_path.parent / "confkv.json"  # the fixture's workdir
    config = build_config(build_parser().parse_args(["serve", "--model", MODEL, *SERVER_FLAGS,
                                                     "--config", str(server_config)]))
    loaded = load_model(MODEL, torch.float32, "cpu", weights="fp32")
    tokens = loaded.tokenizer.encode(topics["assert"] + topics["assignment"], add_bos=False)[:300]
    tiers = ("full", "int4", "int2")
    engine = LLMEngine(loaded, config)
    ref = engine.generate([tokens], SamplingParams(max_tokens=0, prompt_logprobs=1, kv_policy="conf-kv",
                                                   kv_budget=0.5, kv_tiers=tiers))[0]
    fields = {"kv_policy": "conf-kv", "kv_budget": 0.5, "kv_tiers": list(tiers)}
    resp = client.completions.create(model=model, prompt=tokens, max_tokens=0, echo=True, logprobs=1,
                                     extra_body=fields)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    got = torch.tensor(lp.token_logprobs[1:], dtype=torch.float64)
    want = torch.tensor([e.logprob for e in ref.prompt_logprobs[1:]], dtype=torch.float64)
    assert got.shape == want.shape == (299,)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)
    usage, kv = resp.usage.model_dump(), ref.kv_usage
    assert usage["kv_tokens_int4"] + usage["kv_tokens_int2"] > 0  # tiers really froze blocks
    assert (usage["kv_tokens_full"], usage["kv_tokens_int4"], usage["kv_tokens_int2"]) == (
        kv.tokens_full, kv.tokens_int4, kv.tokens_int2)
    assert usage["peak_kv_bytes"] == kv.peak_kv_bytes > 0


# ---- bad inputs ------------------------------------------------------------------------------------

def test_auth_required(server: EngineServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1}
    no_key = httpx.post(f"{server.url}/v1/completions", json=body)
    assert_error(no_key, 401, code="invalid_api_key")
    wrong = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert_error(wrong, 401, code="invalid_api_key")
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()


def test_malformed_json(server: EngineServer) -> None:
    assert_error(post(server, "/v1/completions", '{"prompt": "x",'), 400, code="invalid_json")
    assert_error(post(server, "/v1/chat/completions", "[1, 2]"), 400)


def test_unknown_model(server: EngineServer) -> None:
    resp = post(server, "/v1/completions", {"model": "gpt-4", "prompt": PROMPT})
    assert_error(resp, 404, param="model", code="model_not_found")
    assert_error(httpx.get(f"{server.url}/v1/models/gpt-4", headers=server.headers), 404)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -1), ("top_p", 0), ("max_tokens", -5), ("logprobs", 50), ("kv_budget", 2.0),
    ("kv_policy", "lru"), ("top_k", -3), ("stop", [""]), ("prompt", []), ("prompt", [-1, 5]),
    ("prompt", ""),
])
def test_bad_completion_values(server: EngineServer, field: str, value: object) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, field: value}
    assert_error(post(server, "/v1/completions", body), 400, param=field)


def test_bad_chat_values(server: EngineServer) -> None:
    assert_error(post(server, "/v1/chat/completions", {"messages": []}), 400, param="messages")
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}]}
    assert_error(post(server, "/v1/chat/completions", bad_role), 400)
    only_top = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    assert_error(post(server, "/v1/chat/completions", only_top), 400)


def test_unsupported_parameters(server: EngineServer) -> None:
    cases = [("/v1/completions", {"prompt": PROMPT, "suffix": "end"}, "suffix"),
             ("/v1/completions", {"prompt": [PROMPT, PROMPT]}, "prompt"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools")]
    for path, body, param in cases:
        assert_error(post(server, path, body), 400, param=param, code="unsupported_parameter")


def test_unknown_field_is_rejected(server: EngineServer) -> None:
    resp = post(server, "/v1/completions", {"prompt": PROMPT, "top_K": 3})
    assert_error(resp, 400, param="top_K", code="unknown_parameter")


def test_prompt_over_context_length(server: EngineServer, client: openai.OpenAI) -> None:
    max_len = client.models.list().data[0].max_model_len
    too_long = post(server, "/v1/completions", {"prompt": [100] * (max_len + 1), "max_tokens": 1})
    assert_error(too_long, 400, code="context_length_exceeded")
    with_completion = post(server, "/v1/completions", {"prompt": [100] * (max_len - 4), "max_tokens": 10})
    assert_error(with_completion, 400, code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2-135m", prompt=[100] * (max_len + 1), max_tokens=1)


# ---- back-pressure and shutdown (the SIGTERM test ends the server: keep it last) ------------------

def _long_stream_body() -> dict:
    return {"prompt": "Tell me a story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def test_waiting_queue_full_answers_429(server: EngineServer) -> None:
    url = f"{server.url}/v1/completions"
    clients = [httpx.Client(timeout=60, headers=server.headers) for _ in range(2)]
    with clients[0] as first_client, clients[1] as second_client:
        with first_client.stream("POST", url, json=_long_stream_body()) as running:
            assert running.status_code == 200
            server.wait_metric(names.REQUESTS_RUNNING, lambda v: v == 1)
            # Batch size 1: the second request waits in the engine's queue (maxWaiting 1) ...
            with second_client.stream("POST", url, json=_long_stream_body()) as waiting:
                assert waiting.status_code == 200
                server.wait_metric(names.REQUESTS_WAITING, lambda v: v == 1)
                # ... so a third one is refused.
                refused = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["code"] == "queue_full"
    # Both streams were abandoned: the engine is idle again and accepts work.
    server.wait_metric(names.REQUESTS_RUNNING, lambda v: v == 0, deadline_s=30)
    server.wait_metric(names.REQUESTS_WAITING, lambda v: v == 0, deadline_s=30)
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_sigterm_drains_in_flight_request_then_exits_zero(server: EngineServer) -> None:
    result: dict[str, object] = {}
    body = {"prompt": "Count to ten:", "max_tokens": 24, "ignore_eos": True, "temperature": 0}

    def request() -> None:
        try:
            result["response"] = post(server, "/v1/completions", body)
        except Exception as err:  # reported by the assertions below
            result["error"] = err

    worker = threading.Thread(target=request)
    worker.start()
    server.wait_metric(names.REQUESTS_RUNNING, lambda v: v == 1)
    server.proc.send_signal(signal.SIGTERM)
    worker.join(timeout=120)
    assert "error" not in result, result
    response = result["response"]
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["usage"]["completion_tokens"] == 24 and data["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=60) == 0, server.log_tail()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5)
