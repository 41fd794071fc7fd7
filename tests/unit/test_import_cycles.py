"""No import cycle between the project's modules, counting function-level imports: the one checker,
``tools/check_cycles.py`` (``make lint``), run in the inner loop too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import grimp

ROOT = Path(__file__).resolve().parents[2]


def _checker() -> ModuleType:
    """``tools/check_cycles.py`` (a script, not a package)."""
    spec = importlib.util.spec_from_file_location("check_cycles", ROOT / "tools" / "check_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_cycles", module)
    spec.loader.exec_module(module)
    return module


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*_checker().PACKAGES, include_external_packages=False)


def test_the_graph_sees_function_level_imports() -> None:
    graph = _graph()
    assert graph.direct_import_exists(importer="cdc.names", imported="cdc.errors")
    assert graph.direct_import_exists(importer="cdc.catalog", imported="cdc.registry")


def test_no_import_cycle() -> None:
    assert _checker().cycles(_graph()) == []
