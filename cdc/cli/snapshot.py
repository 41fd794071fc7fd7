"""``cdc snapshot SCHEMA.TABLE ... [--where "..."] | --all [--json]``: request a (re-)snapshot.

The table's state becomes ``pending`` and the registry generation is bumped; a running ``cdc run``
picks the request up within a second (otherwise the next one does) and snapshots the table in
chunks while every table keeps streaming (``docs/snapshots.md``). ``--where`` restricts the
snapshot to the rows matching a restricted filter (column, operator, literal; see
:mod:`snapshot.where`), parsed and checked against the table's columns here, so a bad filter is
refused before anything is recorded. ``--json`` prints ``{"requested": [names], "where": text|null}``.
"""

from __future__ import annotations

import argparse

import orjson

from cdc.cli import VERB_HELP
from cdc.cli.output import print_json
from cdc.config import Settings
from cdc.errors import ConfigError
from cdc.registry import Registry, TableState
from snapshot.where import parse_where


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc snapshot`` to the ``cdc`` parser."""
    snap = sub.add_parser("snapshot", help=VERB_HELP["snapshot"])
    snap.add_argument("tables", nargs="*", metavar="SCHEMA.TABLE")
    snap.add_argument("--all", action="store_true", help="every registered table")
    snap.add_argument(
        "--where",
        metavar="FILTER",
        help="only rows matching COLUMN OP VALUE [AND ...] (OP: = <> != < <= > >=; VALUE: number, "
        "'string', true, false; or COLUMN IS [NOT] NULL)",
    )
    snap.add_argument("--json", action="store_true")
    snap.set_defaults(handler=request_snapshot)


def request_snapshot(args: argparse.Namespace, settings: Settings) -> int:
    if bool(args.all) == bool(args.tables):
        raise ConfigError(
            "name the tables to re-snapshot, or pass --all (not both)",
            fix="e.g. `cdc snapshot public.orders` or `cdc snapshot --all`",
        )
    if args.where is not None and len(args.tables) != 1:
        raise ConfigError(
            "--where applies to one table",
            fix='name exactly one table: `cdc snapshot public.orders --where "id > 100"`',
        )
    with Registry(settings.state_dir) as registry:
        regs = registry.list_tables() if args.all else [registry.find(name) for name in args.tables]
        for reg in regs:
            if args.where is not None:
                parse_where(args.where, [c.name for c in reg.columns])  # refuse a bad filter now
                where = orjson.dumps({"where": args.where}).decode()
                registry.set_table_state(TableState.SNAPSHOT_REQUEST, reg.schema, reg.table, where)
            else:
                registry.set_table_state(TableState.SNAPSHOT_REQUEST, reg.schema, reg.table, None)
            registry.set_snapshot_state(reg.schema, reg.table, "pending")
    names = [r.qualified for r in regs]
    if args.json:
        print_json({"requested": names, "where": args.where})
    else:
        for name in names:
            what = f" (rows where {args.where})" if args.where else ""
            print(f"re-snapshot requested: {name}{what} (a running `cdc run` picks it up, else the next one)")
    return 0
