"""The two halves' import boundaries, read with ast (nothing is imported), function-local imports counted (they
run when the function does; only `if TYPE_CHECKING:` blocks, which never run, are left out):

* the fleet half (shoal.operator: the operator, the gateway, the pods' helpers) imports no torch and no engine module
  but the option declarations its CRD derives from (OPTION_MODULES), and nothing third-party that the operator
  image (Dockerfile.operator) does not pin;
* the option declarations import only each other, pydantic and the standard library (so no torch);
* the engine imports nothing of the fleet half;
* no import cycle among the fleet half's modules; the engine's known cycles (KNOWN_ENGINE_CYCLES) may only shrink.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"shoal.engine": ROOT / "engine", "shoal.operator": ROOT / "operator"}
# The engine modules the fleet half may import: the option declarations (flags, EngineConfig) and the model
# registry's names (api.py lists the supported architectures). Their parent packages' __init__ run on import.
# ...and the API-key file format (engine/server/keys.py) that the engines and the gateways both read, so that a
# rotated Secret means the same to both
# ...and the prefix cache's block hashes (engine/kv_hash.py), which the gateway's precise-prefix routing recomputes
# ...and the stored responses' ids, owner header and Anthropic's error body (engine/server/gateway_contract.py),
# which the gateways route and answer by exactly as the engines issue and answer them
OPTION_MODULES = {"shoal.engine.flags", "shoal.engine.config", "shoal.engine.execution.models",
                  "shoal.engine.server.keys", "shoal.engine.kv_hash", "shoal.engine.server.gateway_contract"}
# Cycles the engine has today (function-local imports hide them from tests/engine/test_import_graph.py): none now.
# A cycle that is not a part of one of these fails; one that is gone must be removed here.
KNOWN_ENGINE_CYCLES: list[set[str]] = []
# import name -> distribution, where they differ (Dockerfile.operator pins distributions)
DISTRIBUTION = {"zmq": "pyzmq", "yaml": "pyyaml", "prometheus_client": "prometheus-client", "huggingface_hub": "huggingface-hub",
                "opentelemetry": "opentelemetry-sdk"}  # the tracing extra: the SDK and its OTLP exporter, pinned together


def module_name(prefix: str, folder: Path, path: Path) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([prefix, *parts])


MODULES = {module_name(prefix, folder, p): p for prefix, folder in PACKAGES.items() for p in folder.rglob("*.py")}


def imports(module: str) -> dict[str, int]:
    """Everything `module` imports, anywhere in it but `if TYPE_CHECKING:` -> the first line that does. A name
    imported from a package is the submodule when there is one (`from shoal.operator import api`)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    never = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
             and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
             for stmt in node.body for n in ast.walk(stmt)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        if id(node) in never:
            continue
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.setdefault(name if name in MODULES else base, node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                found.setdefault(alias.name, node.lineno)
    return found


def fleet(module: str) -> bool:
    return module == "shoal.operator" or module.startswith("shoal.operator.")


def engine(module: str) -> bool:
    return module == "shoal.engine" or module.startswith("shoal.engine.")


def top(name: str) -> str:
    return name.split(".")[0]


def operator_image_pins() -> set[str]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile.operator").read_text())
    return {token.split("==")[0].lower().replace("_", "-") for line in text.splitlines()
            if line.strip().startswith("RUN") and "pip install" in line for token in line.split() if "==" in token}


def test_the_modules_were_found():
    assert {"shoal.operator.handlers", "shoal.operator.gateway.proxy", "shoal.operator.podtools.download",
            "shoal.operator.k8s.client", "shoal.engine.core.engine"} <= MODULES.keys()
    assert OPTION_MODULES <= MODULES.keys()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if fleet(m)))
