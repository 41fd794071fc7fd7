"""The warehouse's incremental compaction between batches (:mod:`sinks.warehouse.compact`), the
disk bytes kept from the log (:class:`sinks.warehouse.reclaim.DiskTracker`), and a reclaim whose cost
does not grow with the run: it deletes from the superseded files kept from the log
(:meth:`~sinks.warehouse.reclaim.DiskTracker.superseded`) and keeps the disk bytes without a walk
(:meth:`~sinks.warehouse.reclaim.DiskTracker.deleted`)."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from sinks.warehouse import WarehouseOptions, WarehouseSink, leases, reclaim
from sinks.warehouse import handles as handles_module
from tests.sinks.conftest import FeedMaker
from tests.sinks.feed import table

APP = "app-test"


def _files(path: Path) -> int:
    return len(DeltaTable(str(path)).file_uris())


def _sink(tmp_path: Path, budget: float, ratio: float = 1.0, retention: float = 300.0) -> WarehouseSink:
    return WarehouseSink(
        tmp_path,
        WarehouseOptions(
            buckets=2,
            clustering="hash",
            maintain_every=0,
            vacuum_every=0,
            compact_budget_s=budget,
            compact_min_files=4,
            vacuum_garbage_ratio=ratio,
            vacuum_min_retention_s=retention,
        ),
    )


def test_closed_history_files_are_compacted_between_batches_and_rows_kept(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """Each batch of updates appends a closed-rows file per touched bucket to the history; with a
    budget, the partitions reaching ``compact_min_files`` small files are compacted after the batch
    (never more than a few files are left per partition), every row kept, the current table the
    same; with no budget the files pile up (one per batch and bucket)."""
    rows: dict[float, list[dict[str, object]]] = {}
    files: dict[float, int] = {}
    for budget in (0.0, 5.0):
        sink = _sink(tmp_path / str(budget), budget)
        reg = table()
        f = feed(reg)
        sink.apply(
            f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(50))), 1, APP
        )
        rng = random.Random(3)
        for batch_id in range(2, 22):
            keys = rng.sample(range(50), 10)
            sink.apply(
                f.batch(
                    *(
                        f.change("u", {"id": i, "name": f"v{batch_id}", "note": None}, 100 * batch_id)
                        for i in keys
                    )
                ),
                batch_id,
                APP,
            )
        hist = sink.paths(reg)[1]
        files[budget] = _files(hist)
        rows[budget] = sorted(
            (r for r in sink.history_rows(reg).to_pylist()),
            key=lambda r: (r["id"], r["_cdc_commit_lsn"], r["_cdc_seq"]),
        )
        assert len(rows[budget]) == 50 + 20 * 10
        assert sorted(r["id"] for r in sink.current_rows(reg, meta=False).to_pylist()) == list(range(50))
    assert files[0.0] >= 20  # a closed file per batch and bucket, never compacted
    assert files[5.0] <= 2 * 2 + 2 * 4  # open + closed partitions of 2 buckets, under min_files each
    assert rows[0.0] == rows[5.0]


def test_disk_tracker_agrees_with_a_walk(tmp_path: Path, feed: FeedMaker) -> None:
    """The bytes the tracker keeps from the log equal a walk of the table after commits, a
    compaction and a reclaim (told with ``forget``); the sink's own reclaim is off, else it would
    delete files this tracker is not told of."""
    sink = _sink(tmp_path, 5.0, ratio=0.0)
    reg = table()
    f = feed(reg)
    tracker = reclaim.DiskTracker()
    path = sink.paths(reg)[1]
    for batch_id in range(1, 12):
        sink.apply(
            f.batch(
                *(
                    f.change(
                        "c" if batch_id == 1 else "u",
                        {"id": i, "name": f"{batch_id}", "note": None},
                        100 * batch_id,
                    )
                    for i in range(20)
                )
            ),
            batch_id,
            APP,
        )
        handle = DeltaTable(str(path))
        got = tracker.usage(path, handle)
        assert got == reclaim.usage(path), f"batch {batch_id}"
        # the superseded files kept from the commits are delta-rs's list of those on disk
        assert tracker.superseded(path) == reclaim.listed_superseded(path, handle, on_disk=True)
    assert reclaim.reclaim(path, 0).files > 0
    tracker.forget(path)
    assert tracker.usage(path, DeltaTable(str(path))) == reclaim.usage(path)


def _rewritten(tmp_path: Path, feed: FeedMaker, batches: int) -> Path:
    """The current table of a table whose 10 rows ``batches`` batches wrote, then rewrote: each
    batch's commit after the first removes files. Its path."""
    sink = _sink(tmp_path, 5.0, ratio=0.0)
    reg = table()
    f = feed(reg)
    for batch_id in range(1, batches + 1):
        rows = [
            f.change(
                "c" if batch_id == 1 else "u", {"id": i, "name": f"{batch_id}", "note": None}, 100 * batch_id
            )
            for i in range(10)
        ]
        sink.apply(f.batch(*rows), batch_id, APP)
    return sink.paths(reg)[0]


