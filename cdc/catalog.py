"""What the source says about itself: table names, table descriptions, server and slot facts.

Ordinary SQL over psycopg 3 (no replication protocol here). Every query reads ``pg_catalog`` with
names passed as values, never spliced into SQL text; identifiers that must appear in SQL are built
with :mod:`psycopg.sql`. Functions take an open connection and leave its transaction state as they
found it when it is in autocommit mode (the callers here use autocommit connections).

Connections come from :mod:`cdc.connect`; identifier parsing and quoting live in :mod:`cdc.names`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from cdc.connect import connect as connect
from cdc.errors import RegistryError, SourceError
from cdc.events import lsn_to_int
from cdc.names import QUOTING_FIX, cli_table_name, sql_ident, sql_string
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


#: the kinds of relation whose changes can be captured: plain and partitioned tables
CAPTURABLE_RELKINDS = ("r", "p")


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
    #: per leaf partition (a partitioned table's changes come under its leaves' names, each with its own
    #: replica identity): (schema, table, relreplident, the columns its old identity carries)
    leaf_identities: tuple[tuple[str, str, str, tuple[str, ...]], ...] = ()

    @property
    def kind(self) -> str:
        return RELKIND_NAMES.get(self.relkind, f"relation of kind {self.relkind!r}")

    @property
    def is_table(self) -> bool:
        """A plain table: the only kind whose changes wal2json reports under its own name (a
        partitioned table's changes come under its leaf partitions' names)."""
        return self.relkind == "r"

    @property
    def is_capturable_kind(self) -> bool:
        """A plain table or a partitioned one (its leaves' changes go to its topic)."""
        return self.relkind in CAPTURABLE_RELKINDS

    def column(self, name: str) -> Column | None:
        return next((c for c in self.columns if c.name == name), None)

    def is_unique_key(self, key: tuple[str, ...]) -> bool:
        """Whether the catalog guarantees ``key`` unique per row: a unique index on a subset of its
        columns, all of them NOT NULL (a unique index admits any number of NULLs)."""

        def not_null(name: str) -> bool:
            col = self.column(name)
            return col is not None and not col.nullable

        return any(set(u) <= set(key) and all(not_null(c) for c in u) for u in self.unique_keys)


_DESCRIBE = """
SELECT c.oid::int8, c.relkind::text, c.relreplident::text, c.reltuples::float8,
       has_table_privilege(c.oid, 'SELECT') AND has_schema_privilege(n.oid, 'USAGE'),
       format('%%I.%%I', n.nspname, c.relname)
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(table)s
"""
#: a type's base type through domains (over domains), an array of domains as an array of the base:
#: ``base_type(oid)``, ``base_mod``, ``is_array`` for the type ``{typ}`` (an oid expression) -- a
#: LATERAL subquery with columns (base, mod): NULL when the type is no domain (nor an array of one)
_BASE_OF = """
LEFT JOIN LATERAL (
    WITH RECURSIVE d(typ, mod, depth) AS (
        SELECT dt.typbasetype, dt.typtypmod, 1 FROM pg_catalog.pg_type dt
         WHERE dt.oid = (CASE WHEN {t}.typlen = -1 AND {t}.typelem <> 0 THEN {t}.typelem ELSE {t}.oid END)
           AND dt.typtype = 'd'
        UNION ALL
        SELECT dt.typbasetype, dt.typtypmod, d.depth + 1 FROM d
          JOIN pg_catalog.pg_type dt ON dt.oid = d.typ AND dt.typtype = 'd'
    )
    SELECT CASE WHEN {t}.typlen = -1 AND {t}.typelem <> 0
                THEN (SELECT bt.typarray FROM pg_catalog.pg_type bt WHERE bt.oid = d.typ) ELSE d.typ END AS base,
           d.mod
    FROM d ORDER BY d.depth DESC LIMIT 1
) {b} ON true
"""
#: a relation's user columns (dropped and system columns left out), in attnum order: name, type
#: (through domains to the base type), nullable, and the domain's name ('' when no domain)
COLUMNS_OF = (
    """
SELECT a.attname::text,
       CASE WHEN b.base IS NULL OR b.base = 0 THEN format_type(a.atttypid, a.atttypmod)
            ELSE format_type(b.base, b.mod) END,
       NOT a.attnotnull,
       CASE WHEN b.base IS NULL OR b.base = 0 THEN '' ELSE format_type(a.atttypid, a.atttypmod) END
FROM pg_catalog.pg_attribute a
JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
"""
    + _BASE_OF.format(t="t", b="b")
    + """
WHERE a.attrelid = {rel} AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""
)
_COLUMNS = COLUMNS_OF.replace("{rel}", "%(oid)s")
#: type names as format_type() and wal2json write them -> (base type, or '' when no domain)
_TYPES = """
SELECT r.name, CASE WHEN b.base IS NULL OR b.base = 0 THEN '' ELSE format_type(b.base, b.mod) END
FROM unnest(%s::text[]) AS r(name)
LEFT JOIN pg_catalog.pg_type t ON t.oid = to_regtype(r.name)
""" + _BASE_OF.format(t="t", b="b")
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
#: a partitioned table's leaves with what their old identity carries (see _identity_of)
_LEAVES = """
SELECT n.nspname::text, c.relname::text, c.relreplident::text,
       coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_catalog.pg_attribute a
                  WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}'),
       coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_catalog.pg_index i
                   JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
                  WHERE i.indrelid = c.oid AND i.indisprimary), '{}'),
       coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_catalog.pg_index i
                   JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
                  WHERE i.indrelid = c.oid AND i.indisreplident), '{}')
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
            names = ", ".join(cli_table_name(s, t) for s, t in similar)
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
        Column(name, type_, bool(nullable), domain)
        for name, type_, nullable, domain in conn.execute(_COLUMNS, {"oid": oid}).fetchall()
    )

    def index_columns(primary: bool) -> tuple[str, ...]:
        rows = conn.execute(_INDEX_COLUMNS, {"oid": oid, "primary": primary}).fetchall()
        return tuple(str(r[0]) for r in rows)

    primary_key = index_columns(True)
    identity = _identity_of(
        replident,
        tuple(c.name for c in columns),
        primary_key,
        index_columns(False) if replident == "i" else (),
    )
    unique = tuple(tuple(r[0]) for r in conn.execute(_UNIQUE, {"oid": oid}).fetchall())
    leaf_ids: tuple[tuple[str, str, str, tuple[str, ...]], ...] = ()
    if relkind == "p":
        leaf_ids = tuple(
            (str(s), str(t), str(ident), _identity_of(str(ident), tuple(cols), tuple(pk), tuple(idx)))
            for s, t, ident, cols, pk, idx in conn.execute(_LEAVES, {"oid": oid}).fetchall()
        )
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
        leaf_partitions=tuple((s, t) for s, t, _, _ in leaf_ids),
        leaf_identities=leaf_ids,
    )


