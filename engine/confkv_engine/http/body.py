"""Large JSON bodies of the API routes, parsed and rendered so that they do not stall the event loop.

FastAPI parses a body with ``json.loads`` on the event loop. That is one C call which holds the
GIL for all of it: about 10 ms for a 10 MB string prompt, but 100 ms for a 10 MB list of token ids,
since every integer is an object to build. Moving the call to a worker thread alone would not help
(the loop still waits for the GIL), so a body over ``OFF_LOOP_BYTES`` is parsed on a worker thread
with a Python-level ``parse_int``: each integer then passes through the interpreter, which hands
the GIL to the event loop at its switch interval. The parse is about twice as slow, and only
bodies this large pay for it; smaller ones are parsed on the loop as before, and the result is the
same object either way (``int`` of the same digits, the same errors for FastAPI to turn into 400s).

Answers can be large too (``/tokenize`` returns every id of a multi-megabyte prompt): FastAPI would
walk them with ``jsonable_encoder`` on the loop and ``json.dumps`` them in one call. ``render_json``
writes the same bytes as ``JSONResponse`` from a worker thread, a slice of each long list at a
time, so no single call holds the GIL for long.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 256 * 1024
_SLICE = 8192  # list items rendered per call (well under a millisecond)


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


class _LargeBodyOffLoopRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(parse_json, body)
            else:
                self._json = json.loads(body)
        return self._json


class LargeBodyOffLoopRoute(APIRoute):
    """An ``APIRoute`` whose JSON body, when large, is parsed off the event loop (``route_class``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_LargeBodyOffLoopRequest(request.scope, request.receive))

        return route
