"""Continuous, incremental compaction of a table's Delta tables between micro-batches, in size tiers.

Every batch adds a file to each partition it writes. A partition that a batch rewrites whole (the
current table's buckets, the history's open rows: copy-on-write) keeps one file; the others only
grow: the history's closed rows (``is_current = false``) gain a file per touched bucket per batch,
and a current table's bucket gains one per batch of new keys. Left alone, a pgbench run's
``pgbench_accounts__history`` held 954 files after 4 minutes, and everything that lists the table
(every batch's read of its partitions, the commit's conflict check, a reader) paid for each.

:func:`step` runs after every batch's commit, within a time budget: the partitions with the most
files to merge first, one compaction each, until the budget is spent (a compaction started is
finished). A compaction never changes what a reader sees (its commit has ``dataChange = false``);
the files it replaces are superseded ones for :mod:`.reclaim`.

**Size tiers** (:func:`plan`). With ``F`` = ``min_files`` and ``T`` = ``target_file_size``, a
partition's files fall into levels by size: level 1 holds the files of ``(T/F², T/F]`` bytes,
level 2 those of ``(T/F³, T/F²]``, and so on (:func:`level`); a file over ``T/F`` is finished
(level 0): ``F`` of them would not fit in one target-size file, so they are never a level to
merge. A compaction merges the smallest level that holds at least ``F`` files with the smaller
files (fewer than ``F`` in each smaller level): delta-rs's ``optimize.compact`` on the
partition with ``target_size`` = the bytes of those files (at most ``T``). delta-rs takes only the
files of at most ``target_size`` bytes and bins them in the log's order (newest first; a larger
file ends a bin's run) into bins of at most ``target_size`` bytes, dropping a bin of one file
(crates/core/src/operations/optimize.rs, ``build_compaction_plan``; :func:`bins` replays it). So:

* no file larger than the files being merged together (nor than ``T``) is ever rewritten. Those
  files are the partition's newest (a level's files are older than the smaller ones), so they make
  one bin, and the next file, older and larger, does not fit in it; an older file is rewritten
  only if it fits in a bin of ``target_size`` with its neighbour in the log (two older files
  together no larger than the files being merged: small ones for their level);
* ``F`` files of a level make at least the level's upper bound: the merged file lands a level up
  (or, Parquet's re-encoding having shrunk it, is merged once more at the same level). A byte is
  rewritten about once per level, log_F of (``T`` / the batch's file size) times -- 2 or 3 times
  from a 50 KB file to ``T`` = 8 MiB, ``F`` = 8 -- whatever the partition's age; the rule before
  (``target_size`` = ``T``: every file under ``T``) rewrote the partition's merged file with every
  ``F`` new ones, the bytes of a compaction growing with the partition's age up to ``T``
  (``docs/benchmarks/compact_aging.md``);
* so a compaction's bytes are bounded, never by the partition's age: one bin in the steady state
  (``F`` files of a level and the smaller ones, about ``F`` × the level's bound: ``T`` for level
  1, ``T/F`` for level 2), and at most ``T`` in all -- with a backlog of small files between
  larger ones, each run of them a bin, :func:`plan` halves ``target_size`` until the merge
  rewrites at most ``T`` (the smallest files first); a step's overrun of its budget is one such
  compaction at most;
* once the budget allows, a partition holds fewer than ``F`` files in each level (a level of
  ``F`` files is merged), besides its finished files.

:func:`plan` replays delta-rs's bins before asking for a compaction: a level whose merge would put
no two of its files in one bin (split by larger files between them in the log's order) is passed
over for the next level up, so no compaction is asked that merges nothing of its level. It holds
for every partition, appended to or rewritten: a batch's copy-on-write of a partition removes
files and adds one, which only changes which files are in which level; the tiers never change what
a reader sees.

The apply's driver splits the partitions by :func:`append_only` (``docs/warehouse.md``, Compaction):
those no batch ever removes a file from (the history's closed rows: a batch's history write reads
and rewrites only the open partitions, :func:`.files.bucket_dataset`) are compacted on the
maintenance thread (:mod:`.background`) while the next batch's tasks run -- a task's commit removes
none of their files, so it never conflicts with that compaction; the others (a bucket's new keys,
the tombstones, the open rows), which a batch's tasks may read and rewrite, only in the driver
between batches.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from sinks.warehouse.layout import IS_CURRENT
from sinks.warehouse.reclaim import Opener

#: which partitions (their values, as the log writes them) a :func:`step` may compact
Where = Callable[[dict[str, str]], bool]

#: delta-rs's own ``target_size`` when ``target_file_size`` is unset
DEFAULT_TARGET = 100 << 20


def append_only(partition: dict[str, str]) -> bool:
    """A partition no batch removes a file from, only adds: a history's closed rows
    (``is_current = false``)."""
    return partition.get(IS_CURRENT) == "false"


def rewritten(partition: dict[str, str]) -> bool:
    """A partition a batch may rewrite (not :func:`append_only`)."""
    return not append_only(partition)


@dataclass(frozen=True)
class Compacted:
    """What :func:`step` did: ``partitions`` compacted, ``files_removed`` (of ``bytes_removed``
    bytes) into ``files_added``, ``seconds`` spent, ``conflicts``: compactions another writer's
    commit made refuse (left for later) (summed over tables by ``+``)."""

    partitions: int = 0
    files_removed: int = 0
    files_added: int = 0
    seconds: float = 0.0
    conflicts: int = 0
    bytes_removed: int = 0

    def __add__(self, other: Compacted) -> Compacted:
        return Compacted(
            self.partitions + other.partitions,
            self.files_removed + other.files_removed,
            self.files_added + other.files_added,
            self.seconds + other.seconds,
            self.conflicts + other.conflicts,
            self.bytes_removed + other.bytes_removed,
        )


def level(size: int, target: int, fanout: int) -> int:
    """The size tier of a file of ``size`` bytes: 0 (finished) over ``target // fanout``, else the
    ``k`` >= 1 with ``target // fanout**(k+1) < size <= target // fanout**k``."""
    k, bound = 0, target // fanout
    while bound > 0 and size <= bound:
        k, bound = k + 1, bound // fanout
    return k


