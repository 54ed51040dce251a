"""Request-body limit of the HTTP server (pure ASGI middleware, in front of FastAPI).

A body larger than ``engine.maxRequestBytes`` gets 413 in OpenAI's error format. A declared
``Content-Length`` over the limit is answered before a byte of the body is read; a chunked body is
counted while it arrives and refused as soon as it passes the limit, so the server never holds more
than the limit per request. A body within the limit is buffered and handed on unchanged; after it,
``receive`` is the server's own again, so a streaming route still sees the client hang up.

Why here and not in FastAPI's parser: the limit must hold before the body is parsed (parsing is
what a huge body costs), and a 413 must not depend on which route or framework version reads it.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from confkv_engine.http.protocol import error_body


class _TooLarge(Exception):
    pass


def too_large_body(limit: int) -> bytes:
    message = (f"The request body is larger than this server's limit of {limit} bytes "
               f"(engine.maxRequestBytes); send a smaller request")
    return json.dumps(error_body(message, "invalid_request_error", None, "request_too_large")).encode()


class RequestBodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.max_bytes:
            await self._refuse(send)
            return
        try:
            first = await self._buffer(receive)
        except _TooLarge:
            await self._refuse(send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return first

        await self.app(scope, replay, send)

    async def _buffer(self, receive: Receive) -> Message:
        """The whole body as one ``http.request`` message (or the disconnect that ended it)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def _refuse(self, send: Send) -> None:
        body = too_large_body(self.max_bytes)
        # Connection: close, since the rest of the body is never read from this connection.
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def _declared_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
