"""Reader leases (:mod:`sinks.warehouse.leases`) and the strict disk bound of
:mod:`sinks.warehouse.reclaim`, on real Delta tables (deltalake; no JVM)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from cdc.cli.query.analytics import Warehouse
from sinks import KeyRanges
from sinks import warehouse as W
from sinks.warehouse import WarehouseOptions, WarehouseSink, leases, reclaim
from sinks.warehouse.layout import BUCKET, table_paths
from tests.sinks.conftest import FeedMaker
from tests.sinks.feed import table

ROWS = 1000


def rewrite(path: Path, version: int) -> None:
    """A new version replacing every row (4 files, one per ``_cdc_bucket``, as the warehouse's
    tables are partitioned): it supersedes every file of the one before, as a batch of random keys
    does. Each version's files are about the same size (random text of a fixed length)."""
    rng = random.Random(version)
    data = pa.table(
        {
            "id": pa.array(range(ROWS), pa.int64()),
            "v": [f"{version:04d}" + rng.randbytes(60).hex() for _ in range(ROWS)],
            BUCKET: pa.array([i % 4 for i in range(ROWS)], pa.int32()),
        }
    )
    write_deltalake(str(path), data, mode="overwrite", partition_by=[BUCKET])


def readable(path: Path, version: int) -> bool:
    """Whether every file of ``version`` is still on disk (its rows read whole)."""
    try:
        rows = DeltaTable(str(path), version=version).to_pyarrow_table()
    except OSError:
        return False
    return rows.num_rows == ROWS and {v[:4] for v in rows.column("v").to_pylist()} == {f"{version:04d}"}


def over(path: Path, ratio: float) -> float:
    use = reclaim.usage(path)
    return use.garbage / use.live if use.live else 0.0


def test_without_a_lease_the_window_is_reclaimed_down_to_the_ratio_oldest_first(tmp_path: Path) -> None:
    """Six versions within ``vacuum_min_retention_s``: the window alone kept five tables' worth of
    superseded files (what held the full-size suite at 3.94x). Now the reclaim deletes the window's
    files, oldest commit first, until the garbage is within the ratio -- and no further."""
    path = tmp_path / "t"
    for version in range(6):
        rewrite(path, version)
    assert over(path, 1.0) > 3
    done = reclaim.within_ratio(path, 1.0, 3600)
    use = reclaim.usage(path)
    assert use.garbage <= 1.0 * use.live, f"{use.garbage:,} B of garbage for {use.live:,} B live"
    assert done.over == 1 and done.leases == 0
    assert done.window_files == done.files > 0 and done.window_bytes == done.bytes > 0
    assert done.window_kept > 0  # only as far as the ratio needed
    assert not readable(path, 0) and readable(path, 4) and readable(path, 5)
    assert reclaim.within_ratio(path, 1.0, 3600) == reclaim.Reclaimed()  # within: nothing to do


def test_a_live_lease_keeps_every_file_of_the_version_its_reader_opened(tmp_path: Path) -> None:
    """A reader takes its lease, then opens the table (version 1); four later versions supersede
    its files. However far over the ratio, the reclaim deletes none of them while the lease lives
    (it deletes the rest); once the lease is released, the next reclaim brings the table within."""
    path = tmp_path / "t"
    rewrite(path, 0)
    rewrite(path, 1)
    with leases.lease(path) as held:
        assert held is not None and held.version == 1 and held.path.exists()
        opened = DeltaTable(str(path))
        for version in range(2, 6):
            rewrite(path, version)
        done = reclaim.within_ratio(path, 1.0, 3600)
        assert done.leases == 1 and done.leased_files == 4 * 4  # versions 1-4, removed by commits 2-5
        assert not readable(path, 0)  # removed by commit 1: the reader never saw it
        assert over(path, 1.0) > 1.0  # over the ratio, for the lease
        assert opened.to_pyarrow_table().num_rows == ROWS and readable(path, 1)
    assert not held.path.exists()
    reclaim.within_ratio(path, 1.0, 3600)
    assert over(path, 1.0) <= 1.0 and readable(path, 5)


def write_lease(path: Path, pid: int, host: str, expires: float, **extra: Any) -> Path:
    folder = path / leases.LEASE_DIR
    folder.mkdir(exist_ok=True)
    target = folder / f"{pid}-{len(list(folder.iterdir()))}.json"
    body = {"pid": pid, "host": host, "since": time.time() - 10, "expires": expires, "version": 0, **extra}
    target.write_bytes(orjson.dumps(body))
    return target


