"""Preflight of the source (``cdc check``): is it ready for logical capture of the registered tables?

Each problem is a :class:`Finding` with the fix; problems of the *check itself* (cannot connect, a
query failed) are raised as :class:`~cdc.errors.CdcError`, never reported as findings. Gathering
facts (:func:`run_preflight`) is kept apart from judging them (the ``check_*`` functions, pure,
unit-testable on :class:`~cdc.catalog.ServerInfo` / :class:`~cdc.catalog.SlotInfo` values).

Verdict (:meth:`Report.exit_code`): 0 no findings (or ``info`` only), 1 warnings, 2 at least one error.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

from cdc.catalog import (
    ServerInfo,
    SlotInfo,
    TableDescription,
    capture_problems,
    describe_table,
    is_table,
    server_info,
    slot_info,
)
from cdc.config import DECODERS
from cdc.errors import RegistryError
from cdc.publication import publication_sql, publication_tables
from cdc.registry import TableReg

#: ``info``: worth knowing, nothing to fix for capture to be right (it does not change the exit code)
Severity = Literal["error", "warning", "info"]

# The checks in the order they run; each name appears in Report.checked when it ran.
CHECKS = (
    "decoder",  # info: the output plugin in use (and pgoutput's publication)
    "wal_level",
    "replication_role",
    "replication_slots",
    "wal_senders",
    "wal2json",  # the plugin loads (the decoder wal2json)
    "pgoutput",  # the server allows it (the decoder pgoutput)
    "publication",  # pgoutput: the publication holds every registered table
    "max_slot_wal_keep_size",
    "slot",
    "registered_tables",
    "replica_identity",
    "select_privilege",
    "watermark_table",  # run by cdc.cli.check (snapshot.chunk_state.check_watermark_table)
    "ddl_recorder",  # run by cdc.cli.check (cdc.recorders.ddl.check_ddl_recorder)
    # run by cdc.cli.check (cdc.recorders.nonfinite.check_nonfinite) unless the reader found a wal2json
    # that sends NaN/Infinity itself (2.6+)
    "nonfinite_recorder",
)
WAL2JSON_TIMEOUT_MS = 10_000


@dataclass(frozen=True, slots=True)
class Finding:
    check: str
    severity: Severity
    message: str
    fix: str
    values: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "severity": self.severity,
            "message": self.message,
            "fix": self.fix,
            "values": self.values,
        }


@dataclass(frozen=True, slots=True)
class Report:
    """``checked``: checks that ran; ``skipped``: check name -> why it could not run."""

    findings: tuple[Finding, ...]
    checked: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def infos(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "info"]

    @property
    def ok(self) -> bool:
        """No errors: capture can start (warnings may still need attention)."""
        return not self.errors

    @property
    def exit_code(self) -> int:
        return verdict_exit_code(self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "findings": [f.to_dict() for f in self.findings],
            "checked": list(self.checked),
            "skipped": dict(self.skipped),
        }


def verdict_exit_code(findings: Iterable[Finding]) -> int:
    """0 when there is nothing to report (or only ``info``), 1 for warnings, 2 when there is an error."""
    severities = {f.severity for f in findings}
    return 2 if "error" in severities else 1 if "warning" in severities else 0


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(size) < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


# --- judging facts (pure) ----------------------------------------------------------------------------
def check_output_plugin(info: ServerInfo, plugin: str = "wal2json") -> list[Finding]:
    """An error when the server's ``output_plugin_libraries`` (current minor releases) leaves out
    ``plugin``: slot creation and streaming are refused until a superuser allows it and reloads."""
    refusal = info.output_plugin_refusal(plugin)
    if refusal is None:
        return []
    message, fix = refusal
    return [Finding(plugin, "error", message, fix, {"output_plugin_libraries": info.output_plugin_libraries})]


def check_publication(
    name: str, have: set[tuple[str, str]] | None, want: Sequence[TableReg], fix_sql: list[str]
) -> list[Finding]:
    """pgoutput sends the changes of the publication's tables only: an error for a registered table
    (existing at the source) it does not hold, or for a missing publication; ``fix_sql`` brings it
    in step (:func:`cdc.publication.publication_sql`)."""
    if not fix_sql:
        return []
    missing = [r.qualified for r in want if have is None or (r.schema, r.table) not in have]
    if not missing and have is not None:
        return []  # only tables no longer registered to drop: their changes are skipped
    what = (
        f"the publication {name!r} does not exist"
        if have is None
        else f"the publication {name!r} lacks registered table(s) {', '.join(missing)}"
    )
    return [
        Finding(
            "publication",
            "error",
            f"{what}: pgoutput sends no change of a table it does not hold",
            "run `cdc run` (it keeps the publication in step) as a role that may, or have the DBA run: "
            + " ".join(fix_sql),
            {"publication": name, "missing": missing},
        )
    ]


def check_wal_level(info: ServerInfo) -> list[Finding]:
    if info.wal_level == "logical":
        return []
    return [
        Finding(
            "wal_level",
            "error",
            f"wal_level is {info.wal_level!r}; logical decoding needs 'logical'",
            "ALTER SYSTEM SET wal_level = 'logical'; then restart the server",
            {"wal_level": info.wal_level},
        )
    ]


def check_role(info: ServerInfo) -> list[Finding]:
    if info.can_replicate:
        return []
    return [
        Finding(
            "replication_role",
            "error",
            f"role {info.role!r} has neither REPLICATION nor SUPERUSER; it cannot create or read a replication slot",
            f'ALTER ROLE "{info.role}" WITH REPLICATION; (and allow it in pg_hba.conf for "replication" connections)',
            {"role": info.role},
        )
    ]


def check_capacity(info: ServerInfo, slot: SlotInfo) -> list[Finding]:
    """Slots: one must be free unless our slot exists. Walsenders: one must be free unless our slot
    is already being streamed (its walsender is then ours to replace)."""
    out: list[Finding] = []
    if not slot.exists and info.slots_in_use >= info.max_replication_slots:
        out.append(
            Finding(
                "replication_slots",
                "error",
                f"all {info.max_replication_slots} replication slots are in use and slot {slot.name!r} does not exist yet",
                "drop an unused slot (SELECT pg_drop_replication_slot(name) FROM pg_replication_slots WHERE NOT active ...), "
                "or raise max_replication_slots (ALTER SYSTEM SET max_replication_slots = ...; restart)",
                {"max_replication_slots": info.max_replication_slots, "slots_in_use": info.slots_in_use},
            )
        )
    if not slot.active and info.senders_in_use >= info.max_wal_senders:
        out.append(
            Finding(
                "wal_senders",
                "error",
                f"all {info.max_wal_senders} WAL senders are in use; the reader needs one",
                "stop an unused replication client, or raise max_wal_senders (ALTER SYSTEM SET max_wal_senders = ...; restart)",
                {"max_wal_senders": info.max_wal_senders, "senders_in_use": info.senders_in_use},
            )
        )
    return out


def check_wal_keep(info: ServerInfo) -> list[Finding]:
    if info.max_slot_wal_keep_size >= 0:
        return []
    return [
        Finding(
            "max_slot_wal_keep_size",
            "warning",
            "max_slot_wal_keep_size is unlimited (-1): a stalled or abandoned slot keeps WAL until the source's disk is full",
            "ALTER SYSTEM SET max_slot_wal_keep_size = '50GB' (sized to the disk); SELECT pg_reload_conf(); "
            "a slot that falls further behind is then invalidated and needs a re-snapshot (`cdc snapshot`)",
            {"max_slot_wal_keep_size": info.max_slot_wal_keep_size},
        )
    ]


def check_slot(slot: SlotInfo, database: str) -> list[Finding]:
    """Our slot (``settings.slot_name``): right kind, not lost, not retaining WAL while nobody reads it."""
    if not slot.exists:
        return []
    name = slot.name
    drop = f"SELECT pg_drop_replication_slot('{name}')"
    if slot.slot_type != "logical" or slot.plugin not in DECODERS or slot.database != database:
        return [
            Finding(
                "slot",
                "error",
                f"slot {name!r} exists but is a {slot.slot_type} slot with plugin {slot.plugin!r} "
                f"in database {slot.database!r}, not a slot of {' or '.join(DECODERS)} in {database!r}",
                f"choose another slot name (CDC_SLOT / cdc.toml slot = ...), or if it is a leftover: {drop}",
                {"slot": name, "plugin": slot.plugin, "database": slot.database, "slot_type": slot.slot_type},
            )
        ]
    values: dict[str, Any] = {
        "slot": name,
        "wal_status": slot.wal_status,
        "retained_bytes": slot.retained_bytes,
        "active": slot.active,
        "safe_wal_size": slot.safe_wal_size,
    }
    if slot.wal_status == "lost":
        return [
            Finding(
                "slot",
                "error",
                f"slot {name!r} is lost: the WAL it needed was removed (max_slot_wal_keep_size), changes were missed",
                f"re-snapshot: drop the slot ({drop}) and run `cdc snapshot` to capture every table again",
                values,
            )
        ]
    if slot.wal_status == "unreserved":
        return [
            Finding(
                "slot",
                "error",
                f"slot {name!r} is behind by more than max_slot_wal_keep_size and will be lost at the next checkpoint",
                "start `cdc run` now so it catches up; if the slot is lost, drop it and run `cdc snapshot`",
                values,
            )
        ]
    if not slot.active and (slot.retained_bytes or 0) > 0:
        retained = slot.retained_bytes or 0
        return [
            Finding(
                "slot",
                "warning",
                f"slot {name!r} is inactive and retains {human_bytes(retained)} of WAL on the source "
                "until the reader consumes it",
                f"start `cdc run` to consume it; if capture is retired, drop the slot: {drop}",
                values,
            )
        ]
    return []


def check_tables(
    regs: Sequence[TableReg], descriptions: dict[tuple[str, str], TableDescription | None], role: str
) -> list[Finding]:
    """Every registered table can still be captured (:func:`cdc.catalog.capture_problems`, the rule
    ``cdc tables add`` and the reader use): it exists as a table or a partitioned table, its key is
    in its replica identity (else wal2json loses its UPDATEs/DELETEs), and the role can read it."""
    return [
        Finding(p.check, "error", p.message, p.fix, p.values)
        for reg in regs
        for p in capture_problems(
            reg.schema, reg.table, descriptions.get((reg.schema, reg.table)), reg.key, role=role
        )
    ]


# --- gathering facts ---------------------------------------------------------------------------------
def _decoder_info(plugin: str, publication: str, slot: SlotInfo) -> Finding:
    where = f" from publication {publication!r}" if plugin == "pgoutput" else ""
    made = "the slot was created with it" if slot.exists else "a new slot is created with it"
    return Finding(
        "decoder",
        "info",
        f"decoder: {plugin}{where} ({made})",
        "decoder in cdc.toml / CDC_DECODER chooses the next slot's; docs/decoders.md",
        {"decoder": plugin, "publication": publication if plugin == "pgoutput" else None},
    )


def probe_wal2json(conn: psycopg.Connection[Any], plugin: str = "wal2json") -> Finding | None:
    """Create and drop a temporary logical slot with output plugin ``plugin``; None when that works.

    Creating a slot waits for transactions open on the source; after ``WAL2JSON_TIMEOUT_MS`` the
    probe gives up with a warning rather than hanging.
    """
    name = f"cdc_check_{uuid.uuid4().hex[:12]}"
    conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(WAL2JSON_TIMEOUT_MS)))
    try:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, %s, true)", (name, plugin))
    except pg_errors.UndefinedFile as exc:
        return Finding(
            "wal2json",
            "error",
            f"the {plugin} output plugin is not installed on the source server ({exc.diag.message_primary})",
            "install it on the server (Debian/Ubuntu: apt-get install postgresql-<version>-wal2json; "
            "RDS/Aurora/Cloud SQL ship it)",
            {},
        )
    except pg_errors.InsufficientPrivilege as exc:
        # REPLICATION was checked before the probe runs: the server refused the library itself
        return Finding(
            "wal2json",
            "error",
            f"the source server refuses the {plugin} output plugin ({exc.diag.message_primary})",
            f"as a superuser on the source, add {plugin} to output_plugin_libraries "
            "(ALTER SYSTEM SET output_plugin_libraries = ...; SELECT pg_reload_conf();)",
            {},
        )
    except pg_errors.QueryCanceled:
        return Finding(
            "wal2json",
            "warning",
            f"could not verify {plugin}: creating a test slot waited more than {WAL2JSON_TIMEOUT_MS // 1000}s "
            "for transactions open on the source",
            "finish or cancel long-running transactions (see pg_stat_activity), then run `cdc check` again",
            {},
        )
    finally:
        conn.execute("RESET statement_timeout")
    conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    return None


def run_preflight(
    conn: psycopg.Connection[Any],
    slot_name: str,
    regs: Sequence[TableReg],
    *,
    plugin: str = "wal2json",
    publication: str | None = None,
    watermark: tuple[str, str] | None = None,
) -> Report:
    """Run every check against the source behind ``conn`` (autocommit) for ``regs``, decoded with
    output plugin ``plugin`` (pgoutput: from ``publication``, which also holds ``watermark``)."""
    info = server_info(conn)
    slot = slot_info(conn, slot_name)
    findings: list[Finding] = []
    checked: list[str] = []
    skipped: dict[str, str] = {}

    def record(names: Sequence[str], found: list[Finding]) -> None:
        checked.extend(names)
        findings.extend(found)

    record(["wal_level"], check_wal_level(info))
    record(["replication_role"], check_role(info))
    record(["replication_slots", "wal_senders"], check_capacity(info, slot))
    publication = publication or slot_name
    record(["decoder"], [_decoder_info(plugin, publication, slot)])
    if plugin == "pgoutput":
        record(["pgoutput"], check_output_plugin(info, "pgoutput"))  # built in: only a refusal
        tables = [(r.schema, r.table) for r in regs] + ([watermark] if watermark else [])
        record(
            ["publication"],
            check_publication(
                publication,
                publication_tables(conn, publication),
                [r for r in regs if is_table(conn, (r.schema, r.table))],  # else registered_tables
                publication_sql(conn, publication, tables),
            ),
        )
    elif refused := check_output_plugin(info):
        record(["wal2json"], refused)
    elif info.wal_level != "logical":
        skipped["wal2json"] = "wal_level is not logical"
    elif not info.can_replicate:
        skipped["wal2json"] = "the role may not create replication slots"
    elif slot.exists and slot.plugin == "wal2json":
        checked.append("wal2json")  # the existing slot proves the plugin loads
    elif info.slots_in_use >= info.max_replication_slots:
        skipped["wal2json"] = "no replication slot is free for a test slot"
    else:
        probe = probe_wal2json(conn)
        record(["wal2json"], [probe] if probe else [])
    record(["max_slot_wal_keep_size"], check_wal_keep(info))
    record(["slot"], check_slot(slot, info.database))
    descriptions: dict[tuple[str, str], TableDescription | None] = {}
    for reg in regs:
        try:
            descriptions[(reg.schema, reg.table)] = describe_table(conn, reg.schema, reg.table)
        except RegistryError:
            descriptions[(reg.schema, reg.table)] = None
    record(
        ["registered_tables", "replica_identity", "select_privilege"],
        check_tables(regs, descriptions, info.role),
    )
    order = {name: i for i, name in enumerate(CHECKS)}
    findings.sort(key=lambda f: order.get(f.check, len(order)))
    return Report(tuple(findings), tuple(sorted(checked, key=lambda n: order.get(n, len(order)))), skipped)
