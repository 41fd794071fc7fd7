"""``cdc check [--json] [--fix] [--ddl-recorder-sql] [--nonfinite-recorder-sql]``: preflight of the
source (see :mod:`cdc.preflight`); ``--fix`` creates the watermark table of chunked snapshots
(``docs/snapshots.md``) and, when the role may, installs the DDL recorder (a superuser;
:mod:`cdc.recorders.ddl`, ``docs/schema-changes.md``) and the non-finite recorder's triggers on the
registered tables (the tables' owner; :mod:`cdc.recorders.nonfinite`); ``--ddl-recorder-sql`` and
``--nonfinite-recorder-sql`` print the SQL that installs either (for the right role's ``psql``) and
check nothing.

Text: one line per check, ``OK|INFO|WARN|ERROR check: message — fix: ...``. ``--json``:
``{"ok", "exit_code", "findings": [{check, severity, message, fix, values}], "checked": [...], "skipped": {...}}``.
Exit code: 0 clean (``info`` findings included), 1 warnings, 2 errors. A check that cannot run at
all (no connection, a failed query) is an error of the command, not a finding.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import psycopg

from cdc import paths
from cdc.cli import VERB_HELP
from cdc.cli.output import print_json
from cdc.codec.plugins import OutputPlugin, plugin_in_use
from cdc.config import Settings
from cdc.connect import classify, connect
from cdc.errors import SourceError
from cdc.logstore.images import unknown_values
from cdc.preflight import Finding, Report, run_preflight
from cdc.publication import keep_publication
from cdc.recorders.ddl import check_ddl_recorder, install_ddl_recorder, install_script
from cdc.recorders.nonfinite import (
    check_nonfinite,
    ensure_nonfinite,
    remember,
    tracked_columns,
)
from cdc.recorders.nonfinite import install_script as nonfinite_script
from cdc.registry import Registry, State, TableReg, TableState
from snapshot.chunk_state import SnapshotOptions, check_watermark_table, ensure_watermark_table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc check`` to the ``cdc`` parser."""
    check = sub.add_parser("check", help=VERB_HELP["check"])
    check.add_argument("--json", action="store_true", help="print the findings as JSON")
    check.add_argument(
        "--fix",
        action="store_true",
        help="create the watermark table of chunked snapshots, and the DDL recorder if the role may",
    )
    check.add_argument(
        "--ddl-recorder-sql",
        action="store_true",
        help="print the SQL a superuser runs to install the DDL recorder, and exit",
    )
    check.add_argument(
        "--nonfinite-recorder-sql",
        action="store_true",
        help="print the SQL the tables' owner runs so that NaN/Infinity are captured with wal2json < 2.6, and exit",
    )
    check.set_defaults(handler=run_check)


def _registered(settings: Settings) -> tuple[list[TableReg], str | None, OutputPlugin]:
    """The registered tables, what the reader found out about wal2json
    (:attr:`cdc.registry.State.WAL2JSON_NUMERIC_AS_STRING`), and the decoder in use."""
    if not paths.registry_path(settings.state_dir).exists():
        return [], None, plugin_in_use(None, settings)
    with Registry(settings.state_dir) as registry:
        return (
            registry.list_tables(),
            registry.get_state(State.WAL2JSON_NUMERIC_AS_STRING),
            plugin_in_use(registry, settings),
        )


def run_check(args: argparse.Namespace, settings: Settings) -> int:
    regs, wal2json_state, plugin = _registered(settings)
    dsn = settings.require_source()
    with connect(dsn, application_name="cdc check") as conn:
        try:
            if args.ddl_recorder_sql:
                sys.stdout.write(install_script(conn))
                return 0
            if args.nonfinite_recorder_sql:
                sys.stdout.write(
                    nonfinite_script(
                        conn,
                        [r for r in regs if tracked_columns(r)],
                        settings.config.nonfinite_recorder_when,
                    )
                )
                return 0
            watermark = SnapshotOptions.from_settings(settings).watermark
            if args.fix:
                if ensure_watermark_table(conn, *watermark):
                    print("created the watermark table", file=sys.stderr)
                if plugin.uses_publication and regs:  # nothing registered: nothing to publish
                    with Registry(settings.state_dir) as registry:
                        keep_publication(conn, registry, settings, watermark, _stderr)
                _fix_ddl_recorder(conn)
                if settings.config.nonfinite_recorder and plugin.may_send_nonfinite_as_null:
                    _fix_nonfinite(conn, regs, settings)
            report = _with_source_objects(
                run_preflight(
                    conn,
                    settings.slot_name,
                    regs,
                    plugin=plugin,
                    dsn=dsn,
                    publication=settings.publication,
                    watermark=watermark,
                ),
                conn,
                settings,
                regs,
                wal2json_state if plugin.may_send_nonfinite_as_null else "1",  # pgoutput: no recorder
            )
        except psycopg.Error as exc:
            raise classify(exc, dsn) from None
    report = _with_unknown_values(report, settings, regs)
    if args.json:
        print_json(report.to_dict())
    else:
        print_report(report)
    return report.exit_code


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _fix_ddl_recorder(conn: psycopg.Connection[Any]) -> None:
    """Install the DDL recorder if the role may; else say why (the finding keeps the fix)."""
    try:
        if install_ddl_recorder(conn):
            print("installed the DDL recorder", file=sys.stderr)
    except SourceError as exc:
        print(f"did not install the DDL recorder: {exc} — fix: {exc.fix}", file=sys.stderr)


