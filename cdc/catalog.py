"""What the source says about itself: table names, table descriptions, server and slot facts.

Ordinary SQL over psycopg 3 (no replication protocol here). Every query reads ``pg_catalog`` with
names passed as values, never spliced into SQL text; identifiers that must appear in SQL are built
with :mod:`psycopg.sql`. Functions take an open connection and leave its transaction state as they
found it when it is in autocommit mode (the callers here use autocommit connections).

Connections come from :mod:`cdc.connect`; identifier parsing and quoting live in :mod:`cdc.names`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from cdc.connect import connect as connect
from cdc.errors import RegistryError, SourceError
from cdc.events import lsn_to_int
from cdc.names import QUOTING_FIX
from cdc.names import quote_table_name as quote_table_name
from cdc.registry import Column

RELKIND_NAMES = {
    "r": "table",
    "p": "partitioned table",
    "v": "view",
    "m": "materialized view",
    "f": "foreign table",
    "S": "sequence",
    "c": "composite type",
    "i": "index",
    "I": "partitioned index",
    "t": "TOAST table",
}


# --- tables ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TableDescription:
    """A relation as the source's catalog describes it.

    ``columns``: user columns in attnum order (dropped and system columns left out), types from
    ``format_type()``. ``primary_key``: key columns in key order (empty: no primary key).
    ``replica_identity``: ``d`` default (the primary key), ``f`` full, ``n`` nothing, ``i`` index;
    ``replica_identity_columns``: the columns an UPDATE/DELETE carries as old identity (every column
    for ``f``, empty for ``n`` or ``d`` without primary key). ``estimated_rows``: ``reltuples``
    (0 when never analyzed). ``has_select_privilege``: the connected role may read every row (SELECT
    on the table and USAGE on the schema). ``sql_name``: ``schema.table`` quoted for SQL text.
    ``unique_keys``: column sets that unique indexes (the primary key included) guarantee unique.
    """

    schema: str
    table: str
    relkind: str
    columns: tuple[Column, ...]
    primary_key: tuple[str, ...]
    replica_identity: str
    replica_identity_columns: tuple[str, ...]
    estimated_rows: int
    has_select_privilege: bool
    sql_name: str
    oid: int = 0
    unique_keys: tuple[tuple[str, ...], ...] = ()  # column sets of unique, non-partial, plain-column indexes
    leaf_partitions: tuple[tuple[str, str], ...] = ()  # (schema, table) of a partitioned table's leaves

    @property
    def kind(self) -> str:
        return RELKIND_NAMES.get(self.relkind, f"relation of kind {self.relkind!r}")

    @property
    def is_table(self) -> bool:
        """A plain table: the only kind whose changes wal2json reports under its own name (a
        partitioned table's changes come under its leaf partitions' names)."""
        return self.relkind == "r"

    def column(self, name: str) -> Column | None:
        return next((c for c in self.columns if c.name == name), None)

    def is_unique_key(self, key: tuple[str, ...]) -> bool:
        """Whether the catalog guarantees ``key`` unique per row: a unique index on a subset of its
        columns, all of them NOT NULL (a unique index admits any number of NULLs)."""

        def not_null(name: str) -> bool:
            col = self.column(name)
            return col is not None and not col.nullable

        return any(set(u) <= set(key) and all(not_null(c) for c in u) for u in self.unique_keys)

    def covers_key(self, key: tuple[str, ...]) -> bool:
        """Whether UPDATE/DELETE events carry every column of ``key`` in their old identity."""
        return bool(key) and set(key) <= set(self.replica_identity_columns)


_DESCRIBE = """
SELECT c.oid::int8, c.relkind::text, c.relreplident::text, c.reltuples::float8,
       has_table_privilege(c.oid, 'SELECT') AND has_schema_privilege(n.oid, 'USAGE'),
       format('%%I.%%I', n.nspname, c.relname)
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(table)s
"""
_COLUMNS = """
SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), NOT a.attnotnull
FROM pg_catalog.pg_attribute a
WHERE a.attrelid = %(oid)s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""
_INDEX_COLUMNS = """
SELECT a.attname::text
FROM pg_catalog.pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = %(oid)s AND (CASE WHEN %(primary)s THEN i.indisprimary ELSE i.indisreplident END)
  AND k.ord <= i.indnkeyatts
ORDER BY k.ord
"""
_UNIQUE = """
SELECT array_agg(a.attname::text ORDER BY k.ord)
FROM pg_catalog.pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = %(oid)s AND i.indisunique AND i.indisvalid AND i.indpred IS NULL AND i.indexprs IS NULL
  AND k.ord <= i.indnkeyatts
GROUP BY i.indexrelid
"""
_LEAVES = """
SELECT n.nspname::text, c.relname::text
FROM pg_partition_tree(%(oid)s::regclass) t
JOIN pg_catalog.pg_class c ON c.oid = t.relid JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE t.isleaf ORDER BY 1, 2
"""
_SIMILAR = """
SELECT n.nspname::text, c.relname::text
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE lower(n.nspname) = lower(%(schema)s) AND lower(c.relname) = lower(%(table)s)
  AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
LIMIT 3
"""


