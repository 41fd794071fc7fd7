"""The warehouse's disk kept within a multiple of its live size (``docs/warehouse.md``, Disk).

Every batch's copy-on-write merge supersedes the files it rewrites; they stay on disk until vacuumed.
The periodic vacuum (``vacuum_every``, ``vacuum_retention_hours``) deletes those unreferenced for an
hour, which at a high write rate is many times a table's live size (a batch of random keys rewrites
about the whole table). So after every batch the sink also measures each Delta table: when its
superseded bytes exceed ``vacuum_garbage_ratio`` times its live bytes (the files its current version
references, and its ``_delta_log``), it deletes superseded files at once (:func:`within_ratio`):

* never one that a commit past the oldest live reader lease's version removed (:mod:`.leases`):
  every cdc reader (``cdc sql``, ``cdc verify``, ``cdc rebuild``, a view built at ``cdc views add``)
  holds a lease while it reads, so a file of the version it reads stays until its lease ends;
* all the others that no commit of the last ``vacuum_min_retention_s`` seconds removed;
* then those that such a recent commit removed (the window: best-effort protection for readers
  outside cdc, an analyst's own DuckDB or Spark that opened the table lately), oldest commit first,
  only as long as the garbage is still over the ratio.

So after the reclaim a table's garbage is at most the ratio times its live size, plus what was
removed while a cdc read was open (and files no commit references: a write in flight or killed,
:func:`orphans`, :func:`vacuum_full`).

The files deleted are only those the Delta log says were removed (delta-rs's own list, a dry run of
its vacuum with no retention); a file written but not yet committed (a Spark task's, before the
driver's commit) is never one of them. delta-rs's vacuum takes a retention in whole hours; the
window's minutes are kept here by the commit files' times: a commit of the last
``vacuum_min_retention_s`` removed the files of a version a reader may have opened since.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from sinks.warehouse import leases
from sinks.warehouse.handles import COMMIT, LOG_DIR, MARKER, open_table, refresh

if TYPE_CHECKING:
    from sinks.warehouse.layout import WarehouseOptions

#: opens the Delta table at a path (None: there is none)
Opener = Callable[[Path], DeltaTable | None]


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


def _log_bytes(path: Path) -> int:
    """The bytes of the table's ``_delta_log`` and of its identity marker (:data:`.handles.MARKER`):
    live, with its data files."""
    try:
        marker = (path / MARKER).stat().st_size
    except FileNotFoundError:
        marker = 0
    return tree_bytes(path / LOG_DIR) + marker


def usage(path: Path, table: DeltaTable | None = None) -> Usage:
    """What the Delta table at ``path`` holds on disk against what its current version needs (its
    files, its log, its marker)."""
    table = DeltaTable(str(path)) if table is None else table
    sizes = pa.table(table.get_add_actions(flatten=False)).column("size_bytes")
    referenced = int(pc.sum(sizes).as_py() or 0)
    return Usage(disk=tree_bytes(path), live=referenced + _log_bytes(path))


class DiskTracker:
    """Each Delta table's bytes on disk and its superseded files, kept from its log instead of
    walked and listed after every batch.

    :func:`usage` walks every file under the table (its data files, superseded ones, and the whole
    ``_delta_log``, which keeps a commit file per batch for its log retention: 30 days by Delta's
    default, 10 minutes for a table cdc creates, :func:`retention_conf`): a cost per batch that grew with
    the run (105 ms for a pgbench batch's tables after one minute, 400 ms after four). The tracker
    walks a table once, then adds what each new commit adds (its ``add`` actions' sizes and the
    commit file itself), takes off what the reclaim deleted (:meth:`deleted`: it measures each file
    it unlinks), and walks again after :data:`RESYNC` versions, after a vacuum deleted files
    (:meth:`forget`), or when the version went back or the table's id changed (a table created anew). Files no commit
    references (a write in flight or killed) are counted from the next walk on: the bound excludes
    them anyway.

    The superseded files still on disk (:meth:`superseded`, what :func:`reclaim` may delete) are
    kept the same way: listed once from delta-rs (a dry run of its vacuum, which lists every file
    removed within ``deletedFileRetentionDuration``, on disk or not: its cost grows with every batch
    of that retention), then each new commit's ``remove`` actions are added, and the reclaim takes
    off what it deleted or found gone. Listed again with every walk but the one after a vacuum. One per writer (not thread-safe)."""

    #: versions after which a table is walked (and its superseded files listed) again
    RESYNC = 200

    def __init__(self) -> None:
        #: path -> (version, disk bytes, log bytes, version of the last walk)
        self._known: dict[str, tuple[int, int, int, int]] = {}
        #: path -> the superseded files not yet deleted (:meth:`superseded`)
        self._pending: dict[str, set[str]] = {}
        #: path -> the Delta table's id (its metadata's) when last seen
        self._ids: dict[str, str] = {}

    def usage(self, path: Path, table: DeltaTable) -> Usage:
        """:func:`usage` of the table at ``path`` (``table``: open at its latest version)."""
        key, version, ident = str(path), table.version(), str(table.metadata().id)
        known = self._known.get(key)
        # a version gone back, or another table at the path (`cdc rebuild` swaps one in)
        renewed = self._ids.get(key, ident) != ident
        resync = renewed or (known is not None and (version < known[0] or version - known[3] >= self.RESYNC))
        self._ids[key] = ident
        if key not in self._pending or resync:
            self._pending[key] = listed_superseded(path, table, on_disk=True)
        if known is None or resync:
            disk, log, walked = tree_bytes(path), _log_bytes(path), version
        else:
            data, commits, removed = _commits_since(path, known[0], version)
            disk, log, walked = known[1] + data + commits, known[2] + commits, known[3]
            self._pending[key].update(removed)
        self._known[key] = (version, disk, log, walked)
        sizes = pa.table(table.get_add_actions(flatten=False)).column("size_bytes")
        return Usage(disk=disk, live=int(pc.sum(sizes).as_py() or 0) + log)

    def forget(self, path: Path) -> None:
        """Files of ``path`` were deleted (by a vacuum): walk it again next time. Its superseded
        files are kept: the reclaim drops those it finds gone."""
        self._known.pop(str(path), None)

    def deleted(self, path: Path, nbytes: int) -> None:
        """:func:`reclaim` deleted ``nbytes`` of the table at ``path`` (the sizes of the files it
        unlinked): its bytes on disk drop by them, with no walk. A walk after every reclaim (about
        every other batch of a table of random keys) read the whole ``_delta_log``, which keeps a
        commit file per batch for its log retention."""
        known = self._known.get(str(path))
        if known is not None:
            version, disk, log, walked = known
            self._known[str(path)] = (version, max(disk - nbytes, 0), log, walked)

    def superseded(self, path: Path) -> set[str] | None:
        """The files of the table at ``path`` that a commit removed and no reclaim deleted yet
        (relative paths, unquoted), as of the last :meth:`usage`; None before it. The set is
        updated in place by :func:`reclaim`, which takes off what it deleted or found gone."""
        return self._pending.get(str(path))


def listed_superseded(path: Path, table: DeltaTable, *, on_disk: bool = False) -> set[str]:
    """The files of the table at ``path`` that its log says were removed (relative, unquoted):
    delta-rs's vacuum, a dry run with no retention, lists every remove within the table's
    ``deletedFileRetentionDuration``, deleted or not; ``on_disk``: only those still there."""
    listed = map(unquote, table.vacuum(retention_hours=0, dry_run=True, enforce_retention_duration=False))
    return {rel for rel in listed if not on_disk or (path / rel).exists()}


def _commits_since(path: Path, version: int, to: int) -> tuple[int, int, list[str]]:
    """The bytes the commits ``version + 1 .. to`` of the table at ``path`` added (their ``add``
    actions' sizes), the bytes of those commit files, and the files they removed (unquoted)."""
    data = commits = 0
    removed: list[str] = []
    for v in range(version + 1, to + 1):
        try:
            raw = (path / LOG_DIR / f"{v:020d}.json").read_bytes()
        except FileNotFoundError:  # cleaned up already: the next walk counts what is there
            continue
        commits += len(raw)
        for line in raw.splitlines():
            if b'"add"' in line or b'"remove"' in line:
                action = orjson.loads(line)
                if add := action.get("add"):
                    data += int(add.get("size") or 0)
                if remove := action.get("remove"):
                    removed.append(unquote(remove["path"]))
    return data, commits, removed


@dataclass(frozen=True)
class Removal:
    """The files (relative paths, unquoted) that the commit of ``version`` removed; ``recent``: it
    was written within ``vacuum_min_retention_s`` (the window)."""

    version: int
    recent: bool
    files: tuple[str, ...]


@dataclass(frozen=True)
class Reclaimed:
    """What :func:`reclaim` did (summed over tables by ``+``): ``files`` and ``bytes`` deleted, of
    which ``window_files`` and ``window_bytes`` were removed by a commit of the last
    ``vacuum_min_retention_s`` (deleted because the ratio needed them); superseded files kept:
    ``leased_files`` for the live leases (``leases``), ``window_kept`` for the window; ``over``:
    the tables found over their ratio."""

    files: int = 0
    bytes: int = 0
    window_files: int = 0
    window_bytes: int = 0
    leased_files: int = 0
    window_kept: int = 0
    leases: int = 0
    over: int = 0

    def __add__(self, other: Reclaimed) -> Reclaimed:
        return Reclaimed(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def removals(path: Path, cutoff: float, after: int | None, latest: int | None = None) -> list[Removal]:
    """The removes of the commits of the table at ``path`` written at time ``cutoff`` or later (by
    the commit file's time: ``recent``) or past version ``after`` (None: none by version), oldest
    first. ``latest``: the table's version, when known: the commits are then read back from it
    until one is neither (the table's one writer commits in time order), never the whole log --
    which keeps a commit per batch for its log retention, and whose listing grew every batch's reclaim with
    the run."""
    chosen: list[tuple[int, bool, str, os.stat_result]] = []
    if after is None and cutoff == float("inf"):
        return []
    if latest is not None:
        for version in range(latest, -1, -1):
            entry_path = path / LOG_DIR / f"{version:020d}.json"
            try:
                st = entry_path.stat()
            except FileNotFoundError:  # cleaned up: so are the older ones
                break
            recent = st.st_mtime >= cutoff
            if not recent and (after is None or version <= after):
                break
            chosen.append((version, recent, str(entry_path), st))
        chosen.reverse()
    else:
        with os.scandir(path / LOG_DIR) as entries:
            for entry in entries:
                match = COMMIT.match(entry.name)
                if not match:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    version, st = int(match.group(1)), entry.stat()
                    recent = st.st_mtime >= cutoff
                    if recent or (after is not None and version > after):
                        chosen.append((version, recent, entry.path, st))
    return [
        Removal(version, recent, _removed_by(commit, st.st_mtime_ns, st.st_size))
        for version, recent, commit, st in sorted(chosen, key=lambda c: c[0])
    ]


@functools.lru_cache(maxsize=1 << 14)
def _removed_by(commit: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    """The files (unquoted) that the commit file ``commit`` removed. Cached by the file's time and
    size (a commit file is written once): every batch's reclaim reads back the commits of the last
    ``vacuum_min_retention_s`` of each table it reclaims (under pgbench about 300 a table), of which
    one or two are new. On 300 commits of 16 adds and 16 removes each, reading them all took 16.0 ms,
    and 2.8 ms with those read before cached (``python -m bench.reclaim_removals``, 2026-11-30); under
    the sustained pgbench run the reclaim's share of the maintenance round rose from 55 to 150 ms a
    batch as its window filled."""
    removed: list[str] = []
    with contextlib.suppress(FileNotFoundError), open(commit, "rb") as f:
        for line in f:
            if b'"remove"' in line:
                action = orjson.loads(line).get("remove")
                if action:
                    removed.append(unquote(action["path"]))
    return tuple(removed)


def _unlink(target: Path) -> int:
    """Delete ``target``; its bytes (0: gone already)."""
    try:
        size = target.stat().st_size
        target.unlink()
    except FileNotFoundError:
        return 0
    return size


def reclaim(
    path: Path,
    min_retention_s: float,
    now: float | None = None,
    table: DeltaTable | None = None,
    *,
    ratio: float | None = None,
    use: Usage | None = None,
    pending: set[str] | None = None,
) -> Reclaimed:
    """Delete the files the table at ``path`` stopped referencing (the log's removed files that its
    current version does not reference: delta-rs's vacuum, a dry run), but for:

    * every file a commit past the oldest live lease's version removed (:mod:`.leases`): never
      deleted while that lease lives;
    * the files the commits of the last ``min_retention_s`` seconds removed (the window): kept with
      ``ratio`` None; else deleted, oldest commit first, until the table's garbage is at most
      ``ratio`` times its live size (by ``use``, measured before: :func:`usage`).

    The table must not be committed to meanwhile (its one writer, the apply job, calls this between
    its batches): a reader whose lease this did not see opens the version read here or a later one.

    ``pending``: the superseded files not deleted yet, kept by the caller from the log
    (:meth:`DiskTracker.superseded`), instead of delta-rs's list (:func:`listed_superseded`), whose
    cost grows with every batch of the table's tombstone retention; the files this call deletes or
    finds deleted are taken off it. A file the current version references is never deleted.
    """
    now = time.time() if now is None else now
    table = DeltaTable(str(path)) if table is None else table
    if pending is None:
        superseded = listed_superseded(path, table)
    else:
        live = pa.table(table.get_add_actions(flatten=False)).column("path").to_pylist()
        superseded = pending - {unquote(p) for p in live}
    held = leases.live_leases(path, now)
    after = min(h.version for h in held) if held else None
    cutoff = now - min_retention_s if min_retention_s > 0 else float("inf")
    leased: set[str] = set()
    window: list[str] = []  # oldest commit first
    found = removals(path, cutoff, after, table.version())
    for removal in found:
        if after is not None and removal.version > after:
            leased.update(removal.files)
        elif removal.recent:
            window.extend(removal.files)
    if after is not None and sum(r.version > after for r in found) < table.version() - after:
        # the log's cleanup deleted commits made since the lease's version: what they removed is
        # unknown, so no superseded file is deleted while the lease lives
        leased = set(superseded)
    window = [f for f in dict.fromkeys(window) if f in superseded and f not in leased]
    files = deleted = 0
    unlinked = sorted(superseded - leased - set(window))
    for name in unlinked:
        size = _unlink(path / name)
        files, deleted = files + (size > 0), deleted + size
    if pending is not None:
        pending.difference_update(unlinked)
    done = Reclaimed(files, deleted, leased_files=len(leased & superseded), leases=len(held))
    if ratio is None:
        return replace(done, window_kept=len(window))
    use = usage(path, table) if use is None else use
    excess = use.garbage - deleted - ratio * use.live
    taken = taken_bytes = 0
    for name in window:
        if excess <= 0:
            break
        size = _unlink(path / name)
        taken, taken_bytes, excess = taken + (size > 0), taken_bytes + size, excess - size
        if pending is not None:
            pending.discard(name)
    return replace(
        done,
        files=files + taken,
        bytes=deleted + taken_bytes,
        window_files=taken,
        window_bytes=taken_bytes,
        window_kept=len(window) - taken,
    )


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


def vacuum_full(path: Path, retention_hours: int, table: DeltaTable | None = None) -> int:
    """delta-rs's vacuum in its full mode: also the files no commit references that are older than
    the retention (a Spark task's or a merge's, killed before its commit); the lite mode deletes only
    the files the log says were removed, so those stayed forever. Returns the files deleted.
    ``table``: an open handle on it at its latest version (default: opened here)."""
    table = DeltaTable(str(path)) if table is None else table
    return len(
        table.vacuum(
            retention_hours=retention_hours, dry_run=False, enforce_retention_duration=False, full=True
        )
    )


def within_ratio(
    path: Path,
    ratio: float,
    min_retention_s: float,
    now: float | None = None,
    table: DeltaTable | None = None,
    tracker: DiskTracker | None = None,
    timed: Callable[[str, float], None] | None = None,
) -> Reclaimed:
    """:func:`reclaim` with ``ratio`` on the table at ``path`` if its garbage exceeds ``ratio``
    times its live size (else nothing). Afterwards its garbage is at most ``ratio`` times its live
    size, plus the files a commit past a live lease's version removed, plus any file no commit
    references (a write in flight, or one killed: :func:`orphans`, :func:`vacuum_full`). ``table``:
    an open handle on it at its latest version (default: opened here). ``tracker``: the table's
    bytes on disk kept from its log (:class:`DiskTracker`; default: walked), and its superseded
    files not deleted yet, which the reclaim deletes from (:meth:`DiskTracker.superseded`).
    ``timed``: told the seconds of the measure (``usage``) and of the reclaim (``reclaim``)."""
    t0 = time.monotonic()
    table = DeltaTable(str(path)) if table is None else table
    use = usage(path, table) if tracker is None else tracker.usage(path, table)
    if timed is not None:
        timed("usage", time.monotonic() - t0)
    if use.garbage <= ratio * use.live:
        return Reclaimed()
    t0 = time.monotonic()
    pending = None if tracker is None else tracker.superseded(path)
    done = reclaim(path, min_retention_s, now, table, ratio=ratio, use=use, pending=pending)
    if tracker is not None:  # the bytes it deleted, measured file by file: no walk
        tracker.deleted(path, done.bytes)
    if timed is not None:
        timed("reclaim", time.monotonic() - t0)
    return replace(done, over=1)


#: the Delta table properties bounding how long the log keeps a removed file's tombstone, and its
#: commit files
TOMBSTONES_CONF = "delta.deletedFileRetentionDuration"
LOG_CONF = "delta.logRetentionDuration"


def retention_conf(opts: WarehouseOptions) -> dict[str, str]:
    """The retentions a new Delta table of the warehouse is created with.

    Delta keeps a removed file's tombstone in the log's state (every checkpoint, every snapshot)
    for ``deletedFileRetentionDuration``, a week by default: under a steady load, where each batch
    of random keys supersedes every file of a table, the state grew with every batch of that week
    (a checkpoint of 1,600 removes after 100 batches of a 16-file table, 9,600 after 600), and
    with it the cost of each snapshot update, checkpoint and vacuum listing. cdc's readers need a
    superseded file no longer than a lease lasts (``lease_max_age_s``), and its full vacuum deletes
    one unreferenced for ``vacuum_retention_hours`` anyway, so the tombstone is kept for the longest
    of those, at least an hour; past it, delta-rs drops it at its next checkpoint.

    The log keeps a commit file per commit for ``logRetentionDuration``, 30 days by default, and
    delta-rs lists the whole ``_delta_log`` each time it looks for new commits: 0.5 ms at 100 files,
    9.3 ms at 2,000, a day of batches is 86,400. The commits cdc reads back are those of the
    readers' window (``vacuum_min_retention_s``), so the log keeps twice that, at least 10 minutes;
    delta-rs deletes older commit files before its latest checkpoint (every 100 commits). A live
    lease older than the commits left keeps every superseded file (:func:`reclaim`)."""
    tombstones = max(
        3600 * opts.vacuum_retention_hours, opts.lease_max_age_s, opts.vacuum_min_retention_s, 3600
    )
    log = max(2 * opts.vacuum_min_retention_s, 600)
    return {
        TOMBSTONES_CONF: f"interval {math.ceil(tombstones)} seconds",
        LOG_CONF: f"interval {math.ceil(log)} seconds",
    }


def due(every: int, batch_id: int) -> bool:
    """A task run every ``every`` batches (0: never) is due after batch ``batch_id``."""
    return every > 0 and batch_id > 0 and batch_id % every == 0


def after_batch(
    paths: Iterable[Path],
    opts: WarehouseOptions,
    batch_id: int,
    *,
    vacuumed: bool = False,
    open_table: Opener = open_table,
    tracker: DiskTracker | None = None,
    timed: Callable[[str, float], None] | None = None,
) -> Reclaimed:
    """The disk rule of the Delta tables at ``paths`` (the ones that exist) after batch ``batch_id``,
    the same for a table's and a view's: every ``vacuum_every`` batches the full vacuum (files of a
    killed write, after ``vacuum_retention_hours``), unless the caller ``vacuumed`` them already;
    then, after every batch, :func:`bound`. Returns what the ratio did. ``open_table``: how a
    table is opened (:meth:`.handles.Handles.get`, to reuse the caller's handles); ``tracker``:
    the tables' bytes on disk kept from their logs (:class:`DiskTracker`); ``timed``: told the
    seconds of each step (``open``: the tables brought up to date, ``vacuum``, ``bound`` and its
    ``usage`` and ``reclaim``)."""
    t0 = time.monotonic()
    tables = {p: t for p in paths if (t := open_table(p)) is not None}
    if timed is not None:
        timed("open", time.monotonic() - t0)
        t0 = time.monotonic()
    if not vacuumed and due(opts.vacuum_every, batch_id):
        for path, table in tables.items():
            vacuum_full(path, opts.vacuum_retention_hours, table)
            refresh(table)  # the vacuum's own commits
            if tracker is not None:
                tracker.forget(path)
        if timed is not None:
            timed("vacuum", time.monotonic() - t0)
    elif vacuumed and tracker is not None:
        for path in tables:
            tracker.forget(path)
    t0 = time.monotonic()
    done = bound(tables, opts, tables.get, tracker, timed)
    if timed is not None:
        timed("bound", time.monotonic() - t0)
    return done


def bound(
    paths: Iterable[Path],
    opts: WarehouseOptions,
    open_table: Opener = open_table,
    tracker: DiskTracker | None = None,
    timed: Callable[[str, float], None] | None = None,
) -> Reclaimed:
    """:func:`within_ratio` with ``opts``' ratio (0: never) on each Delta table at ``paths`` (the
    ones that exist, opened with ``open_table``; ``tracker``: :class:`DiskTracker`; ``timed``: as
    :func:`within_ratio`'s); returns what it did, summed."""
    done = Reclaimed()
    if not opts.vacuum_garbage_ratio:
        return done
    for path in paths:
        table = open_table(path)
        if table is not None:
            done += within_ratio(
                path,
                opts.vacuum_garbage_ratio,
                opts.vacuum_min_retention_s,
                table=table,
                tracker=tracker,
                timed=timed,
            )
    return done
