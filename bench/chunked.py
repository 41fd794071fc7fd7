"""Chunked-snapshot benchmark: the source's CPU for a chunked snapshot against a plain ``COPY`` of
the same rows, in the same run, split into its parts (issue 16, section 3).

Two tables: ``narrow`` (the snapshot benchmark's ``bench``: bigint PK, text, int, numeric,
timestamptz, jsonb; 600k rows) and ``wider`` (14 columns, about 370 bytes a row: texts, a 120-byte
note, numbers, a float, dates, a uuid, jsonb, ``text[]``; 800k rows). ``--quick``: 30k and 40k.

Each round, for each table: the peer ``COPY (SELECT cols FROM t) TO STDOUT`` on a new connection,
then the chunked snapshot of the table registered on a pipeline (``cdc run --once``, a subprocess, a
fresh state directory and slot; the set-up runs before the measurement), at the default chunk size
and at the former default (8,192). Figures are medians over the rounds. Knobs (environment):
``BENCH_ROUNDS`` (3), ``BENCH_SCALE`` (row counts × this), ``BENCH_CHUNK_SIZES`` (comma-separated).

The source's CPU is the whole cluster's: the postmaster (with the CPU of every child it reaped) and
every live child, from ``/proc`` (utime + stime) before and after. It is split by process, sampled
every 50 ms: the chunk reader's backends (``application_name`` ``cdc-snapshot``: the chunk reads and
the watermark writes), the walsender (decoding the watermarks), the other backends of ``cdc run``
(its checks and catalog reads), the background processes, and the rest (postmaster forks, the last
50 ms of exited backends). The watermark writes are separated from the reads by a calibration in the
same run: as many watermark upserts as the snapshot wrote, on one connection, and their decoding
through wal2json with the reader's options (``pg_logical_slot_get_changes`` on a slot of their own).
The monitor's own backend (which asks ``pg_stat_activity`` for the new backends' names) is left out.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql

from bench._common import cpu_s, late_table, loadavg, say
from cdc.devcluster import PgCluster, start_cluster

OLD_CHUNK = 8192

TABLES: dict[str, tuple[str, str]] = {
    "narrow": (
        "CREATE TABLE narrow (id bigint PRIMARY KEY, t text, i int, n numeric(20,6), ts timestamptz, j jsonb)",
        "INSERT INTO narrow SELECT g, 'text value ' || g, mod(g, 1000), g * 1.000001, now(), "
        "jsonb_build_object('k', g, 's', 'v') FROM generate_series(1, %s) g",
    ),
    "wider": (
        "CREATE TABLE wider (id bigint PRIMARY KEY, name text, email text, note text, i int, b bigint, "
        "n numeric(20,6), f float8, ts timestamptz, d date, ok boolean, u uuid, j jsonb, tags text[])",
        "INSERT INTO wider SELECT g, 'name ' || g, 'user' || g || '@example.com', "
        "repeat('note ' || g || ' ', 12), mod(g, 1000), g * 1000, g * 1.000001, g / 7.0, now(), "
        "current_date, g %% 2 = 0, md5(g::text)::uuid, "
        "jsonb_build_object('k', g, 's', 'v', 'arr', jsonb_build_array(1, 2, 3)), ARRAY['a', 'b' || g] "
        "FROM generate_series(1, %s) g",
    ),
}

ROLES = ("chunk reader", "walsender", "other backends", "background", "rest")


def _clock_s(pid: int) -> tuple[float, float]:
    """(own CPU seconds, reaped children's CPU seconds) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tck, (int(fields[13]) + int(fields[14])) / tck


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class SourceCpu:
    """The whole cluster's CPU while something runs, and its split by process role (see the module
    docstring)."""

    def __init__(self, pg: PgCluster, dsn: str) -> None:
        self.postmaster = int((pg.datadir / "postmaster.pid").read_text().split()[0])
        self.dsn = dsn
        self.stop = threading.Event()
        self.role: dict[int, str] = {}
        self.base: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.monitor = 0

    def _total(self) -> float:
        own, reaped = _clock_s(self.postmaster)
        total = own + reaped
        for pid in _children(self.postmaster):
            with contextlib.suppress(OSError):
                total += cpu_s(pid)
        return total

    def _classify(self, conn: psycopg.Connection[Any], pids: list[int]) -> None:
        names = dict(
            conn.execute(
                "SELECT pid, application_name FROM pg_stat_activity WHERE pid = ANY(%s)", [pids]
            ).fetchall()
        )
        for pid in pids:
            title = _title(pid)
            if "walsender" in title:
                self.role[pid] = "walsender"
            elif "(" in title:  # a client backend: "postgres: user db host(port) ..."
                if pid in names:  # else not in pg_stat_activity yet: the next sample tells
                    self.role[pid] = "chunk reader" if names[pid] == "cdc-snapshot" else "other backends"
            elif title.startswith("postgres: "):  # "postgres: checkpointer", "postgres: walwriter", ...
                self.role[pid] = "background"
            # else just forked, still titled as the postmaster: the next sample tells

    def _sample(self, conn: psycopg.Connection[Any]) -> None:
        pids = [p for p in _children(self.postmaster) if p != self.monitor]
        new = [p for p in pids if p not in self.role]
        if new:
            self._classify(conn, new)
        for pid in pids:
            try:
                self.last[pid] = cpu_s(pid)
            except OSError:
                continue

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            self.monitor = conn.info.backend_pid
            for pid in _children(self.postmaster):
                if pid != self.monitor:
                    with contextlib.suppress(OSError):
                        self.base[pid] = cpu_s(pid)
            self.total0 = self._total()
            self.monitor0 = cpu_s(self.monitor)
            self.ready.set()
            while not self.stop.wait(0.05):
                self._sample(conn)
            self._sample(conn)
            time.sleep(0.2)  # let exiting backends be reaped into the postmaster's count
            self.monitor1 = cpu_s(self.monitor)
            self.total1 = self._total()

    def __enter__(self) -> SourceCpu:
        self.ready = threading.Event()
        self.thread.start()
        self.ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)

    def parts(self) -> dict[str, float]:
        """CPU seconds: ``total`` (the whole source, less the monitor) and each of :data:`ROLES`."""
        out = dict.fromkeys(ROLES, 0.0)
        for pid, cpu in self.last.items():
            role = self.role.get(pid, "rest")
            if role != "rest":
                out[role] += cpu - self.base.get(pid, 0.0)
        total = (self.total1 - self.total0) - (self.monitor1 - self.monitor0)
        out["rest"] = total - sum(out[r] for r in ROLES if r != "rest")
        out["total"] = total
        return out