_LEAVES_OF = """
SELECT n.nspname::text, c.relname::text
FROM pg_catalog.pg_class p JOIN pg_catalog.pg_namespace pn ON pn.oid = p.relnamespace
CROSS JOIN LATERAL pg_partition_tree(p.oid) t
JOIN pg_catalog.pg_class c ON c.oid = t.relid JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE pn.nspname = %(schema)s AND p.relname = %(table)s AND p.relkind = 'p' AND t.isleaf
ORDER BY 1, 2
"""


#: per table: a digest of what :func:`capture_problems` reads from the catalog (its kind, replica
#: identity, columns, indexes; its leaves' too), to tell when it must be asked again
_CAPTURE_DIGEST = """
SELECT r.schema_name, r.table_name, md5(string_agg(
         l.oid::text || l.relkind::text || l.relreplident::text
         || coalesce((SELECT string_agg(a.attname::text || ':' || a.atttypid::text, ',' ORDER BY a.attnum)
                        FROM pg_catalog.pg_attribute a
                       WHERE a.attrelid = l.oid AND a.attnum > 0 AND NOT a.attisdropped), '')
         || coalesce((SELECT string_agg(i.indexrelid::text || ':' || i.indisprimary::text || i.indisreplident::text
                                        || i.indisunique::text || i.indkey::text, ',' ORDER BY i.indexrelid)
                        FROM pg_catalog.pg_index i WHERE i.indrelid = l.oid), '')
         || has_table_privilege(c.oid, 'SELECT')::text, '|' ORDER BY l.oid))
FROM unnest(%s::text[], %s::text[]) AS r(schema_name, table_name)
JOIN pg_catalog.pg_namespace n ON n.nspname = r.schema_name
JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = r.table_name
LEFT JOIN LATERAL pg_partition_tree(CASE WHEN c.relkind = 'p' THEN c.oid END::regclass) t ON true
JOIN pg_catalog.pg_class l ON l.oid = coalesce(t.relid, c.oid)
GROUP BY 1, 2
"""


