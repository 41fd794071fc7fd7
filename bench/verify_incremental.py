"""Incremental against full ``cdc verify`` (issue 20, "a verify that costs only what changed"; issue
35: on a narrow table as well as a wide one).

A private Postgres 15 (wal2json) and two shapes, one after the other, each in its own database and
state directory: ``public.big`` (wide: bigint key, text, int, numeric(20,6), timestamptz) and
``public.narrow`` (narrow: int key, text, numeric(12,2)), ``BENCH_ROWS`` rows each (default
1,000,000: the bar's size), registered without search columns, snapshotted by the real reader
(``cdc run --once``) and applied by the Spark-free micro-batch (``BatchApplier``, the real Delta
sink). ``BENCH_SHAPES`` (default ``wide,narrow``) picks the shapes.

Each round of a shape: ``cdc verify --full`` (records the key ranges), then ``rows / 1000`` random updates
(the bar's density: 1,000 changes per 1M rows), captured and applied, then ``cdc verify`` (the
incremental run, with the default scrub of 1% of the ranges); then 1,000 random updates (five times
that density) and ``cdc verify`` again. Each verify is its own process; per run: wall seconds, that
process's CPU seconds (``RUSAGE_CHILDREN``) and the source cluster's CPU (:class:`bench.chunked.SourceCpu`),
and the ranges it checked. Figures are medians over ``BENCH_ROUNDS`` (3) rounds; the ratios are of
medians. ``--quick``: 20,000 rows, one round.
"""

from __future__ import annotations

import compileall
import os
import random
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench._common import CDC, cdc_env, loadavg, say
from bench.chunked import SourceCpu
from cdc.devcluster import PgCluster, start_cluster
from tests.plugins.apply import apply_pending_without_spark


@dataclass(frozen=True)
class Shape:
    """One table the bench verifies: its DDL, its fill (``%s``: the row count), one change of a row
    (``%s``: its key), and how the report describes it."""

    table: str
    ddl: str
    fill: str
    update: str
    columns: str


SHAPES = {
    "wide": Shape(
        "big",
        "CREATE TABLE big (id bigint PRIMARY KEY, name text, n int, price numeric(20,6), ts timestamptz)",
        "INSERT INTO big SELECT g, 'name of row ' || g, mod(g, 1000), g * 1.000001, "
        "'2026-01-01'::timestamptz + g * interval '1 s' FROM generate_series(1, %s) g",
        "UPDATE big SET n = n + 1, name = name || '+' WHERE id = %s",
        "bigint key, text, int, numeric, timestamptz",
    ),
    "narrow": Shape(
        "narrow",
        "CREATE TABLE narrow (id int PRIMARY KEY, name text, price numeric(12,2))",
        "INSERT INTO narrow SELECT g, 'name ' || g, g * 0.01 FROM generate_series(1, %s) g",
        "UPDATE narrow SET name = name || '+' WHERE id = %s",
        "int key, text, numeric",
    ),
}


def _cdc(env: dict[str, str], *args: str) -> tuple[str, float]:
    """``cdc ARGS`` as a new process: (stdout, its CPU seconds); fails on exit codes other than 0."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run([*CDC, *args], env=env, capture_output=True, text=True, timeout=3600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert res.returncode == 0, res.stderr[-2000:] + res.stdout[-2000:]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return res.stdout, cpu


def _verify(pg: PgCluster, dsn: str, env: dict[str, str], *extra: str) -> dict[str, Any]:
    with SourceCpu(pg, dsn) as source:
        t0 = time.perf_counter()
        out, cpu = _cdc(env, "verify", "--json", *extra)
        wall = time.perf_counter() - t0
    (report,) = orjson.loads(out)
    assert report["status"] == "ok", report
    return {
        "wall": wall,
        "cpu": cpu,
        "source": source.parts()["total"],
        "checked": report["ranges_checked"],
        "ranges": report["ranges"],
        "rows": report["rows_checked"],
        "mode": report["mode"],
    }


def _change(
    shape: Shape, dsn: str, rows: int, count: int, rnd: random.Random, state: Path, env: dict[str, str]
) -> None:
    """``count`` updates of random rows (one transaction each), captured and applied."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(count):
            conn.execute(shape.update, [rnd.randint(1, rows)])
    _cdc(env, "run", "--once")
    apply_pending_without_spark(state)


def _compile_project() -> None:
    """Write the project's ``.pyc`` files (``__pycache__``, ignored by git), as an installed package
    has them: the environment may set ``PYTHONDONTWRITEBYTECODE``, and every ``cdc verify`` process
    would then compile the project's modules again (~0.1 s of CPU: a fixed cost that is a share of
    an incremental run, not of what on-call runs)."""
    import cdc
    import sinks
    import snapshot

    for pkg in (cdc, sinks, snapshot):
        compileall.compile_dir(str(Path(pkg.__file__).parent), quiet=2)


