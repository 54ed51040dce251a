"""Malformed protobuf on the engine's control socket (a real Unix socket, the real grpc server of
``ControlPlane``, a grpcio client sending raw bytes): INVALID_ARGUMENT naming the problem, no
traceback in the log, and the server keeps answering well-formed requests."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from confkv_api.config import load_config
from confkv_api.v1 import control_pb2 as pb
from confkv_engine.control.servicer import ControlPlane

MALFORMED = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08" + b"\x80" * 11]  # bad tag, truncated, long varint


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[str]:
    sock = str(tmp_path / "engine.sock")
    plane = ControlPlane(load_config({"engine": {"grpcSocket": sock}}))
    plane.start()
    try:
        yield sock
    finally:
        plane.stop()


@pytest.mark.parametrize("data", MALFORMED)
@pytest.mark.parametrize("method", ["UpdatePolicy", "GetStatus", "Warmup", "WatchStatus"])
def test_malformed_requests_are_invalid_argument_without_a_traceback(
        socket_path: str, method: str, data: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        path = f"/confkv.v1.EngineControl/{method}"
        if method == "WatchStatus":
            call = channel.unary_stream(path)(data, timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                next(call)
        else:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary(path)(data, timeout=10)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert "not a valid protobuf message" in err.value.details()
        # A well-formed request still reaches the servicer (no engine attached here: UNAVAILABLE).
        status = channel.unary_unary("/confkv.v1.EngineControl/GetStatus",
                                     request_serializer=pb.GetStatusRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as ok:
            status(pb.GetStatusRequest(), timeout=10)
        assert ok.value.code() is grpc.StatusCode.UNAVAILABLE, ok.value.details()
    assert not [r for r in caplog.records if r.exc_info or "deserializ" in r.getMessage()], caplog.text
