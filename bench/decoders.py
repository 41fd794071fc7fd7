"""The reader's decoding cost per change: pgoutput (:mod:`cdc.codec.pgoutput`) against wal2json
(:mod:`cdc.codec.wal2json`), on the same changes.

One table of 10 typical columns (bigint key, integer, two texts, numeric, double precision,
boolean, timestamptz, date, jsonb); N inserts, then N updates of one column, in transactions of
100 rows, read from a wal2json slot and a pgoutput slot created at the same point (the SQL
functions ``pg_logical_slot_peek_changes`` / ``peek_binary_changes``, so no socket is timed). Timed
in this process (its CPU time), free of I/O: every message (B/C included) read through the
decoder's ``source`` and ``decode``d as the reader's loop does, then the same plus the per-column
converters to the event values (what ``TableCodec.fast_row`` does). Median of 5 rounds,
microseconds per change (messages of the inserts or the updates, divided by N).

Then both slots are streamed from their start over a replication connection, as the reader does
(psycopg2, its session options, each decoder's options): the CPU per change of the walsender
(``/proc``: what each plugin costs the source) and of this process (read, decode, converters; no
envelope, no log store), one run each.
"""

from __future__ import annotations

import select
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from bench._common import cpu_s, loadavg, say
from cdc.codec import Decoder
from cdc.codec.pgoutput import PgOutput, RawMessage
from cdc.codec.wal2json import DECODER as WAL2JSON
from cdc.codec.wal2json import replication_options
from cdc.connect import SESSION_OPTIONS, connect_replication
from cdc.devcluster import start_cluster

TABLE = (
    "CREATE TABLE t (id bigint PRIMARY KEY, n integer, name text, email varchar(100), amount numeric(12,2),"
    " score double precision, active boolean, created timestamptz, day date, meta jsonb)"
)
INSERT = (
    "INSERT INTO t SELECT g, g %% 1000, 'name ' || g, 'user' || g || '@example.com', g * 1.25, g / 7.0,"
    " g %% 2 = 0, '2026-11-26 01:00:00+00'::timestamptz + g * interval '1 s', '2026-11-26'::date + (g %% 365)::int,"
    " jsonb_build_object('k', g, 'tag', 'x') FROM generate_series(%s::bigint, %s::bigint) g"
)
ROUNDS = 5


def _peek(
    dsn: str, n: int
) -> tuple[list[tuple[int, bytes]], list[tuple[int, bytes]], dict[tuple[int, int], str]]:
    """The wal2json and pgoutput messages of N inserts then N updates (and the type names)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)
        conn.execute("CREATE PUBLICATION pub FOR TABLE t")
        conn.execute("SELECT pg_create_logical_replication_slot('w', 'wal2json')")
        conn.execute("SELECT pg_create_logical_replication_slot('p', 'pgoutput')")
        for lo in range(1, n + 1, 100):
            conn.execute(INSERT, (lo, min(lo + 99, n)))
        for lo in range(1, n + 1, 100):
            conn.execute("UPDATE t SET n = n + 1 WHERE id BETWEEN %s AND %s", (lo, lo + 99))
        conn.execute("SELECT pg_logical_emit_message(false, 'cdc_heartbeat', 'end')")
        opts = [x for kv in replication_options([("public", "t")]).items() for x in kv]
        args = ", ".join(["%s"] * len(opts))
        w = conn.execute(
            f"SELECT lsn - '0/0'::pg_lsn, data FROM pg_logical_slot_peek_changes('w', NULL, NULL, {args})",
            opts,
        ).fetchall()
        p = conn.execute(
            "SELECT lsn - '0/0'::pg_lsn, data FROM pg_logical_slot_peek_binary_changes('p', NULL, NULL,"
            " 'proto_version', '2', 'publication_names', 'pub', 'messages', 'true')"
        ).fetchall()
        types = dict(
            ((int(oid), int(typmod)), str(name))
            for oid, typmod, name in conn.execute(
                "SELECT atttypid, atttypmod, format_type(atttypid, atttypmod) FROM pg_attribute"
                " WHERE attrelid = 't'::regclass AND attnum > 0"
            ).fetchall()
        )
    return (
        [(int(lsn), data.encode()) for lsn, data in w],
        [(int(lsn), bytes(data)) for lsn, data in p],
        types,
    )


def _split(
    msgs: list[tuple[int, bytes]], first_update: Callable[[bytes], bool]
) -> tuple[list[Any], list[Any]]:
    i = next(i for i, (_, d) in enumerate(msgs) if first_update(d))
    while msgs[i - 1][1][:1] not in (b"C", b"{"):  # back to the start of its transaction
        i -= 1
    return msgs[:i], msgs[i:]


def _time(decoder: Decoder, msgs: list[tuple[int, bytes]], convert: bool) -> float:
    """CPU seconds to read ``msgs`` as the reader's loop does: through the decoder's ``source``,
    then ``decode``, then (``convert``) each column's converter."""
    raws = iter([RawMessage(data, lsn) for lsn, data in msgs])
    read = decoder.source(lambda: next(raws, None))
    decode = decoder.decode
    conv: dict[str, Any] = {}
    t0 = time.process_time()
    while (raw := read()) is not None:
        m = decode(raw.payload, raw.data_start)
        if convert and m is not None and m.columns:
            for c in m.columns:
                f = conv.get(c.name, 0)
                if f == 0:
                    f = conv[c.name] = decoder.converter_for(c.type)
                v = c.value
                _ = v if f is None or v is None else f(v)
    return time.process_time() - t0


