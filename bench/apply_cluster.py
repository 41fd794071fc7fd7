"""The apply's work in Spark tasks (issues 19, 35): catch-up speed on ``local[2]`` and on a real
standalone cluster of 1 and then 2 one-core workers, then of 1, 2 and 3 workers each capped at the same
fraction of a core by a cgroup (CPU quotas, so that scaling shows on a 2-core machine), and the CPU per
change of every process, from ``/proc`` and the workers' cgroups.

Workload: the catch-up of ``bench/apply.py`` (1M inserts + 500k updates of the same table, 12 log-store
partitions (``$BENCH_APPLY_PARTITIONS``: 12 shards split evenly over 1, 2 or 3 workers), micro-batches
of 250k), generated once into a template state directory that every run
copies, so each run starts from the same log store and an empty warehouse and index. The runs, each
in a driver process of its own (a Spark session per process):

* ``peer``: the plain-Parquet peer of ``bench/apply.py`` (same Spark job and tasks, each slice's
  newest row per key to one Parquet file), ``local[2]``;
* ``tasks``: the apply (Spark tasks read their offset ranges, parse and write; the driver commits) on
  ``local[2]``, then on the cluster with 1 worker, then with 2 workers. (Until issue 33 a
  ``work=driver`` run measured the records collected to the driver, a mode that is gone.)

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

The master and worker daemons are not counted (they schedule; they do no work per change). Each
run also prints the driver JVM's busiest threads (CPU by thread name from ``/proc/PID/task``, read
at the start, at each batch's end and at the end, so the query's own thread counts though it ends
with the query) and the driver JVM's and Python's CPU per step: up to the end of batch 0 (the query's
start), each batch, and to the end (issue 35).

**Under CPU quotas** (where the cgroup v1 ``cpu`` and ``cpuacct`` controllers are writable, else
skipped with the reason): each worker JVM is put in a cgroup of its own as it starts
(:class:`tests.plugins.spark_standalone.CpuGroup`), capped at ``$BENCH_APPLY_QUOTA`` of a core (default 1/3:
three workers take one core, leaving the other to the driver); its executors and their Python workers
inherit the group. Each group's CPU during the catch-up comes from its ``cpuacct.usage``, and the time
its quota held it back from ``cpu.stat``'s ``throttled_time``: a group that used all its quota bounds
the apply; one that used a fraction of it waited on the driver's critical path.

Sizes: ``--quick`` 50k changes (batches of 25k), 1 round; else ``$BENCH_APPLY_INSERTS`` inserts
(default 1,000,000) and half as many updates, ``$BENCH_APPLY_ROUNDS`` rounds (default 3, ~8 min each
on 2 cores); medians
over the rounds. Capture's rate for the same workload is quoted from ``docs/benchmarks/capture.md``.
"""

from __future__ import annotations

import argparse
import itertools
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
from tests.plugins.spark_standalone import CpuGroup, QuotaUnavailable

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
    workers: int  # 0: local[2]
    peer: bool = False
    quota: bool = False  # each worker in a cgroup of its own, capped at QUOTA of a core

    @property
    def label(self) -> str:
        where = (
            "local[2]" if not self.workers else f"cluster, {self.workers} worker{'s' * (self.workers > 1)}"
        )
        return f"{self.name} ({where}{f', {QUOTA:.2f} core each' if self.quota else ''})"