def capture_digests(
    conn: psycopg.Connection[Any], names: list[tuple[str, str]]
) -> dict[tuple[str, str], str]:
    """Per existing table of ``names``: a digest of the catalog facts :func:`capture_problems`
    judges (one query for all): while it is unchanged, so are the table's problems."""
    rows = conn.execute(_CAPTURE_DIGEST, [[s for s, _ in names], [t for _, t in names]]).fetchall()
    return {(str(s), str(t)): str(d) for s, t, d in rows}


def leaf_partitions(conn: psycopg.Connection[Any], schema: str, table: str) -> list[tuple[str, str]]:
    """The leaf partitions (schema, table) of the partitioned table ``schema.table`` now; ``[]``
    for a plain table, or none."""
    return [(str(s), str(t)) for s, t in conn.execute(_LEAVES_OF, {"schema": schema, "table": table})]


def _identity_of(
    replident: str, columns: tuple[str, ...], primary_key: tuple[str, ...], index: tuple[str, ...]
) -> tuple[str, ...]:
    """The columns an UPDATE/DELETE carries as old identity under REPLICA IDENTITY ``replident``."""
    return {"f": columns, "i": index, "d": primary_key}.get(replident, ())


def resolve_domains(
    conn: psycopg.Connection[Any], columns: tuple[Column, ...], cache: dict[str, str] | None = None
) -> tuple[Column, ...]:
    """``columns`` whose type is named as the source names it (wal2json, the DDL recorder): a
    domain (or an array of one) becomes its base type, the name kept in :attr:`Column.domain`.
    Columns already resolved (``domain`` set) are kept. ``cache``: type name -> base type ('' for
    no domain), filled here (a domain's base type cannot change while a column uses it)."""
    bases = {} if cache is None else cache
    names = sorted({c.type for c in columns if not c.domain and c.type not in bases})
    if names:
        bases.update({str(n): str(b) for n, b in conn.execute(_TYPES, [names]).fetchall()})
    if not any(bases.get(c.type) for c in columns if not c.domain):
        return columns
    return tuple(
        Column(c.name, bases[c.type], c.nullable, c.type) if not c.domain and bases.get(c.type) else c
        for c in columns
    )


def type_namer(conn: psycopg.Connection[Any]) -> Callable[[int, int], str]:
    """``(type oid, typmod) -> name`` as ``format_type`` gives it (what wal2json sends as a column's
    type, e.g. ``character varying(20)``, a domain by its name), cached: pgoutput's Relation
    messages name a column's type only by its oid. Called from the thread that owns ``conn``."""
    cache: dict[tuple[int, int], str] = {}

    def name(oid: int, typmod: int) -> str:
        got = cache.get((oid, typmod))
        if got is None:
            row = conn.execute("SELECT format_type(%s::oid, %s)", [oid, typmod]).fetchone()
            got = cache[(oid, typmod)] = str(row[0]) if row and row[0] is not None else str(oid)
        return got

    return name


# --- can this table be captured? ---------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CaptureProblem:
    """Why a table cannot be captured (keyed by ``key``), with the fix. The one rule every caller
    uses: ``cdc tables add`` refuses the first, ``cdc check`` reports each as a finding, the reader
    refuses a streamed table for the kinds ``key`` and ``identity``.

    ``check``: the ``cdc check`` check it belongs to (``registered_tables``, ``replica_identity``,
    ``select_privilege``). ``kind``: ``missing`` (no such table), ``relkind`` (not a table),
    ``key`` (a key column does not exist), ``identity`` (UPDATEs and DELETEs would not carry the key:
    wal2json drops them), ``privilege`` (the role cannot read it for a snapshot).
    """

    check: str
    kind: str
    message: str
    fix: str
    values: dict[str, Any] = field(default_factory=dict)


