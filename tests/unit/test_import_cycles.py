"""No import cycle between the project's modules, counting function-level imports.

The one checker is ``tools/check_cycles.py`` (``make lint``, beside import-linter's layer contract);
this runs it in the suite, and shows it finds a cycle that a function-level import hides.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import grimp

ROOT = Path(__file__).resolve().parents[2]


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_cycles", ROOT / "tools" / "check_cycles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_cycles", module)
    spec.loader.exec_module(module)
    return module


def test_the_checker_finds_a_cycle_through_a_function_level_import(tmp_path: Path, monkeypatch) -> None:
    pkg = tmp_path / "cyclepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import cyclepkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclepkg import a\n    return a\n")
    (pkg / "c.py").write_text("import cyclepkg.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyclepkg", include_external_packages=False, cache_dir=None)
    assert _checker().cycles(graph) == [["cyclepkg.a", "cyclepkg.b"]]


def test_no_import_cycle(capsys) -> None:
    assert _checker().main() == 0, capsys.readouterr().out
