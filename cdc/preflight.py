"""Preflight of the source (``cdc check``): is it ready for logical capture of the registered tables?

Each problem is a :class:`Finding` with the fix; problems of the *check itself* (cannot connect, a
query failed) are raised as :class:`~cdc.errors.CdcError`, never reported as findings. Gathering
facts (:func:`run_preflight`) is kept apart from judging them (the ``check_*`` functions, pure,
unit-testable on :class:`~cdc.catalog.ServerInfo` / :class:`~cdc.catalog.SlotInfo` values).

Verdict (:meth:`Report.exit_code`): 0 no findings (or ``info`` only), 1 warnings, 2 at least one error.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cdc.catalog import (
    FailoverInfo,
    ServerInfo,
    SlotInfo,
    TableDescription,
    capture_problems,
    describe_table,
    failover_info,
    failover_supported,
    is_table,
    pgoutput_protocol,
    server_info,
    slot_info,
)
from cdc.codec.compiled import native_status
from cdc.codec.plugins import PGOUTPUT, WAL2JSON, OutputPlugin
from cdc.config import parse_dsn
from cdc.connect import connect
from cdc.errors import RegistryError, SourceError
from cdc.publication import publication_sql, publication_tables
from cdc.registry import TableReg

#: ``info``: worth knowing, nothing to fix for capture to be right (it does not change the exit code)
Severity = Literal["error", "warning", "info"]

# The checks in the order they run; each name appears in Report.checked when it ran.
CHECKS = (
    "wal_level",
    "replication_role",
    "replication_slots",
    "wal_senders",
    "decoder",  # info: the output plugin in use (and pgoutput's publication)
    "per_change_path",  # info: the compiled per-change path (cdc.codec._native), or a warning: Python's
    WAL2JSON.name,  # the plugin loads (a library plugin in use: its check is named after it)
    PGOUTPUT.name,  # the server allows it (the decoder pgoutput)
    "publication",  # pgoutput: the publication holds every registered table
    "server_version",  # info: what this server's version brings (streaming levels, failover slots)
    "max_slot_wal_keep_size",
    "slot",
    # failover slots (PostgreSQL 17+): our slot, the primary's and each standby's settings, readiness
    "failover_slot",
    "synchronized_standby_slots",
    "failover_standby",
    "failover_ready",
    "registered_tables",
    "replica_identity",
    "select_privilege",
    "watermark_table",  # run by cdc.cli.check (snapshot.chunk_state.check_watermark_table)
    "ddl_recorder",  # run by cdc.cli.check (cdc.recorders.ddl.check_ddl_recorder)
    # run by cdc.cli.check (cdc.recorders.nonfinite.check_nonfinite) unless the reader found a wal2json
    # that sends NaN/Infinity itself (2.6+)
    "nonfinite_recorder",
    # run by cdc.cli.check: no registered table's topic holds values cdc cannot know (cdc.logstore.images)
    "complete_topics",
)
#: the checks of failover slots: they run on PostgreSQL 17+ only
FAILOVER_CHECKS = ("failover_slot", "synchronized_standby_slots", "failover_standby", "failover_ready")
WAL2JSON_TIMEOUT_MS = 10_000
#: the connect timeout to a standby among the source DSN's hosts (cdc check, cdc status)
STANDBY_TIMEOUT_S = 3
#: what a server without wal2json captures with: pgoutput is built into every PostgreSQL >= 10
USE_PGOUTPUT = (
    f"capture with {PGOUTPUT.name}, built into every PostgreSQL server (no install, no allow-list): "
    f"{PGOUTPUT.setting} in cdc.toml (CDC_DECODER={PGOUTPUT.name})"
)


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
def check_output_plugin(
    info: ServerInfo, plugin: OutputPlugin, installed: bool | None = None
) -> list[Finding]:
    """An error when the server's ``output_plugin_libraries`` (current minor releases) leaves out
    ``plugin``: slot creation and streaming are refused until a superuser allows it and reloads.
    ``installed``: whether the library is on the server (False: allowing it is no fix; None:
    unknown, only a superuser can look, :func:`library_installed`)."""
    refusal = info.output_plugin_refusal(plugin.name)
    if refusal is None:
        return []
    values = {"output_plugin_libraries": info.output_plugin_libraries, "installed": installed}
    if installed is False:
        return [not_installed(plugin, "it is not in the server's library directory", values)]
    message, fix = refusal
    return [
        Finding(
            plugin.name,
            "error",
            message,
            fix if plugin.built_in else f"{fix}; or {USE_PGOUTPUT}",
            values,
        )
    ]


def check_publication(
    name: str, have: set[tuple[str, str]] | None, want: Sequence[TableReg], fix_sql: list[str]
) -> list[Finding]:
    """pgoutput sends the changes of the publication's tables only: an error for a registered table
    (existing at the source) it does not hold, or for a missing publication; ``fix_sql`` brings it
    in step (:func:`cdc.publication.publication_sql`)."""
    if not fix_sql:
        return []
    missing = [r.qualified for r in want if have is None or (r.schema, r.table) not in have]
    if not missing:
        return []  # nothing registered yet, tables no longer registered, an option: nothing is lost
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


def not_installed(plugin: OutputPlugin, detail: str, values: dict[str, Any]) -> Finding:
    """The finding of a server without ``plugin``'s library: pgoutput is what works there."""
    return Finding(
        plugin.name,
        "error",
        f"the {plugin.name} output plugin is not installed on the source server ({detail})",
        f"{USE_PGOUTPUT}; or install {plugin.name} on the server ({plugin.install_hint}) and allow it in "
        "output_plugin_libraries",
        values,
    )