def test_the_fleet_half_imports_no_engine_and_only_what_its_image_has(module):
    pins = operator_image_pins()
    bad = []
    for name, line in imports(module).items():
        if engine(name) and name not in OPTION_MODULES and name != "shoal.engine":
            bad.append(f"{name} (line {line}): engine code")
        elif top(name) not in sys.stdlib_module_names and top(name) != "shoal" \
                and DISTRIBUTION.get(top(name), top(name)).lower().replace("_", "-") not in pins:
            bad.append(f"{name} (line {line}): not in the operator image (Dockerfile.operator)")
    assert not bad, f"{module} imports " + "; ".join(bad)


def test_the_fleet_half_imports_the_engine_package_for_nothing_else():
    """`from shoal.engine import X` reaches the package's lazy attributes (LLM, ... : torch): only submodules that are
    option declarations may be named."""
    for module in (m for m in MODULES if fleet(m)):
        for name, line in imports(module).items():
            assert name != "shoal.engine", f"{module} line {line} imports from the engine package itself"


@pytest.mark.parametrize("module", sorted(OPTION_MODULES))
def test_the_option_declarations_import_no_torch(module):
    allowed = OPTION_MODULES | {"shoal.engine", "shoal.engine.execution", "shoal.engine.server"}
    for name, line in imports(module).items():
        assert (top(name) in sys.stdlib_module_names or top(name) == "pydantic" or name in allowed), \
            f"{module} line {line} imports {name}: the operator image has only the option declarations"
    # parents run at import time (module level only): they must be as light
    parts = module.split(".")
    for i in range(2, len(parts)):
        parent = ".".join(parts[:i])
        tree = ast.parse(MODULES[parent].read_text())
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert all(top(n) in sys.stdlib_module_names for n in names), \
                    f"{parent} (run when {module} is imported) imports {names} at import time"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if engine(m)))
def test_the_engine_imports_nothing_of_the_fleet_half(module):
    back = {n: line for n, line in imports(module).items() if fleet(n)}
    assert not back, f"{module} imports the fleet half: " + ", ".join(f"{n} (line {l})" for n, l in back.items())


def cycles() -> list[set[str]]:
    """The strongly connected components (more than one module) of the import graph of both halves."""
    graph = {m: [t for t in imports(m) if t in MODULES and t != m] for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(MODULES)))
    try:
        for m in sorted(graph):
            if m not in index:
                visit(m)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_cycles_function_local_imports_counted():
    found = cycles()
    new = [sorted(c) for c in found if not any(c <= known for known in KNOWN_ENGINE_CYCLES)]
    assert not new, f"import cycles: {new}"
    gone = [sorted(k) for k in KNOWN_ENGINE_CYCLES if not any(c & k for c in found)]
    assert not gone, f"these cycles are gone: remove them from KNOWN_ENGINE_CYCLES: {gone}"


def test_every_fleet_module_imports_from_what_the_operator_image_carries(tmp_path):
    """The operator image's tree (operator/ and, of engine/, only image_packages.OPERATOR_ENGINE_FILES), with torch
    and transformers made unimportable: every module of the fleet half imports (the `__main__` ones apart, which run
    their command)."""
    import shutil
    import subprocess

    spec = importlib.util.spec_from_file_location("image_packages", ROOT / "operator" / "image_packages.py")
    image_packages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(image_packages)
    shutil.copytree(ROOT / "operator", tmp_path / "shoal" / "operator",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in image_packages.OPERATOR_ENGINE_FILES:
        (tmp_path / "shoal" / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / "shoal" / f)
    modules = sorted(m for m in MODULES if fleet(m) and not m.endswith("__main__"))
    script = f"""
import importlib, importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "triton", "safetensors", "gguf", "numpy"):
            raise ImportError(f"{{name}} is not in the operator image")
# the tree above, not the editable install of the whole repository
sys.meta_path = [Missing()] + [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, {str(tmp_path)!r})
for m in {modules!r}:
    importlib.import_module(m)
import shoal.operator.api
assert shoal.operator.api.__file__.startswith({str(tmp_path)!r}), shoal.operator.api.__file__
print("ok", len({modules!r}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]
