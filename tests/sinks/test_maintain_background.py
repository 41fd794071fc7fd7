"""The warehouse's maintenance on its own thread (:mod:`sinks.warehouse.background`): the driver's
``committed`` returns before the round is done, the next batch's commit waits for it, a round's
compaction of the history's closed rows never conflicts with the writes of a batch read before it,
and a round's error reaches the driver."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

import sinks.warehouse as warehouse
from sinks.warehouse import WarehouseOptions, WarehouseSink, reclaim
from tests.sinks.conftest import FeedMaker
from tests.sinks.feed import Feed, table

APP = "app-test"


def _options(**kw: Any) -> WarehouseOptions:
    base: dict[str, Any] = {
        "buckets": 2,
        "clustering": "hash",
        "maintain_every": 0,
        "vacuum_every": 0,
        "compact_budget_s": 5.0,
        "compact_min_files": 4,
        "vacuum_garbage_ratio": 1.0,
        "vacuum_min_retention_s": 0.0,
    }
    return WarehouseOptions(**{**base, **kw})


def _updates(f: Feed, batch_id: int, keys: list[int]) -> Any:
    return f.batch(
        *(f.change("u", {"id": i, "name": f"v{batch_id}", "note": None}, 100 * batch_id) for i in keys)
    )


def _deferred(task: WarehouseSink, batch: Any, batch_id: int) -> list[Any]:
    """What a Spark task hands the driver for ``batch``: its writes, read at the tables' versions now."""
    pending: list[Any] = []
    task.defer_commits(pending)
    task.apply(batch, batch_id, APP)
    task.defer_commits(None)
    return pending


def _applied(sink: WarehouseSink, reg: Any) -> int | None:
    """The batch the current table committed last (an empty write, as the tombstones' of a batch
    without deletes, commits nothing)."""
    return DeltaTable(str(sink.paths(reg)[0])).transaction_version(APP)


