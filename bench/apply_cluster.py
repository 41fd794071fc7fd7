"""The apply's work in Spark tasks (issue 19): catch-up speed on ``local[2]`` and on a real standalone
cluster of 1 and then 2 one-core workers, and the CPU per change of every process, from ``/proc``.

Workload: the catch-up of ``bench/apply.py`` (1M inserts + 500k updates of the same table, 4 log-store
partitions, micro-batches of 250k), generated once into a template state directory that every run
copies, so each run starts from the same log store and an empty warehouse and index. The runs, each
in a driver process of its own (a Spark session per process):

* ``peer``: the plain-Parquet peer of ``bench/apply.py`` (same Spark job, each batch's newest row per
  key to one Parquet file; sinks given to the job, so it applies on the driver), ``local[2]``;
* ``driver``: ``ApplyOptions(work="driver")`` (the records collected to the driver, which applies
  them), ``local[2]``;
* ``tasks``: ``work="tasks"`` (the default: Spark tasks read their offset ranges, parse and write;
  the driver commits) on ``local[2]``, then on the cluster with 1 worker, then with 2 workers.

Each run warms up first (a 3,000-change apply of another state directory: Python workers started,
code imported), then the catch-up is timed (``ApplyJob.run`` with ``once=True``) and each process's
CPU read before and after it (utime + stime, ``/proc/PID/stat`` fields 14-15, plus fields 16-17
cutime + cstime: its children that ended and were reaped, e.g. a Python worker the ``pyspark.daemon``
forked). The processes, found by pid tree and command line (:func:`cpu_by_role`):

* driver Python: the driver process itself (all its threads), its own CPU only;
* driver JVM: its child whose command line holds ``org.apache.spark.deploy.SparkSubmit`` (pyspark's
  gateway); on ``local[2]`` the executor is this JVM, so its task threads count here;
* driver's Python workers: every descendant of the driver JVM (``pyspark.daemon`` and the workers it
  forks), with the ended ones the JVM and they reaped: on ``local[2]`` the tasks' Python;
* executor JVMs: the processes whose command line holds ``CoarseGrainedExecutorBackend`` and
  ``--app-id`` the run's application id (started by the cluster's workers);
* executors' Python workers: the descendants of those JVMs, as above.

The master and worker daemons are not counted (they schedule; they do no work per change).

Sizes: ``--quick`` 50k changes (batches of 25k), 1 round; else ``$BENCH_APPLY_INSERTS`` inserts
(default 1,000,000) and half as many updates, ``$BENCH_APPLY_ROUNDS`` rounds (default 3, ~8 min each
on 2 cores); medians
over the rounds. Capture's rate for the same workload is quoted from ``docs/benchmarks/capture.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.apply import EventGen, ParquetPeer, _fill, _reg, _state, _warm_up
from cdc.logstore.embedded import EmbeddedLogStore

ROOT = Path(__file__).resolve().parent.parent
SECTION_OF = "apply"  # its section goes in docs/benchmarks/apply.md (bench/__main__.py)
EXECUTOR_MAIN = b"org.apache.spark.executor.CoarseGrainedExecutorBackend"
DRIVER_JVM_MAIN = b"org.apache.spark.deploy.SparkSubmit"
ROLES = (
    "driver Python",
    "driver JVM",
    "driver's Python workers",
    "executor JVMs",
    "executors' Python workers",
)


@dataclass(frozen=True)
class Config:
    name: str
    work: str  # ApplyOptions.work
    workers: int  # 0: local[2]
    peer: bool = False

    @property
    def label(self) -> str:
        where = (
            "local[2]" if not self.workers else f"cluster, {self.workers} worker{'s' * (self.workers > 1)}"
        )
        return f"{self.name} ({where})"


CONFIGS = (
    Config("peer: Parquet", "driver", 0, peer=True),
    Config("work=driver", "driver", 0),
    Config("work=tasks", "tasks", 0),
    Config("work=tasks", "tasks", 1),
    Config("work=tasks", "tasks", 2),
)


# -- CPU from /proc --------------------------------------------------------------------------------
def _procs() -> dict[int, tuple[int, float, float, list[bytes]]]:
    """Every process: pid -> (ppid, own CPU s, reaped children's CPU s, argv)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            f = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        out[int(entry.name)] = (
            int(f[1]),
            (int(f[11]) + int(f[12])) / tick,
            (int(f[13]) + int(f[14])) / tick,
            argv,
        )
    return out


