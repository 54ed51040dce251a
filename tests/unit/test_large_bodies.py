"""Large bodies parsed, validated and rendered off the event loop (``http.body``) give exactly what
FastAPI's own ``json.loads``, validation and ``JSONResponse`` give: the same objects, the same
errors, the same bytes; their id lists are freed a slice at a time once nothing else holds them."""

from __future__ import annotations

import gc
import json

import pytest
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel, ValidationError

from confkv_engine.http import body as large_bodies
from confkv_engine.http.body import free_in_slices, parse_json, render_json, validate_large_body
from confkv_engine.http.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest


@pytest.mark.parametrize("body", [
    b'{"prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0.5, "seed": -9223372036854775808}',
    json.dumps({"prompt": list(range(50_000)), "logit_bias": {"7": -100}}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "caf\u00e9 \U0001f642 " * 1000}]}).encode(),
    b'{"a": [true, false, null, 1e400, -0.0, 12345678901234567890123]}',
])
def test_parse_json_gives_what_json_loads_gives(body: bytes) -> None:
    parsed = parse_json(body)
    assert parsed == json.loads(body)
    assert json.dumps(parsed) == json.dumps(json.loads(body))  # types too (int stays int)


@pytest.mark.parametrize("body", [
    b'{"prompt": "hi", "max_tokens": ' + b"7" * 5000 + b"}",  # over CPython's digit limit
    b'{"prompt": [1, 2,',
    b'{"x": ' * 5000 + b"1" + b"}" * 5000,
    b'{"prompt": "\xff\xfe"}',
])
def test_parse_json_fails_as_json_loads_fails(body: bytes) -> None:
    with pytest.raises(Exception) as expected:
        json.loads(body)
    with pytest.raises(type(expected.value)) as got:
        parse_json(body)
    assert str(got.value) == str(expected.value)


@pytest.mark.parametrize("content", [
    {"count": 3, "max_model_len": 8192, "tokens": [1, 2, 3], "token_strs": None},
    {"count": 100_000, "tokens": list(range(100_000)),
     "token_strs": [f"t\u00e9{i}\n" for i in range(100_000)]},
    {"tokens": [], "empty": {}, "nested": {"a": [1.5, None, True]}, "text": "\U0001f642 \"q\""},
])
def test_render_json_sends_the_bytes_json_response_sends(content: dict) -> None:
    response = render_json(content)
    assert response.body == JSONResponse(content).body
    assert response.media_type == "application/json"


IDS = [100 + (i * 7919) % 49_000 for i in range(20_000)]


@pytest.mark.parametrize(("model", "data"), [
    (CompletionRequest, {"prompt": IDS, "max_tokens": 3, "temperature": 0.5}),
    (CompletionRequest, {"prompt": [IDS], "stop_token_ids": IDS[:100]}),
    (CompletionRequest, {"prompt": [IDS, [], [7]], "n": 2}),
    (CompletionRequest, {"prompt": [*IDS, 2**80], "seed": None}),  # pydantic takes any int
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": IDS}),
    (DetokenizeRequest, {"tokens": IDS}),
])
def test_validate_large_body_builds_the_model_pydantic_builds(model: type[BaseModel], data: dict) -> None:
    held: list[list] = []
    validated = validate_large_body(model, data, held)
    assert isinstance(validated, model)
    assert validated.model_dump() == model.model_validate(data).model_dump()
    assert validated.model_fields_set == model.model_validate(data).model_fields_set
    assert held and all(any(ids is value for value in data.values()) for ids in held)


@pytest.mark.parametrize("data", [
    {"prompt": [*IDS, 1.5]},  # a float id: FastAPI's own validation names it
    {"prompt": [*IDS, True]},  # bool is not an id for StrictInt
    {"prompt": [*IDS, "7"]},
    {"prompt": [IDS, 7]},
    {"prompt": IDS, "temperature": 5},  # the ids are fine, another field is not
    {"prompt": IDS, "unknown": 1},
    {"prompt": "text", "max_tokens": 2},  # no ids: nothing to shortcut
    [IDS],
])
def test_validate_large_body_leaves_other_bodies_to_fastapi(data: object) -> None:
    held: list[list] = []
    assert validate_large_body(CompletionRequest, data, held) is data
    assert held == []


def test_a_text_prompt_is_checked_beyond_its_first_text() -> None:
    with pytest.raises(ValidationError, match="surrogate"):
        CompletionRequest.model_validate({"prompt": ["fine", "\udfff"]})


BIG = 100_000


