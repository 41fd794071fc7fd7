"""``cdc verify [SCHEMA.TABLE] [--json] [--wait SECONDS]``: are the derived tables equal to the source?

Exit codes: 0 every table equal; 1 a difference (missing / extra / different rows, or search
documents); 3 the pipeline had not caught up with the source's consistent point within ``--wait``
(nothing can be concluded; run the pipeline, then verify again). See :mod:`cdc.verify` for how.
"""

from __future__ import annotations

import argparse
from typing import Any

from cdc.cli.output import print_json, print_table
from cdc.config import Settings
from cdc.errors import ConfigError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's verbs to the `cdc` parser."""
    p = sub.add_parser("verify", help="compare source tables with the warehouse and the search index")
    p.add_argument("table", nargs="?", help="SCHEMA.TABLE (default: every registered table)")
    p.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the pipeline to catch up with the source (default 60)",
    )
    p.add_argument(
        "--limit", type=int, default=20, metavar="N", help="list at most N keys per kind (default 20)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per table (a list)")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace, settings: Settings) -> int:
    from cdc.verify import Verifier, select_tables

    if args.wait < 0 or args.limit < 0:
        raise ConfigError("--wait and --limit must not be negative", fix="e.g. --wait 60 --limit 20")
    tables = select_tables(settings, args.table)
    if not tables:
        raise ConfigError("no table is registered", fix="register one with `cdc tables add SCHEMA.TABLE`")
    reports = Verifier(settings, wait_s=float(args.wait), limit=int(args.limit)).verify(tables)
    if args.json:
        print_json([r.to_dict() for r in reports])
    else:
        rows: list[list[Any]] = []
        for r in reports:
            rows.append(
                [
                    r.table,
                    r.status,
                    r.source_rows,
                    r.warehouse_rows,
                    "-" if r.search_docs is None else r.search_docs,
                    r.missing_count,
                    r.extra_count,
                    r.different_count,
                    r.search_missing_count + r.search_extra_count + r.search_different_count,
                ]
            )
        print_table(
            "cdc verify",
            [
                "table",
                "status",
                "source",
                "warehouse",
                "search",
                "missing",
                "extra",
                "different",
                "search diff",
            ],
            rows,
        )
        for r in reports:
            if not r.caught_up:
                print(f"{r.table}: not caught up with the source at {r.consistent_lsn}: {r.lag}")
            for kind, keys in (
                ("missing", r.missing),
                ("extra", r.extra),
                ("different", r.different),
                ("missing from search", r.search_missing),
                ("extra in search", r.search_extra),
                ("different in search", r.search_different),
            ):
                if keys:
                    print(f"{r.table}: {kind}: {keys}")
    if any(not r.caught_up for r in reports):
        return 3
    return 0 if all(r.equal for r in reports) else 1
