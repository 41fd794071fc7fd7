"""Continuous, incremental compaction of a table's Delta tables between micro-batches.

Every batch adds a file to each partition it writes. A partition that a batch rewrites whole (the
current table's buckets, the history's open rows: copy-on-write) keeps one file; the others only
grow: the history's closed rows (``is_current = false``) gain a file per touched bucket per batch,
and a current table's bucket gains one per batch of new keys. Left alone, a pgbench run's
``pgbench_accounts__history`` held 954 files after 4 minutes, and everything that lists the table
(every batch's read of its partitions, the commit's conflict check, a reader) paid for each.
:meth:`sinks.warehouse.WarehouseSink.maintain` compacted them every ``maintain_every`` (100)
batches: a sawtooth, and a pause of the apply as long as the whole table's rewrite.

:func:`step` instead runs after every batch's commit, in the driver (the tables' one writer, between
batches: no task is writing), within a time budget: the partitions holding the most small files
(smaller than half ``target_file_size``) first, each compacted with delta-rs's ``optimize.compact``
restricted to it, until the budget is spent. A partition with fewer than ``min_files`` small files
is left for later. A compaction never changes what a reader sees (its commit has
``dataChange = false``); the files it replaces are superseded ones for :mod:`.reclaim`.

The apply's driver splits the partitions by :func:`append_only` (``docs/warehouse.md``, Compaction):
those no batch ever removes a file from (the history's closed rows: a batch's history write reads
and rewrites only the open partitions, :func:`.files.bucket_dataset`) are compacted on the
maintenance thread (:mod:`.background`) while the next batch's tasks run -- a task's commit removes
none of their files, so it never conflicts with that compaction; the others (a bucket's new keys,
the tombstones, the open rows), which a batch's tasks may read and rewrite, only in the driver
between batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from sinks.warehouse.layout import IS_CURRENT
from sinks.warehouse.reclaim import Opener

#: which partitions (their values, as the log writes them) a :func:`step` may compact
Where = Callable[[dict[str, str]], bool]


def append_only(partition: dict[str, str]) -> bool:
    """A partition no batch removes a file from, only adds: a history's closed rows
    (``is_current = false``)."""
    return partition.get(IS_CURRENT) == "false"


def rewritten(partition: dict[str, str]) -> bool:
    """A partition a batch may rewrite (not :func:`append_only`)."""
    return not append_only(partition)


@dataclass(frozen=True)
class Compacted:
    """What :func:`step` did: ``partitions`` compacted, ``files_removed`` into ``files_added``,
    ``seconds`` spent, ``conflicts``: compactions another writer's commit made refuse (left for
    later) (summed over tables by ``+``)."""

    partitions: int = 0
    files_removed: int = 0
    files_added: int = 0
    seconds: float = 0.0
    conflicts: int = 0

    def __add__(self, other: Compacted) -> Compacted:
        return Compacted(
            self.partitions + other.partitions,
            self.files_removed + other.files_removed,
            self.files_added + other.files_added,
            self.seconds + other.seconds,
            self.conflicts + other.conflicts,
        )


def candidates(table: DeltaTable, small_bytes: int, min_files: int) -> list[tuple[int, dict[str, str]]]:
    """The partitions of ``table`` holding at least ``min_files`` files smaller than ``small_bytes``:
    (their number, the partition's values as the log writes them), the most first."""
    files = pa.table(table.get_add_actions(flatten=True))
    parts = list(table.metadata().partition_columns)
    if files.num_rows < min_files or not parts:
        return []
    small = files.filter(pc.less(files.column("size_bytes"), small_bytes))
    if small.num_rows < min_files:
        return []
    cols = [f"partition.{p}" for p in parts]
    counts = small.select(cols).group_by(cols, use_threads=False).aggregate([([], "count_all")])
    out: list[tuple[int, dict[str, str]]] = []
    for row in counts.to_pylist():
        n = int(row["count_all"])
        if n >= min_files and all(row[c] is not None for c in cols):  # a null partition: never filtered
            out.append((n, {p: _text(row[f"partition.{p}"]) for p in parts}))
    out.sort(key=lambda c: -c[0])
    return out


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


#: a partition to compact: (its small files, the Delta table's path, the partition's values)
Todo = tuple[int, Path, dict[str, str]]


def due(paths: Iterable[Path], open_table: Opener, *, target_size: int | None, min_files: int) -> list[Todo]:
    """The partitions of the Delta tables at ``paths`` with at least ``min_files`` small files
    (:func:`candidates`), the most first."""
    target = target_size or 100 << 20
    todo: list[Todo] = []
    for path in paths:
        table = open_table(path)
        if table is not None:
            todo.extend((n, path, part) for n, part in candidates(table, target // 2, min_files))
    todo.sort(key=lambda c: -c[0])
    return todo


def step(
    paths: Iterable[Path],
    open_table: Opener,
    *,
    target_size: int | None,
    budget_s: float,
    min_files: int,
    where: Where | None = None,
    todo: list[Todo] | None = None,
) -> Compacted:
    """Compact the partitions of the Delta tables at ``paths`` with the most small files first, one
    at a time, until ``budget_s`` seconds are spent (a compaction started is finished: the budget
    may be overrun by one partition's). Returns what was done. ``budget_s`` 0: nothing. ``where``:
    only the partitions it accepts (:func:`append_only`, :func:`rewritten`; None: all). A
    compaction whose commit refuses because another writer committed meanwhile (a task's schema
    change while this runs on the maintenance thread) commits nothing; the partition is left for a
    later step. ``todo``: the partitions to compact, as :func:`due` listed them (maybe before a
    commit: a partition that has fewer small files since is compacted as it is); default: listed
    here."""
    done = Compacted()
    if budget_s <= 0:
        return done
    started = time.monotonic()
    target = target_size or 100 << 20
    if todo is None:
        todo = due(paths, open_table, target_size=target_size, min_files=min_files)
    for _n, path, part in todo:
        if where is not None and not where(part):
            continue
        if time.monotonic() - started >= budget_s:
            break
        table = open_table(path)
        if table is None:
            continue
        filters = [(col, "=", value) for col, value in part.items()]
        try:
            metrics = table.optimize.compact(partition_filters=filters, target_size=target)
        except CommitFailedError:  # another writer's commit came first: nothing was committed
            done += Compacted(conflicts=1)
            continue
        done += Compacted(1, int(metrics.get("numFilesRemoved", 0)), int(metrics.get("numFilesAdded", 0)))
    return Compacted(
        done.partitions, done.files_removed, done.files_added, time.monotonic() - started, done.conflicts
    )