def _copy_peer(pg: PgCluster, dsn: str, table: str, cols: list[str]) -> dict[str, float]:
    query = sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in cols), sql.Identifier(table)
    )
    with SourceCpu(pg, dsn) as cpu, psycopg.connect(dsn, autocommit=True) as conn:
        pid = conn.info.backend_pid
        b0 = cpu_s(pid)
        t0 = time.perf_counter()
        with conn.cursor().copy(query) as copy:
            for _chunk in copy:
                pass
        seconds = time.perf_counter() - t0
        backend = cpu_s(pid) - b0
    return {**cpu.parts(), "backend": backend, "seconds": seconds}


def _chunked(pg: PgCluster, dsn: str, base: Path, table: str, chunk: int, tag: str) -> dict[str, float]:
    """One chunked snapshot of ``table`` by ``cdc run --once`` (a subprocess) with ``chunk`` rows a
    chunk: the source's CPU by part, the reader process's CPU, seconds, chunks."""
    state, slot = base / f"state-{tag}", f"bench_{tag}"
    call = late_table(dsn, state, slot, f"[snapshot]\nchunk_size = {chunk}\n", f"public.{table}", 3600)
    with SourceCpu(pg, dsn) as cpu:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        out = orjson.loads(call("run", "--once", "--json").strip().splitlines()[-1])
        seconds = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the same process with nothing to snapshot: what any `cdc run` start costs the source
    with SourceCpu(pg, dsn) as idle:
        call("run", "--once")
    from cdc.registry import Registry
    from snapshot.chunk_state import load_progress

    with Registry(state) as registry:
        prog = load_progress(registry, "public", table)
    assert prog is not None and prog.done, prog
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])
    shutil.rmtree(state, ignore_errors=True)
    return {
        **cpu.parts(),
        "baseline": idle.parts()["total"],
        "reader": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
        "seconds": seconds,
        "chunks": float(prog.chunks),
        "rows": float(out["snapshot_rows"][f"public.{table}"]),
    }


