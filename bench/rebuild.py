"""``cdc rebuild`` of a table: what a rebuild costs against its parts (``docs/rebuild.md``).

``python -m bench rebuild [--quick]``

A private Postgres 15 (wal2json); ``public.items`` (``id bigint`` key, text, integer, numeric and a
search column) registered, snapshotted empty by ``cdc run --once``, then ROWS inserted and a quarter
of them updated, in transactions of 1,000, captured by ``cdc run --once`` (real reader, embedded log store).
The live derived tables are applied by the apply's Spark-free micro-batch (``BatchApplier`` over
the topic, :func:`tests.plugins.apply.apply_without_spark`): **the peer**, as it is the same
replay into the live state. Then, REPEATS times each: ``cdc verify`` (in this process) and ``cdc
rebuild --yes`` (replay into a staged copy + verify of the copy + swap). Figures: wall seconds and
this process's CPU seconds (its sink threads included; Postgres's CPU is not), medians of the
repeats; replayed records per second.

``--quick``: 2,000 rows, one repeat.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench._common import loadavg, say
from cdc.devcluster import start_cluster

ROWS = 50_000
REPEATS = 3
DDL = "CREATE TABLE items (id bigint PRIMARY KEY, name text, qty integer, price numeric(12,2), note text)"


def _cdc(dsn: str, state: Path, *args: str) -> tuple[int, str]:
    from cdc.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["--source", dsn, "--state", str(state), *args])
    return code, out.getvalue()


def _timed(fn: object, *args: object) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)  # type: ignore[operator]
    return time.perf_counter() - wall, time.process_time() - cpu, out


def run(quick: bool) -> str:
    rows, repeats = (2_000, 1) if quick else (ROWS, REPEATS)
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-rebuild-"))
    pg_base = Path(tempfile.mkdtemp(prefix="cdc-bench-pg-"))
    pg = start_cluster(pg_base)
    try:
        return _measure(pg, base / "state", rows, repeats)
    finally:
        pg.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(pg_base, ignore_errors=True)


def _measure(pg: object, state: Path, rows: int, repeats: int) -> str:
    from tests.plugins.apply import apply_without_spark

    pg.execute(DDL)  # type: ignore[attr-defined]
    dsn = pg.dsn()  # type: ignore[attr-defined]
    assert _cdc(dsn, state, "tables", "add", "public.items", "--search", "name")[0] == 0
    assert _cdc(dsn, state, "run", "--once")[0] == 0
    for lo in range(1, rows + 1, 1_000):
        hi = min(lo + 999, rows)
        pg.execute(  # type: ignore[attr-defined]
            f"INSERT INTO items SELECT g, 'item ' || g || E' it''s \\n \"q\"', g % 97, g * 0.25, "
            f"repeat('n', 200) FROM generate_series({lo}, {hi}) g"
        )
    updates = 0
    for lo in range(1, rows + 1, 4_000):
        pg.execute(f"UPDATE items SET qty = qty + 1 WHERE id BETWEEN {lo} AND {lo + 999}")  # type: ignore[attr-defined]
        updates += min(lo + 999, rows) - lo + 1
    say(f"rebuild: capturing {rows} inserts and {updates} updates")
    assert _cdc(dsn, state, "run", "--once")[0] == 0
    wall, cpu, records = _timed(apply_without_spark, state)
    say(f"rebuild: peer (the live apply, BatchApplier) {records} records in {wall:.1f} s, {cpu:.1f} CPU s")
    peer = (wall, cpu)
    verify, rebuild = [], []
    for i in range(repeats):
        w, c, out = _timed(_cdc, dsn, state, "verify", "--json")
        assert out[0] == 0, out  # type: ignore[index]
        verify.append((w, c))
        w, c, out = _timed(_cdc, dsn, state, "rebuild", "public.items", "--yes", "--json")
        assert out[0] == 0, out  # type: ignore[index]
        rebuild.append((w, c))
        say(f"rebuild: run {i + 1}: verify {verify[-1][0]:.1f} s, rebuild {w:.1f} s ({c:.1f} CPU s)")
    med = {
        name: (statistics.median(w for w, _ in xs), statistics.median(c for _, c in xs))
        for name, xs in (("verify", verify), ("rebuild", rebuild))
    }
    lines = [
        "# `cdc rebuild`",
        "",
        f"{rows:,} rows ({rows:,} inserts + {updates:,} updates: {records:,} records in the topic, one "
        f"search column), embedded log store; medians of {repeats} runs; load average {loadavg()} "
        "(the machine is shared: wall times are noisy, CPU seconds less so).",
        "",
        "| | wall s | CPU s (this process) | records/s |",
        "| --- | --- | --- | --- |",
        f"| peer: the live apply's replay (BatchApplier) | {peer[0]:.1f} | {peer[1]:.1f} | {records / peer[0]:,.0f} |",  # type: ignore[operator]
        f"| `cdc verify` | {med['verify'][0]:.1f} | {med['verify'][1]:.1f} | |",
        f"| `cdc rebuild` (replay + verify + swap) | {med['rebuild'][0]:.1f} | {med['rebuild'][1]:.1f} | "
        f"{records / med['rebuild'][0]:,.0f} |",  # type: ignore[operator]
        "",
        f"A rebuild costs {med['rebuild'][0] / (peer[0] + med['verify'][0]):.2f}x the peer's replay plus "
        "one verify.",
        "",
    ]
    return "\n".join(lines)
