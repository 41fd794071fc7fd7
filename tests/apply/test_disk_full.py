"""The apply job's disk fills up while batches are flowing: `cdc apply` (continuous) must not hang.

The Spark checkpoint, the warehouse, the search index and the metrics files sit on a small tmpfs of
their own (the log store does not, so changes keep arriving). A file fills that disk while the job runs:
the job exits non-zero within a bounded time naming the cause (no space left on device) and the fix,
so a supervisor restarts it; once the disk is freed the restarted job catches up from its checkpoint
and `cdc verify` is clean.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.apply.changes import ChangeWriter, PgMirror, make_reg
from tests.apply.conftest import Env
from tests.apply.test_verify import COLUMNS, DDL, _row, _verify
from tests.plugins.postgres import PgCluster, wait_for

pytestmark = [pytest.mark.spark, pytest.mark.postgres, pytest.mark.slow]

#: the directories of the state that the apply job writes (the log store's stays on the normal disk)
CDC = [sys.executable, "-c", "import sys; from cdc.cli import main; sys.exit(main())"]


def _mount_tmpfs(path: Path, size: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("not root: a size-limited tmpfs cannot be mounted (run as root, or in CI)")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"mount of a size-limited tmpfs is not permitted here: {proc.stderr.strip()}")


@pytest.fixture
def small_state(tmp_path: Path) -> Iterator[Env]:
    """A state directory on a 64 MiB tmpfs of its own (log store, checkpoint, warehouse, index)."""
    from cdc.config import Settings
    from cdc.logstore.embedded import EmbeddedLogStore
    from cdc.registry import Registry

    state = tmp_path / "state"
    state.mkdir()
    _mount_tmpfs(state, "64m")
    try:
        store = EmbeddedLogStore(state / "log", writer=True, compaction_interval_s=None)
        registry = Registry(state)
        try:
            yield Env(Settings(state_dir=state), store, registry)
        finally:
            store.close()
            registry.close()
    finally:
        subprocess.run(["umount", "-l", str(state)], check=False)


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    with filler.open("wb") as f, contextlib.suppress(OSError):
        chunk = b"\0" * (1 << 20)
        while True:
            f.write(chunk)
            f.flush()
    return filler


def _jvm_dump(pid: int) -> str:
    """Thread dumps of a hung job (the JVM's via jstack, Python's via faulthandler on SIGUSR1)."""
    out = []
    with contextlib.suppress(Exception):
        kids = subprocess.run(["pgrep", "-g", str(pid)], capture_output=True, text=True).stdout.split()
        for kid in kids:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
            if b"java" in cmd:
                out.append(subprocess.run(["jstack", kid], capture_output=True, text=True, timeout=60).stdout)
    return "\n".join(out)[-20000:]


@pytest.mark.parametrize("when", ["batches_flowing", "idle"])
def test_disk_full_under_continuous_apply_never_hangs(
    small_state: Env, pg: PgCluster, pg_db: str, tmp_path: Path, when: str
) -> None:
    """The disk fills for a few seconds while batches flow, then is freed. Either the job goes on, or
    it exits non-zero naming the cause -- never alive without progress. Restarted (as a supervisor
    would), it catches up from its checkpoint and `cdc verify` is clean."""
    env = small_state
    pg.execute(DDL, pg_db)
    dsn = pg.dsn(pg_db)
    reg = env.register(make_reg("public", "items", COLUMNS, search=("name",)))
    mirror = PgMirror(dsn, ChangeWriter(env.store, reg, db=pg_db))
    log = tmp_path / "apply.log"
    args = [
        *CDC,
        "--state",
        str(env.state),
        "apply",
        "--trigger-interval",
        "0.2",
        "--max-records-per-batch",
        "20",
        "--stall-timeout",
        "60",
    ]
    next_id = 1

    def write(n: int) -> None:
        nonlocal next_id
        for _ in range(n):
            mirror.insert(_row(next_id))
            if next_id % 3 == 0:
                mirror.update(next_id - 1, {"name": f"widget {next_id - 1} again"})
            next_id += 1

    def applied() -> bool:
        from sinks.warehouse import WarehouseSink

        with contextlib.suppress(Exception):
            return len(WarehouseSink(env.state).current_rows(reg, meta=False)) == next_id - 1
        return False

    try:
        write(300)  # about 20 micro-batches of 20 records: batches are flowing when the disk fills
        with log.open("wb") as f:
            proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(
                lambda: "batch 0:" in log.read_text() or proc.poll() is not None, timeout=180, what="batch 0"
            )
            assert proc.poll() is None, log.read_text()[-5000:]
            if when == "idle":  # caught up: the disk fills while the job only polls for data
                wait_for(lambda: applied() or proc.poll() is not None, timeout=300, what="caught up")
            filler = _fill(env.state)
            try:
                time.sleep(3)  # the fault's duration, not a synchronisation
            finally:
                filler.unlink()
            write(20)  # changes after the disk was freed
            # now: either progress (everything applied) or an exit; never alive and stuck
            try:
                wait_for(lambda: proc.poll() is not None or applied(), timeout=180, what="exit or progress")
            except AssertionError:
                dump = _jvm_dump(proc.pid)
                os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)
                pytest.fail(f"cdc apply hung after a full disk:\n{log.read_text()[-8000:]}\n{dump}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(60)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        text = log.read_text()
        if proc.returncode not in (0, -signal.SIGTERM):  # it failed: loudly, with the cause and the fix
            assert "\nerror: " in text and "\n  fix: " in text, text[-5000:]
            if when == "batches_flowing":
                assert "No space left on device" in text, text[-5000:]
        # the supervisor restarts it: the disk is free again, the job catches up from its checkpoint
        write(5)
        done = subprocess.run([*args[:6], "--once"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        mirror.close()
    code, reports = _verify(env.settings, dsn)
    assert code == 0, reports
    assert reports[0]["source_rows"] == next_id - 1
