"""``cdc wait --lsn LSN [--table T ...] [--timeout S] [--json]``: read-your-writes.

Returns (exit 0) as soon as every named derived table -- a registered table or a view from joins
(default: every registered table and view) -- has applied every change up to commit LSN ``LSN`` in
the warehouse and, where it has one, the search index (a view: every table it reads has, and the
view shows it): take ``SELECT pg_current_wal_lsn()`` after the commit, then ``cdc wait --lsn`` it,
then read. Exit 3 when ``--timeout`` (default 30 s) passes first, saying how far behind each table
is; 2 for a bad LSN or timeout; 1 for a name that is neither a registered table nor a view, or a
source that cannot be reached. How it knows, exactly: :mod:`cdc.cli.wait.lsn`; the pattern and the JSON:
``docs/wait.md``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cdc.cli import VERB_HELP
from cdc.cli.output import print_json
from cdc.config import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc wait`` to the ``cdc`` parser."""
    p = sub.add_parser("wait", help=VERB_HELP["wait"])
    p.add_argument("--lsn", required=True, help="commit LSN as pg_lsn text, e.g. 0/16B3748")
    p.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="TABLE",
        help="a registered table (schema.table) or view; repeat for several (default: every registered "
        "table and view)",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait at most (default 30)")
    p.add_argument("--json", action="store_true", help="the result as JSON")
    p.set_defaults(handler=run_wait)


def render(result: dict[str, Any]) -> str:
    """The result for people: one line, or on timeout one line per table behind."""
    if result["caught_up"]:
        names = ", ".join(t["table"] for t in result["tables"])
        return f"caught up to {result['lsn']} in {result['elapsed_s']:.3f} s: {names}\n"
    lines = [f"NOT caught up to {result['lsn']} after {result['elapsed_s']:.1f} s"]
    cap = result["capture"]
    if not cap["passed"]:
        lines.append(
            f"  capture: slot {cap['slot']} confirmed {cap['confirmed_lsn']}, {cap['behind_bytes']:,} bytes "
            f"behind{'' if cap['active'] else ' (reader not running: `cdc run`)'}"
        )
    for t in result["tables"]:
        if t["caught_up"]:
            lines.append(f"  {t['table']}: caught up")
        elif t.get("error"):
            lines.append(f"  {t['table']}: {t['error']}")
        elif t.get("kind") == "view":
            lines.append(f"  {t['table']} (view of {', '.join(t['reads'])}): waiting for its tables")
        elif t["lag_offsets"] is None:
            lines.append(f"  {t['table']}: waiting for capture")
        else:
            lines.append(f"  {t['table']} ({' + '.join(t['sinks'])}): {_behind(t)}")
    if cap["passed"] and any(not t["caught_up"] for t in result["tables"]):
        lines.append("  is `cdc apply` running? `cdc status` shows each stage")
    return "\n".join(lines) + "\n"


def _behind(table: dict[str, Any]) -> str:
    """How far behind a table is, in words: the changes to apply, the oldest, the partitions."""
    text = f"{table['lag_offsets']} change(s) to apply"
    if table.get("pending_lsn"):
        text += f", the oldest at {table['pending_lsn']} ({table['behind_bytes']:,} bytes before the target)"
    where = ", ".join(
        f"p{p} {v['applied']}/{v['target']}"
        for p, v in table["partitions"].items()
        if v["applied"] < v["target"]
    )
    return f"{text}; applied/target offsets {where}"


def run_wait(args: argparse.Namespace, settings: Settings) -> int:
    from cdc.cli.wait.lsn import parse_lsn, parse_timeout, resolve, wait_for_lsn

    lsn = parse_lsn(args.lsn)
    timeout = parse_timeout(args.timeout)
    targets = resolve(settings.state_dir, args.table)
    result = wait_for_lsn(settings, lsn, targets.tables, timeout, views=targets.views)
    if args.json:
        print_json(result.to_dict())
    else:
        out = sys.stdout if result.caught_up else sys.stderr
        out.write(render(result.to_dict()))
    return result.exit_code
