"""End-to-end freshness as on-call's lag is defined, and the cost of watching it.

* **freshness**: a private Postgres 15 (wal2json), a real ``cdc run`` process (the reader, embedded
  log store), and the Spark apply job running continuously in this process into both sinks (Delta
  current + history, tantivy). A writer commits transactions of 50 changes (inserts and updates of a
  table with a search column) at 1,000 and then 5,000 changes/s. Per event, from the source
  transaction's commit time (wal2json's commit timestamp, ``source.ts_ms``) to the end of the
  micro-batch that committed it in both sinks (visible to a new reader): p50 / p99 / max, with the
  apply job at its default trigger interval (1 s: a change waits up to that for its micro-batch; the
  figures of 2026-11-23 were taken at 0.25 s, docs/benchmarks/oncall.md). The same
  events' commit -> log-store append time (the record's timestamp) is the capture share of it: the
  split against the apply benchmark's figure, which starts at the append. Bar: p99 < 3 s at 1,000/s.
* **status**: ``cdc status`` (:func:`cdc.cli.status.gather`, and the CLI as a process) with 50 tables
  registered while the pipeline runs. Bar: < 1 s.
* **serve sampling**: CPU time of the ``cdc serve`` sampler thread per sample at the default
  ``sample_interval_s`` (5 s), as a share of one core. Bar: < 1 %.

``--quick``: 8 s per rate, 10 tables for status.

On a Spark standalone cluster: ``python -m bench freshness_cluster`` (:func:`run_on_cluster`) measures
the freshness alone with the apply job's driver pointed at a cluster of ``$BENCH_FRESHNESS_WORKERS``
(default 2) one-core workers started on this machine (:mod:`tests.plugins.spark_standalone`, the state
directory shared as object storage would be); its section goes in the same file.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from bench._common import CDC, paced
from cdc.config import load_settings

PER_TXN = 50  # changes per source transaction


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, max(0, int(len(xs) * q) - 1))] if xs else float("nan")


def _cdc(env: dict[str, str], *args: str) -> str:
    from cdc.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["--source", env["CDC_SOURCE"], "--state", env["CDC_STATE"], *args])
    if code != 0:
        raise RuntimeError(f"cdc {' '.join(args)} exited {code}: {out.getvalue()}")
    return out.getvalue()


@dataclass
class _Pipeline:
    """A private cluster with ``items`` registered and a ``cdc run`` process streaming it."""

    dsn: str
    state: Path
    env: dict[str, str]  # the CDC_* variables
    full_env: dict[str, str]  # this process's environment with them
    settings: Any
    reader: subprocess.Popen[bytes]


def _stop_pipeline(pipe: _Pipeline | None, cluster: Any, *dirs: Path) -> None:
    """The reader stopped (it may not have started), the Postgres cluster stopped, ``dirs`` removed."""
    if pipe is not None and pipe.reader.poll() is None:
        pipe.reader.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            pipe.reader.wait(60)
    cluster.stop("immediate")
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _start_pipeline(base: Path, dsn: str) -> _Pipeline:
    """``items`` (1,000 rows) registered with a search column, and ``cdc run`` started on it."""
    state = base / "state"
    (base / "cdc.toml").write_text("heartbeat_interval_s = 1\nbatch_max_ms = 50\n")
    env = {"CDC_SOURCE": dsn, "CDC_STATE": str(state), "CDC_CONFIG": str(base / "cdc.toml")}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int, note text)")
        conn.execute("INSERT INTO items SELECT g, 'item ' || g, g, 'seed' FROM generate_series(1, 1000) g")
    full_env = {**os.environ, **env}
    _cdc(env, "tables", "add", "public.items", "--search", "name")
    settings = load_settings({}, env, base)
    log = open(base / "run.log", "wb")  # noqa: SIM115
    reader = subprocess.Popen([*CDC, "run"], env=full_env, stdout=log, stderr=subprocess.STDOUT)
    return _Pipeline(dsn, state, env, full_env, settings, reader)


class _Applied:
    """The apply job's ``on_batch``: commit -> visible latencies of the events applied while
    :attr:`measuring` is set; :attr:`warm` once a batch applied records."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        #: (seconds, records) of each micro-batch with records applied while measuring
        self.batches: list[tuple[float, int]] = []
        #: the driver's phases of those batches, in tasks (:attr:`spark_jobs.apply.BatchReport.phases`)
        self.phases: list[dict[str, float]] = []
        #: (start, end) in seconds of every micro-batch while measuring: the gaps between them are
        #: Spark's own work between batches (the source's offsets, the offset and commit logs)
        self.spans: list[tuple[float, float]] = []
        self.measuring = threading.Event()
        self.warm = threading.Event()

    def __call__(self, r: Any) -> None:
        if r.records:
            self.warm.set()
        if self.measuring.is_set():
            self.spans.append((r.applied_at_ms / 1000 - r.seconds, r.applied_at_ms / 1000))
            if r.records:
                self.batches.append((r.seconds, r.records))
                if r.phases:  # and what the tasks themselves spent, summed over the batch's tasks
                    work = {
                        "tasks' read+parse": r.read_parse_seconds,
                        "tasks' sinks": sum(r.sink_seconds.values()),
                    }
                    self.phases.append({**r.phases, **work})
            self.latencies.extend((r.applied_at_ms - ts) / 1000 for ts in r.event_ts_ms if ts)