def _watermarks(dsn: str, writes: int) -> tuple[float, float]:
    """(backend CPU seconds, decoding CPU seconds) of ``writes`` watermark upserts: written on one
    connection, then decoded by wal2json with the reader's options on a slot of their own."""
    from cdc.codec.wal2json import replication_options
    from snapshot.chunked import write_mark

    wm = ("public", "cdc_watermark")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('bench_marks', 'wal2json')")
        try:
            with psycopg.connect(dsn, autocommit=True, application_name="bench-marks") as w:
                pid = w.info.backend_pid
                c0 = cpu_s(pid)
                for i in range(writes):
                    write_mark(w, wm, "bench_marks", f"{i:032x}:{'lw' if i % 2 == 0 else 'hw'}")
                written = cpu_s(pid) - c0
            options = replication_options([wm, ("public", "narrow")])
            args = sql.SQL(", ").join(sql.Literal(x) for kv in options.items() for x in kv)
            with psycopg.connect(dsn, autocommit=True) as d:
                pid = d.info.backend_pid
                c0 = cpu_s(pid)
                d.execute(
                    sql.SQL(
                        "SELECT count(*) FROM pg_logical_slot_get_changes('bench_marks', NULL, NULL, {})"
                    ).format(args)
                ).fetchone()
                decoded = cpu_s(pid) - c0
        finally:
            conn.execute("SELECT pg_drop_replication_slot('bench_marks')")
    return written, decoded


def _setup(pg: PgCluster, rows: dict[str, int]) -> str:
    pg.execute("CREATE DATABASE bench")
    dsn = pg.dsn("bench")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name, (ddl, insert) in TABLES.items():
            conn.execute(ddl)  # type: ignore[arg-type]
            conn.execute(insert, [rows[name]])  # type: ignore[arg-type]
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(name)))
        conn.execute("CREATE TABLE tiny (id int PRIMARY KEY)")
        conn.execute("INSERT INTO tiny VALUES (1)")
        conn.execute(
            "CREATE TABLE cdc_watermark (slot text PRIMARY KEY, mark text NOT NULL, "
            "written_at timestamptz NOT NULL DEFAULT now())"
        )
        conn.execute("CHECKPOINT")
    return dsn


def _columns(dsn: str, table: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum",
            [table],
        ).fetchall()
    return [str(r[0]) for r in rows]


