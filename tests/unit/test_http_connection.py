"""``http.connection.StrictConnection``, the h11 connection the server parses requests with: the
framing rules on their own, fed bytes directly (the server's answers over real sockets are in
tests/integration/test_http_framing.py)."""

from __future__ import annotations

import json

import h11
import pytest

from confkv_engine.http.connection import MAX_HEAD_BYTES, AmbiguousFraming, StrictConnection, error_response


def first_event(data: bytes) -> object:
    conn = StrictConnection()
    conn.receive_data(data)
    return conn.next_event()


def test_both_length_headers_are_ambiguous_framing() -> None:
    for order in ([b"Content-Length: 4", b"Transfer-Encoding: chunked"],
                  [b"transfer-encoding: chunked", b"content-length: 0"]):
        with pytest.raises(AmbiguousFraming) as err:
            first_event(b"POST / HTTP/1.1\r\nHost: x\r\n" + b"\r\n".join(order) + b"\r\n\r\n0\r\n\r\n")
        assert err.value.error_status_hint == 400


@pytest.mark.parametrize("size", [MAX_HEAD_BYTES + 1, 4 * MAX_HEAD_BYTES])
def test_a_head_over_the_bound_is_431_even_when_complete(size: int) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * size + b"\r\n\r\n"
    conn = StrictConnection()
    conn.receive_data(head)
    with pytest.raises(h11.RemoteProtocolError) as err:
        conn.next_event()
    assert err.value.error_status_hint == 431 and conn.last_error is err.value


def test_a_head_within_the_bound_followed_by_a_large_body_parses() -> None:
    body = b"x" * (4 * MAX_HEAD_BYTES)
    event = first_event(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert isinstance(event, h11.Request)


def test_error_response_is_an_openai_error_that_closes() -> None:
    raw = error_response(431, "too large", "headers_too_large")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert b"connection: close" in head
    assert json.loads(body)["error"] == {"message": "too large", "type": "invalid_request_error",
                                         "param": None, "code": "headers_too_large"}
