"""Largest source files and classes of the package (issue #29's limits: 600 lines a file,
400 a class). Run: ``.venv/bin/python benchmarks/code_size.py [--top N]``;
``--imports engine`` prints instead who imports whom inside that subpackage (the edges
drawn in docs/architecture.md; imports under ``if TYPE_CHECKING:`` are left out).

A class's length is its span in the file (``end_lineno - lineno + 1``, docstring and
comments included), measured with ``ast``; a file's is ``wc -l``'s line count.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "zeroshard"
FILE_LIMIT, CLASS_LIMIT = 600, 400


def measure(root: Path = ROOT) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, file) and (lines, file:Class) for every module under ``root``."""
    files, classes = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        rel = str(path.relative_to(root.parent))
        files.append((len(text.splitlines()), rel))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.name}"))
    return sorted(files, reverse=True), sorted(classes, reverse=True)


def import_edges(package: str, root: Path = ROOT) -> dict[str, list[str]]:
    """For each module of ``root/package``, the sibling modules it imports at run time."""
    folder = root / package
    names = {p.stem for p in folder.glob("*.py")}
    edges: dict[str, list[str]] = {}
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in typing_only \
                    and node.level == 1:
                mod = (node.module or "").split(".")[0]
                targets = [mod] if mod else [a.name for a in node.names]
                found |= {t for t in targets if t in names}
        edges[path.stem] = sorted(found - {path.stem})
    return edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--imports", metavar="SUBPACKAGE")
    args = parser.parse_args()
    if args.imports:
        edges = import_edges(args.imports)
        used_by = {m: sorted(k for k, v in edges.items() if m in v) for m in edges}
        for m, targets in edges.items():
            print(f"{m:14s} imports {', '.join(targets) or '-'}")
            print(f"{'':14s} used by {', '.join(used_by[m]) or '-'}")
        return
    files, classes = measure()
    for title, rows, limit in (("files", files, FILE_LIMIT), ("classes", classes, CLASS_LIMIT)):
        over = sum(n > limit for n, _ in rows)
        print(f"largest {title} (limit {limit}, over it: {over} of {len(rows)})")
        for n, name in rows[: args.top]:
            print(f"  {n:5d}  {name}")


if __name__ == "__main__":
    main()
