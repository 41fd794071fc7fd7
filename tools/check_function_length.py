"""Fail when a function is over 100 lines (``make lint``; the developers' guide's rule).

A function's length runs from its ``def`` line to its last line, as ``ast`` reports them, so a
nested function counts inside its parent and on its own. Every function over the limit is listed.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cdc", "snapshot", "sinks", "spark_jobs", "bench", "tests")
LIMIT = 100

Function = ast.FunctionDef | ast.AsyncFunctionDef


def functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, Function]]:
    """Every function of a module with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def long_functions(root: Path = ROOT, limit: int = LIMIT) -> dict[str, int]:
    """``path::name`` -> length of every function over ``limit`` lines under the checked packages."""
    found: dict[str, int] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for name, node in functions(tree):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > limit:
                    found[f"{path.relative_to(root).as_posix()}::{name}"] = length
    return found


def main() -> int:
    found = long_functions()
    for name in sorted(found):
        print(f"error: {name} has {found[name]} lines; split it (at most {LIMIT})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