def bins(sizes: Sequence[int], target: int) -> list[list[int]]:
    """delta-rs's compaction bins of a partition whose files have ``sizes`` in the log's order
    (newest first) for ``target_size`` = ``target``: the indices of each bin of two files or more.
    A file over ``target`` is skipped and ends the run; a bin takes the next file of its run while
    its bytes stay within ``target``."""
    out: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if size > target:
            continue
        if current and current[-1] == i - 1 and total + size <= target:
            current.append(i)
            total += size
            continue
        if len(current) > 1:
            out.append(current)
        current, total = [i], size
    if len(current) > 1:
        out.append(current)
    return out


class Plan(NamedTuple):
    """A compaction of one partition: ``optimize.compact``'s ``target_size``, and what it merges
    (replayed by :func:`bins`): ``files`` files of ``bytes`` bytes, to merge level ``level``."""

    target: int
    files: int
    bytes: int
    level: int


def plan(sizes: Sequence[int], target: int, fanout: int) -> Plan | None:
    """The compaction of a partition whose files have ``sizes`` in the log's order (newest first),
    size-tiered (the module's doc): the smallest level holding at least ``fanout`` files whose
    merge, with ``target_size`` the bytes of that level's and the smaller files (at most
    ``target``), puts two of them or more in one bin (:func:`bins`). A merge that would rewrite
    more than ``target`` bytes in all (a backlog: many small files between larger ones, each
    bin of them a merge) asks for half that ``target_size``, and again, down to the level's
    files: the smallest first, ``target`` bytes at most; only when no level has such a merge is
    the smallest level's whole merge asked for. None: no level is due."""
    levels = [level(s, target, fanout) for s in sizes]
    due_levels = sorted((k for k, n in Counter(levels).items() if k > 0 and n >= fanout), reverse=True)
    whole: Plan | None = None
    for k in due_levels:
        size = min(sum(s for s, lv in zip(sizes, levels, strict=True) if lv >= k), target)
        floor = 2 * target // fanout ** (k + 1)  # two files of the level at least
        while size >= floor:
            chosen = bins(sizes, size)
            if any(sum(levels[i] >= k for i in b) >= 2 for b in chosen):  # merges some of the level
                found = Plan(size, sum(map(len, chosen)), sum(sizes[i] for b in chosen for i in b), k)
                if found.bytes <= target:
                    return found
                whole = whole or found
            size //= 2
    return whole