def test_removals_read_back_from_the_latest_commit_equal_a_scan(tmp_path: Path, feed: FeedMaker) -> None:
    """:func:`reclaim.removals` given the table's version reads the log back from it (never the
    whole log) and finds what a scan of the whole log finds: by time and by version."""
    path = _rewritten(tmp_path, feed, 7)
    latest = DeltaTable(str(path)).version()
    for cutoff, after in ((0.0, None), (float("inf"), 3), (float("inf"), latest), (0.0, 2)):
        scanned = reclaim.removals(path, cutoff, after)
        assert reclaim.removals(path, cutoff, after, latest) == scanned
    assert [r.version for r in reclaim.removals(path, float("inf"), 3, latest)] == list(range(4, latest + 1))


def test_removals_read_each_commit_once_and_again_once_it_changed(tmp_path: Path, feed: FeedMaker) -> None:
    """A commit file is parsed once for every later reclaim (by its time and size); a file that
    changed (another commit at that path: a table dropped and created again) is read again."""
    path = _rewritten(tmp_path, feed, 3)
    latest = DeltaTable(str(path)).version()
    reclaim._removed_by.cache_clear()
    first = reclaim.removals(path, 0.0, None, latest)
    assert any(r.files for r in first)
    assert reclaim._removed_by.cache_info().misses == latest + 1
    assert reclaim.removals(path, 0.0, None, latest) == first
    assert reclaim._removed_by.cache_info().misses == latest + 1, "a commit read twice"
    commit = path / "_delta_log" / f"{latest:020d}.json"
    commit.write_bytes(
        b"".join(line for line in commit.read_bytes().splitlines(keepends=True) if b'"remove"' not in line)
    )
    again = reclaim.removals(path, 0.0, None, latest)
    assert again[:-1] == first[:-1] and again[-1].files == () != first[-1].files


def _calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[Path]:
    """The paths :mod:`sinks.warehouse.reclaim`'s function ``name`` is called with from now on."""
    calls: list[Path] = []
    real = getattr(reclaim, name)

    def counted(path: Path, *args: Any, **kwargs: Any) -> Any:
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(reclaim, name, counted)
    return calls


def _run(sink: WarehouseSink, feed: FeedMaker, batches: int, walks: list[Path] | None = None) -> Path:
    """A table of 40 keys, then ``batches`` batches of 12 random updates each. With ``walks`` (the
    tables :func:`reclaim.tree_bytes` walked, recorded by the caller): after each batch, the
    tracker's bytes of the current and history tables equal a walk, and no walk ran in the batch
    but the tracker's first of each table."""
    reg = table()
    f = feed(reg)
    rng = random.Random(5)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(40))), 1, APP
    )
    for batch_id in range(2, batches + 2):
        keys = rng.sample(range(40), 12)
        before = len(walks) if walks is not None else 0
        sink.apply(
            f.batch(
                *(
                    f.change("u", {"id": i, "name": f"v{batch_id}", "note": "x" * 50}, 100 * batch_id)
                    for i in keys
                )
            ),
            batch_id,
            APP,
        )
        if walks is None:
            continue
        if batch_id > 2:
            assert walks[before:] == [], f"batch {batch_id} walked {walks[before:]}"
        for path in sink.paths(reg)[:2]:
            assert sink.disk.usage(path, DeltaTable(str(path))) == reclaim.usage(path), (
                f"batch {batch_id}: the tracker's bytes of {path.name} differ from a walk"
            )
    return sink.paths(reg)[0]