def test_a_lease_of_a_dead_process_or_past_its_expiry_is_ignored_and_deleted(tmp_path: Path) -> None:
    path = tmp_path / "t"
    rewrite(path, 0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    host = socket.gethostname()
    dead = write_lease(path, child.pid, host, time.time() + 3600)
    expired = write_lease(path, os.getpid(), host, time.time() - 1)
    elsewhere = write_lease(path, child.pid, host + ".other", time.time() + 3600)
    assert [h.path for h in leases.live_leases(path)] == [elsewhere]  # another host's: by expiry only
    assert not dead.exists() and not expired.exists()
    elsewhere.unlink()
    write_lease(path, child.pid, host, time.time() + 3600)
    write_lease(path, os.getpid(), host, time.time() - 1)
    for version in range(1, 6):
        rewrite(path, version)
    done = reclaim.within_ratio(path, 1.0, 3600)
    assert done.leases == 0 and done.leased_files == 0
    assert over(path, 1.0) <= 1.0
    assert list((path / leases.LEASE_DIR).iterdir()) == []


def test_a_lease_whose_pid_now_names_another_process_is_ignored(tmp_path: Path) -> None:
    """A reader killed, its pid given to a later process: the lease names the process by its pid and
    its start time, so it is not taken for the later one's (which would hold the files an hour)."""
    path = tmp_path / "t"
    rewrite(path, 0)
    host, later = socket.gethostname(), time.time() + 3600
    started = leases.process_start(os.getpid())
    assert started is not None
    reused = write_lease(path, os.getpid(), host, later, started=started - 1)
    mine = write_lease(path, os.getpid(), host, later, started=started)
    old = write_lease(path, os.getpid(), host, later)  # written before leases named the start
    assert {h.path for h in leases.live_leases(path)} == {mine, old}
    assert not reused.exists()
    with leases.lease(path) as held:
        assert held is not None and held.started == started
        assert orjson.loads(held.path.read_bytes())["started"] == started


def test_a_lease_file_that_is_not_one_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "t"
    rewrite(path, 0)
    bad = path / leases.LEASE_DIR / "x.json"
    bad.parent.mkdir()
    bad.write_bytes(b"{}")
    with pytest.raises(leases.LeaseError) as err:
        leases.live_leases(path)
    assert err.value.path == str(bad)


def test_vacuum_and_readers_leave_the_lease_dir_alone(tmp_path: Path) -> None:
    """delta-rs's vacuum, lite and full (with the warehouse's ``_cdc_bucket`` partitions, whose
    directories start with ``_`` too), never lists or deletes a lease; Delta and ``cdc sql``'s
    DuckDB reads ignore the directory."""
    path = tmp_path / "t"
    rewrite(path, 0)
    rewrite(path, 1)
    with leases.lease(path) as held:
        assert held is not None
        old = time.time() - 7200
        os.utime(held.path, (old, old))  # older than any retention
        for full in (False, True):
            listed = DeltaTable(str(path)).vacuum(
                retention_hours=0, dry_run=True, enforce_retention_duration=False, full=full
            )
            assert listed and not [p for p in listed if leases.LEASE_DIR in p]
        assert reclaim.vacuum_full(path, 0) == 4  # version 0's files
        assert reclaim.orphans(path) == (0, 0)
        assert held.path.exists()
        assert DeltaTable(str(path)).to_pyarrow_table().num_rows == ROWS
        assert readable(path, 1)


def test_cdc_sql_holds_a_lease_on_each_table_until_closed(tmp_path: Path) -> None:
    """``cdc sql``'s connection leases each table before it opens it: a reclaim while it is open
    (four rewrites later, no window) leaves its query's files; closing it releases the leases."""
    reg = table()
    current, history, _ = table_paths(tmp_path, reg)
    rewrite(current, 0)
    rewrite(history, 0)
    with Warehouse(tmp_path, [reg]) as wh:
        for path in (current, history):
            assert [h.pid for h in leases.live_leases(path)] == [os.getpid()]
        for version in range(1, 5):
            rewrite(current, version)
        assert reclaim.within_ratio(current, 1.0, 0).leased_files == 4 * 4  # versions 0-3
        result = wh.query(f'SELECT count(*) AS n, min(v) AS v FROM "{reg.schema}"."{reg.table}"')
        assert result.to_pylist()[0]["n"] == ROWS and result.to_pylist()[0]["v"].startswith("0000")
    assert leases.live_leases(current) == [] and leases.live_leases(history) == []


def test_verify_read_backs_hold_a_lease_while_they_read(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cdc verify``'s read-back of a table, whole or by key ranges, reads under a lease on the
    current table, released after."""
    sink = WarehouseSink(tmp_path, WarehouseOptions(buckets=2, maintain_every=0, vacuum_every=0))
    reg = table()
    f = feed(reg)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(10))), 1, "a"
    )
    cur = sink.paths(reg)[0]
    seen: list[int] = []

    def counting(read: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen.append(len(leases.live_leases(cur)))
            return read(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(W, "read_all", counting(W.read_all))
    monkeypatch.setattr(W, "read_spans", counting(W.read_spans))
    assert sink.read_back(reg).table is not None
    assert sink.read_back(reg, KeyRanges(((None, None),))).table is not None
    assert seen == [1, 1] and leases.live_leases(cur) == []