# the topic's partitions, so the table's shards: 12 split evenly over 1, 2, 3 (and 4) one-core workers
PARTITIONS = int(os.environ.get("BENCH_APPLY_PARTITIONS", "12"))
# 3 workers at a third of a core each leave the driver (and anything else) the other core of 2
QUOTA = float(os.environ.get("BENCH_APPLY_QUOTA", "0.3333"))
CONFIGS = (
    Config("peer: Parquet", 0, peer=True),
    Config("tasks", 0),
    Config("tasks", 1),
    Config("tasks", 2),
)
QUOTA_CONFIGS = tuple(Config("tasks", n, quota=True) for n in (1, 2, 3))


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
    from spark_jobs.applier import open_sinks
    from spark_jobs.apply import ApplyJob, ApplyOptions
    from spark_jobs.session import get_session

    p = argparse.ArgumentParser()
    p.add_argument("--state", type=Path, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--peer", action="store_true")
    p.add_argument("--per-batch", type=int, required=True)
    p.add_argument("--inserts", type=int, required=True)
    p.add_argument("--groups", default="", help="the workers' cgroups, comma-separated")
    a = p.parse_args(argv)
    groups = [CpuGroup(name, QUOTA) for name in a.groups.split(",") if name]
    state: Path = a.state
    spark = get_session(
        "cdc-bench-apply-cluster", master=a.master, local_dir=state.parent / f"{state.name}-spark"
    )
    try:
        _warm_up(spark, state.parent / f"{state.name}-warm")
        settings, reg = _settings(state), _reg()
        out = state / "parquet"
        make_sinks = (lambda s: [ParquetPeer(out)]) if a.peer else open_sinks
        batches: list[list[float]] = []
        jvm = _driver_jvm()
        seen: dict[int, tuple[str, float]] = {}  # the JVM's threads at each batch's end

        def progress(r: Any) -> None:
            batches.append([r.records, r.seconds, _own_cpu(jvm), _own_cpu(os.getpid())])
            seen.update(_threads(jvm))  # a thread that ends before the run does (the query's) still counts
            phases = ", ".join(f"{k} {v:.2f}" for k, v in r.phases.items())
            print(f"    batch {r.batch_id}: {r.records:,} in {r.seconds:.2f} s ({phases})", flush=True)

        opts = ApplyOptions(once=True, max_records_per_batch=a.per_batch)
        job = ApplyJob(spark, settings, opts, make_sinks=make_sinks, on_batch=progress)
        app_id = spark.sparkContext.applicationId
        try:
            g0 = [(g.usage_s(), g.throttled_s()) for g in groups]
            cpu0, th0, t0 = cpu_by_role(app_id), _threads(jvm), time.monotonic()
            own0 = (_own_cpu(jvm), _own_cpu(os.getpid()))
            summary = job.run()
            seconds, cpu1, th1 = time.monotonic() - t0, cpu_by_role(app_id), _threads(jvm)
            own1 = (_own_cpu(jvm), _own_cpu(os.getpid()))
            g1 = [(g.usage_s(), g.throttled_s()) for g in groups]
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
            "groups": [[u1 - u0, t1 - t0_] for (u0, t0_), (u1, t1) in zip(g0, g1, strict=True)],
            "threads": _thread_split(th0, {**seen, **th1}),
            "own": [own0, own1],
        }
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        spark.stop()


def _settings(state: Path) -> Any:
    from cdc.config import Settings

    # the warehouse keeps a new table in as many shards as the log store has partitions (one task
    # each): the topic's partitions here
    return Settings(state_dir=state, partitions=PARTITIONS)


# -- the runs ------------------------------------------------------------------------------------------
def _one(
    cfg: Config,
    template: Path,
    run_dir: Path,
    master: str,
    per_batch: int,
    inserts: int,
    groups: list[CpuGroup] | None = None,
) -> dict[str, Any]:
    state = run_dir / "state"
    shutil.copytree(template, state)
    cmd = [sys.executable, "-m", "bench.apply_cluster", "--child", "--state", str(state), "--master", master]
    cmd += ["--per-batch", str(per_batch), "--inserts", str(inserts)]
    cmd += ["--peer"] if cfg.peer else []
    cmd += ["--groups", ",".join(g.name for g in groups)] if groups else []
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
    if "own" in result:  # the driver's CPU up to each batch's end: the query's start, each batch, the end
        marks = [result["own"][0], *[b[2:] for b in result["batches"]], result["own"][1]]
        steps = ", ".join(f"{b[0] - a[0]:.2f}/{b[1] - a[1]:.2f}" for a, b in itertools.pairwise(marks))
        print(f"    driver JVM/Python CPU s per step (to batch 0's end, each batch, to the end): {steps}")
    busiest = sorted(result.get("threads", {}).items(), key=lambda kv: -kv[1])[:10]
    print(
        "    driver JVM's busiest threads, µs per change: "
        + ", ".join(f"{name} {used / result['records'] * 1e6:.2f}" for name, used in busiest),
        flush=True,
    )
    for i, (used, throttled) in enumerate(result.get("groups", [])):
        assert used > 0, f"{cfg.label}: worker {i}'s cgroup used no CPU: its executors ran outside it"
        print(
            f"    worker {i}'s group: {used / result['records'] * 1e6:.2f} µs per change,"
            f" {used / (result['seconds'] * QUOTA):.0%} of its quota used, throttled {throttled:.1f} s",
            flush=True,
        )
    return result


