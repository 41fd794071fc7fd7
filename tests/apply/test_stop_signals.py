"""`cdc apply` stopped the way a supervisor stops a service: SIGTERM (or Ctrl-C's SIGINT) to its whole
process group while batches flow. The Spark driver JVM runs in a process group of its own, so the
signal reaches the Python driver only: the batch in progress completes with its checkpoint, the job
exits 0, nothing of the run is left running, and a restart catches up with `cdc verify` clean. And
kill -9 of the driver leaves no orphan: the JVM ends when its stdin (a pipe from the driver) closes.

Changes come from the real reader (`cdc run --once`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from cdc.config import Settings
from spark_jobs.checkpoint import checkpoint_dir
from tests.plugins.apply import apply_clean, processes_with_env
from tests.plugins.capture import CDC
from tests.plugins.items import capture, item_row, items_table, source, verify_json
from tests.plugins.postgres import PgCluster, wait_for

ROWS = 300


def _workload(pg: PgCluster, db: str, state: Path) -> str:
    """public.items with ROWS inserts and ROWS/3 updates captured by the real reader: about 20
    micro-batches of 20 records. Returns the DSN."""
    dsn, _reg = items_table(pg, db, state)
    with source(dsn) as src:
        for i in range(1, ROWS + 1):
            src.insert(item_row(i))
            if i % 3 == 0:
                src.update(i - 1, {"name": f"widget {i - 1} again"})
    capture(dsn, state)
    return dsn


def _start(state: Path, log: Path, marker: str) -> subprocess.Popen[bytes]:
    """`cdc apply` running continuously in micro-batches of 20 records, as a supervisor starts it: in
    a process group of its own; ``marker`` (``NAME=VALUE``) in its environment, so every process of
    the run can be found (:func:`processes_with_env`)."""
    name, _, value = marker.partition("=")
    args = [
        *CDC,
        "--state",
        str(state),
        "apply",
        "--trigger-interval",
        "0.2",
        "--max-records-per-batch",
        "20",
    ]
    with log.open("wb") as f:
        return subprocess.Popen(
            args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, name: value}
        )


def _running(proc: subprocess.Popen[bytes], log: Path, batch: int, marker: str) -> None:
    """Wait until the job reported micro-batch ``batch`` and is still running, with its Spark JVM
    out of the job's process group."""
    wait_for(
        lambda: f"batch {batch}:" in log.read_text() or proc.poll() is not None,
        timeout=300,
        what=f"batch {batch}",
    )
    assert proc.poll() is None, log.read_text()[-5000:]
    procs = processes_with_env(marker)
    jvms = [pid for pid, cmd in procs.items() if Path(cmd.split(" ")[0]).name == "java"]
    # one JVM (CI once saw a second, short-lived java of the run: each is named below)
    shown = "\n".join(f"{pid} (parent {_parent(pid)}): {procs[pid]}" for pid in jvms)
    assert jvms, procs
    assert all(_pgid(pid) != proc.pid for pid in jvms), f"a JVM in the job's process group:\n{shown}"


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:  # it ended meanwhile
        return None


def _parent(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except OSError:
        return "gone"


def _end(proc: subprocess.Popen[bytes], marker: str) -> None:
    """Whatever the test did, nothing of the run is left running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)
    for pid in processes_with_env(marker):
        with contextlib.suppress(ProcessLookupError):  # it ended between the listing and the kill
            os.kill(pid, signal.SIGKILL)


def _batch_ids(directory: Path) -> set[int]:
    return {int(p.name) for p in directory.iterdir() if p.name.isdigit()} if directory.exists() else set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_to_the_process_group_stops_the_job_gracefully(
    pg: PgCluster, pg_db: str, tmp_path: Path, jvm: None, spark: Any, sig: signal.Signals
) -> None:
    state, log = tmp_path / "state", tmp_path / "apply.log"
    dsn = _workload(pg, pg_db, state)
    marker = f"CDC_TEST_RUN={uuid.uuid4().hex}"
    proc = _start(state, log, marker)
    try:
        _running(proc, log, 1, marker)
        os.killpg(proc.pid, sig)  # what systemd, supervisord (stopasgroup) or a terminal send
        wait_for(lambda: proc.poll() is not None, timeout=180, what="the job to stop")
    finally:
        _end(proc, marker)
    text = log.read_text()
    assert proc.returncode == 0, text[-5000:]
    assert f"{sig.name}: finishing the micro-batch in progress" in text, text[-5000:]
    assert "went away" not in text and "Traceback" not in text, text[-5000:]
    # every micro-batch the job planned was applied and checkpointed: none was cut short
    ckpt = checkpoint_dir(state)
    planned, committed = _batch_ids(ckpt / "offsets"), _batch_ids(ckpt / "commits")
    # every micro-batch that ran was checkpointed: none was cut short. Spark may have planned one
    # more as the stop landed; that one never started (the gate refused it: it reports nothing) and
    # the restart below replays it
    assert committed and committed <= planned, (sorted(planned), sorted(committed))
    assert planned - committed <= {max(planned)}, (sorted(planned), sorted(committed))
    assert f"batch {max(committed)}:" in text
    assert all(f"batch {n}:" not in text for n in planned - committed), text[-5000:]
    # the JVM and its Python workers ended with the job
    wait_for(lambda: not processes_with_env(marker), timeout=60, what="the run's JVM and workers to exit")

    # restarted, it applies the rest from its checkpoint: the warehouse and the index equal the source
    # (the job `cdc apply --once` runs, on the session's Spark: a JVM start less)
    apply_clean(spark, state)
    code, reports = verify_json(Settings(state_dir=state), dsn)
    assert code == 0, reports
    assert reports[0]["source_rows"] == ROWS


def test_kill_9_of_the_driver_leaves_no_orphan_jvm(
    pg: PgCluster, pg_db: str, tmp_path: Path, jvm: None
) -> None:
    """The JVM is out of the job's process group, so kill -9 of the group does not reach it: it
    must end on its own once the driver is gone (pyspark's gateway exits on EOF of its stdin)."""
    state, log = tmp_path / "state", tmp_path / "apply.log"
    _workload(pg, pg_db, state)
    marker = f"CDC_TEST_RUN={uuid.uuid4().hex}"
    proc = _start(state, log, marker)
    try:
        _running(proc, log, 0, marker)
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
        wait_for(
            lambda: not processes_with_env(marker), timeout=60, what="the orphaned JVM and workers to exit"
        )
    finally:
        _end(proc, marker)
