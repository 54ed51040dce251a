"""Large JSON bodies of the API routes, parsed and rendered so that they do not stall the event loop.

FastAPI parses a body with ``json.loads`` on the event loop. That is one C call which holds the
GIL for all of it: about 10 ms for a 10 MB string prompt, but 100 ms for a 10 MB list of token ids,
since every integer is an object to build. Moving the call to a worker thread alone would not help
(the loop still waits for the GIL), so a body over ``OFF_LOOP_BYTES`` is parsed on a worker thread
with a Python-level ``parse_int``: each integer then passes through the interpreter, which hands
the GIL to the event loop at its switch interval. The parse is about twice as slow, and only
bodies this large pay for it; smaller ones are parsed on the loop as before, and the result is the
same object either way (``int`` of the same digits, the same errors for FastAPI to turn into 400s).

A large body is also validated off the loop when the route's model names ``TOKEN_ID_FIELDS``: pydantic
checks two million ids in one 30 ms call, so each such list of JSON integers is type-checked here a
slice at a time, pydantic validates the body with a one-id stand-in for it, and the parsed list
takes the stand-in's place. That is the model pydantic would build (those fields' validation
depends only on the items being integers), and FastAPI passes an instance of its body model through
unchanged. A body this shortcut does not fit, or one that fails validation, goes to FastAPI as the
parsed JSON, which it validates as before: the same 400s, in the same order after authentication.
When the request is done the id lists are freed a slice at a time on a worker thread (freeing two
million ints is one 15 ms call), unless something still holds them.

Answers can be large too (``/tokenize`` returns every id of a multi-megabyte prompt): FastAPI would
walk them with ``jsonable_encoder`` on the loop and ``json.dumps`` them in one call. ``render_json``
writes the same bytes as ``JSONResponse`` from a worker thread, a slice of each long list at a
time, so no single call holds the GIL for long.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from confkv_engine.http.protocol import first_not_of_types

OFF_LOOP_BYTES = 256 * 1024
_SLICE = 8192  # list items rendered, type-checked or freed per call (well under a millisecond)
_HELD_IDS = "confkv.held_token_ids"  # scope key: the id lists to free when the request is done


def _switching_int(digits: str) -> int:
    # A Python frame per integer is what gives the interpreter its chances to switch threads.
    return int(digits)


def parse_json(body: bytes) -> Any:
    """``json.loads`` that lets other threads run while it works (for a worker thread)."""
    return json.loads(body, parse_int=_switching_int)


def _dumps(value: Any) -> str:
    # JSONResponse's own settings, so that the bytes are what it would send.
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":"))


def render_json(content: dict[str, Any]) -> Response:
    """``JSONResponse(content)``, rendered a slice of each long top-level list at a time."""
    fields = []
    for key, value in content.items():
        if isinstance(value, list) and len(value) > _SLICE:
            slices = [_dumps(value[i:i + _SLICE])[1:-1] for i in range(0, len(value), _SLICE)]
            rendered = "[" + ",".join(slices) + "]"
        else:
            rendered = _dumps(value)
        fields.append(f"{_dumps(key)}:{rendered}")
    return Response("{" + ",".join(fields) + "}", media_type="application/json")


def _all_of_type(items: list[Any], kind: type) -> bool:
    return first_not_of_types(items, {kind}) is None


def _stand_in(value: Any) -> Any:
    """A one-id stand-in for ``value`` when it is a list of JSON integers or of such lists, else None."""
    if not isinstance(value, list) or not value:
        return None
    if _all_of_type(value, int):
        return value[:1]
    if _all_of_type(value, list) and all(_all_of_type(ids, int) for ids in value):
        return [ids[:1] for ids in value]
    return None


def validate_large_body(model: type[BaseModel], data: Any, held: list[list[Any]]) -> Any:
    """``model`` validated from the parsed ``data`` with its token-id lists type-checked a slice at a
    time (see the module docstring); ``data`` itself when that shortcut does not apply or validation
    fails. The id lists put in the model are appended to ``held``."""
    fields: tuple[str, ...] = getattr(model, "TOKEN_ID_FIELDS", ())
    if not isinstance(data, dict):
        return data
    stand_ins = {name: stand_in for name in fields if (stand_in := _stand_in(data.get(name))) is not None}
    if not stand_ins:
        return data
    try:
        validated = model.model_validate({**data, **stand_ins})
    except Exception:  # noqa: BLE001 - FastAPI validates the JSON again and answers as it always does
        return data
    for name in stand_ins:
        held.append(data[name])
        setattr(validated, name, data[name])
    return validated


def free_in_slices(held: list[list[Any]]) -> int:
    """Empty ``held``, freeing each id list that nothing else holds a slice at a time (a worker
    thread's job); how many lists were freed so (a list of id lists counts with each inner one)."""
    freed = 0
    while held:
        ids = held.pop()
        if sys.getrefcount(ids) != _SOLE_HOLDER:
            continue  # still referenced: its last holder frees it
        freed += 1
        while ids:
            if isinstance(ids[-1], list):  # a list of id lists: each inner one is freed in slices
                held.append(ids.pop())
            else:
                del ids[-_SLICE:]
    return freed


def _sole_holder_refcount() -> int:
    probe: list[Any] = []
    return sys.getrefcount(probe)  # of a list only a local holds, as in free_in_slices


_SOLE_HOLDER = _sole_holder_refcount()


class _LargeBodyOffLoopRequest(Request):
    def __init__(self, scope: Scope, receive: Receive, body_model: type[BaseModel] | None) -> None:
        super().__init__(scope, receive)
        self._body_model = body_model

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(self._parse_large, body, self.scope.get(_HELD_IDS))
            else:
                self._json = json.loads(body)
        return self._json

    def _parse_large(self, body: bytes, held: list[list[Any]] | None) -> Any:
        data = parse_json(body)
        if self._body_model is None or held is None:
            return data
        return validate_large_body(self._body_model, data, held)


class LargeBodyOffLoopRoute(APIRoute):
    """An ``APIRoute`` whose JSON body, when large, is parsed and validated off the event loop
    (``route_class``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        annotation = getattr(getattr(self.body_field, "field_info", None), "annotation", None)
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None

        async def route(request: Request) -> Response:
            return await handler(_LargeBodyOffLoopRequest(request.scope, request.receive, model))

        return route

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        held: list[list[Any]] = []
        scope[_HELD_IDS] = held
        try:
            await super().handle(scope, receive, send)
        finally:
            # Every frame and exception of the request is gone by now, so these are the last holders.
            if held:
                await asyncio.to_thread(free_in_slices, held)
