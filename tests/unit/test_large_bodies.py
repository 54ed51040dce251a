"""Large bodies parsed and rendered off the event loop (``http.body``) give exactly what FastAPI's
own ``json.loads`` and ``JSONResponse`` give: the same objects, the same errors, the same bytes."""

from __future__ import annotations

import json

import pytest
from fastapi.responses import JSONResponse

from confkv_engine.http.body import parse_json, render_json


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
