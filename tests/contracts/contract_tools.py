"""Shared helpers of the contract tests: finding the external tools, rendering the chart, loading YAML.

Tools (helm, kubectl, promtool) are looked up on PATH with the repository's ``.venv/bin`` first (where
``scripts/install-tools.sh`` puts helm and kubectl). A missing tool fails the test when the ``CI``
environment variable is set (CI must run every contract) and skips it with the reason otherwise.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "confkv-operator"
CI_VALUES = CHART / "ci" / "ci-values.yaml"
CRD_FILE = REPO / "crds" / "confkvdeployments.confkv.io.yaml"
EXAMPLES = REPO / "examples"
RELEASE = "confkv"
NAMESPACE = "confkv-system"
KUBERNETES_VERSION = "1.35.0"
INSTALL_HINT = "run `make tools` (bash scripts/install-tools.sh .venv)"


def find_tool(name: str) -> str | None:
    """Absolute path of ``name`` from .venv/bin or PATH, or None."""
    search = os.pathsep.join([str(REPO / ".venv" / "bin"), os.environ.get("PATH", "")])
    return shutil.which(name, path=search)


def require_tool(name: str) -> str:
    path = find_tool(name)
    if path is None:
        reason = f"{name} not found on PATH or in .venv/bin: {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def run(argv: list[str], timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure (when ``check``) the assertion message carries its output."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(argv)} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def helm_template_argv(helm: str, *extra: str) -> list[str]:
    return [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--kube-version", KUBERNETES_VERSION, *extra]


@functools.cache
def _render_cached(helm: str, extra: tuple[str, ...]) -> tuple[str, ...]:
    out = run(helm_template_argv(helm, *extra)).stdout
    return tuple(yaml.safe_dump(doc) for doc in yaml.safe_load_all(out) if doc)


def render(helm: str, *extra: str) -> list[dict[str, Any]]:
    """Every object ``helm template`` renders (hooks included), as fresh dicts (callers may mutate)."""
    return [yaml.safe_load(text) for text in _render_cached(helm, tuple(extra))]


def find_obj(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    names = [o["metadata"]["name"] for o in matches]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {names}"
    return matches[0]


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def load_crd() -> dict[str, Any]:
    (crd,) = load_yaml_docs(CRD_FILE)
    return crd


def example_files() -> list[Path]:
    return sorted(p for p in EXAMPLES.glob("*.y*ml") if p.is_file())


def example_crs() -> list[tuple[str, dict[str, Any]]]:
    """(file:index, object) for every ConfKVDeployment in examples/."""
    out = []
    for path in example_files():
        for i, doc in enumerate(load_yaml_docs(path)):
            if doc.get("kind") == "ConfKVDeployment":
                out.append((f"{path.name}:{i}", doc))
    return out
