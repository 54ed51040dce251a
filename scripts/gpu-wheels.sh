#!/usr/bin/env bash
# Builds the wheel folder a GPU machine without internet installs from (bench/gpu.py, confkv serve):
# the engine's and agent's runtime dependencies for CPython 3.12 on x86_64 Linux, except what the GPU
# image already ships (torch with CUDA, triton, transformers and its safetensors, tokenizers, jinja2).
#
#   bash scripts/gpu-wheels.sh [DIR]          # default build/gpu-wheels (git-ignored), <= 64 MiB
#   # on the GPU machine, from the repository root:
#   pip install --no-index --no-deps DIR/*.whl && PYTHONPATH=api:engine:agent python bench/gpu.py --quick
#
# Measured when written: 28 wheels, 31 MB (numpy 15.7 MB, grpcio 7.4 MB, llguidance 3.1 MB the largest;
# numpy is kept although the image has one, so an image without it still installs).
set -euo pipefail
DIR=${1:-build/gpu-wheels}
LIMIT_MIB=64
# Distribution names of the runtime imports of engine/, agent/ and api/ (tests/contracts/test_gpu_wheels.py
# checks the list against those imports), with their dependencies resolved by pip.
PACKAGES=(fastapi uvicorn h11 pydantic gguf llguidance prometheus-client psutil grpcio protobuf nvidia-ml-py numpy)
PY=${PYTHON:-python3}

rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" -m pip download --quiet --dest "$DIR" --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any "${PACKAGES[@]}"
size=$(du -sb "$DIR" | cut -f1)
count=$(find "$DIR" -name '*.whl' | wc -l)
echo "$DIR: $count wheels, $((size / 1024 / 1024)) MiB"
if (( size > LIMIT_MIB * 1024 * 1024 )); then
  echo "more than $LIMIT_MIB MiB: the device run cannot carry it" >&2
  exit 1
fi
