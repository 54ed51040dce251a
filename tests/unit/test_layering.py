"""Imports only go downward, and no module of the repository imports itself in a circle.

Two levels. Inside the engine, each room imports only the rooms below it (the table is the
architecture in docs/architecture.md); the cache's codec and disk store are rooms of their own: the
codec sits below everything, the disk store imports the cache core and never the reverse. Across the
repository, the shipped packages import only ``confkv_api`` besides themselves (and the engine's CLI
the agent it can start), ``testkit`` (the
drivers tests and benchmarks share) imports neither ``tests`` nor ``bench``, ``bench`` never imports
``tests`` and ``tests`` never imports ``bench``; and the module graph of the whole repository
(engine, api, agent, operator, testkit, bench, tests) has no cycle.

Every ``import`` counts, including the ones inside functions: a lazy import that reaches upward is
still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine" / "confkv_engine"
# Where each top-level package's folder is (the shipped ones live one folder down).
PACKAGES = {"confkv_api": ROOT / "api", "confkv_engine": ROOT / "engine", "confkv_agent": ROOT / "agent",
            "confkv_operator": ROOT / "operator", "testkit": ROOT, "bench": ROOT, "tests": ROOT}

# engine room -> rooms it may import (besides itself); ``app`` is the composition root (server, cli).
ALLOWED: dict[str, set[str]] = {
    "model": {"cache.codec"},  # the native-library loader only (the codec is below everything)
    "cache.codec": set(),
    "cache": {"cache.codec"},
    "cache.disk": {"cache", "cache.codec"},
    "attention": {"cache", "cache.codec", "model"},
    "retention": {"cache", "cache.codec"},
    "core": {"model", "cache", "cache.codec", "cache.disk", "attention", "retention"},
    "http": {"core", "cache"},
    "control": {"core", "cache"},
    "parallel": {"model", "cache", "cache.disk", "retention", "core"},
    "app": {"model", "cache", "cache.codec", "cache.disk", "attention", "retention", "core", "http",
            "control", "parallel"},
}
SUBROOMS = ("cache.codec", "cache.disk")

# top-level package -> top-level packages it must never import
FORBIDDEN: dict[str, set[str]] = {
    "confkv_api": {"confkv_engine", "confkv_agent", "confkv_operator", "testkit", "bench", "tests"},
    # the engine's CLI starts the agent beside it (``confkv serve --with-agent``); never the reverse
    "confkv_engine": {"confkv_operator", "testkit", "bench", "tests"},
    "confkv_agent": {"confkv_engine", "confkv_operator", "testkit", "bench", "tests"},
    "confkv_operator": {"confkv_engine", "confkv_agent", "testkit", "bench", "tests"},
    "testkit": {"bench", "tests"},
    "bench": {"tests"},
    "tests": {"bench"},
}


def _module_name(path: Path) -> str:
    top = next(name for name, base in PACKAGES.items() if path.is_relative_to(base / name))
    parts = path.relative_to(PACKAGES[top]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
    sub = ".".join(parts[1:3])
    if sub in SUBROOMS and (len(parts) > 3 or module.endswith(sub)):
        return sub
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else "app"


def _is_module(name: str) -> bool:
    top = name.split(".")[0]
    if top not in PACKAGES:
        return False
    path = PACKAGES[top] / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] in PACKAGES:
                # ``from pkg import submodule`` depends on the submodule (the graph drops non-modules).
                subs = {f"{base}.{a.name}" for a in node.names}
                found.update(subs if all(_is_module(s) for s in subs) else subs | {base})
    return found


def _files() -> list[Path]:
    files = []
    for name, base in PACKAGES.items():
        files += [p for p in (base / name).rglob("*.py") if "__pycache__" not in p.parts]
    return files


def _graph(files: list[Path]) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in files}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    cycles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep):] + [dep]) if dep in path else dep)
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_every_room_has_a_docstring_and_imports_only_rooms_below_it() -> None:
    for room in ALLOWED:
        if room != "app":
            init = ENGINE / room.replace(".", "/") / "__init__.py"
            assert ast.get_docstring(ast.parse(init.read_text())), f"{room}/__init__.py: what the room is"
    upward = []
    for module, deps in _graph(list(ENGINE.rglob("*.py"))).items():
        room = _room(module)
        upward += [f"{module} -> {d}" for d in deps if _room(d) not in ALLOWED[room] | {room}]
    assert upward == []


def test_packages_import_only_what_they_may() -> None:
    wrong = []
    for module, deps in _graph(_files()).items():
        top = module.split(".")[0]
        wrong += [f"{module} -> {d}" for d in deps if d.split(".")[0] in FORBIDDEN[top]]
    assert wrong == []


def test_the_module_graph_of_the_repository_has_no_cycles() -> None:
    assert _cycles(_graph(_files())) == []


def test_the_checker_sees_lazy_and_relative_imports_rooms_and_cycles() -> None:
    found = _imports(ENGINE / "server.py")  # imports control inside a method
    assert "confkv_engine.control.servicer" in found and _room("confkv_engine.server") == "app"
    assert _room("confkv_engine.http.app") == "http" and _room("confkv_engine.cli") == "app"
    assert _room("confkv_engine.cache.codec.blocks") == "cache.codec"
    assert _room("confkv_engine.cache.arena") == "cache"
    assert _room("confkv_engine.cache.disk") == "cache.disk"
    assert _module_name(ROOT / "bench" / "serving" / "throughput.py") == "bench.serving.throughput"
    assert "bench.serving.peers" in _imports(ROOT / "bench" / "serving" / "throughput.py")
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
