"""The engine's rooms import only the rooms below them, and no module imports itself in a circle.

Every ``import`` in the package counts, including the ones inside functions: a lazy import that
reaches upward is still a dependency. The allowed table is the architecture (docs/architecture.md).
"""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine" / "confkv_engine"

# room -> rooms it may import (besides itself). ``app`` is the composition root (server.py, cli.py).
ALLOWED: dict[str, set[str]] = {
    "model": set(),
    "cache": set(),
    "attention": {"cache", "model"},
    "retention": {"cache"},
    "core": {"model", "cache", "attention", "retention"},
    "http": {"core", "cache"},
    "control": {"core", "cache"},
    "app": {"model", "cache", "attention", "retention", "core", "http", "control"},
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else "app"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module_name(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("confkv_engine"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("confkv_engine"):
                # ``from pkg import submodule`` depends on the submodule (the graph drops non-modules).
                subs = {f"{base}.{a.name}" for a in node.names}
                found.update(subs if all((ENGINE.parent / s.replace(".", "/")).with_suffix(".py").exists()
                                         for s in subs) else subs | {base})
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ENGINE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_every_room_has_a_docstring_and_imports_only_rooms_below_it() -> None:
    for room in ALLOWED:
        if room != "app":
            init = ENGINE / room / "__init__.py"
            assert ast.get_docstring(ast.parse(init.read_text())), f"{room}/__init__.py: what the room is"
    upward = []
    for module, deps in _graph().items():
        room = _room(module)
        upward += [f"{module} -> {d}" for d in deps if _room(d) not in ALLOWED[room] | {room}]
    assert upward == []


def test_the_module_graph_has_no_cycles() -> None:
    graph = _graph()
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
    assert cycles == []


def test_the_checker_sees_lazy_and_relative_imports() -> None:
    found = _imports(ENGINE / "server.py")  # imports control inside a method
    assert "confkv_engine.control.servicer" in found and _room("confkv_engine.server") == "app"
    assert _room("confkv_engine.http.app") == "http" and _room("confkv_engine.cli") == "app"
