"""Table output shows user data literally: Rich markup in values is not interpreted (issue 9 item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc.cli import main
from cdc.cli.output import print_table
from cdc.registry import Registry, TableReg

HOSTILE = ["[/x]", "[bold]b[/bold]", "[link=http://x]y", "\\[/z]", "[/]"]


def test_print_table_prints_markup_literally(capsys: pytest.CaptureFixture[str]) -> None:
    print_table("[/title]", ["[/col]", "v"], [[h, h] for h in HOSTILE])
    out = capsys.readouterr().out
    assert "[/title]" in out and "[/col]" in out
    for h in HOSTILE:
        assert f"│ {h}" in out


def test_tables_list_with_markup_in_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Registry(tmp_path) as reg:
        reg.add(TableReg("[/x]", "[bold]t", "cdc.__x_._bold_t", ("[/k]",), search=("[/s]",)))
    assert main(["--state", str(tmp_path), "tables", "list"]) == 0
    out = capsys.readouterr().out
    assert "[/x]" in out and "[bold]t" in out and "[/k]" in out


def test_sql_value_with_markup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--state", str(tmp_path), "sql", "SELECT '[/x]' AS v, '[bold]b' AS \"[/h]\""]) == 0
    out = capsys.readouterr().out
    assert "[/x]" in out and "[/h]" in out