_IDENTITY_NAMES = {"d": "DEFAULT", "f": "FULL", "n": "NOTHING", "i": "USING INDEX"}


def capture_problems(
    schema: str, table: str, desc: TableDescription | None, key: tuple[str, ...], *, role: str
) -> list[CaptureProblem]:
    """What stops ``schema.table`` (``desc``: its description, None when it does not exist) from
    being captured keyed by ``key`` (empty: it has no key) by ``role``; ``[]`` when nothing does.
    A partitioned table is capturable; its leaves' replica identities must carry the key."""
    name = quote_table_name(schema, table)
    cli = cli_table_name(schema, table)
    values: dict[str, Any] = {"table": f"{schema}.{table}"}
    if desc is None:
        return [
            CaptureProblem(
                "registered_tables",
                "missing",
                f"table {name} does not exist in the source (dropped or renamed?)",
                f"recreate it, or remove the registration: cdc tables remove {cli}",
                values,
            )
        ]
    if not desc.is_capturable_kind:
        return [
            CaptureProblem(
                "registered_tables",
                "relkind",
                f"{name} is a {desc.kind}; only tables and partitioned tables can be captured "
                "(logical decoding carries changes of tables only)",
                f"capture the table(s) it reads from instead; a registration of it: cdc tables remove {cli}",
                {**values, "relkind": desc.relkind},
            )
        ]
    out = [*_key_problems(desc, key, name, cli, values)]
    if not desc.has_select_privilege:
        schema_sql = sql_ident(desc.schema)
        out.append(
            CaptureProblem(
                "select_privilege",
                "privilege",
                f"role {role!r} cannot SELECT from {name}; the snapshot cannot read it",
                f'GRANT USAGE ON SCHEMA {schema_sql} TO "{role}"; GRANT SELECT ON {desc.sql_name} TO "{role}";',
                {**values, "role": role},
            )
        )
    return out


def key_columns_gone(schema: str, table: str, missing: list[str]) -> CaptureProblem:
    """The problem of a table whose key column(s) ``missing`` do not exist (kind ``key``)."""
    name, cli = quote_table_name(schema, table), cli_table_name(schema, table)
    return CaptureProblem(
        "registered_tables",
        "key",
        f"key column(s) {', '.join(missing)} of {name} do not exist in the source (dropped or "
        "renamed?); its changes cannot be keyed",
        f"register it again with its new key: cdc tables remove {cli} then cdc tables add {cli} "
        "[--key ...] (a new snapshot); or rename the column back",
        {"table": f"{schema}.{table}", "missing": missing},
    )


