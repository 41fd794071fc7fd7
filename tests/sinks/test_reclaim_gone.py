"""The reclaim's cost does not grow with the run: it skips the superseded files it deleted before
(:meth:`sinks.warehouse.reclaim.DiskTracker.gone`) and keeps the disk bytes without a walk
(:meth:`~sinks.warehouse.reclaim.DiskTracker.deleted`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from deltalake import DeltaTable

from sinks.warehouse import WarehouseOptions, WarehouseSink, reclaim
from tests.sinks.conftest import FeedMaker
from tests.sinks.feed import table

pytestmark = pytest.mark.check

APP = "app-test"


def _sink(tmp_path: Path, ratio: float) -> WarehouseSink:
    return WarehouseSink(
        tmp_path,
        WarehouseOptions(
            buckets=2,
            clustering="hash",
            maintain_every=0,
            vacuum_every=0,
            compact_budget_s=5.0,
            compact_min_files=4,
            vacuum_garbage_ratio=ratio,
            vacuum_min_retention_s=0,
        ),
    )


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
    walks: list[Path] = []
    real = reclaim.tree_bytes

    def counted(path: Path) -> int:
        walks.append(path)
        return real(path)

    monkeypatch.setattr(reclaim, "tree_bytes", counted)
    sink = _sink(tmp_path, 0.5)
    reclaims: list[reclaim.Reclaimed] = []
    real_within = reclaim.within_ratio

    def within(*a: object, **k: object) -> reclaim.Reclaimed:
        done = real_within(*a, **k)  # type: ignore[arg-type]
        reclaims.append(done)
        return done

    monkeypatch.setattr(reclaim, "within_ratio", within)
    _run(sink, feed, 14, walks)
    assert sum(r.files for r in reclaims) > 10, "the test needs reclaims that deleted files"


def test_a_reclaim_skips_the_files_it_deleted_before(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """delta-rs lists every file removed within its retention (a week) whether it is still on disk
    or not; a reclaim given the files it deleted before (``gone``) does not touch them again, so
    its cost follows what the batches since removed, not the age of the table."""
    sink = _sink(tmp_path, 0.0)  # the sink reclaims nothing itself
    current = _run(sink, feed, 10)
    listed = {
        p
        for p in DeltaTable(str(current)).vacuum(
            retention_hours=0, dry_run=True, enforce_retention_duration=False
        )
    }
    assert len(listed) >= 10
    calls: list[Path] = []
    real = reclaim._unlink

    def counted(target: Path) -> int:
        calls.append(target)
        return real(target)

    monkeypatch.setattr(reclaim, "_unlink", counted)
    gone: set[str] = set()
    first = reclaim.reclaim(current, 0, gone=gone)
    assert first.files == len(listed) and len(calls) == len(listed)
    assert gone == listed
    calls.clear()
    assert reclaim.reclaim(current, 0, gone=gone).files == 0
    assert calls == [], "the second reclaim tried files it had deleted"
    # without what it deleted, it tries every one of them again: the cost this saves
    assert reclaim.reclaim(current, 0).files == 0
    assert len(calls) == len(listed)
    # a file delta-rs no longer lists is dropped from the set (kept in step with delta-rs)
    gone.add("never-listed.parquet")
    reclaim.reclaim(current, 0, gone=gone)
    assert "never-listed.parquet" not in gone