def test_the_tracker_takes_off_what_the_reclaim_deleted_and_equals_a_walk(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After every batch -- commits, compactions, and reclaims that deleted files (ratio 0.5 with no
    window: most batches reclaim) -- the bytes the sink's tracker keeps equal a walk of the table,
    and the sink walked no table to get them."""
    walks = _calls(monkeypatch, "tree_bytes")
    sink = _sink(tmp_path, 5.0, ratio=0.5, retention=0)
    reclaims: list[reclaim.Reclaimed] = []
    real_within = reclaim.within_ratio

    def within(*a: object, **k: object) -> reclaim.Reclaimed:
        done = real_within(*a, **k)  # type: ignore[arg-type]
        reclaims.append(done)
        return done

    monkeypatch.setattr(reclaim, "within_ratio", within)
    _run(sink, feed, 14, walks)
    assert sum(r.files for r in reclaims) > 10, "the test needs reclaims that deleted files"


def test_a_reclaim_deletes_from_the_superseded_files_kept_from_the_log(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """delta-rs lists every file removed within the table's tombstone retention (a week by
    default), on disk or not, so a reclaim that asked it at every batch paid for the whole age of
    the table. The tracker lists once, then keeps the superseded files from each new commit's
    removes: a reclaim deletes exactly those, takes them off, and a second one touches nothing; the
    batches after it bring only their own removes, with no new listing; a file the current version
    references is never deleted, even if the set holds it."""
    sink = _sink(tmp_path, 5.0, ratio=0.0, retention=0)  # the sink reclaims nothing itself
    current = _run(sink, feed, 10)
    handle = DeltaTable(str(current))
    listed = reclaim.listed_superseded(current, handle)
    assert len(listed) >= 10
    tracker = reclaim.DiskTracker()
    tracker.usage(current, handle)
    pending = tracker.superseded(current)
    assert pending == listed
    unlinks = _calls(monkeypatch, "_unlink")
    listings = _calls(monkeypatch, "listed_superseded")
    assert reclaim.reclaim(current, 0, table=handle, pending=pending).files == len(listed)
    assert len(unlinks) == len(listed) and pending == set()
    unlinks.clear()
    assert reclaim.reclaim(current, 0, table=handle, pending=pending).files == 0
    assert unlinks == [], "the second reclaim tried files it had deleted"
    # two more batches: only their removes are pending, read from their commits
    f = feed(table())
    for batch_id in (20, 21):
        rows = [
            f.change("u", {"id": i, "name": f"w{batch_id}", "note": None}, 10_000 * batch_id)
            for i in range(0, 40, 3)
        ]
        sink.apply(f.batch(*rows), batch_id, APP)
    table_now = DeltaTable(str(current))
    tracker.usage(current, table_now)
    assert listings == [], "the tracker listed delta-rs's tombstones again"
    fresh = tracker.superseded(current)
    assert fresh and fresh == reclaim.listed_superseded(current, table_now, on_disk=True)
    # a file the current version references (as a restore would add one back) is never deleted
    live = pa.table(table_now.get_add_actions(flatten=False)).column("path")[0].as_py()
    reclaim.reclaim(current, 0, table=table_now, pending=fresh | {live})
    assert (current / live).exists()
    assert sorted(r["id"] for r in sink.current_rows(table(), meta=False).to_pylist()) == list(range(40))


def test_new_tables_keep_tombstones_and_commits_only_as_long_as_cdc_needs_them(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """Delta's week of tombstones and 30 days of commit files grew every snapshot, checkpoint and
    log listing with each batch; a table the sink creates keeps tombstones for the longest of a
    lease, the full vacuum's retention and the readers' window (at least an hour), and commit files
    for twice the readers' window (at least 10 minutes)."""
    for options, tombstones, log in (
        (WarehouseOptions(), 3600, 600),
        (WarehouseOptions(lease_max_age_s=7200.5), 7201, 600),
        (WarehouseOptions(vacuum_retention_hours=3, vacuum_min_retention_s=900), 3 * 3600, 1800),
    ):
        sink = WarehouseSink(tmp_path / str(tombstones + log), options)
        reg = table()
        f = feed(reg)
        sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": None}, 100)), 1, APP)
        for path in sink.paths(reg):
            conf = DeltaTable(str(path)).metadata().configuration
            assert conf[reclaim.TOMBSTONES_CONF] == f"interval {tombstones} seconds", path.name
            assert conf[reclaim.LOG_CONF] == f"interval {log} seconds", path.name