def _streamed_cpu(dsn: str, slot: str, decoder: Decoder) -> tuple[float, float]:
    """Stream the whole slot as the reader does (psycopg2, the reader's session options): CPU
    seconds of the walsender (``/proc``) and of this process (read, decode, converters) until the
    workload's end message."""
    conn = connect_replication(dsn, options=SESSION_OPTIONS, application_name="cdc-bench")
    try:
        cur = conn.cursor()
        cur.start_replication(
            slot_name=slot, decode=False, options=decoder.replication_options([("public", "t")])
        )
        with psycopg.connect(dsn) as c:
            row = c.execute(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            ).fetchone()
        assert row is not None
        pid = int(row[0])
        walsender, reader = cpu_s(pid), time.process_time()
        read = decoder.source(cur.read_message)
        conv: dict[str, Any] = {}
        while True:
            raw = read()
            if raw is None:
                select.select([conn], [], [], 0.5)
                continue
            m = decoder.decode(raw.payload, raw.data_start)
            if m is None:
                continue
            if m.action == "M":
                break
            for c in m.columns or ():
                f = conv.get(c.name, 0)
                if f == 0:
                    f = conv[c.name] = decoder.converter_for(c.type)
                if f is not None and c.value is not None:
                    f(c.value)
        return cpu_s(pid) - walsender, time.process_time() - reader
    finally:
        conn.close()


def _stream_rows(dsn: str, n: int, types: dict[tuple[int, int], str]) -> list[str]:
    rows = []
    for slot, decoder in (("w", WAL2JSON), ("p", PgOutput(lambda o, t: types[(o, t)], "pub", 150000))):
        ws, rs = _streamed_cpu(dsn, slot, decoder)
        per = 2 * n / 1e6
        say(f"{decoder.plugin}: walsender {ws / per:.2f} µs/change, reader {rs / per:.2f} µs/change")
        rows.append(f"| {decoder.plugin} | {ws / per:.2f} | {rs / per:.2f} | {rs / ws:.2f} |")
    return rows


def run(quick: bool) -> str:
    n = 2_000 if quick else 20_000
    with tempfile.TemporaryDirectory(prefix="cdc-bench-dec-") as base:
        pg = start_cluster(Path(base))
        try:
            db = pg.create_database()
            w, p, types = _peek(pg.dsn(db), n)
            streamed = _stream_rows(pg.dsn(db), n, types)
        finally:
            pg.stop("immediate")
    say(f"{len(w)} wal2json and {len(p)} pgoutput messages for {n} inserts and {n} updates")
    w_ins, w_upd = _split(w, lambda d: b'"action":"U"' in d)
    p_ins, p_upd = _split(p, lambda d: d[:1] == b"U")
    relation = next(d for _, d in p if d[:1] == b"R")
    rows = []
    for label, convert in (("decode", False), ("decode + converters", True)):
        for what, wm, pm in (("insert", w_ins, p_ins), ("update", w_upd, p_upd)):
            wt, pt = [], []
            for _ in range(ROUNDS):
                wt.append(_time(WAL2JSON, wm, convert))
                dec = PgOutput(lambda oid, typmod: types[(oid, typmod)], "pub", 150000)
                dec.decode(relation, 0)  # sent once, before the first insert
                pt.append(_time(dec, pm, convert))
            wu, pu = statistics.median(wt) / n * 1e6, statistics.median(pt) / n * 1e6
            say(f"{label:20} {what}: wal2json {wu:.2f} µs/change, pgoutput {pu:.2f} µs/change")
            rows.append(f"| {label} | {what} | {wu:.2f} | {pu:.2f} | {pu / wu:.2f} |")
    return "\n".join(
        [
            "# Decoding cost per change: pgoutput against wal2json",
            "",
            __doc__.strip().split("\n\n", 1)[1] if __doc__ else "",
            "",
            f"{n} changes of each kind; load average {loadavg()}.",
            "",
            "| work | change | wal2json µs/change | pgoutput µs/change | pgoutput / wal2json |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "Streamed through a replication connection (the same changes, both slots from the start):"
            " CPU per change of the walsender and of this process (read, decode, converters).",
            "",
            "| decoder | walsender µs/change | reader µs/change | reader / walsender |",
            "|---|---|---|---|",
            *streamed,
            "",
        ]
    )
