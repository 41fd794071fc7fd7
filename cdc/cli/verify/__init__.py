"""``cdc verify [SCHEMA.TABLE|VIEW] [--full] [--scrub N] [--json] [--wait SECONDS]``: are the
derived tables (and the views from joins, each against its SQL run on the source,
:mod:`cdc.cli.verify.views`) equal to the source?

After a clean run has recorded a table's key ranges, a run checks only the ranges with changes in
the topic since, plus a rotating sample of the others (``--scrub``); ``--full`` reads everything
and records fresh ranges (:mod:`cdc.cli.verify.ranges`).

Exit codes: 0 every table equal; 1 a difference (missing / extra / different rows, or search
documents); 3 the pipeline had not caught up with the source's consistent point within ``--wait``
(nothing can be concluded; run the pipeline, then verify again). See :mod:`cdc.cli.verify.compare` for how.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cdc.cli import VERB_HELP
from cdc.cli.output import print_json, print_table
from cdc.config import Settings
from cdc.errors import ConfigError

if TYPE_CHECKING:
    from cdc.cli.verify.compare import TableReport


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's verbs to the `cdc` parser."""
    p = sub.add_parser("verify", help=VERB_HELP["verify"])
    p.add_argument("table", nargs="?", help="SCHEMA.TABLE or VIEW (default: every registered table and view)")
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
    p.add_argument(
        "--full",
        action="store_true",
        help="read every row (default: only the key ranges changed since the last clean verify)",
    )
    p.add_argument(
        "--scrub",
        type=int,
        default=None,
        metavar="N",
        help="also re-check N unchanged ranges, in turn (default: 1%% of the table's ranges)",
    )
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace, settings: Settings) -> int:
    from cdc.cli.verify.compare import Verifier
    from cdc.cli.verify.views import subjects

    if args.wait < 0 or args.limit < 0 or (args.scrub is not None and args.scrub < 0):
        raise ConfigError(
            "--wait, --limit and --scrub must not be negative", fix="e.g. --wait 60 --limit 20 --scrub 10"
        )
    tables, views, skipped = subjects(settings.state_dir, args.table)
    if not tables and not views:
        raise ConfigError("no table is registered", fix="register one with `cdc tables add SCHEMA.TABLE`")
    for note in skipped:
        print(note, file=sys.stderr)
    verifier = Verifier(
        settings, wait_s=float(args.wait), limit=int(args.limit), full=bool(args.full), scrub=args.scrub
    )
    reports = verifier.verify(tables, views)
    if args.json:
        print_json([r.to_dict() for r in reports])
    else:
        _print_reports(reports)
    if any(not r.caught_up for r in reports):
        return 3
    return 0 if all(r.equal for r in reports) else 1


def _print_reports(reports: Sequence[TableReport]) -> None:
    """The text form: one line per table (the rows or documents each sink holds, the primary sink's
    differences, the others' totals), then the keys that differ."""
    if not reports:
        return
    names = list(reports[0].sinks)
    rows: list[list[Any]] = []
    for r in reports:
        primary = r.primary[1]
        rows.append(
            [r.table, r.status, r.source_rows]
            + ["-" if d.stored is None else d.stored for d in r.sinks.values()]
            + [primary.missing_count, primary.extra_count, primary.different_count]
            + [d.differences for _, d in r.others]
        )
    header = ["table", "status", "source", *names, "missing", "extra", "different"]
    print_table("cdc verify", header + [f"{n} diff" for n in names[1:]], rows)
    for r in reports:
        if r.mode == "incremental":
            scrubbed = sum(1 for c in r.checked if c["why"] == "scrub")
            print(
                f"{r.table}: incremental: checked {len(r.checked)} of {r.ranges} key ranges "
                f"({len(r.checked) - scrubbed} changed, {scrubbed} scrubbed; {r.changes_read} records read)"
            )
        elif r.fallback:
            count = r.ranges_checked
            print(f"{r.table}: full: checked all {count} key range{'' if count == 1 else 's'} ({r.fallback})")
        if not r.caught_up:
            print(f"{r.table}: not caught up with the source at {r.consistent_lsn}: {r.lag}")
        primary = r.primary[1]
        found = [("missing", primary.missing), ("extra", primary.extra), ("different", primary.different)]
        for n, d in r.others:
            found += [
                (f"missing from {n}", d.missing),
                (f"extra in {n}", d.extra),
                (f"different in {n}", d.different),
            ]
        for kind, keys in found:
            if keys:
                print(f"{r.table}: {kind}: {keys}")
