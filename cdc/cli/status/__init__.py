"""``cdc status [--json] [--watch [SECONDS]]``: every stage's lag and verdict, for on-call.

Exit code: 0 when every stage is OK, 1 when the worst is a warning, 2 when one is critical
(STALLED, STOPPED, ERROR, or a threshold's critical level). ``--json`` prints the report whose
schema ``docs/status.md`` documents. ``--watch`` redraws the text view in place every SECONDS
(default 2) until Ctrl-C, and exits with the last report's code. Needs no running process.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from cdc.cli import VERB_HELP
from cdc.cli.output import print_json
from cdc.config import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc status`` to the ``cdc`` parser."""
    p = sub.add_parser("status", help=VERB_HELP["status"])
    p.add_argument("--json", action="store_true", help="the report as JSON (schema: docs/status.md)")
    p.add_argument(
        "--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS", help="refresh in place"
    )
    p.set_defaults(handler=run_status)


def _age(ms: int | None, now: int) -> str:
    if not ms:
        return "-"
    s = (now - ms) / 1000
    return f"{s:.0f} s ago" if s < 120 else f"{s / 60:.0f} min ago"


def _lag(stage: dict[str, Any]) -> str:
    parts = []
    if stage.get("lag_bytes") is not None:
        parts.append(f"{stage['lag_bytes']:,} B")
    if stage.get("lag_offsets") is not None:
        parts.append(f"{stage['lag_offsets']:,} offsets")
    if stage.get("retained_wal_bytes") is not None:
        parts.append(f"retained {stage['retained_wal_bytes']:,} B")
    if stage.get("decoder"):
        parts.append(f"decoder {stage['decoder']}")
    if stage.get("lag_seconds") is not None:
        parts.append(f"{stage['lag_seconds']:.1f} s")
    return ", ".join(parts) or "-"


def render(report: dict[str, Any]) -> str:
    """The report for people (plain text, one line per stage, then what to do)."""
    now = int(report["generated_ms"])
    lines = [
        f"cdc status: {report['verdict']} ({report['severity']})   source {report['source']['dsn']}"
        + ("" if report["source"]["reachable"] else f" UNREACHABLE: {report['source']['error']}"),
        "",
        f"{'STAGE':44} {'VERDICT':9} {'LAG':40} REASON",
    ]
    for st in report["stages"]:
        verdict = st["verdict"] + ("!" if st["severity"] == "critical" and st["verdict"] == "WARN" else "")
        lines.append(f"{st['name'][:44]:44} {verdict:9} {_lag(st)[:40]:40} {st['reason']}")
    lines.append("")
    for role, proc in report["processes"].items():
        state = "running" if proc["running"] else "not running"
        extra = (
            f", pid {proc.get('pid')} on {proc.get('host')}, heartbeat {_age(proc.get('heartbeat_ms'), now)}"
        )
        lines.append(f"{role:8} {state}{extra if proc.get('published') else ' (never published)'}")
        if proc.get("last_error"):
            err = proc["last_error"]
            lines.append(
                f"         last error {_age(err.get('at_ms'), now)}: {err.get('type')}: {err.get('message')}"
            )
    dead = report["dead_letters"]
    lines.append(f"dead letters: {dead['total']} total, {dead['recent']} in the last {dead['window_s']:g} s")
    for table in report["tables"]:
        clean = table.get("last_verified_clean")
        when = _age(int(clean["at"] * 1000), now) if clean else "never"
        how = f" ({clean['mode']}, at {clean['lsn']})" if clean else ""
        lines.append(f"verified clean {table['table']}: {when}{how}")
    for snap in report["snapshots"]:
        lines.append(
            f"snapshot {snap['table']}: {snap['state']} ({snap['topic_records'] or 0} records in its topic)"
        )
    if report.get("slot_drop"):
        d = report["slot_drop"]
        lines.append(
            f"slot {d['slot']} dropped at {d['at']}: {d['reason']}; tables marked: {', '.join(d['tables'])}"
        )
    fixes = [(st["name"], st["fix"]) for st in report["stages"] if st.get("fix")]
    if fixes:
        lines.append("")
        lines.append("what to do:")
        lines.extend(f"  {name}: {fix}" for name, fix in fixes)
    return "\n".join(lines)


def run_status(args: argparse.Namespace, settings: Settings) -> int:
    from cdc.cli.status.gather import collect
    from cdc.cli.status.options import StatusOptions

    options = StatusOptions.from_settings(settings)
    if args.watch is None:
        report = collect(settings, options)
        if args.json:
            print_json(report)
        else:
            print(render(report))
        return int(report["exit_code"])
    code = 0
    try:
        while True:
            report = collect(settings, options)
            code = int(report["exit_code"])
            if args.json:
                print_json(report)
            else:
                sys.stdout.write("\x1b[H\x1b[2J" + render(report) + "\n")
            sys.stdout.flush()
            time.sleep(max(0.2, float(args.watch)))
    except KeyboardInterrupt:
        return code
