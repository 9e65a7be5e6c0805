"""The package's import graph has no cycles (issue #17: ``cli`` <-> ``demo``/``train``/
``state.consolidate`` through ``UsageError`` and ``planner`` <-> ``recommend`` are gone).

Every ``import`` / ``from ... import`` in every module counts, including those inside
functions (lazy imports still tie modules together). ``from . import x`` is an edge to
the submodule ``x`` where one exists, else to the package. Imports under
``if TYPE_CHECKING:`` count like any other (issue #43: that is where cycles hid).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for f in (ROOT / "zeroshard").rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _edges(name: str, f: Path, mods: dict[str, Path]) -> set[str]:
    pkg = name if f.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    tree = ast.parse(f.read_text())
    # Imports under `if TYPE_CHECKING:` count too: a name needed only for annotations
    # still ties the two modules' designs together, and a cycle hidden there is one.
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & mods.keys()
            out |= subs or {target}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m in mods and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                found.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    mods = _modules()
    graph = {m: _edges(m, f, mods) for m, f in mods.items()}
    assert "zeroshard.memory.recommend" in graph["zeroshard.memory.planner"]  # it sees edges
    assert _cycles(graph) == []


def test_the_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