def _key_problems(
    desc: TableDescription, key: tuple[str, ...], name: str, cli: str, values: dict[str, Any]
) -> list[CaptureProblem]:
    full = f"ALTER TABLE {desc.sql_name} REPLICA IDENTITY FULL;"
    if not key:
        return [
            CaptureProblem(
                "replica_identity",
                "identity",
                f"table {name} has no primary key: under REPLICA IDENTITY DEFAULT wal2json drops its "
                "UPDATEs and DELETEs without an error",
                f"add a primary key (ALTER TABLE {desc.sql_name} ADD PRIMARY KEY (...)), or name the key "
                f"with --key COL,... and run {full}",
                values,
            )
        ]
    missing = [c for c in key if desc.column(c) is None]
    if missing:
        return [key_columns_gone(desc.schema, desc.table, missing)]
    leaves = desc.leaf_identities or (
        (desc.schema, desc.table, desc.replica_identity, desc.replica_identity_columns),
    )
    for leaf_schema, leaf, ident, carried in leaves:
        if set(key) <= set(carried):
            continue
        where = name if (leaf_schema, leaf) == (desc.schema, desc.table) else f"{name} (partition {leaf})"
        if ident == "d" and not carried:
            why = "it has no primary key and REPLICA IDENTITY DEFAULT"
        else:
            why = f"REPLICA IDENTITY {_IDENTITY_NAMES.get(ident, ident)} carries: {', '.join(carried) or 'nothing'}"
        target = desc.sql_name if leaf == desc.table else f"{sql_ident(leaf_schema)}.{sql_ident(leaf)}"
        alter = f"ALTER TABLE {target} REPLICA IDENTITY FULL;"
        pk = ""
        if desc.primary_key and tuple(desc.primary_key) != tuple(key):
            pk = f", or register it keyed by its primary key ({', '.join(desc.primary_key)}): without --key"
        return [
            CaptureProblem(
                "replica_identity",
                "identity",
                f"the key ({', '.join(key)}) is not carried by the replica identity of {where} ({why}): "
                "its UPDATEs and DELETEs cannot be keyed: wal2json drops them, and pgoutput's publication "
                "makes the source refuse them",
                f"{alter} (or make the key its primary key{pk})",
                {**values, "replica_identity": ident, "key": list(key), "partition": leaf},
            )
        ]
    return []


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
            f"ALTER SYSTEM SET output_plugin_libraries = {', '.join(sql_string(n) for n in wanted)}; "
            "SELECT pg_reload_conf();  -- or in postgresql.conf: "
            f"output_plugin_libraries = {sql_string(', '.join(wanted))}, then pg_ctl reload",
        )


def _library_name(name: str) -> str:
    """``$libdir/wal2json.so`` -> ``wal2json``: the plugin a listed library name stands for."""
    base = name.rsplit("/", 1)[-1]
    return base[: -len(".so")] if base.endswith(".so") else base


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


# --- creating a slot -------------------------------------------------------------------------------
#: PostgreSQL 17 has failover slots: a logical slot created with ``failover`` is kept in sync on a
#: physical standby (``sync_replication_slots``), and stays usable there after its promotion
FAILOVER_SLOTS_VERSION = 170000


def failover_supported(server_version: int) -> bool:
    """Whether a server of ``server_version`` (``server_version_num``) can create failover slots."""
    return server_version >= FAILOVER_SLOTS_VERSION


def pgoutput_protocol(server_version: int) -> tuple[int, str]:
    """pgoutput's highest ``proto_version`` on a server of ``server_version`` and the ``streaming``
    level it brings: 4 and ``parallel`` (PostgreSQL 16+), 3 (15: two-phase) and 2 (14) with
    ``on`` (in-progress transactions streamed), 1 with ``off`` before (whole transactions only)."""
    if server_version >= 160000:
        return 4, "parallel"
    if server_version >= 150000:
        return 3, "on"
    if server_version >= 140000:
        return 2, "on"
    return 1, "off"


def create_logical_slot(
    conn: psycopg.Connection[Any], slot: str, plugin: str, *, failover: bool | None = None
) -> int:
    """Create the persistent logical slot ``slot`` with output plugin ``plugin`` (``"wal2json"``,
    ``"pgoutput"``) in the connected database; returns its consistent point. ``failover``: a slot
    a standby keeps in sync (PostgreSQL 17+); None: wherever the server supports it."""
    if failover is None:
        failover = failover_supported(conn.info.server_version)
    if failover:
        query = "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, %s, false, false, true)"
    else:
        query = "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, %s)"
    row = conn.execute(query, [slot, plugin]).fetchone()
    assert row is not None  # the function returns one row or raises
    return lsn_to_int(str(row[0]))


def create_slot_command(
    slot: str, plugin: str, *, temporary: bool, server_version: int, failover: bool | None = None
) -> str:
    """The replication-protocol command that creates the logical slot ``slot`` with output plugin
    ``plugin`` and exports its snapshot (the initial snapshot reads under it): with ``failover``
    where the server supports it and the slot is persistent (a temporary slot cannot fail over).
    ``slot`` and ``plugin`` are validated by the caller (``[a-z_][a-z0-9_]*``)."""
    if failover is None:
        failover = failover_supported(server_version) and not temporary
    temp = " TEMPORARY" if temporary else ""
    if failover:
        return (
            f'CREATE_REPLICATION_SLOT "{slot}"{temp} LOGICAL "{plugin}" (FAILOVER true, SNAPSHOT \'export\')'
        )
    return f'CREATE_REPLICATION_SLOT "{slot}"{temp} LOGICAL "{plugin}" EXPORT_SNAPSHOT'


