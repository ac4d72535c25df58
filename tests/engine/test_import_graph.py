"""The engine's import graph, read with ast (nothing is imported): the engine loop (core/) and the model execution
(execution/, distributed/) share their data contracts through shoal.engine.contracts only, so no import cycle can
form between them, and no import cycle exists among the engine's modules at import time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[2] / "engine"
PREFIX = "shoal.engine"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ENGINE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PREFIX, *parts])


MODULES = {module_name(p): p for p in ENGINE.rglob("*.py")}


def imports(path: Path, import_time_only: bool) -> dict[str, int]:
    """Engine modules that `path` imports -> the first line that does. With import_time_only, imports inside
    functions and classes (run later, if ever) are left out; those at module level, including under if/try (but not `if TYPE_CHECKING:`), count."""
    tree = ast.parse(path.read_text(), filename=str(path))
    if import_time_only:
        nodes, todo = [], list(tree.body)
        while todo:
            node = todo.pop()
            nodes.append(node)
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                todo.extend(node.orelse)  # annotations only: never runs
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                todo.extend(ast.iter_child_nodes(node))
    else:
        nodes = list(ast.walk(tree))
    found: dict[str, int] = {}
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod.
            names = [f"{node.module}.{a.name}" for a in node.names]
            targets = [n if n in MODULES else node.module for n in names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            if t == PREFIX or t.startswith(PREFIX + "."):
                found.setdefault(t, node.lineno)
    return found


def in_package(module: str, *packages: str) -> bool:
    return any(module == f"{PREFIX}.{p}" or module.startswith(f"{PREFIX}.{p}.") for p in packages)


def test_the_modules_were_found():
    assert {f"{PREFIX}.contracts", f"{PREFIX}.core.engine", f"{PREFIX}.execution.runner"} <= MODULES.keys()


def test_contracts_import_no_engine_module():
    assert imports(MODULES[f"{PREFIX}.contracts"], import_time_only=False) == {}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if in_package(m, "execution", "distributed")))
def test_execution_never_imports_core(module):
    """core/ drives execution/ (LLMEngine owns its executor); the other way round would close a cycle. What both
    sides need lives in shoal.engine.contracts."""
    back = {t: line for t, line in imports(MODULES[module], import_time_only=False).items() if in_package(t, "core")}
    assert not back, f"{module} imports the engine loop: " + ", ".join(f"{t} (line {n})" for t, n in back.items())


def test_no_import_cycle_at_import_time():
    graph = {m: [t for t in imports(p, import_time_only=True) if t in MODULES] for m, p in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)
