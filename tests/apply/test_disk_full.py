"""The apply job's disk fills up: `cdc apply` (continuous) must fail, never hang, and lose nothing.

The apply job's part of the state (the Spark checkpoint, the warehouse, the search index) sits on a
small tmpfs of its own; the log store and the registry do not, so the real reader (`cdc run --once`)
keeps capturing while that disk is full. The disk fills while batches flow, or while the job is idle
and new changes then arrive: a write of the next batch must hit the full disk, and the job must exit 1
within a bounded time naming the cause (no space left on device) and the fix, so a supervisor
restarts it. Once the disk is freed the restarted job catches up from its checkpoint and `cdc verify`
is clean.
"""

from __future__ import annotations

import base64
import contextlib
import os
import random
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.logstore.factory import open_log_store
from tests.plugins.apply import apply_clean, descendants, reader_env
from tests.plugins.capture import CDC
from tests.plugins.items import capture, item_row, items_table, source, verify_json
from tests.plugins.postgres import PgCluster, wait_for

#: the directories of the state that only the apply job writes (cdc/paths.py)
APPLY_DIRS = ("spark", "warehouse", "search")


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} is not permitted here: {proc.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(state directory, disk): the apply job's directories of the state are bind mounts of a
    64 MiB tmpfs; the rest of the state (log store, registry) stays on the normal disk."""
    if os.geteuid() != 0:
        pytest.skip("not root: a size-limited tmpfs cannot be mounted (run as root, or in CI)")
    state, disk = tmp_path / "state", tmp_path / "disk"
    state.mkdir(mode=0o700)
    disk.mkdir()
    mounted: list[Path] = []
    try:
        _mount("-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(disk))
        mounted.append(disk)
        for name in APPLY_DIRS:
            (disk / name).mkdir(mode=0o700)
            (state / name).mkdir(mode=0o700)
            _mount("--bind", str(disk / name), str(state / name))
            mounted.append(state / name)
        yield state, disk
    finally:
        for path in reversed(mounted):
            subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(disk: Path) -> Path:
    """Fill ``disk`` to the last byte: big writes, then smaller ones down to one byte."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            chunk = b"\0" * size
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk)
    assert os.statvfs(disk).f_bavail == 0, "the disk is not full"
    return filler


def _used(disk: Path) -> int:
    """Bytes in use on the filesystem of ``disk``."""
    st = os.statvfs(disk)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _jvm_dump(pid: int) -> str:
    """Thread dumps of a hung job (the JVM's via jstack)."""
    out = []
    with contextlib.suppress(Exception):
        for kid in descendants(pid):  # the JVM runs in a process group of its own
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
            if b"java" in cmd:
                out.append(
                    subprocess.run(["jstack", str(kid)], capture_output=True, text=True, timeout=60).stdout
                )
    return "\n".join(out)[-20000:]


