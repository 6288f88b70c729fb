"""The house, drawn from the code (docs/architecture.md): imports go down the floors, never in a
circle. Read with ``ast`` from the source tree, nothing imported.

Floors: ``kernels/`` and ``kvpool/`` and ``shared/`` hold what services share; ``services/`` and
``bench/`` stand on them. No module of the lower floors imports ``services`` or ``bench``;
``shared/engine/`` does not import ``shared/transfer/`` (the ring's networking lives in
``shared/ring/``); and no module imports one that (through others) imports it back. Imports under
``if TYPE_CHECKING:`` are annotations only and do not count.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared", "kernels", "kvpool", "services", "bench", "tests")
LOWER = ("shared", "kernels", "kvpool")
UPPER = ("services", "bench")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return isinstance(t, ast.Name) and t.id == "TYPE_CHECKING" or \
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The first-party modules ``name`` imports (at any depth of its code, TYPE_CHECKING aside)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _type_checking(node)
            for child in node.body for n in ast.walk(child)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    out = set()
    for mod in found:
        while mod and mod not in modules:   # a name inside a module: the module
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            out.add(mod)
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _floor(mod: str) -> str:
    return mod.split(".")[0]


def test_no_import_climbs_a_floor():
    climbs = sorted(f"{m} -> {d}" for m, deps in _graph().items() if _floor(m) in LOWER
                    for d in deps if _floor(d) in UPPER)
    assert climbs == []


def test_the_engine_does_not_import_the_data_plane():
    found = sorted(f"{m} -> {d}" for m, deps in _graph().items() if m.startswith("shared.engine")
                   for d in deps if d.startswith("shared.transfer"))
    assert found == []


def test_no_import_cycle():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:   # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == []


def test_the_graph_sees_the_imports():
    """The walk finds what is there (a check on the checks above)."""
    graph = _graph()
    assert "shared.ring.session" in graph["shared.ring.connector"]
    assert "shared.bus" in graph["services.worker"]
    assert "shared.schemas" in graph["services.gateway.nats_backend"]
