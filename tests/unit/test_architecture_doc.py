"""docs/architecture.md names only what exists: every path it names (a backticked token with a slash
or a file suffix) is a file or folder of the repository (or of the engine package), and every
backticked module of the engine (``core.scheduler``, ``cache.readback``) is a module of it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine" / "confkv_engine"
DOC = ROOT / "docs" / "architecture.md"
ROOMS = ("model", "cache", "attention", "retention", "core", "http", "control")


def _tokens() -> list[str]:
    return re.findall(r"`([^`\s]+)`", DOC.read_text())


def _is_path(token: str) -> bool:
    return "/" in token or bool(re.search(r"\.(py|md|json|yaml|toml)$", token))


def _exists(token: str) -> bool:
    rel = token.rstrip("/")
    return (ROOT / rel).exists() or (ENGINE / rel).exists()


def _is_module(token: str) -> bool:
    path = ENGINE / token.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def test_every_path_the_architecture_names_exists() -> None:
    paths = [t for t in _tokens() if _is_path(t)]
    assert len(paths) > 20  # the page names the tree; an empty list would prove nothing
    assert [t for t in paths if not _exists(t)] == []


def test_every_engine_module_the_architecture_names_exists() -> None:
    dotted = [t for t in _tokens() if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", t) and t.split(".")[0] in ROOMS]
    # the last part may be a function or class of the module (``core.threads.serial_torch_ops``)
    missing = [t for t in dotted if not (_is_module(t) or _is_module(t.rsplit(".", 1)[0]))]
    assert dotted and missing == []


def test_every_room_is_named() -> None:
    text = DOC.read_text()
    rooms = [p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists()]
    rooms += [f"cache/{p.name}" for p in (ENGINE / "cache").iterdir() if (p / "__init__.py").exists()]
    assert [r for r in rooms if f"`{r}`" not in text] == []
