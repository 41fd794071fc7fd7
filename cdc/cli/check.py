"""``cdc check [--json] [--fix]``: preflight of the source (see :mod:`cdc.preflight`); ``--fix``
creates the watermark table of chunked snapshots (``docs/snapshots.md``).

Text: one line per check, ``OK|WARN|ERROR check: message — fix: ...``. ``--json``:
``{"ok", "exit_code", "findings": [{check, severity, message, fix, values}], "checked": [...], "skipped": {...}}``.
Exit code: 0 clean, 1 warnings only, 2 errors. A check that cannot run at all (no connection, a
failed query) is an error of the command, not a finding.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import psycopg

from cdc.cli.output import print_json
from cdc.config import Settings
from cdc.connect import classify, connect
from cdc.preflight import Finding, Report, run_preflight
from cdc.registry import Registry, TableReg
from snapshot.chunked import SnapshotOptions, check_watermark_table, ensure_watermark_table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc check`` to the ``cdc`` parser."""
    check = sub.add_parser("check", help="check that the source is ready for capture")
    check.add_argument("--json", action="store_true", help="print the findings as JSON")
    check.add_argument("--fix", action="store_true", help="create the watermark table of chunked snapshots")
    check.set_defaults(handler=run_check)


def _registered(settings: Settings) -> list[TableReg]:
    if not (settings.state_dir / "registry.db").exists():
        return []
    with Registry(settings.state_dir) as registry:
        return registry.list_tables()


def run_check(args: argparse.Namespace, settings: Settings) -> int:
    regs = _registered(settings)
    dsn = settings.require_source()
    with connect(dsn, application_name="cdc check") as conn:
        try:
            if args.fix and ensure_watermark_table(conn, *SnapshotOptions.from_settings(settings).watermark):
                print("created the watermark table", file=sys.stderr)
            report = _with_watermark(run_preflight(conn, settings.slot_name, regs), conn, settings)
        except psycopg.Error as exc:
            raise classify(exc, dsn) from None
    if args.json:
        print_json(report.to_dict())
    else:
        print_report(report)
    return report.exit_code


def _with_watermark(report: Report, conn: psycopg.Connection[Any], settings: Settings) -> Report:
    """The report with the watermark table's check (see :func:`snapshot.chunked.check_watermark_table`)."""
    found = check_watermark_table(conn, *SnapshotOptions.from_settings(settings).watermark)
    findings = report.findings
    if found is not None:
        severity, message, fix = found
        findings = (*findings, Finding("watermark_table", severity, message, fix))  # type: ignore[arg-type]
    return Report(findings, (*report.checked, "watermark_table"), report.skipped)


def print_report(report: Report) -> None:
    for name in report.checked:
        found = [f for f in report.findings if f.check == name]
        if not found:
            print(f"OK    {name}")
        for f in found:
            print(f"{'ERROR' if f.severity == 'error' else 'WARN ':5} {name}: {f.message} — fix: {f.fix}")
    for name, why in report.skipped.items():
        print(f"SKIP  {name}: {why}")
    errors, warnings = len(report.errors), len(report.warnings)
    verdict = (
        "ready" if not errors and not warnings else "ready, with warnings" if not errors else "NOT ready"
    )
    print(f"{verdict}: {errors} error(s), {warnings} warning(s), {len(report.checked)} check(s) run")
