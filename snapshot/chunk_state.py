"""What a chunked snapshot keeps outside the stream: its options (``[snapshot]``), its watermark
table on the source, and its resume state in the registry (:class:`ChunkProgress`).

Split from :mod:`snapshot.chunked` so that verbs which only read or check this state (``cdc tables
list``, ``cdc check``) do not import pyarrow and the chunk reader.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import psycopg
from psycopg import sql

from cdc.config import Settings, SnapshotConfig, section_options
from cdc.errors import SourceError
from cdc.names import parse_table_name
from cdc.registry import Registry, TableState

__all__ = [
    "ChunkProgress",
    "SnapshotOptions",
    "check_watermark_table",
    "ensure_watermark_table",
    "load_progress",
    "progress_view",
    "save_progress",
    "watermark_ddl",
]


# --- options -----------------------------------------------------------------------------------
class SnapshotOptions(SnapshotConfig):
    """``[snapshot]`` of ``cdc.toml``, whose model (:class:`cdc.config.SnapshotConfig`) holds each
    key's default and bounds."""

    @classmethod
    def from_settings(cls, settings: Settings) -> SnapshotOptions:
        return section_options(cls, settings, "snapshot")

    @classmethod
    def from_mapping(cls, raw: Any) -> SnapshotOptions:
        return section_options(cls, Settings(extra={"snapshot": raw}), "snapshot")

    @property
    def watermark(self) -> tuple[str, str]:
        return parse_table_name(self.watermark_table)


def watermark_ddl(schema: str, table: str) -> sql.Composed:
    return sql.SQL(
        "CREATE TABLE IF NOT EXISTS {} (slot text PRIMARY KEY, mark text NOT NULL, "
        "written_at timestamptz NOT NULL DEFAULT now())"
    ).format(sql.Identifier(schema, table))


def ensure_watermark_table(conn: psycopg.Connection[Any], schema: str, table: str) -> bool:
    """Create the watermark table if it does not exist; True if it was created. A role that may not
    create it gets a SourceError with the DDL a DBA can run (or ``cdc check --fix``)."""
    row = conn.execute(
        "SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s",
        [schema, table],
    ).fetchone()
    if row is not None:
        return False
    ddl = watermark_ddl(schema, table)
    try:
        conn.execute(ddl)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise SourceError(
            f"the watermark table {schema}.{table} does not exist and this role may not create it",
            fix=f"have a DBA run: {ddl.as_string(conn)}; GRANT INSERT, UPDATE, SELECT ON it to the cdc role "
            "(or run `cdc check --fix` as a role that may)",
            table=f"{schema}.{table}",
        ) from exc
    return True


_WATERMARK_STATE = """
SELECT c.oid IS NOT NULL,
       coalesce(has_table_privilege(c.oid, 'INSERT') AND has_table_privilege(c.oid, 'UPDATE')
                AND has_table_privilege(c.oid, 'SELECT'), false),
       coalesce(has_schema_privilege(n.oid, 'CREATE'), false),
       n.oid IS NOT NULL,
       coalesce((SELECT array_agg(a.attname::text ORDER BY a.attnum) FROM pg_catalog.pg_attribute a
                 WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped), '{}')
FROM (SELECT 1) one
LEFT JOIN pg_catalog.pg_namespace n ON n.nspname = %(schema)s
LEFT JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = %(table)s
"""


def check_watermark_table(
    conn: psycopg.Connection[Any], schema: str, table: str
) -> tuple[str, str, str] | None:
    """``cdc check``'s view of the watermark table: None when usable (or missing but ``cdc run``
    may create it), else ``(severity, message, fix)``."""
    row = conn.execute(_WATERMARK_STATE, {"schema": schema, "table": table}).fetchone()
    assert row is not None
    exists, writable, can_create, schema_exists, columns = row
    ddl = watermark_ddl(schema, table).as_string(conn)
    what = (
        f"the watermark table {schema}.{table} (two small writes per chunk of a chunked snapshot: tables "
        "registered later, `cdc snapshot`, recovery after a lost slot)"
    )
    if not exists:
        if schema_exists and can_create:
            return None
        return (
            "warning",
            f"{what} does not exist and this role may not create it",
            f"run `cdc check --fix` as a role that may, or have a DBA run: {ddl}; "
            f"GRANT SELECT, INSERT, UPDATE ON {schema}.{table} TO <the cdc role>",
        )
    if not {"slot", "mark"} <= set(columns):
        return (
            "error",
            f"{what} exists but lacks the columns slot and mark (it has {', '.join(columns)})",
            f"point [snapshot] watermark_table at another table, or drop this one and run `cdc check --fix`: {ddl}",
        )
    if not writable:
        return (
            "error",
            f"{what} exists but this role may not SELECT, INSERT and UPDATE it",
            f"GRANT SELECT, INSERT, UPDATE ON {schema}.{table} TO <the cdc role>",
        )
    return None


# --- progress (durable, in the registry) --------------------------------------------------------
@dataclass
class ChunkProgress:
    """Resume state of one table's chunked snapshot (registry state ``chunked:[schema, table]``).

    ``after``: the key (text values, key-column order) of the last done chunk's upper bound; None
    before the first. ``floor``: the commit LSN of the run's first LW. ``full``: no ``--where``
    and no ``partitions`` (ends with the TRUNCATE marker). ``partitions``: read only these leaves of
    a partitioned table (attached to it; the rows of its other leaves are in the topic already).
    ``done``: every chunk is durable.
    """

    run: str
    full: bool = True
    where: str | None = None
    partitions: list[list[str]] | None = None
    after: list[str] | None = None
    chunks: int = 0
    rows: int = 0
    read: int = 0
    floor: int | None = None
    last_lsn: int | None = None
    estimate: int = 0
    chunk_size: int = SnapshotConfig().chunk_size  # (a progress saved before it was recorded)
    started: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    done: bool = False

    def to_json(self) -> str:
        return orjson.dumps(asdict(self)).decode()

    @classmethod
    def from_json(cls, text: str) -> ChunkProgress:
        body = orjson.loads(text)
        return cls(**{k: v for k, v in body.items() if k in cls.__dataclass_fields__})


def load_progress(registry: Registry, schema: str, table: str) -> ChunkProgress | None:
    raw = registry.get_table_state(TableState.CHUNKED_PROGRESS, schema, table)
    return ChunkProgress.from_json(raw) if raw else None


def save_progress(registry: Registry, schema: str, table: str, progress: ChunkProgress) -> None:
    registry.set_table_state(TableState.CHUNKED_PROGRESS, schema, table, progress.to_json())


def progress_view(progress: ChunkProgress | None) -> dict[str, Any] | None:
    """What ``cdc tables list`` shows: chunks done and left (from the row estimate), rows, the rate
    (rows read per second since the run started) and the ETA in seconds (None when unknown)."""
    if progress is None:
        return None
    elapsed = max(progress.updated - progress.started, 1e-6)
    rate = progress.read / elapsed if progress.read else 0.0
    left_rows = max(progress.estimate - progress.read, 0)
    left = 0 if progress.done else max(-(-left_rows // max(progress.chunk_size, 1)), 1)
    return {
        "run": progress.run,
        "done": progress.done,
        "chunks_done": progress.chunks,
        "chunks_left": left,
        "rows_read": progress.read,
        "rows_written": progress.rows,
        "estimate": progress.estimate,
        "rate": round(rate, 1),
        "eta_s": None if progress.done or not rate else round(left_rows / rate, 1),
        "where": progress.where,
        "partitions": progress.partitions,
    }
