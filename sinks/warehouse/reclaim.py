"""The warehouse's disk kept within a multiple of its live size (``docs/warehouse.md``, Disk).

Every batch's copy-on-write merge supersedes the files it rewrites; they stay on disk until vacuumed.
The periodic vacuum (``vacuum_every``, ``vacuum_retention_hours``) deletes those unreferenced for an
hour, which at a high write rate is many times a table's live size (a batch of random keys rewrites
about the whole table). So after every batch the sink also measures each Delta table: when its
superseded bytes exceed ``vacuum_garbage_ratio`` times its live bytes (the files its current version
references, and its ``_delta_log``), it deletes the superseded files at once, except those a
version committed in the last ``vacuum_min_retention_s`` seconds references -- what a reader that
opened the table since then (``cdc sql``, ``cdc verify``, a view) may still be reading.

The files deleted are only those the Delta log says were removed (delta-rs's own list, a dry run of
its vacuum with no retention); a file written but not yet committed (a Spark task's, before the
driver's commit) is never one of them. delta-rs's vacuum takes a retention in whole hours; the
minutes are kept here by protecting every file that a commit of the last ``vacuum_min_retention_s``
removed (a reader pinned a version at most that old: what it reads is in that version, and what that
version referenced and the current one does not was removed since).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

if TYPE_CHECKING:
    from sinks.warehouse.layout import WarehouseOptions

LOG_DIR = "_delta_log"
_COMMIT = re.compile(r"^\d{20}\.json$")


@dataclass(frozen=True)
class Usage:
    """A Delta table's bytes: ``disk`` (every file under it), ``live`` (its current version's files
    and its ``_delta_log``); ``garbage`` is the rest (superseded files, and any not yet committed)."""

    disk: int
    live: int

    @property
    def garbage(self) -> int:
        return max(self.disk - self.live, 0)


def tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path`` (``os.scandir``, symbolic links not followed)."""
    total = 0
    stack = [str(path)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except FileNotFoundError:  # deleted meanwhile (a vacuum)
            continue
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def usage(path: Path, table: DeltaTable | None = None) -> Usage:
    """What the Delta table at ``path`` holds on disk against what its current version needs."""
    table = DeltaTable(str(path)) if table is None else table
    sizes = pa.table(table.get_add_actions(flatten=False)).column("size_bytes")
    referenced = int(pc.sum(sizes).as_py() or 0)
    return Usage(disk=tree_bytes(path), live=referenced + tree_bytes(path / LOG_DIR))


def recently_removed(path: Path, min_retention_s: float, now: float) -> set[str]:
    """The files (relative paths, unquoted) that the commits of the last ``min_retention_s`` seconds
    removed: a reader that opened the table since may still read them."""
    removed: set[str] = set()
    cutoff = now - min_retention_s
    with os.scandir(path / LOG_DIR) as entries:
        recent = [e.path for e in entries if _COMMIT.match(e.name) and e.stat().st_mtime >= cutoff]
    for commit in recent:
        with contextlib.suppress(FileNotFoundError), open(commit, "rb") as f:
            for line in f:
                if b'"remove"' in line:
                    action = orjson.loads(line).get("remove")
                    if action:
                        removed.add(unquote(action["path"]))
    return removed


def reclaim(
    path: Path, min_retention_s: float, now: float | None = None, table: DeltaTable | None = None
) -> tuple[int, int]:
    """Delete the files the table at ``path`` stopped referencing, except those removed in the last
    ``min_retention_s`` seconds; returns (files, bytes) deleted."""
    now = time.time() if now is None else now
    table = DeltaTable(str(path)) if table is None else table
    # the log's removed files not referenced by the current version (delta-rs's vacuum, a dry run)
    superseded = table.vacuum(retention_hours=0, dry_run=True, enforce_retention_duration=False)
    keep = recently_removed(path, min_retention_s, now) if min_retention_s > 0 else set()
    files = deleted = 0
    for rel in superseded:
        name = unquote(rel)
        if name in keep:
            continue
        target = path / name
        with contextlib.suppress(FileNotFoundError):
            size = target.stat().st_size
            target.unlink()
            files, deleted = files + 1, deleted + size
    return files, deleted


def orphans(path: Path, table: DeltaTable | None = None) -> tuple[int, int]:
    """Delete the files under the table at ``path`` that no commit of its log ever added (what a
    killed task or merge wrote and nobody committed: delta-rs's vacuum in full mode lists them with
    the superseded ones, its lite mode only the superseded); returns (files, bytes) deleted. Only
    for the table's one writer, before it writes (``cdc apply`` starting under the apply lock): a
    write in flight elsewhere would lose its files. Superseded files are left to :func:`reclaim`,
    which keeps those a reader may still hold."""
    table = DeltaTable(str(path)) if table is None else table
    unreferenced, superseded = (
        set(table.vacuum(retention_hours=0, dry_run=True, enforce_retention_duration=False, full=full))
        for full in (True, False)
    )
    files = deleted = 0
    for rel in sorted(unreferenced - superseded):
        target = path / unquote(rel)
        with contextlib.suppress(FileNotFoundError):
            size = target.stat().st_size
            target.unlink()
            files, deleted = files + 1, deleted + size
    return files, deleted


def vacuum_full(path: Path, retention_hours: int) -> int:
    """delta-rs's vacuum in its full mode: also the files no commit references that are older than
    the retention (a Spark task's or a merge's, killed before its commit); the lite mode deletes only
    the files the log says were removed, so those stayed forever. Returns the files deleted."""
    table = DeltaTable(str(path))
    return len(
        table.vacuum(
            retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False, full=True
        )
    )


def within_ratio(path: Path, ratio: float, min_retention_s: float) -> tuple[int, int]:
    """:func:`reclaim` on the table at ``path`` if its garbage exceeds ``ratio`` times its live size;
    returns (files, bytes) deleted."""
    table = DeltaTable(str(path))
    use = usage(path, table)
    if use.garbage <= ratio * use.live:
        return 0, 0
    return reclaim(path, min_retention_s, table=table)


def due(every: int, batch_id: int) -> bool:
    """A task run every ``every`` batches (0: never) is due after batch ``batch_id``."""
    return every > 0 and batch_id > 0 and batch_id % every == 0


def after_batch(
    paths: Iterable[Path], opts: WarehouseOptions, batch_id: int, *, vacuumed: bool = False
) -> int:
    """The disk rule of the Delta tables at ``paths`` (the ones that exist) after batch ``batch_id``,
    the same for a table's and a view's: every ``vacuum_every`` batches the full vacuum (files of a
    killed write, after ``vacuum_retention_hours``), unless the caller ``vacuumed`` them already;
    then, after every batch, :func:`bound`. Returns the bytes the ratio deleted."""
    tables = [p for p in paths if DeltaTable.is_deltatable(str(p))]
    if not vacuumed and due(opts.vacuum_every, batch_id):
        for path in tables:
            vacuum_full(path, opts.vacuum_retention_hours)
    return bound(tables, opts)


def bound(paths: Iterable[Path], opts: WarehouseOptions) -> int:
    """:func:`within_ratio` with ``opts``' ratio (0: never) on each Delta table at ``paths`` (the
    ones that exist); returns the bytes deleted."""
    if not opts.vacuum_garbage_ratio:
        return 0
    return sum(
        within_ratio(path, opts.vacuum_garbage_ratio, opts.vacuum_min_retention_s)[1]
        for path in paths
        if DeltaTable.is_deltatable(str(path))
    )