def _write_items(dsn: str, rate: int, stop: threading.Event, commits: list[int], next_id: list[int]) -> None:
    """Commit ``rate`` changes/s to ``items`` until ``stop``: transactions of ``PER_TXN`` changes,
    half inserts of new ids (from ``next_id``), half updates of the seeded rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for k in paced(rate / PER_TXN, stop):
            with conn.transaction():
                start = next_id[0]
                next_id[0] += PER_TXN // 2
                conn.execute(
                    "INSERT INTO items SELECT g, 'new ' || g, 1, 'w' FROM generate_series(%s::bigint, %s::bigint) g",
                    [start, start + PER_TXN // 2 - 1],
                )
                lo = (k * PER_TXN // 2) % 1000 + 1
                conn.execute(
                    "UPDATE items SET qty = qty + 1 WHERE id BETWEEN %s AND %s",
                    [lo, lo + PER_TXN // 2 - 1],
                )
            commits.append(PER_TXN)


#: one rate's figures: (target rate, achieved rate, events, p50, p99, max), the capture shares and
#: the micro-batches' (seconds, records)
_Round = tuple[tuple[int, float, int, float, float, float], list[float], list[tuple[float, int]]]


def _freshness_at(
    pipe: _Pipeline, applied: _Applied, rate: int, seconds: float, next_id: list[int]
) -> _Round:
    """Write at ``rate`` for ``seconds``, wait (up to 60 s) for the tail to be applied; the figures."""
    applied.latencies.clear()
    applied.batches.clear()
    applied.phases.clear()
    applied.spans.clear()
    stop = threading.Event()
    commits: list[int] = []
    applied.measuring.set()
    w = threading.Thread(target=_write_items, args=(pipe.dsn, rate, stop, commits, next_id), daemon=True)
    t0 = time.monotonic()
    w.start()
    time.sleep(seconds)
    stop.set()
    w.join()
    achieved = sum(commits) / (time.monotonic() - t0)
    # wait for the tail to be applied
    deadline = time.monotonic() + 60
    n_expected = sum(commits)
    while len(applied.latencies) < n_expected and time.monotonic() < deadline:
        time.sleep(0.2)
    applied.measuring.clear()
    lat = sorted(applied.latencies)
    cap = _capture_share(pipe.settings, lat and n_expected)
    row = (
        rate,
        achieved,
        len(lat),
        statistics.median(lat) if lat else float("nan"),
        _pct(lat, 0.99),
        lat[-1] if lat else float("nan"),
    )
    print(
        f"  {rate:,}/s (achieved {achieved:,.0f}/s): {len(lat):,} events, p50 {row[3]:.2f} s, "
        f"p99 {row[4]:.2f} s, max {row[5]:.2f} s; {_batches_text(applied.batches)}{_phases_text(applied.phases)}"
        f"{_gaps_text(applied.spans)}",
        flush=True,
    )
    return row, sorted(cap), list(applied.batches)


def _batches_text(batches: list[tuple[float, int]]) -> str:
    """The micro-batches' count, median seconds and median records (what the apply spent)."""
    if not batches:
        return "-"
    secs = statistics.median(b[0] for b in batches)
    recs = statistics.median(b[1] for b in batches)
    return f"{len(batches)} batches, median {secs:.2f} s / {recs:,.0f} records"


def _gaps_text(spans: list[tuple[float, float]]) -> str:
    """The median time between one micro-batch's end and the next one's start (Spark's own work:
    the source's latest offsets, the offset log, the commit log, the trigger's wait)."""
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(spans)]
    return f"; between batches median {statistics.median(gaps):.2f} s, max {max(gaps):.2f} s" if gaps else ""


