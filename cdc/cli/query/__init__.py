"""``cdc sql`` and ``cdc search``: the analyst's commands.

* ``sql "SELECT ..." [--json | --csv]`` runs one DuckDB statement over the warehouse (see
  :mod:`cdc.cli.query.analytics`): ``schema.table`` is a table's current state, ``schema.table__history`` its
  history. Text: a table; ``--json``: a list of row objects (decimals as strings, timestamps ISO 8601,
  bytes hex); ``--csv``: a header line and the rows, same value formatting.
* ``search SCHEMA.TABLE|VIEW "query" [--limit N] [--json]`` ranks the table's documents (BM25, tantivy
  query syntax) and shows each hit's key, score and a snippet with the matches between ``**``
  markers (plain text, also in JSON). ``--json``: a list of ``{"key", "score", "snippet", "document"}``;
  ``key`` is the row's key as an object (``{"id": 7}``), a view's the key of its driving row.
"""

from __future__ import annotations

import argparse
import csv
import sys
from typing import TYPE_CHECKING, Any

import orjson

from cdc.cli import VERB_HELP
from cdc.cli.output import print_json, print_table
from cdc.config import Settings
from cdc.errors import ConfigError
from cdc.registry import Registry

if TYPE_CHECKING:
    import pyarrow as pa

# pyarrow, duckdb and deltalake (through cdc.cli.query.analytics) are imported inside the handlers: other
# verbs (``cdc run``) must not pay their import time and memory.


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc sql`` and ``cdc search`` to the ``cdc`` parser."""
    sql = sub.add_parser("sql", help=VERB_HELP["sql"])
    sql.add_argument("query", metavar="SQL", help='e.g. "SELECT * FROM public.orders LIMIT 10"')
    fmt = sql.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print a JSON list of row objects")
    fmt.add_argument("--csv", action="store_true", help="print CSV with a header line")
    sql.set_defaults(handler=run_sql)

    search = sub.add_parser("search", help=VERB_HELP["search"])
    search.add_argument("table", metavar="SCHEMA.TABLE|VIEW")
    search.add_argument(
        "query", metavar="QUERY", help='tantivy syntax: words, "a phrase", col:word, +must -not'
    )
    search.add_argument("--limit", type=int, default=10, help="at most N hits (default 10)")
    search.add_argument(
        "--json", action="store_true", help='a JSON list of {"key","score","snippet","document"}'
    )
    search.set_defaults(handler=run_search)


def _text(value: Any) -> str:
    from cdc.cli.query.analytics import jsonable

    v = jsonable(value)
    if isinstance(v, list | dict):
        return orjson.dumps(v).decode()
    return "" if v is None else str(v)


def _tuples(result: pa.Table) -> list[tuple[Any, ...]]:
    """Rows as tuples (keeps columns that share a name, unlike row dicts)."""
    return list(zip(*(col.to_pylist() for col in result.columns), strict=True))


def run_sql(args: argparse.Namespace, settings: Settings) -> int:
    from cdc.cli.query.analytics import Warehouse, rows_of
    from sinks.warehouse import WarehouseOptions

    with Registry(settings.state_dir) as registry:
        tables = registry.list_tables()
        views = registry.list_views()
    lease_s = WarehouseOptions.from_settings(settings).lease_max_age_s
    with Warehouse(settings.state_dir, tables, views, lease_max_age_s=lease_s) as wh:
        result = wh.query(args.query)
    if args.json:
        print_json(rows_of(result))
    elif args.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(result.column_names)
        for row in _tuples(result):
            writer.writerow([_text(v) for v in row])
    else:
        print_table(
            None,
            list(result.column_names),
            ([_text(v) for v in row] for row in _tuples(result)),
        )
        sys.stdout.write(f"({result.num_rows} row{'' if result.num_rows == 1 else 's'})\n")
    return 0


def run_search(args: argparse.Namespace, settings: Settings) -> int:
    from sinks.search import search

    if args.limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {args.limit}", fix="pass --limit 10")
    with Registry(settings.state_dir) as registry:
        view = next((v for v in registry.list_views() if v.name == args.table), None)
        reg = registry.find(args.table) if view is None else None
    if reg is not None:
        title, hits = reg.qualified, search(settings.state_dir, reg, args.query, limit=args.limit)
    else:  # a view from joins (cdc views add NAME --search COLS): keyed by its driving row's key
        from sinks.view_search import search_view

        assert view is not None
        title, hits = view.name, search_view(settings.state_dir, view, args.query, limit=args.limit)
    if args.json:
        print_json(
            [{"key": h.key, "score": h.score, "snippet": h.snippet, "document": h.document} for h in hits]
        )
        return 0
    print_table(
        f"{title}: {args.query}",
        ["key", "score", "snippet"],
        ([orjson.dumps(h.key).decode(), f"{h.score:.3f}", h.snippet.replace("\n", " ")] for h in hits),
    )
    sys.stdout.write(f"({len(hits)} hit{'' if len(hits) == 1 else 's'})\n")
    return 0
