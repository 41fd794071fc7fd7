"""Snapshots: read registered tables and write ``op=r`` events (``docs/snapshots.md``).

Two kinds: the initial snapshot, under an exported snapshot (below, :mod:`snapshot.exported`), and
every later one, in chunks while streaming (:mod:`snapshot.chunked`). Both read with a plain COPY
and build the events in the service (:mod:`snapshot.encode`). The initial snapshot's interface:

* :func:`create_exported_slot` runs ``CREATE_REPLICATION_SLOT <slot> [TEMPORARY] LOGICAL <plugin>``
  exporting its snapshot (a persistent slot with ``FAILOVER`` on PostgreSQL 17+:
  :func:`cdc.catalog.create_slot_command`) on a replication connection and returns the snapshot
  name and the slot's consistent point. That connection must stay open and idle until every reader has imported the
  snapshot (closing it drops a temporary slot and ends the export).
* :func:`read_tables` (in :mod:`snapshot.exported`) reads tables under that snapshot: every worker
  thread has its own psycopg 3 connection that runs ``BEGIN ISOLATION LEVEL REPEATABLE READ;
  SET TRANSACTION SNAPSHOT '<name>'`` first, then ``COPY (SELECT ...) TO STDOUT (FORMAT csv)``. It
  appends each row as an ``op=r`` event with version ``(consistent_lsn, 0)`` in durable batches and
  returns, per table, the alignment (consistent point and the topic's end offsets right after the
  table's last row). The caller records it in the registry.

Failure: a table whose snapshot fails does not stop the others; :func:`read_tables` then raises
:class:`SnapshotError` naming the first failed table (and the value's column, when a value could not
be encoded), carrying the tables that completed (``done``): the caller records those as snapshotted
and leaves the others to a chunked snapshot while streaming from the slot. A run killed outright
records nothing; the next run snapshots again from scratch under a new slot, starting with a
TRUNCATE marker just below the new consistent point so the rows of the killed run (keys deleted
since included) are superseded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from cdc.catalog import create_slot_command
from cdc.codec.plugins import OutputPlugin
from cdc.connect import classify, is_transient, sqlstate
from cdc.errors import CdcError, SourceError
from cdc.events import lsn_to_int
from cdc.registry import Alignment, Column, TableReg


@dataclass(frozen=True, slots=True)
class ExportedSnapshot:
    """A snapshot exported by a replication connection: its name and the slot's consistent point."""

    slot: str
    name: str
    consistent_lsn: int


@dataclass(frozen=True, slots=True)
class TableSnapshot:
    """The outcome of one table's snapshot."""

    reg: TableReg
    columns: tuple[Column, ...]
    rows: int
    alignment: Alignment


class Progress(Protocol):
    """Progress of a snapshot, per table (called from worker threads)."""

    def start(self, table: str, estimate: int) -> None: ...

    def advance(self, table: str, rows: int) -> None: ...

    def finish(self, table: str, rows: int) -> None: ...

    def close(self) -> None: ...


def create_exported_slot(
    repl_cursor: Any, slot: str, *, temporary: bool, plugin: OutputPlugin
) -> ExportedSnapshot:
    """Create a logical slot with output plugin ``plugin`` that exports its snapshot, on a psycopg2
    replication connection's cursor (psycopg2's create_replication_slot does not export); a
    persistent one is a failover slot where the server supports it (PostgreSQL 17+). The slot name
    is validated by the caller (``[a-z_][a-z0-9_]*``)."""
    version = int(repl_cursor.connection.server_version)
    repl_cursor.execute(create_slot_command(slot, plugin.name, temporary=temporary, server_version=version))
    row = repl_cursor.fetchone()
    return ExportedSnapshot(slot=str(row[0]), name=str(row[2]), consistent_lsn=lsn_to_int(str(row[1])))


class SnapshotError(SourceError):
    """A table's snapshot failed for a reason nobody foresaw (``table``; ``column``: the column of
    the value that could not be read or encoded, None when unknown; ``cause``: the underlying
    error's type). ``done``: the tables whose snapshot completed before it was raised."""

    done: list[TableSnapshot]


def snapshot_error(
    table: str, column: str | None, exc: BaseException, dsn: str | None = None
) -> SnapshotError:
    """The :class:`SnapshotError` for ``exc``, raised while reading ``table`` (its ``column``). With
    ``dsn``, a permanent refusal of the source (a privilege, a missing object) keeps the message, fix
    and exit code :func:`cdc.connect.classify` gives it."""
    if isinstance(exc, SnapshotError):
        return exc
    if dsn is not None and not isinstance(exc, CdcError) and sqlstate(exc) and not is_transient(exc):
        exc = classify(exc, dsn)
    where = f", column {column}" if column else ""
    if isinstance(exc, CdcError):  # foreseen, with its own fix
        what, fix = exc.message, exc.fix or "see the message"
    else:
        what = f"{type(exc).__name__}: {str(exc)[:300]}"
        fix = (
            f"report this value of {table}.{column} with the column's type (`cdc tables list`); "
            f"meanwhile exclude the column (`cdc tables add {table} ... --exclude {column}`)"
            if column
            else "report this error with the table's column types (`cdc tables list`)"
        )
    err = SnapshotError(
        f"the snapshot of {table} failed{where}: {what}",
        fix=fix
        + "; the tables already snapshotted are kept, and `cdc run` snapshots this one again in chunks",
        table=table,
        column=column,
        cause=type(exc).__name__,
    )
    err.done = []
    if isinstance(exc, CdcError):
        err.exit_code = exc.exit_code
    return err


__all__ = [
    "ExportedSnapshot",
    "Progress",
    "SnapshotError",
    "TableSnapshot",
    "create_exported_slot",
    "snapshot_error",
]
