#!/usr/bin/env bash
# Generates the Python gRPC stubs of proto/confkv/v1/control.proto into api/confkv_api/v1/
# (control_pb2.py, control_pb2.pyi, control_pb2_grpc.py) with grpcio-tools' bundled protoc.
# The stubs are committed; tests/contracts/test_proto_stubs.py regenerates them into a temporary
# directory and fails when the committed copies are stale.
# Usage: bash scripts/gen-proto.sh [output root, default: api]   (PYTHON overrides the interpreter)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/api}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3

mkdir -p "$OUT/confkv_api/v1"
# The import path maps the proto directory onto the Python package, so the generated *_grpc module
# imports `confkv_api.v1.control_pb2` (the proto package stays confkv.v1).
"$PYTHON" -m grpc_tools.protoc \
  "-Iconfkv_api/v1=$ROOT/proto/confkv/v1" \
  --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  "confkv_api/v1/control.proto"
[ -f "$OUT/confkv_api/v1/__init__.py" ] || echo '"""Generated gRPC stubs of proto/confkv/v1 (do not edit; run scripts/gen-proto.sh)."""' \
  > "$OUT/confkv_api/v1/__init__.py"
