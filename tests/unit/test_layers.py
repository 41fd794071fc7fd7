"""The tree's layers, file by file: ``tools/check_layers.py`` (``make lint``) run in the suite, and
shown to find what import-linter's contract would not name (a new module, a function-level import).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import grimp

ROOT = Path(__file__).resolve().parents[2]


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_layers", module)
    spec.loader.exec_module(module)
    return module


def _graph(imports: dict[str, list[str]]) -> grimp.ImportGraph:
    graph = grimp.ImportGraph()
    for importer, imported in imports.items():
        graph.add_module(importer)
        for other in imported:
            graph.add_import(importer=importer, imported=other, line_number=3, line_contents="import x")
    return graph


def test_the_checker_finds_each_kind_of_problem() -> None:
    graph = _graph(
        {
            "cdc.cli.verify.compare": ["sinks.all", "spark_jobs.applier", "snapshot.exported"],
            "cdc.reader": ["snapshot.exported"],
            "cdc.events": ["sinks.all"],
            "cdc.catalog": ["snapshot.exported"],
            "cdc.newthing": [],
        }
    )
    found = _checker().problems(graph, ["cdc.cli", "cdc.reader", "cdc.events", "cdc.catalog"])
    assert len(found) == 3, found
    assert found[0].startswith("cdc.catalog imports snapshot.exported (line 3)")
    assert found[1].startswith("cdc.events imports sinks.all (line 3)")
    assert found[2].startswith("cdc.newthing is in no layer")


def test_the_tree_keeps_its_layers(capsys) -> None:
    assert _checker().main() == 0, capsys.readouterr().out