def _phases_text(phases: list[dict[str, float]]) -> str:
    """The driver's median / max seconds per phase of the batches applied in tasks (none: empty)."""
    if not phases:
        return ""
    names = list(phases[0])
    return (
        " (driver: "
        + ", ".join(
            f"{n} {statistics.median(p.get(n, 0.0) for p in phases):.2f} / {max(p.get(n, 0.0) for p in phases):.2f} s"
            for n in names
        )
        + ")"
    )


def _freshness(spark: Any, pipe: _Pipeline, quick: bool, where: str = "`local[2]`") -> list[str]:
    """The continuous apply job at its default trigger, writes at 1,000 and 5,000 changes/s; the
    report's freshness table (``where``: the Spark master, in words). The job is stopped before
    returning."""
    from spark_jobs.apply import ApplyJob, ApplyOptions

    applied = _Applied()
    job = ApplyJob(
        spark,
        pipe.settings,
        ApplyOptions(once=False),  # the default trigger, as `cdc apply` runs
        on_batch=applied,
        keep_event_ts=True,
    )
    load0 = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    runner = threading.Thread(target=job.run, daemon=True)
    runner.start()
    applied.warm.wait(180)
    seconds = 8 if quick else 30
    next_id = [10_000]
    rows = [_freshness_at(pipe, applied, rate, seconds, next_id) for rate in (1_000, 5_000)]
    lines = [
        "Commit time at the source to visible in both the Delta current table and the tantivy index "
        "(`cdc run` process + continuous apply job at the default trigger, "
        f"{ApplyOptions().trigger_interval_s:g} s (`cdc apply --trigger-interval`), {where}; load average "
        "before / after: " + f"{load0} / " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + "):",
        "",
        "| target rate | achieved | events | p50 | p99 | max | capture share p50 / p99 (commit -> log store) "
        "| micro-batches |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (rate, achieved, n, p50, p99, mx), cap, batches in rows:
        cap_txt = f"{statistics.median(cap):.2f} s / {_pct(cap, 0.99):.2f} s" if cap else "-"
        lines.append(
            f"| {rate:,}/s | {achieved:,.0f}/s | {n:,} | {p50:.2f} s | {p99:.2f} s | {mx:.2f} s | {cap_txt} "
            f"| {_batches_text(batches)} |"
        )
    lines += [
        "",
        f"Bar: p99 < 3 s at 1,000 changes/s: {'met' if rows and rows[0][0][4] < 3 else 'NOT met'}.",
        "",
    ]
    # the apply job is stopped before the tables are added: registering 49 tables while it runs made
    # a micro-batch fail (TableNotFoundError "No files in log segment", reported to the sinks owner)
    job.stop()
    runner.join(120)
    job.close()
    return lines


def _register_tables(pipe: _Pipeline, n_tables: int) -> None:
    """``n_tables - 1`` more tables of 100 rows registered; wait (up to 300 s) for their snapshots."""
    from cdc.registry import Registry

    with psycopg.connect(pipe.dsn, autocommit=True) as conn:
        for i in range(n_tables - 1):
            conn.execute(f"CREATE TABLE t{i} (id int PRIMARY KEY, v text)")
            conn.execute(f"INSERT INTO t{i} SELECT g, 'v' FROM generate_series(1, 100) g")
    for i in range(n_tables - 1):
        _cdc(pipe.env, "tables", "add", f"public.t{i}")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        with Registry(pipe.state) as reg:
            if all(t.snapshot_state == "done" for t in reg.list_tables()):
                break
        time.sleep(0.5)


def _status_cost(pipe: _Pipeline, quick: bool) -> tuple[list[str], int]:
    """``cdc status`` with a bigger registry while capture runs: in-process and as a process; the
    report's lines and the number of tables."""
    from cdc.cli.status.gather import collect

    _register_tables(pipe, 10 if quick else 50)
    collect(pipe.settings)  # warm
    times = []
    cpu = []
    for _ in range(5):
        t0, c0 = time.perf_counter(), time.process_time()
        report = collect(pipe.settings)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    proc_times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([*CDC, "status", "--json"], env=pipe.full_env, capture_output=True, check=False)
        proc_times.append(time.perf_counter() - t0)
    n = len(report["tables"])
    print(
        f"  status, {n} tables: {statistics.median(times):.3f} s in-process, "
        f"{statistics.median(proc_times):.3f} s as `cdc status --json`",
        flush=True,
    )
    return [
        f"### `cdc status` with {n} registered tables while capture runs",
        "",
        "| | median | max | CPU (median) |",
        "| --- | ---: | ---: | ---: |",
        f"| `collect()` in-process | {statistics.median(times):.3f} s | {max(times):.3f} s | {statistics.median(cpu):.3f} s |",
        f"| `cdc status --json` (a new process, imports included) | {statistics.median(proc_times):.3f} s | {max(proc_times):.3f} s | |",
        "",
        "Bar: < 1 s.",
        "",
    ], n


def _sampling_cost(settings: Any, n_tables: int) -> list[str]:
    """CPU of the ``cdc serve`` sampler per sample, as a share of a core at the default interval."""
    from cdc.cli.serve.server import Sampler
    from cdc.cli.status.options import StatusOptions

    sampler = Sampler(settings, StatusOptions.from_settings(settings), 5.0, 3600.0)
    for _ in range(5):
        sampler.sample()
    per_sample = sampler.cpu_s / sampler.count
    share = per_sample / 5.0 * 100
    print(
        f"  serve sampling: {per_sample * 1000:.1f} ms CPU per sample = {share:.2f} % of a core at 5 s",
        flush=True,
    )
    return [
        "### `cdc serve` sampling",
        "",
        f"CPU of the sampler thread: {per_sample * 1000:.1f} ms per sample ({n_tables} tables); "
        f"at the default `sample_interval_s = 5`: **{share:.2f} % of one core** (bar: < 1 %). "
        "The source's share (a handful of catalog queries per sample) is not included.",
        "",
    ]


def run(quick: bool) -> str:
    from cdc.devcluster import start_cluster
    from spark_jobs.session import get_session

    base = Path(tempfile.mkdtemp(prefix="cdc-bench-fresh-"))
    lines = ["## Freshness end to end (source commit -> capture -> apply -> Delta + tantivy)", ""]
    pg_base = Path(tempfile.mkdtemp(prefix="cdc-bench-fresh-pg-"))
    cluster = start_cluster(pg_base)
    pipe: _Pipeline | None = None
    try:
        pipe = _start_pipeline(base, cluster.dsn("postgres"))
        spark = get_session("cdc-bench-freshness", local_dir=base / "spark")
        lines += _freshness(spark, pipe, quick)
        status_lines, n_tables = _status_cost(pipe, quick)
        lines += status_lines
        lines += _sampling_cost(pipe.settings, n_tables)
        spark.stop()
    finally:
        _stop_pipeline(pipe, cluster, base, pg_base)
    text = "\n".join(lines)
    print(text)
    return text


def run_on_cluster(quick: bool) -> str:
    """The freshness alone, the apply job's driver here and its tasks on a standalone cluster of
    ``$BENCH_FRESHNESS_WORKERS`` (default 2) one-core workers; the section of
    ``docs/benchmarks/freshness.md`` between its markers."""
    from cdc.devcluster import start_cluster
    from spark_jobs.session import get_session
    from tests.plugins.spark_standalone import start_cluster as start_spark_cluster

    workers = int(os.environ.get("BENCH_FRESHNESS_WORKERS", "2"))
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-fresh-cluster-"))
    pg_base = Path(tempfile.mkdtemp(prefix="cdc-bench-fresh-cluster-pg-"))
    where = f"a Spark standalone cluster of {workers} one-core worker{'s' * (workers > 1)} on this machine"
    lines = [f"### Freshness with the apply's tasks on {where}", ""]
    cluster = start_cluster(pg_base)
    spark_cluster = start_spark_cluster(base / "spark-cluster", workers=workers)
    pipe: _Pipeline | None = None
    try:
        pipe = _start_pipeline(base, cluster.dsn("postgres"))
        spark = get_session("cdc-bench-freshness-cluster", master=spark_cluster.url, local_dir=base / "spark")
        try:
            lines += _freshness(spark, pipe, quick, where=f"driver here, tasks on {where}")
        finally:
            spark.stop()
    finally:
        spark_cluster.stop()
        _stop_pipeline(pipe, cluster, base, pg_base)
    text = "\n".join(lines)
    print(text)
    return text


def _capture_share(settings: Any, _n: object) -> list[float]:
    """Commit time -> log-store append time (the record's timestamp) of the streamed events."""
    import orjson

    from cdc.logstore.factory import open_log_store

    out: list[float] = []
    with open_log_store(settings) as store:
        topic = "cdc.public.items"
        for part, end in store.end_offsets(topic).items():
            start = max(store.start_offsets(topic)[part], end - 20_000)
            for rec in store.iter_partition(topic, part, start, end):
                if rec.value is None:
                    continue
                src = orjson.loads(rec.value).get("source") or {}
                if src.get("snapshot") == "false" and src.get("ts_ms"):
                    out.append((rec.timestamp_ms - int(src["ts_ms"])) / 1000)
    return out