def run(quick: bool) -> str:
    from snapshot.chunk_state import SnapshotOptions

    default = SnapshotOptions().chunk_size
    rows = {"narrow": 30_000, "wider": 40_000} if quick else {"narrow": 600_000, "wider": 800_000}
    scale = float(os.environ.get("BENCH_SCALE", "1"))  # e.g. 0.25 for a first run at modest sizes
    rows = {k: int(v * scale) for k, v in rows.items()}
    rounds = int(os.environ.get("BENCH_ROUNDS", "3"))
    sizes = [default] if default == OLD_CHUNK else [default, OLD_CHUNK]
    if os.environ.get("BENCH_CHUNK_SIZES"):  # e.g. "8192,32768,65536" to choose the default
        sizes = [int(x) for x in os.environ["BENCH_CHUNK_SIZES"].split(",")]
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-chunked-"))
    pg = start_cluster(Path(tempfile.mkdtemp(prefix="cdc-bench-pg-")))
    load_start = loadavg()
    try:
        dsn = _setup(pg, rows)
        say(f"{rows} rows; {rounds} rounds; chunk sizes {sizes}; load average {load_start}")
        got: dict[tuple[str, str], list[dict[str, float]]] = {}
        for r in range(rounds):
            for table in TABLES:
                cols = _columns(dsn, table)
                peer = _copy_peer(pg, dsn, table, cols)
                got.setdefault((table, "copy"), []).append(peer)
                say(
                    f"round {r + 1} {table}: COPY source {peer['total']:.2f} s (backend {peer['backend']:.2f} s)"
                )
                for size in sizes:
                    res = _chunked(pg, dsn, base, table, size, f"{table}_{size}_{r}")
                    assert res["rows"] == rows[table], (res["rows"], rows[table])
                    got.setdefault((table, str(size)), []).append(res)
                    say(
                        f"round {r + 1} {table} chunk {size}: source {res['total']:.2f} s "
                        f"({res['total'] / peer['total']:.2f}x COPY), "
                        + ", ".join(f"{k} {res[k]:.2f}" for k in ROLES)
                        + f"; reader {res['reader']:.2f} s, {res['seconds']:.1f} s, {res['chunks']:.0f} chunks"
                    )
        # the watermark writes and their decoding, per write (calibration, the same run)
        cal_n = 2000 if not quick else 400
        marks = [_watermarks(dsn, cal_n) for _ in range(rounds)]
        mark_w = statistics.median(m[0] for m in marks) / cal_n
        mark_d = statistics.median(m[1] for m in marks) / cal_n
        say(f"watermark write: {mark_w * 1e6:.0f} µs backend, {mark_d * 1e6:.0f} µs decoding, per write")
        return _report(got, rows, sizes, rounds, (mark_w, mark_d), load_start, default)
    finally:
        pg.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