def _tree_cpu(procs: dict[int, tuple[int, float, float, list[bytes]]], root: int) -> float:
    """The CPU of ``root``'s descendants (not its own), with what it and they reaped."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = procs[root][2], list(kids.get(root, []))
    while todo:
        pid = todo.pop()
        total += procs[pid][1] + procs[pid][2]
        todo.extend(kids.get(pid, []))
    return total


def cpu_by_role(app_id: str) -> dict[str, float]:
    """CPU seconds so far of this driver's processes and of ``app_id``'s executors, by role (see the
    module docstring)."""
    procs = _procs()
    me = os.getpid()
    cpu = dict.fromkeys(ROLES, 0.0)
    cpu["driver Python"] = procs[me][1]
    for pid, (ppid, own, _reaped, argv) in procs.items():
        if ppid == me and DRIVER_JVM_MAIN in argv:
            cpu["driver JVM"] += own
            cpu["driver's Python workers"] += _tree_cpu(procs, pid)
        elif (
            EXECUTOR_MAIN in argv
            and b"--app-id" in argv
            and argv[argv.index(b"--app-id") + 1] == app_id.encode()
        ):
            cpu["executor JVMs"] += own
            cpu["executors' Python workers"] += _tree_cpu(procs, pid)
    return cpu


# -- one run, in a driver process of its own ---------------------------------------------------------
def _child(argv: list[str]) -> None:
    from sinks.warehouse import WarehouseSink
    from spark_jobs.apply import ApplyJob, ApplyOptions
    from spark_jobs.session import get_session

    p = argparse.ArgumentParser()
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--peer", action="store_true")
    p.add_argument("--per-batch", type=int, required=True)
    p.add_argument("--inserts", type=int, required=True)
    a = p.parse_args(argv)
    state: Path = a.state
    spark = get_session(
        "cdc-bench-apply-cluster", master=a.master, local_dir=state.parent / f"{state.name}-spark"
    )
    try:
        _warm_up(spark, state.parent / f"{state.name}-warm", work=a.work)
        settings, reg = _settings(state), _reg()
        sinks = [ParquetPeer(state / "parquet")] if a.peer else None
        batches: list[str] = []

        def progress(r: Any) -> None:
            batches.append([r.records, r.seconds])
            print(f"    batch {r.batch_id}: {r.records:,} in {r.seconds:.2f} s", flush=True)

        opts = ApplyOptions(once=True, max_records_per_batch=a.per_batch, work=a.work)
        job = ApplyJob(spark, settings, opts, sinks=sinks, on_batch=progress)
        app_id = spark.sparkContext.applicationId
        try:
            cpu0, t0 = cpu_by_role(app_id), time.monotonic()
            summary = job.run()
            seconds, cpu1 = time.monotonic() - t0, cpu_by_role(app_id)
        finally:
            job.close()
        if not a.peer:
            rows = WarehouseSink(state).current_rows(reg, meta=False).num_rows
            assert rows == a.inserts, f"current table has {rows} rows, expected {a.inserts}"
        result = {
            "records": summary.records,
            "seconds": seconds,
            "cpu": {k: cpu1[k] - cpu0[k] for k in ROLES},
            "batches": batches,
        }
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        spark.stop()


def _settings(state: Path) -> Any:
    from cdc.config import Settings

    return Settings(state_dir=state)


# -- the runs ------------------------------------------------------------------------------------------
def _one(
    cfg: Config, template: Path, run_dir: Path, master: str, per_batch: int, inserts: int
) -> dict[str, Any]:
    state = run_dir / "state"
    shutil.copytree(template, state)
    cmd = [sys.executable, "-m", "bench.apply_cluster", "--child", "--state", str(state), "--master", master]
    cmd += ["--work", cfg.work, "--per-batch", str(per_batch), "--inserts", str(inserts)]
    cmd += ["--peer"] if cfg.peer else []
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    result: dict[str, Any] | None = None
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
            else:
                print(line, end="", flush=True)
    assert proc.returncode == 0 and result is not None, (
        f"{cfg.label}: the driver process failed ({proc.returncode})"
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    rate = result["records"] / result["seconds"]
    print(
        f"  {cfg.label}: {result['records']:,} changes in {result['seconds']:.1f} s = {rate:,.0f}/s",
        flush=True,
    )
    cpu = ", ".join(f"{k} {v / result['records'] * 1e6:.2f}" for k, v in result["cpu"].items())
    print(f"    CPU µs per change: {cpu}; result {json.dumps(result)}", flush=True)
    return result


def _round(base: Path, template: Path, r: int, per_batch: int, inserts: int) -> dict[Config, dict[str, Any]]:
    from spark_jobs.devcluster import start_cluster

    out: dict[Config, dict[str, Any]] = {}
    for i, cfg in enumerate(CONFIGS):
        run_dir = base / f"r{r}-{i}"
        run_dir.mkdir()
        if not cfg.workers:
            out[cfg] = _one(cfg, template, run_dir, "local[2]", per_batch, inserts)
            continue
        cluster = start_cluster(run_dir / "cluster", workers=cfg.workers)
        try:
            out[cfg] = _one(cfg, template, run_dir, cluster.url, per_batch, inserts)
        finally:
            cluster.stop()
            deadline = time.monotonic() + 30  # a SIGKILLed process stays in its group until reaped
            while cluster.leftovers():
                assert time.monotonic() < deadline, (
                    f"the cluster's processes outlived it: {cluster.leftovers()}"
                )
                time.sleep(0.2)
    return out


def _later_rate(res: dict[str, Any]) -> float:
    """Changes/s over the micro-batches after the first (their own seconds)."""
    rest = res["batches"][1:]
    return float(sum(n for n, _ in rest) / sum(t for _, t in rest)) if rest else float("nan")


def capture_rate() -> float | None:
    """``cdc run --once`` (wal2json) changes/s on the same workload, from docs/benchmarks/capture.md."""
    try:
        text = (ROOT / "docs" / "benchmarks" / "capture.md").read_text()
    except OSError:
        return None
    m = re.search(r"\*\*cdc run --once\*\*, wal2json[^|]*\| [\d.]+ \| ([\d,]+) \|", text)
    return float(m.group(1).replace(",", "")) if m else None


def run(quick: bool) -> str:
    inserts = 33_334 if quick else int(os.environ.get("BENCH_APPLY_INSERTS", "1000000"))
    updates = 16_666 if quick else inserts // 2
    per_batch = 25_000 if quick else max(25_000, (inserts + updates) // 6)
    rounds = 1 if quick else int(os.environ.get("BENCH_APPLY_ROUNDS", "3"))
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-apply-cluster-"))
    try:
        t0 = time.monotonic()
        reg = _reg()
        _, template = _state(base, "template", reg)
        with EmbeddedLogStore(template / "log", writer=True, compaction_interval_s=None) as store:
            total = _fill(store, EventGen(reg), inserts, updates)
        print(f"  generated {total:,} changes in {time.monotonic() - t0:.1f} s", flush=True)
        results = [_round(base, template, r, per_batch, inserts) for r in range(rounds)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = "\n".join(_report(results, inserts, updates, per_batch))
    print(text)
    return text


def _report(
    results: list[dict[Config, dict[str, Any]]], inserts: int, updates: int, per_batch: int
) -> list[str]:
    def rate(res: dict[str, Any]) -> float:
        return float(res["records"] / res["seconds"])

    def med(cfg: Config, f: Any) -> float:
        return statistics.median(f(r[cfg]) for r in results)

    def us(cfg: Config, *roles: str) -> float:
        return med(cfg, lambda res: sum(res["cpu"][k] for k in roles) / res["records"] * 1e6)

    n = len(results)
    lines = [
        f"## Apply in Spark tasks, on a standalone cluster (issue 19): {inserts:,} inserts + {updates:,} updates",
        "",
        f"{inserts + updates:,} changes, micro-batches of {per_batch:,}, 4 log-store partitions (4 slices a batch);"
        f" {n} round{'s' * (n > 1)}, medians (each run in brackets). CPU: µs per change, from /proc"
        " (see `bench/apply_cluster.py` for which process is which). Load average at the end: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + ".",
        "",
        "| run | changes/s | driver Python | driver JVM | driver's Python workers | executor JVMs | executors' Python workers | all |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cfg in CONFIGS:
        each = ", ".join(f"{rate(r[cfg]):,.0f}" for r in results)
        lines.append(
            f"| {cfg.label} | {med(cfg, rate):,.0f} ({each}) | "
            + " | ".join(f"{us(cfg, k):.2f}" for k in ROLES)
            + f" | {us(cfg, *ROLES):.2f} |"
        )
    peer, drv, loc, one, two = CONFIGS
    scale = [rate(r[two]) / rate(r[one]) for r in results]
    later = [_later_rate(r[two]) / _later_rate(r[one]) for r in results]
    driver_us = us(two, "driver Python", "driver JVM")
    driver_all = us(two, "driver Python", "driver JVM", "driver's Python workers")
    cap = capture_rate()
    executors_us = us(two, "executor JVMs", "executors' Python workers")
    lines += [
        "",
        f"- **2 workers / 1 worker: {statistics.median(scale):.2f}×** ({', '.join(f'{s:.2f}' for s in scale)});"
        f" bar ≥ 1.6×: {'met' if statistics.median(scale) >= 1.6 else 'not met'}. Without the first batch"
        f" (applied in one task: the table does not exist yet, so it has no shards):"
        f" {statistics.median(later):.2f}× ({', '.join(f'{s:.2f}' for s in later)}).",
        f"- **Driver CPU per change on the 2-worker cluster (Python + JVM): {driver_us:.2f} µs**"
        f" (Python {us(two, 'driver Python'):.2f}, JVM {us(two, 'driver JVM'):.2f}); bar ≤ 5 µs:"
        f" {'met' if driver_us <= 5 else 'not met'}. With the driver's own Python workers (the"
        f" `cdclog` source's planning and offsets, run by the driver JVM): {driver_all:.2f} µs."
        " Executors (JVM + Python):"
        f" {executors_us:.2f} µs per change.",
        f"- work=tasks / work=driver on local[2]: {med(loc, rate) / med(drv, rate):.2f}×;"
        f" work=tasks on local[2] / the Parquet peer: {med(loc, rate) / med(peer, rate):.2f}×.",
    ]
    if cap:
        lines.append(
            f"- Catch-up / capture (`cdc run --once`, wal2json, {cap:,.0f} changes/s in docs/benchmarks/capture.md,"
            f" not rerun): 2-worker cluster {med(two, rate) / cap:.2f}×, local[2] tasks {med(loc, rate) / cap:.2f}×;"
            " aim ≥ 0.5× on 2 cores."
        )
    return [*lines, ""]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
    else:
        run(quick="--quick" in sys.argv)  # prints its section; `python -m bench apply_cluster` files it
