"""``tools/check_figures.py`` (``make lint``): a figure in the README or ``docs/`` names its bench.

It lists a paragraph's measurement-looking figures when the paragraph cites no bench, and leaves
settings, inputs and code alone; this holds it to both sides on small documents.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_figures", ROOT / "tools" / "check_figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("check_figures", module)
    spec.loader.exec_module(module)
    return module


def _found(tmp_path: Path, readme: str) -> list[tuple[str, int, list[str], str]]:
    (tmp_path / "docs" / "benchmarks").mkdir(parents=True)
    (tmp_path / "docs" / "benchmarks" / "rebuild.md").write_text("figures\n")
    (tmp_path / "README.md").write_text(readme)
    return _checker().uncited(tmp_path)


def test_an_uncited_measurement_is_listed_with_its_line(tmp_path: Path) -> None:
    found = _found(
        tmp_path, "# Title\n\nIntro.\n\nA table rebuilds in 8.2 s\nat 7,709 records/s, 0.92x the peer.\n"
    )
    assert [(number, hits) for _, number, hits, _ in found] == [
        (5, ["8.2 s"]),
        (6, ["7,709 records/s", "0.92x"]),
    ]


def test_a_paragraph_citing_a_bench_is_not_listed(tmp_path: Path) -> None:
    cited = "A table rebuilds in 8.2 s (`python -m bench rebuild`, 2026-11-26).\n\nIt took 3.8 s\n(`docs/benchmarks/rebuild.md`).\n"
    assert _found(tmp_path, cited) == []


def test_settings_inputs_code_and_zero_are_not_figures(tmp_path: Path) -> None:
    text = (
        "It checks every 2 s, with a timeout of 60 s, up to 10 MB (`retry_max_s`, 60 s by default).\n"
        "`window_s` (300 s) and `--wait 30s`; rows of ~9 KB, 9 KB records; 0 s when idle.\n\n"
        "```\ncdc verify   # took 4.2 s\n```\n\n"
        "| `lag_warn_s` | 60 s |\n\n"
        "500,000 records are 4.5 GB.<!-- figures: arithmetic, not a measurement -->\n"
    )
    assert _found(tmp_path, text) == []


def test_a_table_row_is_cited_by_the_paragraph_before_it_and_its_own_file_or_date(tmp_path: Path) -> None:
    text = (
        "Figures from `docs/benchmarks/`:\n\n"
        "| what | figure |\n| --- | --- |\n"
        "| rebuild (`rebuild.md`) | 8.2 s |\n| a run of 2026-11-26 | 5.1 s |\n| nothing named | 3.8 s |\n"
    )
    assert [(number, hits) for _, number, hits, _ in _found(tmp_path, text)] == [(7, ["3.8 s"])]
