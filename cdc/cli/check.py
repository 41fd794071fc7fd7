"""``cdc check [--json]``: preflight of the source (see :mod:`cdc.preflight`).

Text: one line per check, ``OK|WARN|ERROR check: message — fix: ...``. ``--json``:
``{"ok", "exit_code", "findings": [{check, severity, message, fix, values}], "checked": [...], "skipped": {...}}``.
Exit code: 0 clean, 1 warnings only, 2 errors. A check that cannot run at all (no connection, a
failed query) is an error of the command, not a finding.
"""

from __future__ import annotations

import argparse

import psycopg

from cdc.catalog import connect
from cdc.cli.output import print_json
from cdc.config import Settings
from cdc.errors import SourceError
from cdc.preflight import Report, run_preflight
from cdc.registry import Registry, TableReg


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc check`` to the ``cdc`` parser."""
    check = sub.add_parser("check", help="check that the source is ready for capture")
    check.add_argument("--json", action="store_true", help="print the findings as JSON")
    check.set_defaults(handler=run_check)


def _registered(settings: Settings) -> list[TableReg]:
    if not (settings.state_dir / "registry.db").exists():
        return []
    with Registry(settings.state_dir) as registry:
        return registry.list_tables()


def run_check(args: argparse.Namespace, settings: Settings) -> int:
    regs = _registered(settings)
    with connect(settings.require_source(), application_name="cdc check") as conn:
        try:
            report = run_preflight(conn, settings.slot_name, regs)
        except psycopg.Error as exc:
            raise SourceError(
                f"the check itself failed on the source: {exc}",
                fix="see the message; the role needs to read pg_catalog and pg_replication_slots",
            ) from exc
    if args.json:
        print_json(report.to_dict())
    else:
        print_report(report)
    return report.exit_code


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