# --- failover slots (PostgreSQL 17+) --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SyncedSlot:
    """A standby's copy of a logical slot (``pg_replication_slots`` there). It is *ready* -- the
    slot survives the standby's promotion with the position the primary's had when last synced --
    when ``synced AND NOT temporary``: a copy stays temporary until the primary's slot has moved
    past the WAL and catalog xmin the standby could reserve for it."""

    name: str
    synced: bool
    temporary: bool
    failover: bool
    confirmed_flush_lsn: int | None
    invalidation_reason: str | None

    @property
    def ready(self) -> bool:
        return self.synced and not self.temporary and self.invalidation_reason is None


_SYNCED_SLOT = """
SELECT synced, temporary, failover, confirmed_flush_lsn::text, invalidation_reason
FROM pg_catalog.pg_replication_slots WHERE slot_name = %(slot)s
"""


def synced_slot(conn: psycopg.Connection[Any], slot_name: str) -> SyncedSlot | None:
    """The standby's copy of ``slot_name`` (failover readiness: :attr:`SyncedSlot.ready`); None
    when it has none. The server must be PostgreSQL 17+ (:func:`failover_supported`)."""
    row = conn.execute(_SYNCED_SLOT, {"slot": slot_name}).fetchone()
    if row is None:
        return None
    synced, temporary, failover, confirmed, reason = row
    return SyncedSlot(
        slot_name,
        bool(synced),
        bool(temporary),
        bool(failover),
        lsn_to_int(confirmed) if confirmed else None,
        reason,
    )


@dataclass(frozen=True, slots=True)
class FailoverInfo:
    """What one server says about failover slots (PostgreSQL 17+), primary or standby.

    ``synchronized_standby_slots``: the physical slots a logical consumer may not get ahead of (a
    primary's setting; '' unset). ``physical_slots``: this server's physical slots (its standbys').
    ``standbys``: walsenders streaming to a standby now. ``conninfo_has_dbname``: whether
    ``primary_conninfo`` names a database (a standby's slot-sync worker connects to one); None when
    the role may not read it (it is superuser-only: pg_read_all_settings reads it).
    ``slot``: this server's copy of our slot (None: none).
    """

    in_recovery: bool
    synchronized_standby_slots: str
    physical_slots: tuple[str, ...]
    standbys: int
    sync_replication_slots: bool
    hot_standby_feedback: bool
    primary_slot_name: str
    conninfo_has_dbname: bool | None
    slot: SyncedSlot | None


_FAILOVER = """
SELECT pg_is_in_recovery(), current_setting('synchronized_standby_slots'),
       coalesce((SELECT array_agg(slot_name::text ORDER BY slot_name) FROM pg_catalog.pg_replication_slots
                  WHERE slot_type = 'physical'), '{}'),
       (SELECT count(*) FROM pg_catalog.pg_stat_replication)::int,
       current_setting('sync_replication_slots')::bool, current_setting('hot_standby_feedback')::bool,
       current_setting('primary_slot_name'),
       (SELECT setting FROM pg_catalog.pg_settings WHERE name = 'primary_conninfo')
"""


def failover_info(conn: psycopg.Connection[Any], slot_name: str) -> FailoverInfo:
    """The failover facts of the server behind ``conn`` (PostgreSQL 17+; see :class:`FailoverInfo`).
    ``primary_conninfo`` is read only to tell whether it names a database (it may hold a password:
    it is never kept or shown)."""
    row = conn.execute(_FAILOVER).fetchone()
    assert row is not None
    in_recovery, sync_standby, physical, standbys, sync_slots, feedback, slot_name_setting, conninfo = row
    has_dbname: bool | None = None
    if conninfo is not None:  # pg_settings leaves out a superuser-only setting the role may not read
        try:
            has_dbname = bool(conninfo_to_dict(conninfo).get("dbname")) if conninfo else False
        except psycopg.ProgrammingError:
            has_dbname = False
    return FailoverInfo(
        in_recovery=bool(in_recovery),
        synchronized_standby_slots=str(sync_standby or ""),
        physical_slots=tuple(physical),
        standbys=int(standbys),
        sync_replication_slots=bool(sync_slots),
        hot_standby_feedback=bool(feedback),
        primary_slot_name=str(slot_name_setting or ""),
        conninfo_has_dbname=has_dbname,
        slot=synced_slot(conn, slot_name),
    )