def test_after_the_log_cleanup_handles_are_reused_and_rows_kept(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a log retention of a second and a checkpoint every 5 commits, delta-rs deletes the
    table's first commit files; the sink's handles, recognised by the table's marker, are still
    reused (no table opened anew after the first batch), and every row is there.

    delta-rs's cleanup (after each commit) deletes only the commit files before a checkpoint that
    is itself no later than the oldest commit file modified within the retention: every commit file
    up to that checkpoint must be past the retention, not only the first batch's. So the log is
    aged once a checkpoint exists, and the next batch's commit deletes what precedes it, however
    fast the batches run; the batches after it open no table anew."""
    real = reclaim.retention_conf
    monkeypatch.setattr(
        reclaim,
        "retention_conf",
        lambda opts: {**real(opts), reclaim.LOG_CONF: "interval 1 seconds", "delta.checkpointInterval": "5"},
    )
    opened = _calls(monkeypatch, "open_table")
    monkeypatch.setattr(handles_module, "open_table", reclaim.open_table)
    sink = _sink(tmp_path, 5.0, ratio=0.5, retention=0)
    reg = table()
    f = feed(reg)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(20))), 1, APP
    )
    first = len(opened)

    def update(batch_id: int) -> None:
        rows = [
            f.change("u", {"id": i, "name": f"v{batch_id}", "note": None}, 100 * batch_id)
            for i in range(0, 20, 3)
        ]
        sink.apply(f.batch(*rows), batch_id, APP)

    for batch_id in range(2, 7):
        update(batch_id)
    current = sink.paths(reg)[0]
    assert list((current / "_delta_log").glob("*.checkpoint.parquet")), "no checkpoint to clean up to"
    for path in sink.paths(reg):  # every commit so far made an hour ago: past the retention
        for entry in (path / "_delta_log").iterdir():
            os.utime(entry, (time.time() - 3600, time.time() - 3600))
    update(7)
    assert not (current / "_delta_log" / f"{0:020d}.json").exists(), "the log was not cleaned up"
    for batch_id in range(8, 16):
        update(batch_id)
    assert len(opened) == first, f"tables opened anew after the cleanup: {opened[first:]}"
    got = {r["id"]: r["name"] for r in sink.current_rows(reg, meta=False).to_pylist()}
    assert got == {i: ("v15" if i % 3 == 0 else "a") for i in range(20)}


def test_the_tracker_starts_again_on_another_table_at_the_same_path(tmp_path: Path, feed: FeedMaker) -> None:
    """A table replaced at its path (``cdc rebuild`` swaps one in) by one of a later version: the
    tracker walks and lists it anew, never carrying the old table's files or bytes over."""
    old = _run(_sink(tmp_path / "a", 0.0, ratio=0.0), feed, 2)
    tracker = reclaim.DiskTracker()
    tracker.usage(old, DeltaTable(str(old)))
    new = _run(_sink(tmp_path / "b", 0.0, ratio=0.0), feed, 9)
    shutil.rmtree(old)
    shutil.copytree(new, old)
    handle = DeltaTable(str(old))
    assert tracker.usage(old, handle) == reclaim.usage(old)
    assert tracker.superseded(old) == reclaim.listed_superseded(old, handle, on_disk=True)


def test_a_lease_older_than_the_logs_commits_keeps_every_superseded_file(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reclaim keeps the files removed since a live lease's version, which it learns from those
    commits; once the log's cleanup deleted some of them, it cannot tell, and deletes nothing of the
    table while the lease lives (then everything it may)."""
    real = reclaim.retention_conf
    monkeypatch.setattr(
        reclaim,
        "retention_conf",
        lambda opts: {**real(opts), reclaim.LOG_CONF: "interval 1 seconds", "delta.checkpointInterval": "5"},
    )
    sink = _sink(tmp_path, 0.0, ratio=0.0, retention=0)  # the sink reclaims nothing itself
    reg = table()
    f = feed(reg)

    def batch(batch_id: int) -> None:
        rows = [
            f.change(
                "u" if batch_id > 1 else "c", {"id": i, "name": f"v{batch_id}", "note": None}, 100 * batch_id
            )
            for i in range(12)
        ]
        sink.apply(f.batch(*rows), batch_id, APP)

    batch(1)
    current = sink.paths(reg)[0]
    with leases.lease(current):
        for batch_id in range(2, 7):
            batch(batch_id)
        for entry in (current / "_delta_log").iterdir():
            os.utime(entry, (time.time() - 3600, time.time() - 3600))
        for batch_id in range(7, 17):
            batch(batch_id)
        assert not (current / "_delta_log" / f"{2:020d}.json").exists(), "the log was not cleaned up"
        superseded = reclaim.listed_superseded(current, DeltaTable(str(current)), on_disk=True)
        assert superseded
        done = reclaim.reclaim(current, 0)
        assert done.files == 0 and all((current / p).exists() for p in superseded)
    assert reclaim.reclaim(current, 0).files == len(superseded)