def _round(
    base: Path, template: Path, r: int, per_batch: int, inserts: int, configs: tuple[Config, ...]
) -> dict[Config, dict[str, Any]]:
    from tests.plugins.spark_standalone import start_cluster

    out: dict[Config, dict[str, Any]] = {}
    for i, cfg in enumerate(configs):
        run_dir = base / f"r{r}-{i}"
        run_dir.mkdir()
        if not cfg.workers:
            out[cfg] = _one(cfg, template, run_dir, "local[2]", per_batch, inserts)
            continue
        cluster = start_cluster(
            run_dir / "cluster", workers=cfg.workers, cpu_quota=QUOTA if cfg.quota else None
        )
        try:
            out[cfg] = _one(cfg, template, run_dir, cluster.url, per_batch, inserts, cluster.groups)
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
    return float(sum(b[0] for b in rest) / sum(b[1] for b in rest)) if rest else float("nan")


def capture_rate() -> float | None:
    """``cdc run --once`` (wal2json) changes/s on the same workload, from docs/benchmarks/capture.md."""
    try:
        text = (ROOT / "docs" / "benchmarks" / "capture.md").read_text()
    except OSError:
        return None
    m = re.search(r"\*\*cdc run --once\*\*, wal2json[^|]*\| [\d.]+ \| ([\d,]+) \|", text)
    return float(m.group(1).replace(",", "")) if m else None


