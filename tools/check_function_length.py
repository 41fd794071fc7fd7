"""Fail when a function is over 100 lines (``make lint``; the developers' guide's rule).

A function's length runs from its ``def`` line to its last line, as ``ast`` reports them, so a
nested function counts inside its parent and on its own. Every function over the limit is listed.

``tools/long_functions.txt`` is the allow-list of functions still being split (one
``path::qualified.name`` a line, ``#`` comments allowed): those are reported as warnings and do not
fail the check. A listed function that is no longer over the limit (or no longer exists) is
reported too, so that its line can be removed. Once the list is empty, every long function fails.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cdc", "snapshot", "sinks", "spark_jobs", "bench", "tests")
LIMIT = 100
ALLOW_LIST = ROOT / "tools" / "long_functions.txt"

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


def allowed(path: Path = ALLOW_LIST) -> set[str]:
    """The allow-list's entries, without blank lines and comments."""
    if not path.is_file():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines())
    return {line for line in lines if line}


def main() -> int:
    found = long_functions()
    allow = allowed()
    failing = {name: n for name, n in found.items() if name not in allow}
    for name in sorted(found.keys() & allow):
        print(f"warning: {name} has {found[name]} lines (allow-listed in {ALLOW_LIST.name})")
    for name in sorted(allow - found.keys()):
        print(f"note: {name} is no longer over {LIMIT} lines; remove it from {ALLOW_LIST.name}")
    for name in sorted(failing):
        print(f"error: {name} has {failing[name]} lines; split it (at most {LIMIT})")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