def describe_table(conn: psycopg.Connection[Any], schema: str, table: str) -> TableDescription:
    """Describe ``schema.table`` (exact names). RegistryError if no such relation exists."""
    params: dict[str, Any] = {"schema": schema, "table": table}
    row = conn.execute(_DESCRIBE, params).fetchone()
    if row is None:
        similar = conn.execute(_SIMILAR, params).fetchall()
        hint = ""
        if similar:
            names = ", ".join(f"'{quote_table_name(s, t)}'" for s, t in similar)
            hint = f"names differ in case from {names}: quote the name exactly as created; "
        raise RegistryError(
            f"table {quote_table_name(schema, table)} does not exist in the source database",
            fix=hint
            + "check the name (and its schema: no schema means public) with \\dt in psql; "
            + QUOTING_FIX,
            schema=schema,
            table=table,
        )
    oid, relkind, replident, reltuples, can_select, sql_name = row
    columns = tuple(
        Column(name, type_, bool(nullable))
        for name, type_, nullable in conn.execute(_COLUMNS, {"oid": oid}).fetchall()
    )

    def index_columns(primary: bool) -> tuple[str, ...]:
        rows = conn.execute(_INDEX_COLUMNS, {"oid": oid, "primary": primary}).fetchall()
        return tuple(str(r[0]) for r in rows)

    primary_key = index_columns(True)
    if replident == "f":
        identity = tuple(c.name for c in columns)
    elif replident == "i":
        identity = index_columns(False)
    elif replident == "d":
        identity = primary_key
    else:
        identity = ()
    unique = tuple(tuple(r[0]) for r in conn.execute(_UNIQUE, {"oid": oid}).fetchall())
    leaves: tuple[tuple[str, str], ...] = ()
    if relkind == "p":
        leaves = tuple((str(s), str(t)) for s, t in conn.execute(_LEAVES, {"oid": oid}).fetchall())
    return TableDescription(
        schema=schema,
        table=table,
        relkind=relkind,
        columns=columns,
        primary_key=primary_key,
        replica_identity=replident,
        replica_identity_columns=identity,
        estimated_rows=max(0, int(reltuples)),
        has_select_privilege=bool(can_select),
        sql_name=str(sql_name),
        oid=int(oid),
        unique_keys=tuple(sorted(unique)),
        leaf_partitions=leaves,
    )


# --- server and slot ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ServerInfo:
    """Settings and usage that decide whether logical replication can run.

    ``max_slot_wal_keep_size`` in bytes, -1 when unlimited (the setting's default).
    ``senders_in_use``: walsender processes running now (any database).
    """

    server_version_num: int
    database: str
    wal_level: str
    max_replication_slots: int
    max_wal_senders: int
    slots_in_use: int
    senders_in_use: int
    max_slot_wal_keep_size: int
    role: str
    role_replication: bool
    role_superuser: bool
    #: ``output_plugin_libraries`` (15.20+, 16.15+, 17.11+, 18.6+): the output plugins the server lets
    #: a replication connection load; None on a server without the setting (it allows every plugin)
    output_plugin_libraries: str | None = None

    @property
    def can_replicate(self) -> bool:
        return self.role_replication or self.role_superuser

    def output_plugins_allowed(self) -> tuple[str, ...] | None:
        """The allow-list as library names, in order; None when the server has no allow-list."""
        if self.output_plugin_libraries is None:
            return None
        return tuple(
            name.strip().strip('"') for name in self.output_plugin_libraries.split(",") if name.strip()
        )

    def output_plugin_refusal(self, plugin: str) -> tuple[str, str] | None:
        """``(message, fix)`` when the server refuses to load the output plugin ``plugin``; None when
        it may. The fix is the exact ``ALTER SYSTEM`` statement (the list kept, ``plugin`` added) and
        the reload; the setting needs no restart."""
        allowed = self.output_plugins_allowed()
        if allowed is None or any(_library_name(name) == plugin for name in allowed):
            return None
        wanted = [*allowed, plugin]
        shown = ", ".join(allowed) if allowed else "(empty)"
        return (
            f"the source server refuses the {plugin} output plugin: its output_plugin_libraries is "
            f"{shown!r} (PostgreSQL 15.20, 16.15, 17.11, 18.6 and later allow only the listed plugins)",
            "as a superuser on the source, allow it and reload (no restart): "
            f"ALTER SYSTEM SET output_plugin_libraries = {', '.join(_sql_string(n) for n in wanted)}; "
            "SELECT pg_reload_conf();  -- or in postgresql.conf: "
            f"output_plugin_libraries = {_sql_string(', '.join(wanted))}, then pg_ctl reload",
        )


