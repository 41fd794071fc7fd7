"""Open Delta tables, reused from batch to batch instead of opened anew at every use.

Opening a Delta table replays its log from the last checkpoint: 12 ms of CPU at 60 commits, more as
the log grows to the next checkpoint (every 100 commits); bringing an open one up to date reads only
the commits since (:func:`refresh`: one ``stat`` when there are none). A slice of a micro-batch used to open each of its
table's Delta tables five times, and the driver each one twice more per batch (its commit, the disk
bound): a fixed cost per batch that, for the small batches of an apply that keeps up, was as large
as the work.

:meth:`Handles.get` returns the table at ``path`` at its latest committed version, whoever
committed it (the handle reads the new log entries), as a new ``DeltaTable(path)`` would. A handle
is reused only while the table is the same one: its identity marker (:func:`mark`), or for a table
without one its log's first commit file, is the one the handle was opened on (same inode, size and
modification time). A table deleted and created again, or swapped in by ``cdc rebuild``, is opened
anew, and so is one without a marker whose first commit file is gone (log cleanup after a
checkpoint): reuse is an optimisation, never a condition. Not shared between
threads: each thread has its own handles (a ``DeltaTable`` brought up to date in one thread while
another reads it is not safe).
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from pathlib import Path
from urllib.parse import unquote

from deltalake import DeltaTable

#: a Delta table's log directory, and the name of a commit file in it (its version)
LOG_DIR = "_delta_log"
COMMIT = re.compile(r"^(\d{20})\.json$")
_FIRST_COMMIT = os.path.join(LOG_DIR, f"{0:020d}.json")

#: a file the warehouse writes once into each Delta table it creates, beside its log: what identifies
#: the table, when its log's cleanup has deleted the first commit file (the underscore hides it from
#: Delta readers and from vacuum)
MARKER = "_cdc_table"

#: what identifies a table: its marker's, else its log's first commit file's (inode, device, size,
#: mtime in ns)
_Identity = tuple[int, int, int, int]


def _identity(path: str) -> _Identity | None:
    for name in (MARKER, _FIRST_COMMIT):
        try:
            st = os.stat(os.path.join(path, name))
        except FileNotFoundError:
            continue
        return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)
    return None


def mark(path: Path | str) -> None:
    """Write the identity marker (:data:`MARKER`) of the Delta table just created at ``path``,
    atomically (a temporary name, then renamed): a table deleted and created again, or swapped in,
    has a new one."""
    target = os.path.join(_key(path), MARKER)
    staged = f"{target}.{os.getpid()}.{uuid.uuid4().hex}"
    with open(staged, "w") as f:
        f.write(uuid.uuid4().hex)
    os.replace(staged, target)


def _key(path: Path | str) -> str:
    """The local path of a table given as a path or as its ``table_uri`` (``file:///...``, which
    the writes carry): one handle per table however it is named."""
    key = str(path)
    if key.startswith("file://"):
        key = unquote(key.removeprefix("file://"))
    return key.rstrip("/") or "/"


def refresh(table: DeltaTable) -> DeltaTable:
    """``table`` brought up to its latest committed version (returned). delta-rs learns the latest
    version by listing the whole ``_delta_log``, which keeps a commit file per commit for the table's
    ``logRetentionDuration`` (30 days by default), so each update cost more as the table aged: with
    no new commit, 0.5 ms at 100 log files, 4.6 ms at 1,000 and 9.3 ms at 2,000, dozens of times a
    micro-batch. A commit writes the next version's file atomically, so when that one file does not
    exist the table is up to date: one ``stat``, and the listing only when there is news."""
    following = os.path.join(_key(table.table_uri), LOG_DIR, f"{table.version() + 1:020d}.json")
    if os.path.exists(following):
        table.update_incremental()
    return table


def open_table(path: Path | str) -> DeltaTable | None:
    """A new handle on the Delta table at ``path`` (None: there is none)."""
    key = str(path)
    return DeltaTable(key) if DeltaTable.is_deltatable(key) else None


class Handles:
    """Delta table handles by path, one set per thread (see the module docstring); ``shared``: one
    set for every thread of the process, for a user that never uses it from two threads at once
    (:data:`TASK_HANDLES`)."""

    def __init__(self, *, shared: bool = False) -> None:
        self._local = threading.local()
        self._shared: dict[str, tuple[DeltaTable, _Identity]] | None = {} if shared else None

    def _open(self) -> dict[str, tuple[DeltaTable, _Identity]]:
        if self._shared is not None:
            return self._shared
        tables: dict[str, tuple[DeltaTable, _Identity]] | None = getattr(self._local, "tables", None)
        if tables is None:
            tables = self._local.tables = {}
        return tables

    def get(self, path: Path | str) -> DeltaTable | None:
        """The Delta table at ``path`` (a path or a ``file://`` URI) at its latest version (None:
        there is none)."""
        key = _key(path)
        tables = self._open()
        held = tables.get(key)
        ident = _identity(key)
        if held is not None and ident is not None and held[1] == ident:
            return refresh(held[0])
        tables.pop(key, None)
        table = open_table(key)
        if table is not None and ident is not None and _identity(key) == ident:
            tables[key] = (table, ident)
        return table

    def put(self, path: Path | str, table: DeltaTable) -> DeltaTable:
        """Keep ``table`` (just created or altered here) as the handle of ``path``; returns it."""
        ident = _identity(_key(path))
        if ident is not None:
            self._open()[_key(path)] = (table, ident)
        return table

    def clear(self) -> None:
        """Forget this thread's handles."""
        self._open().clear()


#: the handles of the warehouse sinks of the Spark tasks run by this process (a Python worker runs
#: one task at a time, and a task's sink one call at a time, but on a thread of its own per task):
#: kept from task to task, a slice's tables are brought up to date (~1 ms) instead of opened anew,
#: which replays up to 100 commits from the last checkpoint (60 ms each under pgbench on a loaded
#: ``local[2]``, five per slice: the larger part of a small slice)
TASK_HANDLES = Handles(shared=True)
