"""The committed gRPC stubs in api/confkv_api/v1/ are exactly what scripts/gen-proto.sh generates from
proto/confkv/v1/control.proto, and they expose the service the engine and the agent use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from contract_tools import REPO

GENERATED = ("control_pb2.py", "control_pb2.pyi", "control_pb2_grpc.py")
COMMITTED = REPO / "api" / "confkv_api" / "v1"


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", str(REPO / "scripts" / "gen-proto.sh"), str(tmp_path)], check=True, env=env,
                   capture_output=True, timeout=120)
    stale = [name for name in GENERATED
             if (tmp_path / "confkv_api" / "v1" / name).read_bytes() != (COMMITTED / name).read_bytes()]
    assert not stale, f"stale stubs {stale}: run `bash scripts/gen-proto.sh` and commit the result"


def test_service_contract() -> None:
    from confkv_api.v1 import control_pb2

    service = control_pb2.DESCRIPTOR.services_by_name["EngineControl"]
    assert service.full_name == "confkv.v1.EngineControl"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == {"GetStatus", "WatchStatus", "UpdatePolicy", "Compress", "RebuildIndex", "Warmup"}
    assert methods["WatchStatus"].server_streaming
    assert not any(m.client_streaming for m in methods.values())
    assert methods["UpdatePolicy"].output_type.name == "UpdatePolicyResponse"