def _library_name(name: str) -> str:
    """``$libdir/wal2json.so`` -> ``wal2json``: the plugin a listed library name stands for."""
    base = name.rsplit("/", 1)[-1]
    return base[: -len(".so")] if base.endswith(".so") else base


def _sql_string(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


_SERVER = """
SELECT current_setting('server_version_num')::int, current_database()::text,
       current_setting('wal_level'),
       current_setting('max_replication_slots')::int, current_setting('max_wal_senders')::int,
       (SELECT count(*) FROM pg_catalog.pg_replication_slots)::int,
       (SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE backend_type = 'walsender')::int,
       (SELECT CASE WHEN setting::bigint < 0 THEN -1 ELSE setting::bigint * 1024 * 1024 END
          FROM pg_catalog.pg_settings WHERE name = 'max_slot_wal_keep_size'),
       r.rolname::text, r.rolreplication, r.rolsuper,
       (SELECT setting FROM pg_catalog.pg_settings WHERE name = 'output_plugin_libraries')
FROM pg_catalog.pg_roles r WHERE r.rolname = current_user
"""


def server_info(conn: psycopg.Connection[Any]) -> ServerInfo:
    row = conn.execute(_SERVER).fetchone()
    if row is None:  # pragma: no cover - current_user always has a pg_roles row
        raise SourceError("the connected role is not in pg_roles")
    return ServerInfo(*row)


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """A replication slot as ``pg_replication_slots`` shows it (``exists=False``: no such slot).

    LSNs as integers (:func:`cdc.events.int_to_lsn` for text). ``retained_bytes``: WAL the slot keeps
    on the source's disk (current WAL position − ``restart_lsn``); ``lag_bytes``: WAL not yet
    confirmed (current − ``confirmed_flush_lsn``). ``safe_wal_size``: bytes that can still be written
    before the slot is in danger of being lost (None when unlimited).
    """

    name: str
    exists: bool
    plugin: str | None = None
    slot_type: str | None = None
    database: str | None = None
    temporary: bool = False
    active: bool = False
    active_pid: int | None = None
    wal_status: str | None = None
    restart_lsn: int | None = None
    confirmed_flush_lsn: int | None = None
    safe_wal_size: int | None = None
    retained_bytes: int | None = None
    lag_bytes: int | None = None


_SLOT = """
SELECT plugin::text, slot_type, database::text, temporary, active, active_pid, wal_status,
       restart_lsn::text, confirmed_flush_lsn::text, safe_wal_size::int8,
       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8,
       pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8
FROM pg_catalog.pg_replication_slots WHERE slot_name = %(slot)s
"""


def slot_info(conn: psycopg.Connection[Any], slot_name: str) -> SlotInfo:
    row = conn.execute(_SLOT, {"slot": slot_name}).fetchone()
    if row is None:
        return SlotInfo(name=slot_name, exists=False)
    plugin, slot_type, database, temporary, active, pid, wal_status, restart, confirmed, safe, kept, lag = row
    return SlotInfo(
        name=slot_name,
        exists=True,
        plugin=plugin,
        slot_type=slot_type,
        database=database,
        temporary=bool(temporary),
        active=bool(active),
        active_pid=pid,
        wal_status=wal_status,
        restart_lsn=lsn_to_int(restart) if restart else None,
        confirmed_flush_lsn=lsn_to_int(confirmed) if confirmed else None,
        safe_wal_size=safe,
        retained_bytes=kept,
        lag_bytes=lag,
    )