def _configs() -> tuple[tuple[Config, ...], str | None]:
    """The runs: :data:`CONFIGS`, then :data:`QUOTA_CONFIGS` where cgroups are writable (else the
    reason they were skipped). ``$BENCH_APPLY_CLUSTER_ONLY=quota`` runs the quota runs alone."""
    try:
        CpuGroup.create(f"cdc-bench-probe-{os.getpid()}", QUOTA).remove()
    except QuotaUnavailable as e:
        print(f"  skipping the runs under CPU quotas: {e}", flush=True)
        return CONFIGS, str(e)
    if os.environ.get("BENCH_APPLY_CLUSTER_ONLY") == "quota":
        return QUOTA_CONFIGS, None
    return CONFIGS + QUOTA_CONFIGS, None


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
            total = _fill(store, EventGen(reg), inserts, updates, PARTITIONS)
        print(f"  generated {total:,} changes in {time.monotonic() - t0:.1f} s", flush=True)
        configs, skipped = _configs()
        results = [_round(base, template, r, per_batch, inserts, configs) for r in range(rounds)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = "\n".join(_report(results, inserts, updates, per_batch, skipped))
    print(text)
    return text


def _report(
    results: list[dict[Config, dict[str, Any]]],
    inserts: int,
    updates: int,
    per_batch: int,
    skipped: str | None,
) -> list[str]:
    ran = list(results[0])

    def rate(res: dict[str, Any]) -> float:
        return float(res["records"] / res["seconds"])

    def med(cfg: Config, f: Any) -> float:
        return statistics.median(f(r[cfg]) for r in results)

    def us(cfg: Config, *roles: str) -> float:
        return med(cfg, lambda res: sum(res["cpu"][k] for k in roles) / res["records"] * 1e6)

    n = len(results)
    lines = [
        f"## Apply in Spark tasks, on a standalone cluster (issues 19, 35): {inserts:,} inserts + {updates:,} updates",
        "",
        f"{inserts + updates:,} changes, micro-batches of {per_batch:,}, {PARTITIONS} log-store partitions ({PARTITIONS} slices a batch);"
        f" {n} round{'s' * (n > 1)}, medians (each run in brackets). CPU: µs per change, from /proc"
        " (see `bench/apply_cluster.py` for which process is which). Load average at the end: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + ".",
        "",
        "| run | changes/s | driver Python | driver JVM | driver's Python workers | executor JVMs | executors' Python workers | all |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for cfg in ran:
        each = ", ".join(f"{rate(r[cfg]):,.0f}" for r in results)
        lines.append(
            f"| {cfg.label} | {med(cfg, rate):,.0f} ({each}) | "
            + " | ".join(f"{us(cfg, k):.2f}" for k in ROLES)
            + f" | {us(cfg, *ROLES):.2f} |"
        )
    lines.append("")
    if all(c in ran for c in CONFIGS):
        lines += _unquoted(results, rate, med, us)
    lines += (
        _quota(results, ran, rate, us)
        if skipped is None
        else [f"- Runs under CPU quotas skipped: {skipped}."]
    )
    return [*lines, ""]


def _unquoted(results: list[dict[Config, dict[str, Any]]], rate: Any, med: Any, us: Any) -> list[str]:
    peer, loc, one, two = CONFIGS
    scale = [rate(r[two]) / rate(r[one]) for r in results]
    later = [_later_rate(r[two]) / _later_rate(r[one]) for r in results]
    driver_us = us(two, "driver Python", "driver JVM")
    driver_all = us(two, "driver Python", "driver JVM", "driver's Python workers")
    cap = capture_rate()
    executors_us = us(two, "executor JVMs", "executors' Python workers")
    lines = [
        f"- Without quotas, **2 workers / 1 worker: {statistics.median(scale):.2f}×**"
        f" ({', '.join(f'{s:.2f}' for s in scale)}), the workers, the driver and everything else sharing"
        f" the machine's cores. Without the first batch (the query's start: its ranges collected by a"
        f" Spark job, the new table created from a sample): {statistics.median(later):.2f}× ({', '.join(f'{s:.2f}' for s in later)}).",
        f"- Driver CPU per change on the 2-worker cluster (Python + JVM): {driver_us:.2f} µs"
        f" (Python {us(two, 'driver Python'):.2f}, JVM {us(two, 'driver JVM'):.2f}). With the driver's own"
        f" Python workers (the `cdclog` source's planning and offsets, run by the driver JVM): {driver_all:.2f} µs."
        f" Executors (JVM + Python): {executors_us:.2f} µs per change.",
        f"- tasks on local[2] / the Parquet peer: {med(loc, rate) / med(peer, rate):.2f}×.",
    ]
    if cap:
        lines.append(
            f"- Catch-up / capture (`cdc run --once`, wal2json, {cap:,.0f} changes/s in docs/benchmarks/capture.md,"
            f" not rerun): 2-worker cluster {med(two, rate) / cap:.2f}×, local[2] tasks {med(loc, rate) / cap:.2f}×;"
            " aim ≥ 0.5× on 2 cores."
        )
    return lines


def _quota(results: list[dict[Config, dict[str, Any]]], ran: list[Config], rate: Any, us: Any) -> list[str]:
    one, two, three = QUOTA_CONFIGS
    if not all(c in ran for c in QUOTA_CONFIGS):
        return []

    def scale(cfg: Config) -> tuple[float, str]:
        each = [rate(r[cfg]) / rate(r[one]) for r in results]
        return statistics.median(each), ", ".join(f"{x:.2f}" for x in each)

    def group(cfg: Config, i: int) -> tuple[float, float, float]:
        """Worker ``i``'s group: µs per change, share of its quota used, seconds throttled."""
        used = [r[cfg]["groups"][i][0] for r in results]
        return (
            statistics.median(u / r[cfg]["records"] * 1e6 for u, r in zip(used, results, strict=True)),
            statistics.median(u / (r[cfg]["seconds"] * QUOTA) for u, r in zip(used, results, strict=True)),
            statistics.median(r[cfg]["groups"][i][1] for r in results),
        )

    (s2, e2), (s3, e3) = scale(two), scale(three)
    later = [
        statistics.median(_later_rate(r[c]) / _later_rate(r[one]) for r in results) for c in (two, three)
    ]
    lines = [
        f"- **Under CPU quotas** (each worker JVM, and so its executors and their Python workers, in a cgroup"
        f" v1 `cpu` group of its own capped at {QUOTA:.2f} of a core; the driver outside, uncapped):"
        f" **2 workers / 1 worker {s2:.2f}×** ({e2}; bar ≥ 1.6×: {'met' if s2 >= 1.6 else 'not met'}),"
        f" **3 workers / 1 worker {s3:.2f}×** ({e3}; bar ≥ 2.2×: {'met' if s3 >= 2.2 else 'not met'})."
        f" Without the first batch (the query's start: its ranges collected by a Spark job, the new"
        f" table created from a sample, then one task per shard like every batch):"
        f" {later[0]:.2f}× and {later[1]:.2f}×.",
    ]
    for cfg in QUOTA_CONFIGS:
        driver_us = us(cfg, "driver Python", "driver JVM")
        groups = "; ".join(
            f"worker {i}: {g[0]:.2f} µs per change, {g[1]:.0%} of its quota, throttled {g[2]:.1f} s"
            for i, g in ((i, group(cfg, i)) for i in range(cfg.workers))
        )
        lines.append(
            f"- {cfg.label}: driver (Python + JVM) **{driver_us:.2f} µs per change** (bar ≤ 5 µs:"
            f" {'met' if driver_us <= 5 else 'not met'}; with its Python workers"
            f" {us(cfg, 'driver Python', 'driver JVM', 'driver' + chr(39) + 's Python workers'):.2f});"
            f" each worker's group, from `cpuacct.usage` and `cpu.stat`: {groups}."
        )
    return lines


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    """A process's threads: tid -> (name, CPU seconds so far)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in Path(f"/proc/{pid}/task").iterdir():
        try:
            raw = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        f = raw.rsplit(")", 1)[1].split()
        out[int(entry.name)] = (re.sub(r"\d+", "N", name), (int(f[11]) + int(f[12])) / tick)
    return out


def _own_cpu(pid: int) -> float:
    """A process's own CPU seconds so far (all its threads)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _driver_jvm() -> int:
    """The pid of this process's driver JVM (pyspark's gateway)."""
    return next(p for p, (pp, *_r, argv) in _procs().items() if pp == os.getpid() and DRIVER_JVM_MAIN in argv)


def _thread_split(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU s by thread name (digits as N) between two :func:`_threads` reads (``after`` may add the
    last read of threads that ended since)."""
    out: dict[str, float] = {}
    for tid, (name, used) in after.items():
        out[name] = out.get(name, 0.0) + used - before.get(tid, (name, 0.0))[1]
    return out


def idle_cpu(seconds: float, settle_s: float = 20.0, group: CpuGroup | None = None) -> dict[str, Any]:
    """The CPU an idle ``cdc apply`` (``ApplyJob.run`` without ``once``: a trigger every second,
    nothing to apply) spends over ``seconds``, on ``$CDC_SPARK_MASTER`` or ``local[2]``: the fixed
    cost that a slow catch-up pays per change (at 3,500 changes/s, 1% of a core is 2.9 µs per change).
    The job applies a small warm-up log first, then runs ``settle_s`` before the measure. Returns
    ``wall`` (s), ``load`` (1-min load average before and after), ``roles`` (CPU s by role, as
    :func:`cpu_by_role`; a Python worker that ends in the window unreaped by a counted parent takes
    its CPU out of the sum), ``threads`` (the driver JVM's CPU s by thread name, digits as N), and
    with ``group`` (a cgroup holding this process and so all it starts) ``all``: its CPU s."""
    import threading

    from cdc.config import Settings
    from spark_jobs.apply import ApplyJob, ApplyOptions
    from spark_jobs.session import get_session

    base = Path(tempfile.mkdtemp(prefix="cdc-bench-apply-idle-"))
    spark = get_session("cdc-bench-apply-idle", local_dir=base / "spark")
    try:
        _warm_up(spark, base)  # base/warm: a registered table, its log applied
        job = ApplyJob(spark, Settings(state_dir=base / "warm"), ApplyOptions())
        runner = threading.Thread(target=job.run, name="idle-apply", daemon=True)
        runner.start()
        try:
            time.sleep(settle_s)
            app_id = spark.sparkContext.applicationId
            jvm = _driver_jvm()
            g0 = group.usage_s() if group else 0.0
            load0, cpu0, th0, t0 = os.getloadavg(), cpu_by_role(app_id), _threads(jvm), time.monotonic()
            time.sleep(seconds)
            g1 = group.usage_s() if group else 0.0
            cpu1, th1, wall, load1 = (
                cpu_by_role(app_id),
                _threads(jvm),
                time.monotonic() - t0,
                os.getloadavg(),
            )
            threads = _thread_split(th0, th1)
        finally:
            job.stop()
            runner.join(120)
            job.close()
    finally:
        spark.stop()
        shutil.rmtree(base, ignore_errors=True)
    return {
        "wall": wall,
        "load": [load0[0], load1[0]],
        "roles": {r: cpu1[r] - cpu0[r] for r in ROLES},
        "threads": threads,
        **({"all": g1 - g0} if group else {}),
    }


def idle(seconds: float) -> None:
    """Print :func:`idle_cpu` by role and the driver JVM's busiest threads.
    ``python -m bench.apply_cluster --idle 60``; prints only."""
    res = idle_cpu(seconds)
    wall, (load0, load1) = res["wall"], res["load"]
    print(f"idle apply over {wall:.1f} s (load {load0:.2f} before, {load1:.2f} after):")
    for role, used in res["roles"].items():
        print(f"  {role}: {used:.2f} s CPU = {used / wall:.2%} of a core")
    total = sum(res["roles"].values())
    print(f"  all: {total:.2f} s CPU = {total / wall:.2%} of a core")
    print("  the driver JVM's busiest threads (by name):")
    for name, used in sorted(res["threads"].items(), key=lambda kv: -kv[1])[:12]:
        print(f"    {name}: {used:.3f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2:])
    elif sys.argv[1:2] == ["--idle"]:
        idle(float(sys.argv[2]) if len(sys.argv) > 2 else 60.0)
    else:
        run(quick="--quick" in sys.argv)  # prints its section; `python -m bench apply_cluster` files it