def check_server_version(info: ServerInfo) -> list[Finding]:
    """What the server's version brings to capture (info): pgoutput's protocol and ``streaming``
    level, and whether it has failover slots (PostgreSQL 17+)."""
    version = info.server_version_num
    proto, streaming = pgoutput_protocol(version)
    name = f"PostgreSQL {version // 10000}.{version % 10000}"
    stream = {
        "parallel": "streaming = parallel (in-progress transactions streamed, applied in parallel)",
        "on": "streaming = on (in-progress transactions streamed)",
        "off": "no streaming (a transaction arrives at its commit)",
    }[streaming]
    values = {"server_version_num": version, "proto_version": proto, "streaming": streaming}
    if failover_supported(version):
        return [
            Finding(
                "server_version",
                "info",
                f"{name}: pgoutput protocol {proto}, {stream}; failover slots: the slot is created with "
                "failover, so a standby that syncs it takes over capture after a failover",
                "nothing to do; for failover, set up the standby as the failover checks below say",
                {**values, "failover_slots": True},
            )
        ]
    return [
        Finding(
            "server_version",
            "info",
            f"{name}: pgoutput protocol {proto}, {stream}; no failover slots (PostgreSQL 17+): after a "
            "primary failover the slot is lost and every table is snapshotted again",
            "upgrade to PostgreSQL 17 or later to keep the slot through a failover",
            {**values, "failover_slots": False},
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


def check_slot(slot: SlotInfo, database: str, plugin: OutputPlugin) -> list[Finding]:
    """Our slot (``settings.slot_name``): right kind (a logical slot of ``plugin``, the decoder's),
    not lost, not retaining WAL while nobody reads it."""
    if not slot.exists:
        return []
    name = slot.name
    drop = f"SELECT pg_drop_replication_slot('{name}')"
    if slot.slot_type != "logical" or not plugin.made(slot.plugin) or slot.database != database:
        return [
            Finding(
                "slot",
                "error",
                f"slot {name!r} exists but is a {slot.slot_type} slot with plugin {slot.plugin!r} "
                f"in database {slot.database!r}, not a {plugin.name} slot in {database!r}",
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


# --- failover slots (PostgreSQL 17+) ----------------------------------------------------------------
#: a standby of the source DSN's hosts: ``host:port``, its server_version_num, and its facts (None
#: when it is older than 17 and cannot sync slots)
Standby = tuple[str, int, FailoverInfo | None]


def _alter(name: str, value: str) -> str:
    return f"ALTER SYSTEM SET {name} = {value}; SELECT pg_reload_conf();"


def check_failover_primary(
    primary: FailoverInfo, slot: SlotInfo, standbys: Sequence[Standby]
) -> list[Finding]:
    """On the primary (PostgreSQL 17+): our slot is a failover slot, and where there is a standby,
    ``synchronized_standby_slots`` names its physical slot (else the reader may confirm changes
    the standby has not received, which its synced slot then lacks after a failover)."""
    out: list[Finding] = []
    copy = primary.slot
    if slot.exists and slot.slot_type == "logical" and copy is not None and not copy.failover:
        out.append(
            Finding(
                "failover_slot",
                "warning",
                f"slot {slot.name!r} was created without failover: no standby keeps a copy, and a "
                "primary failover loses it (every table is then snapshotted again)",
                'make it a failover slot on a replication connection: psql "dbname=<db> '
                f'replication=database" -c \'ALTER_REPLICATION_SLOT "{slot.name}" (FAILOVER true)\'',
                {"slot": slot.name},
            )
        )
    has_standby = bool(primary.physical_slots or primary.standbys or standbys)
    if has_standby and not primary.synchronized_standby_slots:
        names = ", ".join(primary.physical_slots) or "<the standby's physical slot>"
        out.append(
            Finding(
                "synchronized_standby_slots",
                "warning",
                "synchronized_standby_slots is not set on the primary: the reader may confirm changes "
                "a standby has not received yet, and after a failover the standby's copy of the slot "
                "would be past changes nobody delivered",
                "on the primary, name the standbys' physical slots (those that must have every change "
                f"before cdc does): {_alter('synchronized_standby_slots', repr(names))}",
                {"physical_slots": list(primary.physical_slots), "standbys": primary.standbys},
            )
        )
    return out


def check_failover_standby(where: str, version: int, standby: FailoverInfo | None) -> list[Finding]:
    """What a standby (``where``: host:port) lacks to keep a synced copy of the slot, each with
    its fix (run on that standby)."""
    if standby is None:
        return [
            Finding(
                "failover_standby",
                "warning",
                f"standby {where} is PostgreSQL {version // 10000}: it cannot sync slots (17+)",
                "upgrade the standby to the primary's major version",
                {"standby": where, "server_version_num": version},
            )
        ]
    missing: list[tuple[str, str, str]] = []
    if not standby.sync_replication_slots:
        missing.append(("sync_replication_slots", "is off", _alter("sync_replication_slots", "on")))
    if not standby.hot_standby_feedback:
        missing.append(("hot_standby_feedback", "is off", _alter("hot_standby_feedback", "on")))
    if not standby.primary_slot_name:
        missing.append(
            (
                "primary_slot_name",
                "is not set (the standby streams without a physical slot)",
                "on the primary: SELECT pg_create_physical_replication_slot('standby1'); on the standby: "
                + _alter("primary_slot_name", "'standby1'"),
            )
        )
    if standby.conninfo_has_dbname is False:
        missing.append(
            (
                "primary_conninfo",
                "names no database (the slot-sync worker connects to one)",
                "add dbname=<any database> to primary_conninfo: "
                + _alter("primary_conninfo", "'<the current value> dbname=postgres'"),
            )
        )
    return [
        Finding(
            "failover_standby",
            "warning",
            f"standby {where}: {name} {why}; it does not keep a synced copy of the slot, so a failover "
            "to it loses the slot",
            f"on the standby {where}: {fix}",
            {"standby": where, "setting": name},
        )
        for name, why, fix in missing
    ]


def check_failover_ready(where: str, slot: SlotInfo, standby: FailoverInfo) -> list[Finding]:
    """Readiness: the standby's copy of our (existing) slot is ``synced AND NOT temporary``."""
    if not slot.exists:
        return []
    copy = standby.slot
    values: dict[str, Any] = {"standby": where, "slot": slot.name}
    if copy is not None and copy.ready:
        return [
            Finding(
                "failover_ready",
                "info",
                f"standby {where} has a synced copy of slot {slot.name!r}: capture continues there after a failover",
                "nothing to do",
                {**values, "ready": True},
            )
        ]
    if copy is None:
        why = "has no copy of it yet"
    elif copy.invalidation_reason:
        why = f"has an invalidated copy ({copy.invalidation_reason})"
    elif copy.temporary:
        why = "has a temporary copy (kept until the primary's slot moves past what the standby can reserve)"
    else:
        why = "has a copy that is not synced from the primary"
    return [
        Finding(
            "failover_ready",
            "warning",
            f"standby {where} is not ready to take over slot {slot.name!r}: it {why}",
            "let `cdc run` stream (its confirmed position moves the primary's slot on) and fix the "
            "failover_standby findings; the copy is ready when synced AND NOT temporary",
            {**values, "ready": False},
        )
    ]


def _other_hosts(dsn: str, conn: psycopg.Connection[Any]) -> list[dict[str, str]]:
    """The libpq parameters (host, port, hostaddr) of each host the DSN names besides the one
    ``conn`` is connected to."""
    params = parse_dsn(dsn)
    hosts = (params.get("host") or "").split(",")
    if len(hosts) < 2:
        return []
    ports = (params.get("port") or "5432").split(",")
    addrs = params["hostaddr"].split(",") if params.get("hostaddr") else []
    here = (conn.info.host, str(conn.info.port))
    out = []
    for i, host in enumerate(hosts):
        one = {"host": host, "port": ports[i] if len(ports) > 1 else ports[0]}
        if addrs:
            one["hostaddr"] = addrs[i]
        if (one.get("hostaddr", host), one["port"]) != here and (host, one["port"]) != here:
            out.append(one)
    return out


def gather_standbys(
    dsn: str, conn: psycopg.Connection[Any], slot_name: str
) -> tuple[list[Standby], dict[str, str]]:
    """Each other host of a multi-host source DSN (``host=a,b port=x,y``) that is a standby, reached
    with ``target_session_attrs=any``; and ``host:port`` -> why, for those that could not be asked."""
    standbys: list[Standby] = []
    unreachable: dict[str, str] = {}
    for params in _other_hosts(dsn, conn):
        where = f"{params['host']}:{params['port']}"
        try:
            one = make_conninfo(dsn, **params, target_session_attrs="any", connect_timeout=STANDBY_TIMEOUT_S)
            with connect(one, application_name="cdc check") as other:
                version = other.info.server_version
                if not failover_supported(version):
                    standbys.append((where, version, None))
                    continue
                facts = failover_info(other, slot_name)
                if facts.in_recovery:
                    standbys.append((where, version, facts))
                else:
                    unreachable[where] = "it is not a standby (not in recovery)"
        except SourceError as exc:
            unreachable[where] = exc.message
    return standbys, unreachable


def failover_findings(
    conn: psycopg.Connection[Any], slot: SlotInfo, dsn: str | None
) -> tuple[list[Finding], dict[str, str]]:
    """The failover checks of a PostgreSQL 17+ primary and the standbys its DSN names (see
    :func:`check_failover_primary`, :func:`check_failover_standby`, :func:`check_failover_ready`);
    and the standbys that could not be asked (``failover_standby@host:port`` -> why)."""
    primary = failover_info(conn, slot.name)
    standbys, unreachable = gather_standbys(dsn, conn, slot.name) if dsn else ([], {})
    found = check_failover_primary(primary, slot, standbys)
    for where, version, facts in standbys:
        found.extend(check_failover_standby(where, version, facts))
        if facts is not None and primary.slot is not None and primary.slot.failover:
            found.extend(check_failover_ready(where, slot, facts))
    return found, {f"failover_standby@{where}": why for where, why in unreachable.items()}


# --- gathering facts ---------------------------------------------------------------------------------
def _decoder_info(plugin: OutputPlugin, publication: str, slot: SlotInfo) -> Finding:
    where = f" from publication {publication!r}" if plugin.uses_publication else ""
    made = "the slot was created with it" if slot.exists else "a new slot is created with it"
    return Finding(
        "decoder",
        "info",
        f"decoder: {plugin.name}{where} ({made})",
        "decoder in cdc.toml / CDC_DECODER chooses the next slot's; docs/decoders.md",
        {"decoder": plugin.name, "publication": publication if plugin.uses_publication else None},
    )


def _per_change_path() -> Finding:
    """Which per-change path a reader started now runs (issue #34): the compiled one (every decoder
    has one), or the Python one (``CDC_NATIVE=0``, or the extension not built: a warning)."""
    compiled, what = native_status()
    severity: Severity = "info" if compiled or os.environ.get("CDC_NATIVE") == "0" else "warning"
    return Finding(
        "per_change_path",
        severity,
        what,
        "" if severity == "info" else "install gcc and python3-dev, then `make setup` again",
        {"compiled": compiled},
    )


def _check_pgoutput(
    conn: psycopg.Connection[Any],
    info: ServerInfo,
    regs: Sequence[TableReg],
    publication: str,
    watermark: tuple[str, str] | None,
) -> list[Finding]:
    """pgoutput is built in (only a refusal by the allow-list), and its publication holds every
    registered table that exists (a missing one is the registered_tables finding)."""
    tables = [(r.schema, r.table) for r in regs] + ([watermark] if watermark else [])
    return check_output_plugin(info, PGOUTPUT) + check_publication(
        publication,
        publication_tables(conn, publication),
        [r for r in regs if is_table(conn, (r.schema, r.table))],
        publication_sql(conn, publication, tables),
    )


def probe_plugin(conn: psycopg.Connection[Any], plugin: OutputPlugin) -> Finding | None:
    """Create and drop a temporary logical slot with output plugin ``plugin``; None when that works.

    Creating a slot waits for transactions open on the source; after ``WAL2JSON_TIMEOUT_MS`` the
    probe gives up with a warning rather than hanging.
    """
    name = f"cdc_check_{uuid.uuid4().hex[:12]}"
    conn.execute(sql.SQL("SET statement_timeout = {}").format(sql.Literal(WAL2JSON_TIMEOUT_MS)))
    try:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, %s, true)", (name, plugin.name))
    except pg_errors.UndefinedFile as exc:
        return not_installed(plugin, exc.diag.message_primary or "its library is missing", {})
    except pg_errors.InsufficientPrivilege as exc:
        # REPLICATION was checked before the probe runs: the server refused the library itself
        return Finding(
            plugin.name,
            "error",
            f"the source server refuses the {plugin.name} output plugin ({exc.diag.message_primary})",
            f"as a superuser on the source, add {plugin.name} to output_plugin_libraries "
            f"(ALTER SYSTEM SET output_plugin_libraries = ...; SELECT pg_reload_conf();); or {USE_PGOUTPUT}",
            {},
        )
    except pg_errors.QueryCanceled:
        return Finding(
            plugin.name,
            "warning",
            f"could not verify {plugin.name}: creating a test slot waited more than {WAL2JSON_TIMEOUT_MS // 1000}s "
            "for transactions open on the source",
            "finish or cancel long-running transactions (see pg_stat_activity), then run `cdc check` again",
            {},
        )
    finally:
        conn.execute("RESET statement_timeout")
    conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    return None


_LIBRARY_FILE = """
SELECT (pg_stat_file(setting || '/' || %s, true)).size IS NOT NULL
FROM pg_catalog.pg_config WHERE name = 'PKGLIBDIR'
"""


def library_installed(conn: psycopg.Connection[Any], info: ServerInfo, plugin: OutputPlugin) -> bool | None:
    """Whether ``plugin``'s library is in the server's library directory; None when the role may
    not look. Only a superuser may (``pg_config`` and ``pg_stat_file`` are theirs): a REPLICATION
    role learns it from a test slot (:func:`probe_plugin`), which tells a missing library apart
    only once ``output_plugin_libraries`` allows it (the allow-list refuses first)."""
    if not info.role_superuser:
        return None
    try:
        row = conn.execute(_LIBRARY_FILE, [plugin.library_file]).fetchone()
    except pg_errors.InsufficientPrivilege:
        return None
    return bool(row[0]) if row else None


def _check_library(
    conn: psycopg.Connection[Any], info: ServerInfo, slot: SlotInfo, plugin: OutputPlugin
) -> tuple[list[Finding] | None, str]:
    """The check that ``plugin``'s library loads (wal2json's): its findings, or None and why it
    could not run."""
    refused = check_output_plugin(info, plugin, installed=library_installed(conn, info, plugin))
    if refused:
        return refused, ""
    if info.wal_level != "logical":
        return None, "wal_level is not logical"
    if not info.can_replicate:
        return None, "the role may not create replication slots"
    if slot.exists and plugin.made(slot.plugin):
        return [], ""  # the existing slot proves the plugin loads
    if info.slots_in_use >= info.max_replication_slots:
        return None, "no replication slot is free for a test slot"
    probe = probe_plugin(conn, plugin)
    return [probe] if probe else [], ""


def run_preflight(
    conn: psycopg.Connection[Any],
    slot_name: str,
    regs: Sequence[TableReg],
    *,
    plugin: OutputPlugin,
    dsn: str | None = None,
    publication: str | None = None,
    watermark: tuple[str, str] | None = None,
) -> Report:
    """Run every check against the source behind ``conn`` (autocommit) for ``regs``, capturing
    with ``plugin`` (the output plugin in use; pgoutput from
    ``publication``, default the slot's name, which also holds ``watermark``). ``dsn``: the source
    DSN; when it names several hosts, the standbys among them are checked for failover too."""
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
    record(["per_change_path"], [_per_change_path()])
    if plugin.built_in:
        skipped[WAL2JSON.name] = f"the decoder is {plugin.name}, built into the server"
    else:
        found, why = _check_library(conn, info, slot, plugin)
        if found is None:
            skipped[plugin.name] = why
        else:
            record([plugin.name], found)
    if plugin.uses_publication:
        record([plugin.name, "publication"], _check_pgoutput(conn, info, regs, publication, watermark))
    record(["server_version"], check_server_version(info))
    record(["max_slot_wal_keep_size"], check_wal_keep(info))
    record(["slot"], check_slot(slot, info.database, plugin))
    if failover_supported(info.server_version_num):
        found_failover, unreachable = failover_findings(conn, slot, dsn)
        record(FAILOVER_CHECKS, found_failover)
        skipped.update(unreachable)
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
