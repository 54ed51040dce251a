"""HTTP/1.1 connection handling of the engine's server: uvicorn's h11 protocol with stricter framing,
OpenAI-format errors where the HTTP parser answers, and a deadline for reading a request's head.

The server runs uvicorn with this protocol class (``server.run_server``), never ``http="auto"``: the
choice would otherwise depend on whether ``httptools`` happens to be installed, and the two parsers
frame requests differently. h11 is pure Python and already refuses most bad framing (conflicting
``Content-Length`` values, a ``Transfer-Encoding`` other than ``chunked``, bad chunk sizes); what it
lets through, and what uvicorn answers around it, is handled here:

- **Request smuggling**: a request carrying both ``Content-Length`` and ``Transfer-Encoding`` is
  ambiguous (RFC 9112 section 6.1: a proxy may frame it by the other header), so it is refused with
  400 and the connection is closed; nothing after it on that connection is read as a request.
- **Head size**: h11 bounds a head only while it is incomplete, so one that arrives whole in one read
  was parsed whatever its size; here a head (request line and headers) over ``MAX_HEAD_BYTES`` is
  refused however it arrives.
- **Errors of the HTTP layer** are answered in OpenAI's error body like every other error: 400
  (``invalid_http_request``) for malformed requests, 431 (``headers_too_large``) when the request
  line and headers exceed ``MAX_HEAD_BYTES``, 408 (``request_timeout``) when a client does not
  send a complete head within ``header_timeout`` seconds; each with ``Connection: close``, after
  which the connection is closed (the stream can no longer be trusted to be in sync).
- **Header-read deadline**: a connection waiting for a request head (a new connection, or a
  kept-alive one whose client started its next request) is closed after ``header_timeout``
  seconds without a complete head, so slow-header clients cannot hold sockets open indefinitely.
  Reading the body and streaming the answer are not bounded by it. Idle kept-alive connections are
  closed by uvicorn's own keep-alive timeout.

The deadline is a timer per connection, armed and cancelled from ``data_received`` by looking at
h11's public connection state, so uvicorn's request handling itself is not copied or changed.
"""

from __future__ import annotations

import asyncio
import http
import json
import re
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from confkv_engine.http.protocol import error_body

MAX_HEAD_BYTES = 16 * 1024  # request line + headers; h11's own default, stated here
DEFAULT_HEADER_TIMEOUT_S = 10.0

_ERRORS = {  # status -> (code, message)
    400: ("invalid_http_request", "The request is not valid HTTP/1.1"),
    408: ("request_timeout", "The request line and headers did not arrive within {timeout:g} s"),
    431: ("headers_too_large", f"The request line and headers exceed {MAX_HEAD_BYTES} bytes"),
}


class AmbiguousFraming(h11.RemoteProtocolError):
    """A request whose body length two headers state (``Content-Length`` and ``Transfer-Encoding``)."""


_HEAD_END = re.compile(rb"\n\r?\n")  # what h11 takes for the end of a head


def _has_both_lengths(headers: Any) -> bool:
    names = {name.lower() for name, _ in headers}
    return b"content-length" in names and b"transfer-encoding" in names


class StrictConnection(h11.Connection):
    """h11's server connection that refuses ambiguous framing and remembers its last error."""

    def __init__(self, max_head_bytes: int = MAX_HEAD_BYTES) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.last_error: h11.RemoteProtocolError | None = None

    def _head_too_large(self) -> bool:
        if self.their_state is not h11.IDLE:
            return False
        data = self.trailing_data[0]
        return len(data) > self.max_head_bytes and not _HEAD_END.search(data, 0, self.max_head_bytes + 3)

    def next_event(self) -> Any:
        try:
            if self._head_too_large():
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            event = super().next_event()
        except h11.RemoteProtocolError as err:
            self.last_error = err
            raise
        if isinstance(event, h11.Request) and _has_both_lengths(event.headers):
            self.last_error = AmbiguousFraming(
                "the request has both Content-Length and Transfer-Encoding; send one", error_status_hint=400)
            raise self.last_error
        return event


def error_response(status: int, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response with OpenAI's error body that closes the connection."""
    body = json.dumps(error_body(message, "invalid_request_error", None, code), ensure_ascii=True).encode()
    head = (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class ConfKVH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the rules of the module docstring (one instance per connection)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictConnection()
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.trailing_data[0]:  # the start of a pipelined request: its head has a deadline
            self._watch_head()

    def _watch_head(self) -> None:
        """Arm the deadline while a request head is awaited, cancel it once one has arrived."""
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            code, message = _ERRORS[408]
            self._fail(408, message.format(timeout=self.header_timeout), code)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to an h11 parse error, as an OpenAI error with the status h11 suggests."""
        err = self.conn.last_error
        status = err.error_status_hint if err is not None and err.error_status_hint in _ERRORS else 400
        code, message = _ERRORS[status]
        if status == 400 and err is not None:
            message = f"{message}: {str(err)[:200]}"
        self._fail(status, message, code)

    def _fail(self, status: int, message: str, code: str) -> None:
        self._cancel_head_timer()
        # Mid-response (a body that went bad while the answer streams) there is no room for another
        # response: the connection is only closed.
        cycle = self.cycle  # the last request's; a finished one leaves room for this answer
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(error_response(status, message, code))
        self.transport.close()


def protocol_class(header_timeout: float) -> type[ConfKVH11Protocol]:
    """The protocol class to give uvicorn (``http=``), with this header-read deadline."""
    return type("ConfKVH11Protocol", (ConfKVH11Protocol,), {"header_timeout": header_timeout})
