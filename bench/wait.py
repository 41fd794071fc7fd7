"""The added latency of ``cdc wait`` over the apply's own (read-your-writes, ``cdc/cli/wait/lsn.py``).

A private Postgres 15 (wal2json), a real ``cdc run`` process, and the Spark apply job running
continuously in this process at its default trigger into both sinks (as ``bench/freshness.py``).
A probe commits one change to ``probe`` (a table with a search column), takes
``pg_current_wal_lsn()`` and calls :func:`cdc.cli.wait.lsn.wait_for_lsn` on it (in this process, as ``GET
/wait`` does). The apply's own moment of visibility is the end of the micro-batch that applied the
probe: its ``on_batch`` report, whose batch had committed the probe table's consumer positions at or
past the wait's targets (read from the log store in the callback, after both sinks committed). Per
probe: commit -> visible (the apply's own), commit -> wait returned, and their difference, the
**added latency** of the wait (its polling, the slot read, the targets scan). Probes run on an idle
source and under load (a writer committing 1,000 changes/s to ``items`` meanwhile). A few probes also
time ``cdc wait`` as a new process (Python start and imports included).

``--quick``: 5 probes per condition.
"""

from __future__ import annotations

import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from bench._common import CDC, loadavg, say
from bench.freshness import _cdc, _Pipeline, _start_pipeline, _stop_pipeline, _write_items

LOAD_RATE = 1_000  # changes/s to items while the "under load" probes run


class _Batches:
    """The apply job's ``on_batch``: per micro-batch, when it finished and the probe topic's
    committed positions then."""

    def __init__(self, settings: Any, topic: str) -> None:
        from cdc.logstore.factory import open_log_store

        self.store = open_log_store(settings, writer=False)
        self.topic = topic
        self.seen: list[tuple[int, dict[int, int]]] = []
        self.lock = threading.Lock()
        self.warm = threading.Event()

    def __call__(self, report: Any) -> None:
        from cdc.logstore import APPLY_CONSUMER

        try:
            done = self.store.committed(APPLY_CONSUMER, self.topic)
        except Exception:  # the probe topic before the reader created it
            done = {}
        with self.lock:
            self.seen.append((report.applied_at_ms, done))
        if report.records:
            self.warm.set()

    def visible_at(self, targets: dict[int, int], after_ms: int) -> int | None:
        """When the first batch finishing after ``after_ms`` had the probe's positions at its targets."""
        with self.lock:
            for at, done in self.seen:
                if at >= after_ms and all(done.get(p, 0) >= t for p, t in targets.items()):
                    return at
        return None


def _probe(
    pipe: _Pipeline, conn: psycopg.Connection[Any], reg: Any, batches: _Batches, k: int
) -> tuple[float, float, float]:
    """One probe: (commit -> visible by the apply, commit -> wait returned, the wait's CPU), seconds."""
    from cdc.cli.wait.lsn import wait_for_lsn
    from cdc.events import lsn_to_int

    conn.execute("UPDATE probe SET name = %s WHERE id = 1", [f"probe {k}"])
    committed_ms = time.time() * 1000
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    cpu0 = time.thread_time()
    result = wait_for_lsn(pipe.settings, lsn_to_int(str(row[0])), [reg], 120)
    returned_ms = time.time() * 1000
    cpu = time.thread_time() - cpu0
    if not result.caught_up:
        raise RuntimeError(f"probe {k} not caught up: {result.to_dict()}")
    targets = {int(p): v["target"] for p, v in result.tables[0]["partitions"].items()}
    deadline = time.monotonic() + 10
    visible = batches.visible_at(targets, int(committed_ms))
    while visible is None and time.monotonic() < deadline:  # the callback runs after the positions' commit
        time.sleep(0.01)
        visible = batches.visible_at(targets, int(committed_ms))
    if visible is None:
        raise RuntimeError(f"probe {k}: no batch report with the positions {targets}")
    return (visible - committed_ms) / 1000, (returned_ms - committed_ms) / 1000, cpu


def _round(
    pipe: _Pipeline, reg: Any, batches: _Batches, n: int, loaded: bool
) -> list[tuple[float, float, float]]:
    stop = threading.Event()
    writer = None
    if loaded:
        writer = threading.Thread(
            target=_write_items, args=(pipe.dsn, LOAD_RATE, stop, [], [100_000]), daemon=True
        )
        writer.start()
        time.sleep(3)
    out = []
    try:
        with psycopg.connect(pipe.dsn, autocommit=True) as conn:
            for k in range(n):
                out.append(_probe(pipe, conn, reg, batches, k))
                time.sleep(0.3)  # probes apart: not always in step with the trigger
    finally:
        stop.set()
        if writer is not None:
            writer.join()
    return out


