"""Fail when a file of ``cdc/`` outside the commands (``cdc/cli``) reaches up the layers (``make lint``).

The tree shows the layers (``docs/architecture.md``, "Layers"): the commands are ``cdc/cli``; apply is
``sinks/`` and ``spark_jobs/``; capture is ``cdc/reader`` (the only importer of ``snapshot/`` in
``cdc/``), ``snapshot/``, ``cdc/recorders``, ``cdc/preflight.py``, ``cdc/publication.py``; the rest of
``cdc/`` is the core. import-linter's contract (pyproject ``[tool.importlinter]``) checks the
modules it names; this check holds every file to the tree's picture, a new one included:

- outside ``cdc/cli``, no file of ``cdc/`` imports ``sinks`` or ``spark_jobs``;
- outside ``cdc/cli`` and ``cdc/reader``, no file of ``cdc/`` imports ``snapshot``;
- every module of ``cdc/`` outside ``cdc/cli`` is named in a layer of the first layers contract.

Imports inside functions count (grimp reads every import statement of a module).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

import grimp

COMMANDS = "cdc.cli"
#: a package outside cdc/, and the packages of cdc/ (besides the commands) that may import it
ONLY_FROM = {"sinks": (), "spark_jobs": (), "snapshot": ("cdc.reader",)}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layered(pyproject: Path) -> list[str]:
    """The modules the first layers contract names (parentheses and separators dropped)."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in config if c["type"] == "layers")["layers"]
    return [name for layer in layers for name in re.split(r"[\s:|()]+", layer) if name]


def problems(graph: grimp.ImportGraph, layered: list[str]) -> list[str]:
    found: list[str] = []
    for module in sorted(m for m in graph.modules if _within(m, "cdc") and not _within(m, COMMANDS)):
        if module != "cdc" and not any(_within(module, name) for name in layered):
            found.append(f"{module} is in no layer of [tool.importlinter]: add it to the one it belongs to")
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            for top, allowed in ONLY_FROM.items():
                if _within(imported, top) and not any(_within(module, a) for a in allowed):
                    lines = graph.get_import_details(importer=module, imported=imported)
                    where = ", ".join(str(d["line_number"]) for d in lines)
                    found.append(
                        f"{module} imports {imported} (line {where}): only {COMMANDS}"
                        + "".join(f" and {a}" for a in allowed)
                        + f" may import {top}; move the code that needs it into {COMMANDS}"
                    )
    return found


def main() -> int:
    graph = grimp.build_graph("cdc", "sinks", "snapshot", "spark_jobs", include_external_packages=False)
    found = problems(graph, _layered(Path(__file__).resolve().parent.parent / "pyproject.toml"))
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} file(s) of cdc/ out of their layer (see docs/architecture.md, 'Layers')")
        return 1
    print(f"cdc/ outside {COMMANDS}: 0 imports of sinks/spark_jobs, snapshot imported by cdc.reader only")
    return 0


if __name__ == "__main__":
    sys.exit(main())