def run(quick: bool) -> str:
    rows = 20_000 if quick else int(os.environ.get("BENCH_ROWS", "1000000"))
    rounds = 1 if quick else int(os.environ.get("BENCH_ROUNDS", "3"))
    names = [n.strip() for n in os.environ.get("BENCH_SHAPES", "wide,narrow").split(",") if n.strip()]
    pg = start_cluster(Path(tempfile.mkdtemp(prefix="cdc-bench-pg-")))
    _compile_project()
    load_start = loadavg()
    sections: list[str] = []
    ratios: list[str] = []
    try:
        for name in names:
            got = _shape(pg, name, SHAPES[name], rows, rounds)
            sections.append(_report(SHAPES[name], name, got, rows))
            full = got["full"]
            for k, v in got.items():
                if k != "full":
                    ratios.append(_ratio_line(name, k, v, full))
    finally:
        pg.stop("immediate")
        shutil.rmtree(pg.datadir.parent, ignore_errors=True)
    head = [
        "# Incremental against full `cdc verify`",
        "",
        f"{rows:,} rows per table, no search columns; medians of {rounds} rounds; load average at the "
        f"start {load_start}, at the end {loadavg()} (the machine is shared: the CPU columns are the "
        "steadier figures). `verify CPU` is the `cdc verify` process, `source CPU` the whole Postgres "
        "cluster while it ran; `CPU vs full` is the two together. Changes: random single-row updates, "
        "at the bar's density (1,000 per 1M rows) and 1,000 of them; the ranges checked include the "
        "scrub's 1% of the table's ranges. The bar: an incremental run after 1,000 changes to 1M rows "
        "under 5% of a full one, on both shapes.",
        "",
        *ratios,
        "",
    ]
    return "\n".join(head + sections)


def _shape(pg: PgCluster, name: str, shape: Shape, rows: int, rounds: int) -> dict[str, list[dict[str, Any]]]:
    """One shape's rounds (module docstring): every run's figures, by run."""
    sparse = max(rows // 1000, 1)
    counts = sorted({sparse, 1000})  # one count at 1M rows, where the bar's density is 1,000
    got: dict[str, list[dict[str, Any]]] = {"full": [], **{f"{c} changes": [] for c in counts}}
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-verify-"))
    try:
        db = pg.create_database("bench")
        pg.execute(shape.ddl, db)
        pg.execute(shape.fill % rows, db)
        dsn = pg.dsn(db)
        state = base / "state"
        env = cdc_env(dsn, state, f"cdc_bench_verify_{name}")
        _cdc(env, "tables", "add", f"public.{shape.table}")
        _cdc(env, "run", "--once")
        apply_pending_without_spark(state)
        say(f"{name}: {rows} rows; {rounds} rounds; load average {loadavg()}")
        rnd = random.Random(20)
        for r in range(rounds):
            got["full"].append(_verify(pg, dsn, env, "--full"))
            for count in counts:
                _change(shape, dsn, rows, count, rnd, state, env)
                got[f"{count} changes"].append(_verify(pg, dsn, env))
            say(f"{name} round {r + 1}: " + "; ".join(f"{k} {v[-1]['wall']:.2f} s" for k, v in got.items()))
        return got
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {f: statistics.median(x[f] for x in runs) for f in ("wall", "cpu", "source", "checked", "rows")}


def _ratio_line(name: str, run: str, runs: list[dict[str, Any]], full_runs: list[dict[str, Any]]) -> str:
    """One line of the summary: a shape's incremental run against its full one (ratios of medians)."""
    m, full = _medians(runs), _medians(full_runs)
    wall = m["wall"] / full["wall"]
    cpu = (m["cpu"] + m["source"]) / (full["cpu"] + full["source"])
    return (
        f"- **{name}, {run}: {wall:.1%} of a full run's wall time, {cpu:.1%} of its CPU** "
        f"({m['wall']:.2f} s against {full['wall']:.2f} s; CPU {m['cpu'] + m['source']:.2f} s against "
        f"{full['cpu'] + full['source']:.2f} s)"
    )


def _report(shape: Shape, name: str, got: dict[str, list[dict[str, Any]]], rows: int) -> str:
    med = {k: _medians(v) for k, v in got.items()}
    full = med["full"]
    ranges = got["full"][0]["ranges"]
    lines = [
        f"## {name}: `public.{shape.table}` ({shape.columns})",
        "",
        f"{rows:,} rows; ranges of {rows // max(ranges, 1):,} keys ({ranges:,}).",
        "",
        "| run | ranges checked | rows read | wall s | verify CPU s | source CPU s | wall vs full | CPU vs full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k, m in med.items():
        lines.append(
            f"| {k} | {m['checked']:,.0f} | {m['rows']:,.0f} | {m['wall']:.2f} | {m['cpu']:.2f} | "
            f"{m['source']:.2f} | {m['wall'] / full['wall']:.1%} | "
            f"{(m['cpu'] + m['source']) / (full['cpu'] + full['source']):.1%} |"
        )
    lines.append("")
    return "\n".join(lines)
