"""``cdc rebuild SCHEMA.TABLE|VIEW [--yes] [--json] [--wait SECONDS]``: build a derived table (or
view) again into a staged copy, verify it against the source, and swap it in only if it is equal.

The swap replaces live data: it is asked for on the terminal once the copy verified, unless
``--yes`` (without a terminal, ``--yes`` is required). Exit codes: 0 rebuilt (swapped in); 1 the
copy differs from the source, or the swap was declined (the live data stays, the copy is kept for
inspection); 2 a table's copy verified but ``cdc apply`` held its lock at the swap (the copy is
kept and the next rebuild resumes it), or refused before any work (a view while ``cdc apply``
runs, another rebuild of the same name, no ``--yes`` without a terminal); 3 the pipeline had not
caught up with the source within ``--wait`` (nothing swapped). See :mod:`cdc.cli.rebuild.staged`.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from cdc.cli import VERB_HELP
from cdc.cli.output import print_json, print_table
from cdc.config import Settings
from cdc.errors import ConfigError

if TYPE_CHECKING:
    from cdc.cli.rebuild.staged import RebuildReport


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's verbs to the `cdc` parser."""
    p = sub.add_parser("rebuild", help=VERB_HELP["rebuild"])
    p.add_argument("name", metavar="SCHEMA.TABLE|VIEW", help="a registered table or view")
    p.add_argument(
        "--wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="how long to wait for the capture to reach the source's point when the copy differs (default 60)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=20,
        metavar="N",
        help="list at most N differing keys per kind (default 20)",
    )
    p.add_argument("--yes", action="store_true", help="swap the verified copy in without asking")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(handler=handle)


def _progress(line: str) -> None:
    sys.stderr.write(f"cdc rebuild: {line}\n")
    sys.stderr.flush()


def _ask(report: RebuildReport) -> bool:
    """On the terminal: swap the verified copy in?"""
    sys.stderr.write(
        f"cdc rebuild: the copy of {report.name} ({report.rows} rows) equals the source. "
        "Swap it in for the live one? [y/N] "
    )
    sys.stderr.flush()
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def handle(args: argparse.Namespace, settings: Settings) -> int:
    from cdc.cli.rebuild.staged import rebuild

    if args.wait < 0 or args.limit < 0:
        raise ConfigError("--wait and --limit must not be negative", fix="e.g. --wait 60 --limit 20")
    if not args.yes and not sys.stdin.isatty():
        raise ConfigError(
            "cdc rebuild replaces live derived data and there is no terminal to ask before the swap",
            fix=f"run it on a terminal, or pass --yes (`cdc rebuild {args.name} --yes`)",
        )
    report = rebuild(
        settings,
        args.name,
        wait_s=float(args.wait),
        limit=int(args.limit),
        progress=_progress,
        confirm=(lambda _report: True) if args.yes else _ask,
    )
    if args.json:
        print_json(report.to_dict())
        return report.exit_code
    verify = report.verify
    rows = [
        ["status", report.status],
        ["source rows", verify.get("source_rows", "-")],
        ["copy rows", report.rows],
        ["records replayed", report.records if report.kind == "table" else "-"],
        ["seconds", report.seconds],
    ]
    print_table(f"cdc rebuild {report.kind} {report.name}", ["", ""], rows)
    for live in report.swapped:
        print(f"swapped in: {live}")
    for view in report.views:
        print(f"view computed again from the rebuilt table: {view}")
    if report.replaced:
        print(f"the replaced data is kept in {report.replaced} until the next rebuild of {report.name}")
    if report.status != "rebuilt":
        print(f"NOT swapped: the live data is unchanged; the copy is kept in {report.stage}")
        for kind in ("missing", "extra", "different"):
            if verify.get(kind):
                print(f"{report.name}: {kind} in the copy: {verify[kind]}")
        for sink in ("search",):
            if isinstance(verify.get(sink), dict) and any(
                verify[sink].get(k) for k in ("missing", "extra", "different")
            ):
                print(f"{report.name}: {sink}: {verify[sink]}")
        if verify.get("lag"):
            print(f"{report.name}: not caught up: {verify['lag']}")
    for note in report.notes:
        print(f"note: {note}")
    return report.exit_code