def _fix_nonfinite(conn: psycopg.Connection[Any], regs: list[TableReg], settings: Settings) -> None:
    """Install or update the non-finite recorder's triggers where the role may; say where not
    (each table's state kept for ``cdc tables list``)."""
    outcomes = ensure_nonfinite(conn, regs, settings.config.nonfinite_recorder_when)
    if outcomes:
        with Registry(settings.state_dir) as registry:
            remember(registry, outcomes)
    for outcome in outcomes:
        if outcome.action == "installed":
            print(f"installed the non-finite recorder on {outcome.reg.qualified}", file=sys.stderr)
        elif outcome.action == "failed":
            print(
                f"did not install the non-finite recorder on {outcome.reg.qualified}: {outcome.why}",
                file=sys.stderr,
            )


def _with_source_objects(
    report: Report,
    conn: psycopg.Connection[Any],
    settings: Settings,
    regs: list[TableReg],
    wal2json_state: str | None,
) -> Report:
    """The report with the checks of the objects the service keeps at the source: the watermark
    table (:func:`snapshot.chunk_state.check_watermark_table`), the DDL recorder
    (:func:`cdc.recorders.ddl.check_ddl_recorder`) and, unless the reader found a wal2json that sends
    NaN/Infinity itself, the non-finite recorder (:func:`cdc.recorders.nonfinite.check_nonfinite`)."""
    findings = report.findings
    checks: list[tuple[str, tuple[str, str, str] | None]] = [
        ("watermark_table", check_watermark_table(conn, *SnapshotOptions.from_settings(settings).watermark)),
        ("ddl_recorder", check_ddl_recorder(conn)),
    ]
    if wal2json_state != "1":
        checks.append(
            ("nonfinite_recorder", check_nonfinite(conn, regs, settings.config.nonfinite_recorder_when))
        )
    for name, found in checks:
        if found is not None:
            severity, message, fix = found
            findings = (*findings, Finding(name, severity, message, fix))  # type: ignore[arg-type]
    return Report(findings, (*report.checked, *(name for name, _ in checks)), report.skipped)


def _with_unknown_values(report: Report, settings: Settings, regs: list[TableReg]) -> Report:
    """The report with a warning per table whose topic holds values the reader could not know
    (:mod:`cdc.logstore.images`): its topic is not a complete copy until it is snapshotted again."""
    if not regs:
        return report
    found: list[Finding] = []
    with Registry(settings.state_dir) as registry:
        for reg in regs:
            raw = registry.get_table_state(TableState.VALUES_UNKNOWN, reg.schema, reg.table)
            if raw:
                message, fix = unknown_values(reg.qualified, raw)
                found.append(Finding("complete_topics", "warning", message, fix, {"table": reg.qualified}))
    return Report((*report.findings, *found), (*report.checked, "complete_topics"), report.skipped)


_LABELS = {"error": "ERROR", "warning": "WARN", "info": "INFO"}


def print_report(report: Report) -> None:
    for name in report.checked:
        found = [f for f in report.findings if f.check == name]
        if not found:
            print(f"OK    {name}")
        for f in found:
            print(f"{_LABELS.get(f.severity, f.severity.upper()):5} {name}: {f.message} — fix: {f.fix}")
    for name, why in report.skipped.items():
        print(f"SKIP  {name}: {why}")
    errors, warnings = len(report.errors), len(report.warnings)
    verdict = (
        "ready" if not errors and not warnings else "ready, with warnings" if not errors else "NOT ready"
    )
    print(f"{verdict}: {errors} error(s), {warnings} warning(s), {len(report.checked)} check(s) run")