# --- the reader's watch on its tables (cdc.reader.watch) ----------------------------------------
#: per source table: None (it does not exist), () (a plain table) or its leaf partitions
Leaves = tuple[tuple[str, str], ...] | None

_IS_TABLE = """
SELECT count(*) FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r', 'p')
"""


def is_table(conn: psycopg.Connection[Any], name: tuple[str, str]) -> bool:
    """Whether the table (or partitioned table) ``name`` (schema, table) exists."""
    row = conn.execute(_IS_TABLE, list(name)).fetchone()
    return bool(row and row[0])


_SOURCE_TABLES = """
SELECT n.nspname::text, c.relname::text, c.relkind::text, ln.nspname::text, l.relname::text
FROM unnest(%s::text[], %s::text[]) AS r(schema_name, table_name)
JOIN pg_catalog.pg_namespace n ON n.nspname = r.schema_name
JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = r.table_name AND c.relkind IN ('r', 'p')
LEFT JOIN LATERAL pg_partition_tree(CASE WHEN c.relkind = 'p' THEN c.oid END::regclass) t ON t.isleaf
LEFT JOIN pg_catalog.pg_class l ON l.oid = t.relid
LEFT JOIN pg_catalog.pg_namespace ln ON ln.oid = l.relnamespace
"""


def source_tables(
    conn: psycopg.Connection[Any], names: list[tuple[str, str]]
) -> dict[tuple[str, str], Leaves]:
    """Per table of ``names`` (schema, table): None when it does not exist at the source (dropped,
    or renamed), else the leaf partitions of a partitioned table (wal2json reports a partitioned
    table's changes under its leaves' names), ``()`` for a plain table (one query for all)."""
    out: dict[tuple[str, str], Leaves] = dict.fromkeys(names)
    if not names:
        return out
    parts: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for schema, table, kind, leaf_schema, leaf in conn.execute(
        _SOURCE_TABLES, [[s for s, _ in names], [t for _, t in names]]
    ).fetchall():
        lst = parts.setdefault((str(schema), str(table)), [])
        if kind == "p" and leaf is not None:
            lst.append((str(leaf_schema), str(leaf)))
    for key, lst in parts.items():
        out[key] = tuple(sorted(lst))
    return out


_TABLE_COLUMNS = """
SELECT r.schema_name, r.table_name, array_agg(a.attname::text) FILTER (WHERE a.attname IS NOT NULL)
FROM unnest(%s::text[], %s::text[]) AS r(schema_name, table_name)
JOIN pg_catalog.pg_namespace n ON n.nspname = r.schema_name
JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = r.table_name
LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
GROUP BY 1, 2
"""


def column_names(conn: psycopg.Connection[Any], schema: str, table: str) -> set[str] | None:
    """The names of the table's columns now (dropped ones left out); None when it does not exist."""
    rows = conn.execute(_TABLE_COLUMNS, [[schema], [table]]).fetchall()
    return set(rows[0][2] or ()) if rows else None


_TABLE_OIDS = """
SELECT c.oid::bigint, n.nspname::text, c.relname::text
FROM unnest(%s::text[], %s::text[]) AS r(schema_name, table_name)
JOIN pg_catalog.pg_namespace n ON n.nspname = r.schema_name
JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = r.table_name AND c.relkind IN ('r', 'p')
"""


def table_oids(conn: psycopg.Connection[Any], names: list[tuple[str, str]]) -> dict[int, tuple[str, str]]:
    """The oid of each table of ``names`` that exists (oid -> (schema, table))."""
    if not names:
        return {}
    rows = conn.execute(_TABLE_OIDS, [[s for s, _ in names], [t for _, t in names]]).fetchall()
    return {int(oid): (str(schema), str(table)) for oid, schema, table in rows}
