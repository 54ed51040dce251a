"""Malformed protobuf on the control socket: INVALID_ARGUMENT, and no traceback in the engine's log.

grpc decodes a request with the method's deserializer before the servicer runs; when the bytes are
not a valid message, grpc logs "Exception deserializing request!" with a traceback and answers
INTERNAL, as if the engine had failed. ``MalformedRequests`` (a server interceptor) wraps each
method's deserializer so that an undecodable request becomes an ``Undecodable`` value, and the
method answers INVALID_ARGUMENT naming the problem without running. Only methods with a single
request message exist in ``confkv.v1.EngineControl``; a client-streaming one would pass unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc


class Undecodable:
    """A request whose bytes did not decode; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """``deserializer`` that returns ``Undecodable`` instead of raising."""
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as err:  # noqa: BLE001 - protobuf's DecodeError, or anything a parser raises
            return Undecodable(f"{type(err).__name__}: {err}")
    return decode


def refusing_undecodable(behavior: Callable[[Any, grpc.ServicerContext], Any],
                         method: str) -> Callable[[Any, grpc.ServicerContext], Any]:
    def run(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{method}: the request is not a valid protobuf message ({request.reason})")
        return behavior(request, context)
    return run


class MalformedRequests(grpc.ServerInterceptor):
    """Undecodable requests get INVALID_ARGUMENT (see the module docstring)."""

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        decode = tolerant(handler.request_deserializer)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                refusing_undecodable(handler.unary_stream, method), decode, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(
            refusing_undecodable(handler.unary_unary, method), decode, handler.response_serializer)
