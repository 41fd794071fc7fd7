"""Printing for people (rich tables) and for scripts (JSON lines or one JSON document)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from cdc.errors import CdcError

_OPTS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def json_dumps(value: Any, *, pretty: bool = False) -> str:
    opts = _OPTS | (orjson.OPT_INDENT_2 if pretty else 0)
    try:
        return orjson.dumps(value, default=str, option=opts).decode()
    except orjson.JSONEncodeError:  # e.g. a str with lone surrogates (a non-UTF-8 argument)
        return json.dumps(value, default=str, indent=2 if pretty else None)


def print_json(value: Any) -> None:
    sys.stdout.write(json_dumps(value) + "\n")


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
    """A table for people. Every title, header and cell is shown as the literal text it is: user data
    such as ``[/x]`` or ``[bold]`` is never read as Rich markup (so it can neither raise
    ``MarkupError`` nor restyle the output). Callers pass plain strings, not escaped ones. Rich is
    imported here: most runs of a verb print JSON or no table, and rich costs ~0.1 s to import."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=None if title is None else Text(title), show_lines=False)
    for col in columns:
        table.add_column(Text(str(col)), overflow="fold")
    for row in rows:
        table.add_row(*(Text("" if v is None else str(v)) for v in row))
    # not a terminal (a pipe, a log file): don't wrap at rich's default 80 columns
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def print_error(err: CdcError, *, as_json: bool) -> None:
    if as_json:
        sys.stderr.write(json_dumps(err.to_dict()) + "\n")
        return
    sys.stderr.write(f"error: {err.message}\n")
    if err.fix:
        sys.stderr.write(f"  fix: {err.fix}\n")