def _until(what: Any, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < end, "not within the deadline"
        time.sleep(0.01)


def test_a_batch_s_commit_waits_for_the_round_before_it_not_its_own_committed(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``committed`` hands the round over and returns while it is held; the next batch's tasks
    write meanwhile; its commit starts only once the round is done."""
    reg = table()
    f = feed(reg)
    driver, task = WarehouseSink(tmp_path, _options()), WarehouseSink(tmp_path, _options())
    driver.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(20))), 1, APP
    )
    release, entered, order = threading.Event(), threading.Event(), []
    real_after, real_commit = reclaim.after_batch, warehouse.commit_all

    def held_after(*args: Any, **kw: Any) -> Any:
        entered.set()
        assert release.wait(60)
        done = real_after(*args, **kw)
        order.append("round")
        return done

    def commit_all(*args: Any, **kw: Any) -> None:
        order.append("commit")
        real_commit(*args, **kw)

    monkeypatch.setattr(reclaim, "after_batch", held_after)
    monkeypatch.setattr(warehouse, "commit_all", commit_all)
    try:
        driver.commit_deferred(_deferred(task, _updates(f, 2, list(range(10))), 2), APP, 2)
        driver.committed(reg, 2)  # returns with its round held
        _until(entered.is_set)
        assert driver.background.busy and order == ["commit"]
        writes = _deferred(task, _updates(f, 3, list(range(10, 20))), 3)  # the next batch's task
        committing = threading.Thread(target=driver.commit_deferred, args=(writes, APP, 3))
        committing.start()
        assert order == ["commit"] and committing.is_alive()
        release.set()
        committing.join(60)
        assert not committing.is_alive()
        assert order == ["commit", "round", "commit"]
        assert _applied(driver, reg) == 3
    finally:
        release.set()
        driver.close()
    names = {r["id"]: r["name"] for r in driver.current_rows(reg, meta=False).to_pylist()}
    assert names == {i: "v2" if i < 10 else "v3" for i in range(20)}


def test_closed_rows_compacted_beside_a_batch_read_before_lose_and_double_nothing(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """Each batch's task reads the tables before the previous batch's round runs (it compacts the
    history's closed rows and reclaims); every commit goes through (no conflict: a batch never
    removes a closed-rows file), the closed files are compacted, and the rows are those of a sink
    maintaining in line, none lost or doubled; after the last round each table is within its
    garbage ratio."""
    reg = table()
    rows: dict[bool, list[dict[str, Any]]] = {}
    files: dict[bool, int] = {}
    for behind in (False, True):
        opts = _options(maintain_in_background=behind)
        driver, task = (
            WarehouseSink(tmp_path / str(behind), opts),
            WarehouseSink(tmp_path / str(behind), opts),
        )
        f = feed(reg)
        driver.apply(
            f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(50))), 1, APP
        )
        rng = random.Random(5)
        writes = _deferred(task, _updates(f, 2, rng.sample(range(50), 10)), 2)
        for batch_id in range(2, 22):
            driver.commit_deferred(writes, APP, batch_id)
            # the next batch's task reads now, before this batch's round (held back by the GIL at
            # most: the round runs once committed hands it over)
            writes = _deferred(task, _updates(f, batch_id + 1, rng.sample(range(50), 10)), batch_id + 1)
            driver.committed(reg, batch_id)
        driver.commit_deferred(writes, APP, 22)
        driver.committed(reg, 22)
        driver.close()
        assert _applied(driver, reg) == 22
        for path in driver.paths(reg):  # the disk bound after the last round: garbage <= ratio x live
            use = reclaim.usage(path)
            assert use.garbage <= 1.0 * use.live, (path.name, use)
        hist = driver.paths(reg)[1]
        files[behind] = len(DeltaTable(str(hist)).file_uris())
        rows[behind] = sorted(
            driver.history_rows(reg).to_pylist(), key=lambda r: (r["id"], r["_cdc_commit_lsn"], r["_cdc_seq"])
        )
        assert len(rows[behind]) == 50 + 21 * 10
    assert rows[True] == rows[False]
    assert files[True] <= 2 * 2 + 2 * 4  # open + closed partitions of 2 buckets, under min_files each


def test_a_round_s_error_is_raised_at_the_next_commit(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round that fails (here a disk error of the reclaim) fails the next batch's commit, which
    commits nothing: the job stops, as with the maintenance in line."""
    reg = table()
    f = feed(reg)
    driver, task = WarehouseSink(tmp_path, _options()), WarehouseSink(tmp_path, _options())
    driver.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(10))), 1, APP
    )

    def failing(*args: Any, **kw: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(reclaim, "after_batch", failing)
    driver.commit_deferred(_deferred(task, _updates(f, 2, [1, 2]), 2), APP, 2)
    driver.committed(reg, 2)
    writes = _deferred(task, _updates(f, 3, [3]), 3)
    with pytest.raises(OSError, match="No space left"):
        driver.commit_deferred(writes, APP, 3)
    assert _applied(driver, reg) == 2
    driver.close()


def test_new_keys_files_are_compacted_by_the_driver_from_the_round_s_listing(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """Batches of new keys append a file per bucket to the current table (a partition a batch may
    rewrite, so never compacted beside the tasks): the round lists it, the driver's next
    ``committed`` compacts it; the files stay few, every row kept."""
    reg = table()
    f = feed(reg)
    driver, task = WarehouseSink(tmp_path, _options()), WarehouseSink(tmp_path, _options())
    n = 0
    for batch_id in range(1, 16):
        rows = [f.change("c", {"id": n + i, "name": "a", "note": None}, 100 * batch_id) for i in range(6)]
        n += 6
        driver.commit_deferred(_deferred(task, f.batch(*rows), batch_id), APP, batch_id)
        driver.committed(reg, batch_id)
    driver.close()
    assert driver.maintain_phases()["compact"] > 0  # the driver compacted from a round's listing
    assert len(DeltaTable(str(driver.paths(reg)[0])).file_uris()) <= 2 * 4  # 2 buckets, under min_files
    assert sorted(r["id"] for r in driver.current_rows(reg, meta=False).to_pylist()) == list(range(n))


def test_a_table_s_writes_read_at_two_versions_commit_as_read_at_the_earliest(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """Two tasks of a batch may read a table on either side of a round's compaction (found by
    ``bench.freshness_sustained``: the apply failed with "cannot be committed together"): their
    writes merge, read at the earlier version, and the commit checks what they remove."""
    from sinks.warehouse.files import HISTORY, TableWrite

    first = TableWrite("file:///t", 206, ["_cdc_bucket"], HISTORY, adds=[{"path": "a"}])
    first.merge(TableWrite("file:///t", 205, ["_cdc_bucket"], HISTORY, adds=[{"path": "b"}]))
    assert first.read_version == 205 and [a["path"] for a in first.adds] == ["a", "b"]