class _Items:
    """The items workload of one test: changes made at the source and captured by the real reader,
    and what the job applied of them."""

    def __init__(self, pg: PgCluster, db: str, state: Path) -> None:
        self.state = state
        self.dsn, self.reg = items_table(pg, db, state)
        self.env = reader_env(state)
        self.rows = 0

    def write(self, n: int, blob: int = 0) -> None:
        """n inserts and n/3 updates at the source, captured by the real reader; ``blob``: each
        insert carries that many bytes of incompressible text."""
        with source(self.dsn) as src:
            for _ in range(n):
                self.rows += 1
                row = item_row(self.rows)
                if blob:
                    row["blob"] = base64.b64encode(random.Random(self.rows).randbytes(blob * 3 // 4)).decode()
                src.insert(row)
                if self.rows % 3 == 0:
                    src.update(self.rows - 1, {"name": f"widget {self.rows - 1} again"})
        capture(self.dsn, self.state)

    def applied(self) -> bool:
        from sinks.warehouse import WarehouseSink

        with contextlib.suppress(Exception):
            return len(WarehouseSink(self.state).current_rows(self.reg, meta=False)) == self.rows
        return False

    def idle(self) -> bool:
        """Every record in the log store was read by the job and applied."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            read = orjson.loads((self.state / "metrics" / "apply.json").read_bytes())["counters"].get(
                "records_read"
            )
            with open_log_store(self.env.settings) as store:
                return bool(read == sum(store.end_offsets(self.reg.topic).values()) and self.applied())
        return False


def _apply_args(state: Path) -> list[str]:
    """``cdc apply`` running continuously, in micro-batches of 20 records."""
    return [
        *CDC,
        "--state",
        str(state),
        "apply",
        "--trigger-interval",
        "0.2",
        "--max-records-per-batch",
        "20",
        "--stall-timeout",
        "60",
    ]


def _wait_running(proc: subprocess.Popen[bytes], log: Path, items: _Items, when: str) -> None:
    """Until the job wrote its first batch (and, ``idle``, caught up); it must still run."""
    try:
        wait_for(
            lambda: "batch 0:" in log.read_text() or proc.poll() is not None, timeout=300, what="batch 0"
        )
    except AssertionError:
        pytest.fail(f"no batch 0 in 300 s:\n{log.read_text()[-5000:]}\n{_jvm_dump(proc.pid)}")
    assert proc.poll() is None, log.read_text()[-5000:]
    if when == "idle":  # caught up: the disk fills while the job only polls for data
        wait_for(lambda: items.idle() or proc.poll() is not None, timeout=300, what="caught up")
        assert proc.poll() is None, log.read_text()[-5000:]


def _fill_until_exit(proc: subprocess.Popen[bytes], log: Path, items: _Items, disk: Path) -> None:
    """Fill the disk, write changes, and wait for the job to exit on it; the disk is freed after."""
    used = _used(disk)
    filler = _fill(disk)
    try:
        # New changes whatever the job did meanwhile, each batch of them bigger than all the job
        # wrote so far: space the job frees after the fill (a search index merge, a temporary
        # file) cannot hold it, so a write of the batch must hit the full disk.
        items.write(20, blob=max(64 << 10, used // 10))
        try:
            wait_for(lambda: proc.poll() is not None, timeout=240, what="the job to exit on the full disk")
        except AssertionError:
            dump = _jvm_dump(proc.pid)
            pytest.fail(
                f"cdc apply went on or hung on a full disk (applied: {items.applied()}):\n"
                f"{log.read_text()[-8000:]}\n{dump}"
            )
    finally:
        filler.unlink()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """The job's process group ended: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.mark.parametrize("when", ["batches_flowing", "idle"])
def test_disk_full_under_continuous_apply_fails_loudly_then_recovers(
    small_disk: tuple[Path, Path],
    pg: PgCluster,
    pg_db: str,
    tmp_path: Path,
    when: str,
    jvm: None,
    spark: Any,
) -> None:
    """The disk fills while batches flow (or while the job is idle, then changes arrive) and stays
    full until the job exits: it must exit 1 naming ENOSPC and the fix -- never go on or hang.
    Restarted on a freed disk (as a supervisor would), it catches up from its checkpoint and
    `cdc verify` is clean."""
    state, disk = small_disk
    items = _Items(pg, pg_db, state)
    log = tmp_path / "apply.log"
    args = _apply_args(state)
    items.write(300)  # about 20 micro-batches of 20 records: batches are flowing when the disk fills
    with log.open("wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_running(proc, log, items, when)
        _fill_until_exit(proc, log, items, disk)
    finally:
        _stop(proc)
    text = log.read_text()
    # the full disk was hit by a write: the job failed loudly, with the cause and the fix
    assert proc.returncode == 1, text[-5000:]
    assert "\nerror: " in text and "\n  fix: " in text, text[-5000:]
    assert "No space left on device" in text and "free space on the filesystem" in text, text[-5000:]
    assert not items.applied(), "every change was applied although the disk was full"

    # the supervisor restarts it: the disk is free again, the job catches up from its checkpoint
    items.write(5)
    apply_clean(spark, state)  # the job `cdc apply --once` runs, on the session's Spark: a JVM start less
    assert items.applied()
    code, reports = verify_json(items.env.settings, items.dsn)
    assert code == 0, reports
    assert reports[0]["source_rows"] == items.rows