@pytest.mark.parametrize(("model", "data"), [
    (CompletionRequest, {"prompt": [7] * BIG + [None]}),
    (CompletionRequest, {"prompt": [None] * BIG}),
    (CompletionRequest, {"prompt": [[7] * BIG, [None] * BIG]}),
    (CompletionRequest, {"prompt": "x", "stop": [1] * BIG}),
    (CompletionRequest, {"prompt": "x", "stop_token_ids": ["a"] * BIG}),
    (CompletionRequest, {"prompt": "x", "logit_bias": {str(i): "a" for i in range(BIG)}}),
    (ChatCompletionRequest, {"messages": [1] * BIG}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [1] * BIG}]}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [1] * BIG}),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "metadata": {str(i): 1 for i in range(BIG)}}),
    (DetokenizeRequest, {"tokens": ["a"] * BIG}),
])
def test_a_long_list_or_mapping_of_bad_items_fails_at_its_first_bad_item(model: type[BaseModel],
                                                                        data: dict) -> None:
    # An error per item is what held the event loop for seconds on a 10 MB body.
    with pytest.raises(ValidationError) as err:
        model.model_validate(data)
    assert err.value.error_count() <= 5


@pytest.mark.parametrize(("prompt", "named"), [
    ([1, 2, None], "item 2 is null"), ([1, 2.0, 1.5], "item 1 is a number"),
    ([1, 2, True], "item 2 is a boolean"), ([1, 5, {}], "item 2 is an object"),
    ([5] * BIG + ["x"], f"item {BIG} is a string"),
])
def test_a_list_of_ids_with_a_bad_item_is_refused_naming_that_item(prompt: list, named: str) -> None:
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate({"prompt": prompt})
    (error,) = err.value.errors()
    assert error["loc"] == ("prompt",) and named in error["msg"]


@pytest.mark.parametrize("data", [{"prompt": [1, True]}, {"prompt": [1, 2.0]}, {"prompt": [[1, "2"]]},
                                  {"prompt": "x", "logit_bias": {"3": "1.5"}},
                                  {"prompt": "x", "logit_bias": {"4": True}}])
def test_ids_and_biases_are_strict_json_types(data: dict) -> None:
    # OpenAI's API is strict: an id is a JSON integer, a bias a JSON number.
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(data)


def test_free_in_slices_frees_only_what_nothing_else_holds() -> None:
    kept, kept_inner = list(IDS), list(IDS)
    held = [list(IDS), kept, [list(IDS), kept_inner, list(IDS[:10])]]
    assert free_in_slices(held) == 1 + 1 + 2  # flat, nested, and the nested one's unshared two
    assert held == [] and kept == IDS and kept_inner == IDS


def _echo_app(route_class: type[APIRoute]) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def _errors(_: Request, err: RequestValidationError) -> JSONResponse:
        return JSONResponse([{k: e[k] for k in ("type", "loc", "msg")} for e in err.errors()], 400)

    router = APIRouter(route_class=route_class)

    @router.post("/completions")
    async def completions(req: CompletionRequest) -> dict:
        if req.max_tokens == 0:
            raise HTTPException(418, "refused")  # a request refused from its handler
        return {"ids": req.prompt[:3], "count": len(req.prompt), "max_tokens": req.max_tokens}

    app.include_router(router)
    return app


@pytest.mark.parametrize(("body", "freed_lists"), [
    ({"prompt": IDS * 10, "max_tokens": 4}, [1]),
    ({"prompt": IDS * 10, "max_tokens": 0}, [1]),  # refused: its frames are gone before the free
    ({"prompt": [*IDS * 10, 0.5], "max_tokens": 4}, []),
    ({"prompt": IDS * 10, "temperature": 9}, []),
    ({"prompt": ["a" * 300_000, "\udfff"]}, []),
])
def test_large_bodies_through_the_route_answer_as_fastapi_answers(
        body: dict, freed_lists: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    freed: list[int] = []
    real_free = large_bodies.free_in_slices

    def free_after_collecting(held: list[list]) -> None:
        # The request's frames can sit in reference cycles (tracebacks, the framework's exit stacks)
        # until the collector runs, which happens at no fixed point: collect first, so what is
        # checked is that the route frees the lists off the loop once nothing live holds them.
        gc.collect()
        freed.append(real_free(held))

    monkeypatch.setattr(large_bodies, "free_in_slices", free_after_collecting)
    content = json.dumps(body)
    assert len(content) > large_bodies.OFF_LOOP_BYTES
    headers = {"Content-Type": "application/json"}
    with TestClient(_echo_app(large_bodies.LargeBodyOffLoopRoute)) as off_loop, \
            TestClient(_echo_app(APIRoute)) as plain:
        got = off_loop.post("/completions", content=content, headers=headers)
        expected = plain.post("/completions", content=content, headers=headers)
    assert (got.status_code, got.json()) == (expected.status_code, expected.json())
    assert freed == freed_lists