def _process_waits(pipe: _Pipeline, n: int) -> list[float]:
    """``cdc wait --lsn`` as a new process on an LSN already applied: its fixed cost."""
    out = []
    with psycopg.connect(pipe.dsn, autocommit=True) as conn:
        lsn = str(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
    _cdc(pipe.env, "wait", "--lsn", lsn, "--table", "public.probe", "--timeout", "120")
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(
            [*CDC, "wait", "--lsn", lsn, "--table", "public.probe"],
            env=pipe.full_env,
            check=True,
            capture_output=True,
        )
        out.append(time.perf_counter() - t0)
    return out


def _row(name: str, probes: list[tuple[float, float, float]]) -> str:
    own = [a for a, _, _ in probes]
    waited = [b for _, b, _ in probes]
    added = sorted(b - a for a, b, _ in probes)
    cpu = [c for _, _, c in probes]
    return (
        f"| {name} | {len(probes)} | {statistics.median(own):.3f} s | {statistics.median(waited):.3f} s | "
        f"**{statistics.median(added) * 1000:.0f} ms** | {added[-1] * 1000:.0f} ms | "
        f"{statistics.median(cpu) * 1000:.0f} ms |"
    )


def _measure(spark: Any, pipe: _Pipeline, quick: bool) -> list[str]:
    from cdc.registry import Registry
    from spark_jobs.apply import ApplyJob, ApplyOptions

    with Registry(pipe.state) as registry:
        reg = registry.find("public.probe")
    batches = _Batches(pipe.settings, reg.topic)
    job = ApplyJob(spark, pipe.settings, ApplyOptions(once=False), on_batch=batches)
    runner = threading.Thread(target=job.run, daemon=True)
    runner.start()
    try:
        batches.warm.wait(300)
        n = 5 if quick else 25
        idle = _round(pipe, reg, batches, n, loaded=False)
        say(f"  idle: {_row('idle', idle)}")
        loaded = _round(pipe, reg, batches, n, loaded=True)
        say(f"  under load: {_row('load', loaded)}")
        procs = _process_waits(pipe, 3 if quick else 5)
    finally:
        job.stop()
        runner.join(120)
        job.close()
        batches.store.close()
    return [
        "Per probe: one change committed to `probe`, `pg_current_wal_lsn()`, then `wait_for_lsn` in "
        "process (as `GET /wait`); the apply's own visibility is the end of the micro-batch that "
        f"applied it (`cdc run` process + continuous apply job at the default trigger, "
        f"{ApplyOptions().trigger_interval_s:g} s, `local[2]`):",
        "",
        "| source | probes | commit -> visible (apply, p50) | commit -> wait returned (p50) | added (p50) | added (max) | wait CPU (p50) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        _row("idle", idle),
        _row(f"{LOAD_RATE:,} changes/s to another table", loaded),
        "",
        f"`cdc wait` as a new process on an LSN already applied (imports, the registry, one slot read): "
        f"median {statistics.median(procs):.2f} s of {len(procs)}.",
        "",
    ]


def run(quick: bool) -> str:
    from cdc.devcluster import start_cluster
    from spark_jobs.session import get_session

    base = Path(tempfile.mkdtemp(prefix="cdc-bench-wait-"))
    pg_base = Path(tempfile.mkdtemp(prefix="cdc-bench-wait-pg-"))
    lines = ["## Read-your-writes: the added latency of `cdc wait`", ""]
    cluster = start_cluster(pg_base)
    pipe: _Pipeline | None = None
    started = time.monotonic()
    try:
        pipe = _start_pipeline(base, cluster.dsn("postgres"))
        with psycopg.connect(pipe.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE probe (id int PRIMARY KEY, name text)")
            conn.execute("INSERT INTO probe VALUES (1, 'probe')")
        _cdc(pipe.env, "tables", "add", "public.probe", "--search", "name")
        spark = get_session("cdc-bench-wait", local_dir=base / "spark")
        lines += _measure(spark, pipe, quick)
        spark.stop()
    finally:
        _stop_pipeline(pipe, cluster, base, pg_base)
    lines += [
        f"_Load average at the end: {loadavg()} (1/5/15 min) on 2 cores shared with other processes; "
        f"{time.monotonic() - started:.0f} s in all._",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    return text