def _report(
    got: dict[tuple[str, str], list[dict[str, float]]],
    rows: dict[str, int],
    sizes: list[int],
    rounds: int,
    mark: tuple[float, float],
    load_start: str,
    default: int,
) -> str:
    def med(table: str, kind: str, part: str) -> float:
        return statistics.median(x[part] for x in got[(table, kind)])

    def ratio(table: str, kind: str, own: bool = False) -> float:
        # per round: the chunked snapshot against the COPY of the same round
        pairs = zip(got[(table, kind)], got[(table, "copy")], strict=True)
        return statistics.median(
            (c["total"] - (c["baseline"] if own else 0.0)) / p["total"] for c, p in pairs
        )

    mark_w, mark_d = mark
    lines = [
        "# Chunked snapshot: the source's CPU against a plain COPY",
        "",
        "`python -m bench chunked` (issue 16, section 3). The chunked snapshot of a table registered on a "
        "pipeline (`cdc run --once`, a subprocess: chunk reads, watermarks, windows, durable appends to the "
        "embedded log store) against the peer `COPY (SELECT cols FROM t) TO STDOUT` of the same rows on a "
        f"new connection, interleaved in each of {rounds} rounds; medians over the rounds. Source CPU: the "
        "whole cluster (postmaster with its reaped children, every backend, the walsender, background "
        "processes), from `/proc`. Tables: `narrow` (`id bigint PK, t text, i int, n numeric(20,6), ts "
        "timestamptz, j jsonb`) and `wider` (14 columns, ~370 bytes a row: three texts, a 120-byte note, "
        "int, bigint, numeric, float8, timestamptz, date, bool, uuid, jsonb, text[]).",
        "",
        "| table | rows | chunk rows | chunks | source CPU s, whole `cdc run --once` | × COPY | `cdc run` start "
        "alone | **the snapshot's own (less the start) × COPY** | source µs/row (own) | chunk reads | "
        "watermark writes | walsender | other `cdc run` backends | background | rest | reader (`cdc run`) "
        "µs/row | seconds |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    for table in TABLES:
        n = rows[table]
        copy = med(table, "copy", "total")
        lines.append(
            f"| {table} | {n:,} | plain COPY (peer) | | {copy:.2f} | 1.00 | | 1.00 | {copy / n * 1e6:.2f} "
            f"| | | | | | | | {med(table, 'copy', 'seconds'):.2f} |"
        )
        for size in sizes:
            k = str(size)
            chunks = med(table, k, "chunks")
            writes = mark_w * 2 * chunks
            reader = med(table, k, "chunk reader")
            own = med(table, k, "total") - med(table, k, "baseline")
            tag = " (default)" if size == default else " (former default)" if size == OLD_CHUNK else ""
            lines.append(
                f"| {table} | {n:,} | {size:,}{tag} | {chunks:.0f} | {med(table, k, 'total'):.2f} | "
                f"{ratio(table, k):.2f} | {med(table, k, 'baseline'):.2f} | **{ratio(table, k, own=True):.2f}** | "
                f"{own / n * 1e6:.2f} | {max(reader - writes, 0.0):.2f} | {writes:.3f} | "
                f"{med(table, k, 'walsender'):.3f} | {med(table, k, 'other backends'):.2f} | "
                f"{med(table, k, 'background'):.2f} | {med(table, k, 'rest'):.2f} | "
                f"{med(table, k, 'reader') / n * 1e6:.2f} | {med(table, k, 'seconds'):.1f} |"
            )
    at = default if default in sizes else sizes[0]
    worst = max(ratio(t, str(at), own=True) for t in TABLES)
    worst_whole = max(ratio(t, str(at)) for t in TABLES)
    lines += [
        "",
        "Parts (of the whole run): *chunk reads*: the chunk reader's backends (`application_name` "
        "`cdc-snapshot`, sampled every 50 ms) less the watermark writes; *watermark writes*: 2 per chunk at "
        f"{mark_w * 1e6:.0f} µs each, measured in the same run ({rounds} × 2,000 upserts on one "
        "connection, median); *walsender*: the `cdc run` walsender, measured (decoding the watermarks "
        f"and its start-up; wal2json decodes a watermark write in {mark_d * 1e6:.0f} µs, calibrated "
        "like the writes with `pg_logical_slot_get_changes` and the reader's options); *other `cdc run` "
        "backends*: its checks, registry and catalog reads; *background*: checkpointer, walwriter, "
        "autovacuum and the other background processes over the run's wall time; *rest*: the postmaster "
        "(forks) and backends that lived less than 50 ms or their last 50 ms. *`cdc run` start alone*: the "
        "same `cdc run --once` again right after, with nothing to snapshot (connections, checks, a stream "
        "session); *the snapshot's own*: the whole run less that. *× COPY*: the median over the rounds of "
        "each round's ratio. Reader: the `cdc run` process's own CPU (user + system).",
        "",
        f"Bar (issue 16): the source's CPU for a chunked snapshot at most 1.5× the plain COPY's at the default "
        f"chunk size: the snapshot's own **{worst:.2f}×** ({'✔' if worst <= 1.5 else '✘'}); with the start "
        f"of a `cdc run` process counted in, {worst_whole:.2f}×.",
        "",
        f"Machine: {os.cpu_count()} cores shared with other agents' work; load average at the start "
        f"{load_start}, at the end {loadavg()} (1, 5, 15 min). CPU seconds on a loaded machine vary "
        "between runs (cache and scheduler effects); the ratios come from runs interleaved in the same "
        "rounds.",
        "",
    ]
    section = "\n".join(lines)
    say(section)
    return section