def candidates(table: DeltaTable, target: int, min_files: int) -> list[tuple[Plan, dict[str, str]]]:
    """The partitions of ``table`` with a compaction due (:func:`plan`, ``min_files`` its fanout):
    (the plan, the partition's values as the log writes them), the most files first."""
    files = pa.table(table.get_add_actions(flatten=True))
    parts = list(table.metadata().partition_columns)
    if files.num_rows < min_files or not parts:
        return []
    cols = [f"partition.{p}" for p in parts]
    small = files.filter(pc.less_equal(files.column("size_bytes"), target // min_files))
    if small.num_rows < min_files:
        return []
    counts = small.select(cols).group_by(cols, use_threads=False).aggregate([([], "count_all")])
    keys = {
        tuple(row[c] for c in cols)
        for row in counts.to_pylist()
        if row["count_all"] >= min_files and all(row[c] is not None for c in cols)  # null: never filtered
    }
    if not keys:
        return []
    sizes: dict[tuple[object, ...], list[int]] = {k: [] for k in keys}
    for *values, size in zip(*(files.column(c).to_pylist() for c in [*cols, "size_bytes"]), strict=True):
        found = sizes.get(tuple(values))
        if found is not None:
            found.append(size)
    out: list[tuple[Plan, dict[str, str]]] = []
    for key, listed in sizes.items():
        due = plan(listed, target, min_files)
        if due is not None:
            out.append((due, {p: _text(v) for p, v in zip(parts, key, strict=True)}))
    out.sort(key=lambda c: (-c[0].files, c[0].bytes))
    return out


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


#: a partition's values as one hashable key (:func:`_key`)
_Key = tuple[tuple[str, str], ...]


class Todo(NamedTuple):
    """A partition to compact: its :class:`Plan`, the Delta table's path, the partition's values,
    and the table's version the plan was made at."""

    plan: Plan
    path: Path
    partition: dict[str, str]
    version: int


def due(paths: Iterable[Path], open_table: Opener, *, target_size: int | None, min_files: int) -> list[Todo]:
    """The partitions of the Delta tables at ``paths`` with a compaction due (:func:`candidates`),
    the most files first."""
    target = target_size or DEFAULT_TARGET
    todo: list[Todo] = []
    for path in paths:
        table = open_table(path)
        if table is not None:
            version = table.version()
            todo.extend(Todo(p, path, part, version) for p, part in candidates(table, target, min_files))
    todo.sort(key=lambda t: (-t.plan.files, t.plan.bytes))
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
    """Compact the partitions of the Delta tables at ``paths`` with the most files to merge first
    (:func:`due`: size-tiered, the module's doc), one compaction each, until ``budget_s`` seconds
    are spent: a compaction starts only within the budget and is finished once started, so the
    budget may be overrun by one compaction, whose bytes are bounded (at most about ``min_files``
    files of one level and the smaller ones). Returns what was done. ``budget_s`` 0: nothing.
    ``where``: only the partitions it accepts (:func:`append_only`, :func:`rewritten`; None: all).
    A compaction whose commit refuses because another writer committed meanwhile (a task's schema
    change while this runs on the maintenance thread) commits nothing; the partition is left for a
    later step. ``todo``: the partitions to compact, as :func:`due` listed them (maybe before a
    commit: a table changed since by another commit than this step's is planned again, and a
    partition no longer due is passed over); default: listed here."""
    done = Compacted()
    if budget_s <= 0:
        return done
    started = time.monotonic()
    target = target_size or DEFAULT_TARGET
    if todo is None:
        todo = due(paths, open_table, target_size=target_size, min_files=min_files)
    planned: dict[Path, tuple[int, dict[_Key, Plan] | None]] = {}  # path: (version, plans anew)
    for item in todo:
        if where is not None and not where(item.partition):
            continue
        if time.monotonic() - started >= budget_s:
            break
        table = open_table(item.path)
        if table is None:
            continue
        version, fresh = planned.get(item.path, (item.version, None))
        if table.version() != version:  # another writer's commit: plan the table again
            version = table.version()
            fresh = {_key(part): p for p, part in candidates(table, target, min_files)}
        current = item.plan if fresh is None else fresh.get(_key(item.partition))
        if current is None:
            planned[item.path] = (version, fresh)
            continue
        filters = [(col, "=", value) for col, value in item.partition.items()]
        try:
            metrics = table.optimize.compact(partition_filters=filters, target_size=current.target)
        except CommitFailedError:  # another writer's commit came first: nothing was committed
            done += Compacted(conflicts=1)
            planned[item.path] = (version, fresh)
            continue
        planned[item.path] = (table.version(), fresh)  # this commit touched only this partition
        removed = int(metrics.get("numFilesRemoved", 0))
        bytes_removed = (
            int(json.loads(metrics.get("filesRemoved") or "{}").get("totalSize", 0)) if removed else 0
        )
        done += Compacted(1, removed, int(metrics.get("numFilesAdded", 0)), bytes_removed=bytes_removed)
    return dataclasses.replace(done, seconds=time.monotonic() - started)


def _key(partition: dict[str, str]) -> _Key:
    return tuple(sorted(partition.items()))
