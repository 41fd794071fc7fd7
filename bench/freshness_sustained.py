"""Freshness under a steady pgbench load, over time (issue 32): does it hold as the run ages?

A private Postgres 15 (wal2json), ``pgbench -i -s SCALE`` (scale 2: 200k accounts), then a
continuous ``cdc run`` and ``cdc apply`` -- both as processes, at their defaults -- while pgbench's
TPC-B runs at ``RATE`` transactions/s (``-R``; 300/s: about 900 captured changes/s, an update of
``pgbench_accounts``, ``pgbench_tellers`` and ``pgbench_branches`` each; ``pgbench_history`` has no
primary key and is not registered). The load starts once the accounts' snapshot is applied. A probe row (``probe``, registered too) is updated every 2 s
and timed from its commit until a plain delta-rs reader (a ``DeltaTable`` kept open and brought up
to date every 50 ms) sees the new value in its Delta current table.

Reported per window of ``WINDOW`` (5 min): freshness p50 / p90 / p99 / max, ``cdc apply``'s batches
(count, mean records, mean and p90 wall), and at the window's end the Parquet files of the
current and history tables (what their latest version references) and the processes' RSS. Then the
batch duration's trend: the last window's mean against the second window's (the first includes the
start). ``cdc apply``'s own progress lines give the batches and their phases (``[plan ..., tasks
..., commit warehouse ..., maintain warehouse ...]``): the mean of each phase per window.

``python -m bench freshness_sustained`` runs ``$BENCH_SUSTAINED_ROUNDS`` (default 3) rounds of
``$BENCH_SUSTAINED_MINUTES`` (default 30) at pgbench scale ``$BENCH_SUSTAINED_SCALE`` (default 2), and
reports each window's median over the rounds with the bars on those medians, then each round; on
``$BENCH_SUSTAINED_MASTER`` (``local`` = ``local[2]``, the default; ``cluster`` = a standalone
cluster of two one-core workers on this machine, :mod:`tests.plugins.spark_standalone`). Or directly:
``python -m bench.freshness_sustained --minutes 12 --master local [--scale 10] [--rounds 3]`` (its section of
``docs/benchmarks/freshness.md`` is then ``freshness_sustained_<master>``, ``_s<scale>`` added for a
scale other than 2: one per master and scale;
``--no-write`` only prints). ``$BENCH_SUSTAINED_WINDOW_S`` changes the window (300 s) for a
shorter run. The report also gives the mean time between one batch's end and the next one's start
(Spark's own: offsets, its logs, the trigger). ``BENCH_KEEP=1`` keeps the state directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench._common import CDC, loadavg, say

SECTION_OF = "freshness"  # its section goes in docs/benchmarks/freshness.md (bench/__main__.py)

SCALE = int(os.environ.get("BENCH_SUSTAINED_SCALE", "2"))  # pgbench scale: 100k accounts each
RATE = 300  # pgbench transactions/s: 3 captured changes each
WINDOW = float(os.environ.get("BENCH_SUSTAINED_WINDOW_S", "300"))  # seconds
PROBE_EVERY = 2.0
TABLES = ("public.pgbench_accounts", "public.pgbench_branches", "public.pgbench_tellers", "public.probe")
BATCH_LINE = re.compile(r"^batch (\d+): ([\d,]+) records.*?, ([\d.]+) s \(")
PHASES = re.compile(r"\[(.*)\]\s*$")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(len(xs) * q + 0.999999) - 1))] if xs else float("nan")


def _rss_mb(pid: int) -> float:
    """The resident set of ``pid`` and its descendants (a JVM's Python workers), in MB."""
    total = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(FileNotFoundError):
                    todo.extend(int(c) for c in (task / "children").read_text().split())
    return total / 1024


def _files(path: Path) -> int:
    """The data files the Delta table's latest version references (0: none yet)."""
    from deltalake import DeltaTable

    try:
        return len(DeltaTable(str(path)).file_uris())
    except Exception:
        return 0


@dataclass
class _Run:
    """What the run records as it goes (seconds since the load started)."""

    t0: float = 0.0
    fresh: list[tuple[float, float]] = field(default_factory=list)  # (at, seconds)
    batches: list[tuple[float, int, float, dict[str, float]]] = field(default_factory=list)
    samples: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # files, RSS
    probe_misses: int = 0
    restarts: int = 0  # `cdc apply` started again after CONNECT_BACK at start-up


def _follow_apply(stream: Any, run: _Run, log: Path) -> None:
    """``cdc apply``'s progress lines: each batch's (time, records, seconds, phases), the lines kept."""
    with open(log, "a") as out:
        for line in stream:
            out.write(line)
            out.flush()
            m = BATCH_LINE.match(line)
            if not m:
                continue
            phases: dict[str, float] = {}
            pm = PHASES.search(line)
            for part in pm.group(1).split(", ") if pm else ():
                name, value, _unit = part.rsplit(" ", 2)
                phases[name] = float(value) / 1000
            if run.t0:
                run.batches.append(
                    (time.monotonic() - run.t0, int(m.group(2).replace(",", "")), float(m.group(3)), phases)
                )


def _probe(dsn: str, current: Path, run: _Run, stop: threading.Event) -> None:
    """Update the probe row every 2 s; time each value from its commit until a delta-rs reader sees it."""
    from deltalake import DeltaTable

    table: DeltaTable | None = None
    with psycopg.connect(dsn, autocommit=True) as conn:
        k = 1_000
        nxt = time.monotonic()
        while not stop.is_set():
            k += 1
            conn.execute("UPDATE probe SET v = %s WHERE id = 1", [k])
            committed = time.monotonic()
            deadline = committed + 60
            seen = False
            while time.monotonic() < deadline and not stop.is_set():
                try:
                    if table is None:
                        table = DeltaTable(str(current))
                    else:
                        table.update_incremental()
                    v = table.to_pyarrow_table(columns=["v"]).column("v").to_pylist()
                except Exception:
                    table = None
                    continue
                if v and v[0] is not None and v[0] >= k:
                    run.fresh.append((committed - run.t0, time.monotonic() - committed))
                    seen = True
                    break
                time.sleep(0.05)
            if not seen and not stop.is_set():  # the update in flight when the run ends is no miss
                run.probe_misses += 1
            nxt = max(nxt + PROBE_EVERY, time.monotonic())
            stop.wait(max(0.0, nxt - time.monotonic()))


def _sample(paths: dict[str, Path], pids: dict[str, int], run: _Run, stop: threading.Event) -> None:
    """Every 30 s: the current and history tables' file counts, the processes' RSS."""
    while not stop.wait(30):
        s = {f"files {name}": float(_files(p)) for name, p in paths.items()}
        s.update({f"RSS {name}": _rss_mb(pid) for name, pid in pids.items()})
        run.samples.append((time.monotonic() - run.t0, s))


def _setup(dsn: str, base: Path, env: dict[str, str], scale: int) -> None:
    subprocess.run(["pgbench", "-i", "-s", str(scale), "-q", dsn], check=True, capture_output=True, env=env)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE probe (id int PRIMARY KEY, v bigint)")
        conn.execute("INSERT INTO probe VALUES (1, 0)")
    for t in TABLES:
        subprocess.run([*CDC, "tables", "add", t], check=True, capture_output=True, env=env)


def _start(
    base: Path, env: dict[str, str], master: str | None
) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """``cdc run`` (its output to run.log) and ``cdc apply`` (its progress lines piped here)."""
    run_log = open(base / "run.log", "w")  # noqa: SIM115 - the process's for its life
    reader = subprocess.Popen([*CDC, "run"], env=env, stdout=run_log, stderr=subprocess.STDOUT, text=True)
    args = [*CDC, "apply"] + (["--master", master] if master else [])
    err = open(base / "apply.err", "w")  # noqa: SIM115 - the process's for its life
    apply = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    return reader, apply


def _measure(minutes: float, master: str | None, where: str, scale: int) -> tuple[_Run, str, str]:
    from cdc.devcluster import start_cluster

    base = Path(tempfile.mkdtemp(prefix="cdc-bench-sustained-"))
    pg_base = Path(tempfile.mkdtemp(prefix="cdc-bench-sustained-pg-"))
    pg = start_cluster(pg_base)
    dsn = pg.dsn("postgres")
    state = base / "state"
    env = {**os.environ, "CDC_SOURCE": dsn, "CDC_STATE": str(state)}
    for k in ("CDC_LOG", "CDC_CONFIG", "CDC_SLOT", "CDC_TOPIC_PREFIX"):
        env.pop(k, None)
    run = _Run()
    stop = threading.Event()
    procs: list[subprocess.Popen[str]] = []
    load0 = loadavg()
    try:
        _setup(dsn, base, env, scale)
        reader, apply = _start(base, env, master)
        procs += [reader, apply]
        apply = _started_apply(base, env, master, state, run, reader, apply, procs)
        _await_snapshot(state / "warehouse" / "public" / "pgbench_accounts", scale * 100_000, apply)
        say(f"  {where}: load starts ({minutes:g} min at {RATE} tps, ~{RATE * 3} changes/s)")
        run.t0 = time.monotonic()
        bench = subprocess.Popen(
            [
                "pgbench",
                "-n",
                "-c",
                "4",
                "-j",
                "2",
                "-R",
                str(RATE),
                "-T",
                str(int(minutes * 60)),
                "-P",
                "60",
                dsn,
            ],
            env=env,
            stdout=open(base / "pgbench.log", "w"),  # noqa: SIM115 - the process's for its life
            stderr=subprocess.STDOUT,
        )
        procs.append(bench)  # type: ignore[arg-type]
        wh = state / "warehouse" / "public"
        paths = {
            "accounts": wh / "pgbench_accounts",
            "accounts history": wh / "pgbench_accounts__history",
            "tellers history": wh / "pgbench_tellers__history",
        }
        pids = {"cdc run": reader.pid, "cdc apply (+JVM, workers)": apply.pid, "postgres": _postmaster(pg)}
        threads = [
            threading.Thread(target=_probe, args=(dsn, wh / "probe", run, stop), daemon=True),
            threading.Thread(target=_sample, args=(paths, pids, run, stop), daemon=True),
        ]
        for t in threads:
            t.start()
        while bench.poll() is None:
            if apply.poll() is not None:
                raise RuntimeError(f"cdc apply ended during the run (exit {apply.returncode}); see {base}")
            time.sleep(1)
        stop.set()
        for t in threads:
            t.join(90)
        tps = re.findall(r"tps = ([\d.]+)", (base / "pgbench.log").read_text())
        return run, load0, tps[0] if tps else "?"
    finally:
        stop.set()
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(120)
            if p.poll() is None:
                p.kill()
        pg.stop("immediate")
        shutil.rmtree(pg_base, ignore_errors=True)
        if os.environ.get("BENCH_KEEP") != "1":
            shutil.rmtree(base, ignore_errors=True)
        else:
            say(f"  kept {base}")


def _await_snapshot(current: Path, rows: int, apply: subprocess.Popen[str]) -> None:
    """Wait (up to 30 min) until the accounts' current table holds its ``rows`` snapshot rows: the load
    starts on an applied snapshot, whatever the scale."""
    from deltalake import DeltaTable

    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if apply.poll() is not None:
            raise RuntimeError(f"cdc apply ended before the snapshot was applied (exit {apply.returncode})")
        with contextlib.suppress(Exception):  # not created yet, or a commit in flight
            if DeltaTable(str(current)).to_pyarrow_dataset().count_rows() >= rows:
                return
        time.sleep(1)
    raise RuntimeError(f"the snapshot of {rows:,} accounts was not applied in 30 minutes")


#: ``cdc apply``'s error when a Python worker Spark forked (the data source's planner) did not
#: connect back within Spark's fixed 10 s: a start-up on a machine loaded to 15-25 on 2 cores
CONNECT_BACK = "Python worker failed to connect back"


def _started_apply(
    base: Path,
    env: dict[str, str],
    master: str | None,
    state: Path,
    run: _Run,
    reader: subprocess.Popen[str],
    apply: subprocess.Popen[str],
    procs: list[subprocess.Popen[str]],
) -> subprocess.Popen[str]:
    """Wait (up to 20 min) for the apply's first batches (the probe's Delta table); an apply that
    ends at start-up with :data:`CONNECT_BACK` is started again (counted in
    ``run.restarts``, said in the report; at most 8 times); any other end fails the benchmark."""
    current = state / "warehouse" / "public" / "probe"
    deadline = time.monotonic() + 1200
    while True:
        threading.Thread(
            target=_follow_apply, args=(apply.stdout, run, base / "apply.log"), daemon=True
        ).start()
        while not (current / "_delta_log").exists() and time.monotonic() < deadline:
            if reader.poll() is not None:
                raise RuntimeError(f"cdc run ended early; see {base}")
            if apply.poll() is not None:
                break
            time.sleep(0.5)
        if apply.poll() is None:
            return apply
        if CONNECT_BACK not in (base / "apply.err").read_text() or run.restarts >= 8:
            raise RuntimeError(f"cdc apply ended early; see {base}")
        run.restarts += 1
        say(f"  cdc apply ended at start-up ({CONNECT_BACK}): started again ({run.restarts})")
        (base / "apply.err").rename(base / f"apply.err.{run.restarts}")
        args = [*CDC, "apply"] + (["--master", master] if master else [])
        err = open(base / "apply.err", "w")  # noqa: SIM115 - the process's for its life
        apply = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        procs.append(apply)


def _postmaster(pg: Any) -> int:
    pid_file = Path(pg.datadir) / "postmaster.pid"
    with contextlib.suppress(FileNotFoundError, ValueError):
        return int(pid_file.read_text().split()[0])
    return 0


@dataclass
class _Window:
    """One window of a run: its freshness percentiles and its batches' mean wall."""

    label: str
    p50: float
    p90: float
    p99: float
    wall: float


def _windows(run: _Run, minutes: float) -> list[_Window]:
    n = max(1, int(minutes * 60 // WINDOW + (minutes * 60 % WINDOW > 30)))
    out = []
    for w in range(n):
        lo, hi = w * WINDOW, (w + 1) * WINDOW if w < n - 1 else float("inf")
        f = [s for at, s in run.fresh if lo <= at < hi]
        b = [x[2] for x in run.batches if lo <= x[0] < hi]
        label = f"{lo / 60:g}-{min(hi, minutes * 60) / 60:g} min"
        wall = statistics.mean(b) if b else float("nan")
        out.append(_Window(label, _pct(f, 0.5), _pct(f, 0.9), _pct(f, 0.99), wall))
    return out


def _bars(p90s: list[float], walls: list[float]) -> str:
    """The issue's bars on a run's (or the rounds' median) windows."""
    bar_fresh = all(p <= 3 for p in p90s if p == p)
    trend = walls[-1] / walls[1] if len(walls) > 2 and walls[1] > 0 else float("nan")
    verdict = "met" if trend <= 1.2 else "NOT met" if trend == trend else "needs 3 windows"
    return (
        f"Bars: freshness p90 <= 3 s in every window: **{'met' if bar_fresh else 'NOT met'}**; last window's mean "
        f"batch wall / the second window's: **{trend:.2f}x** (bar <= 1.2x: {verdict})."
    )


def _report(run: _Run, minutes: float, where: str, load0: str, tps: str, scale: int) -> list[str]:
    lines = [
        f"{minutes:g} minutes of pgbench TPC-B (scale {scale}: {scale * 100_000:,} accounts, `-R {RATE}`: ~{RATE * 3} "
        f"captured changes/s; achieved {tps} tps) through `cdc run` and `cdc apply` at their defaults, {where}; a "
        f"probe row updated every {PROBE_EVERY:g} s, timed from its commit until a delta-rs reader sees it. Load "
        f"average before / after: {load0} / {loadavg()} (the machine is shared: other engineers' work ran meanwhile).",
        "",
        "| window | freshness p50 | p90 | p99 | max | batches | records / batch | batch wall mean | p90 "
        "| between batches | accounts files | accounts history files | tellers history files | RSS apply (+JVM) "
        "| RSS cdc run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    windows = _windows(run, minutes)
    phase_rows: list[str] = []
    for w, win in enumerate(windows):
        lo, hi = w * WINDOW, (w + 1) * WINDOW if w < len(windows) - 1 else float("inf")
        f = [s for at, s in run.fresh if lo <= at < hi]
        b = [x for x in run.batches if lo <= x[0] < hi]
        smp = [s for at, s in run.samples if lo <= at < hi]
        last = smp[-1] if smp else {}
        # Spark's own time between a batch's end and the next one's start (offsets, logs, trigger)
        ends = [x[0] for x in run.batches]
        gaps = [x[0] - x[2] - ends[i - 1] for i, x in enumerate(run.batches) if i and lo <= x[0] < hi]
        lines.append(
            f"| {win.label} | {win.p50:.2f} s | {win.p90:.2f} s "
            f"| {win.p99:.2f} s | {max(f, default=float('nan')):.2f} s | {len(b)} "
            f"| {statistics.mean(x[1] for x in b) if b else 0:,.0f} | {win.wall:.2f} s | {_pct([x[2] for x in b], 0.9):.2f} s "
            f"| {statistics.mean(gaps) if gaps else float('nan'):.2f} s | {last.get('files accounts', 0):.0f} | {last.get('files accounts history', 0):.0f} "
            f"| {last.get('files tellers history', 0):.0f} | {last.get('RSS cdc apply (+JVM, workers)', 0):,.0f} MB "
            f"| {last.get('RSS cdc run', 0):,.0f} MB |"
        )
        names = sorted({k for x in b for k in x[3]})
        if names:
            phase_rows.append(
                f"| {win.label} | "
                + ", ".join(f"{k} {statistics.mean(x[3].get(k, 0.0) for x in b) * 1000:.0f}" for k in names)
                + " |"
            )
    lines += [
        "",
        _bars([w.p90 for w in windows], [w.wall for w in windows])
        + f" Probe updates never seen within 60 s: {run.probe_misses}. `cdc apply` started again at start-up "
        f"after Spark's Python worker did not connect back in time (the machine's load): {run.restarts}.",
        "",
        "Mean milliseconds per batch and phase, per window (`cdc apply`'s progress line):",
        "",
        "| window | phases (ms) |",
        "| --- | --- |",
        *phase_rows,
        "",
    ]
    return lines


def _medians(runs: list[_Run], minutes: float) -> list[str]:
    """Per window, the median over the rounds of each round's percentiles and mean batch wall, and the
    bars on those medians."""
    per_round = [_windows(r, minutes) for r in runs]
    lines = [
        f"Median of {len(runs)} rounds, per window (each round's own table below):",
        "",
        "| window | freshness p50 | p90 | p99 | batch wall mean | p90 of each round |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    p90s, walls = [], []
    for i, win in enumerate(per_round[0]):
        ws = [r[i] for r in per_round if i < len(r)]
        p90 = statistics.median(w.p90 for w in ws)
        wall = statistics.median(w.wall for w in ws)
        p90s.append(p90)
        walls.append(wall)
        lines.append(
            f"| {win.label} | {statistics.median(w.p50 for w in ws):.2f} s | {p90:.2f} s "
            f"| {statistics.median(w.p99 for w in ws):.2f} s | {wall:.2f} s | "
            + " / ".join(f"{w.p90:.2f}" for w in ws)
            + " |"
        )
    return [*lines, "", _bars(p90s, walls) + " (on the medians)", ""]


def measure(minutes: float, master_kind: str, scale: int = SCALE, rounds: int = 1) -> str:
    """``rounds`` sustained runs on ``master_kind`` (``local`` or ``cluster``), each from a new source
    and state; the report's section (with the rounds' per-window medians when more than one)."""
    from tests.plugins.spark_standalone import start_cluster as start_spark_cluster

    where = "`local[2]`"
    results: list[tuple[_Run, str, str]] = []
    for i in range(rounds):
        say(f"  round {i + 1} of {rounds}")
        if master_kind == "cluster":
            spark_base = Path(tempfile.mkdtemp(prefix="cdc-bench-sustained-spark-"))
            sc = start_spark_cluster(spark_base, workers=2)
            try:
                where = (
                    "the apply's tasks on a Spark standalone cluster of 2 one-core workers on this machine"
                )
                results.append(_measure(minutes, sc.url, where, scale))
            finally:
                sc.stop()
                shutil.rmtree(spark_base, ignore_errors=True)
        else:
            results.append(_measure(minutes, None, where, scale))
    title = f"### Sustained freshness, {where}" + ("" if scale == 2 else f", pgbench scale {scale}")
    lines = [title, ""]
    if rounds > 1:
        lines += _medians([r for r, _, _ in results], minutes)
    for i, (run, load0, tps) in enumerate(results):
        if rounds > 1:
            lines += [f"#### Round {i + 1}", ""]
        lines += _report(run, minutes, where, load0, tps, scale)
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def run(quick: bool) -> str:
    minutes = 2.0 if quick else float(os.environ.get("BENCH_SUSTAINED_MINUTES", "30"))
    rounds = 1 if quick else int(os.environ.get("BENCH_SUSTAINED_ROUNDS", "3"))
    return measure(minutes, os.environ.get("BENCH_SUSTAINED_MASTER", "local"), SCALE, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.freshness_sustained")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--master", choices=("local", "cluster"), default="local")
    parser.add_argument("--scale", type=int, default=SCALE, help="pgbench scale (100k accounts each)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs; more than 1 adds their per-window medians"
    )
    parser.add_argument("--no-write", action="store_true", help="print only; docs/benchmarks untouched")
    args = parser.parse_args()
    started = time.time()
    text = measure(args.minutes, args.master, args.scale, args.rounds)
    if args.no_write:
        return
    from bench.__main__ import _put_section

    header = (
        f"<!-- written by `python -m bench.freshness_sustained --minutes {args.minutes:g} --master {args.master} "
        f"--scale {args.scale} --rounds {args.rounds}` "
        f"on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {time.time() - started:.0f} s -->\n"
    )
    out = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "freshness.md"
    scale = "" if args.scale == 2 else f"_s{args.scale}"
    _put_section(out, f"freshness_sustained_{args.master}{scale}", header + text)


if __name__ == "__main__":
    main()
