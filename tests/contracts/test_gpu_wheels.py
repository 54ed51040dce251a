"""scripts/gpu-wheels.sh lists every third-party package the engine, agent and API import, except what
the GPU image ships (torch with Triton, transformers and the packages transformers needs), so a GPU machine
without internet can install the rest from the folder. The download itself needs PyPI and is not
run here (nothing downloads during tests); its measured size is in the script."""

from __future__ import annotations

import ast
import re
import sys

from contract_tools import REPO

SCRIPT = REPO / "scripts" / "gpu-wheels.sh"
IN_GPU_IMAGE = {"torch", "triton", "safetensors", "tokenizers", "jinja2"}  # torch (with Triton), transformers
NOT_SERVED = {"kubernetes"}  # the agent's Kubernetes events: not used by a single-machine GPU run
IMPORT_TO_DIST = {"google": "protobuf", "grpc": "grpcio", "pynvml": "nvidia-ml-py",
                  "prometheus_client": "prometheus-client", "starlette": "fastapi"}


def _listed() -> set[str]:
    match = re.search(r"^PACKAGES=\(([^)]*)\)", SCRIPT.read_text(), re.MULTILINE)
    assert match, "PACKAGES=(...) not found"
    return set(match.group(1).split())


def _imports() -> set[str]:
    found = set()
    for package in ("engine/confkv_engine", "agent/confkv_agent", "api/confkv_api"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and not name.startswith("confkv")}


def test_every_runtime_import_is_in_the_wheel_folder_or_the_image() -> None:
    needed = {IMPORT_TO_DIST.get(name, name) for name in _imports()} - IN_GPU_IMAGE - NOT_SERVED
    assert needed <= _listed(), f"missing from scripts/gpu-wheels.sh: {sorted(needed - _listed())}"


def test_the_folder_targets_the_gpu_images_python() -> None:
    text = SCRIPT.read_text()
    assert "--python-version 3.12" in text and "--only-binary=:all:" in text and "LIMIT_MIB=64" in text
