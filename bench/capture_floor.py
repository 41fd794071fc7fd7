"""The floors under the reader's CPU per change (issue #34): what the stream costs before cdc does
anything with it, beside what ``cdc run --once`` spends, the same workload and session.

``python -m bench.capture_floor [--changes N] [--decoders pgoutput,wal2json]``: one workload of N
changes (default 300,000: 2/3 inserts in 10 transactions, 1/3 single-row updates 1,000 per
transaction, :func:`bench.capture._workload`), then per decoder, each from a slot of its own with
the options the reader sends:

* ``pg_recvlogical`` to /dev/null: libpq's floor (C, one ``PQgetCopyData`` per message);
* **(a) psycopg2 alone**: a process that only ``read_message``\\ s (the reader's Python reference,
  ``decode=False``, the reader's connection options), and one whose ``consume_stream`` callback
  does nothing: its CPU per message and per change, timed around the loop (start-up excluded);
* **(a') the libpq reader alone** (``cdc.codec._native.CopyStream``, what the reader reads with):
  the messages read and dropped in C (``skim``: the floor of its ``pump``, which makes no object
  per row change), and called once per message (a ``RawMessage`` each, as the messages the compiled
  path does not take reach Python); for (a) and (a') also per message: user / kernel CPU and the
  messages found per wake-up (a reader faster than its walsender wakes up for a few at a time: then
  the kernel's share, which ``pg_recvlogical`` pays too, is most of the floor); and dropped in C
  with the reader's wait (a stream drained after messages read again ``GATHER_S`` later, not at
  its next message: :data:`cdc.reader.replication.GATHER_S`), the read as the reader does it;
* ``cdc run --once`` into the durable embedded store, net of the same process with nothing to
  stream (as ``bench capture`` counts it);
* in this process, over the messages (a) read (their payloads kept): **(c) the compiled encode
  alone** (``Encoder.change``: message bytes to key and value bytes), the compiled path as the
  stream loop calls it (``Changes``: the encode, the builder's state, the ``Record``) and through
  ``Changes.pump`` (what the stream loop runs: runs of changes drained into the batch's compiled
  ``Records``, no object per change), the Python path (decode, ``EventBuilder.change``), and **(b)
  the append** of those records, in the batch's form (:func:`cdc.logstore.batch.records_form`), into
  a durable embedded store (``append_many`` per batch of ``batch_max_events``, compaction off), CPU
  per record;
* for wal2json, whose compiled path parses and encodes in one call, the stages apart (``(w)``):
  every byte of the message touched in C (what any parser must at least do), the compiled JSON
  parse alone, the encode alone, the two together, and ``orjson.loads`` and the Python path's
  msgspec parse of the same messages.

Prints each figure, then the reader's cost split into those floors and what is above them, and the
load average (the machine is shared: read the figures of one run together).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import pickle
import resource
import select
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench._common import discard_cluster, loadavg, say
from bench.capture import (
    PGOUTPUT_OPTS,
    WAL2JSON_OPTS,
    _cdc_once,
    _cdc_state,
    _consume,
    _create_slots,
    _drop_slots,
    _pg_recvlogical,
    _setup_source,
    _wal_lsn,
    _workload,
)
from cdc.codec.compiled import native_module
from cdc.devcluster import start_cluster

BATCH = 5_000  # the reader's default batch_max_events


def _options(decoder: str) -> dict[str, str]:
    opts = WAL2JSON_OPTS if decoder == "wal2json" else PGOUTPUT_OPTS
    return dict(o.split("=", 1) for o in opts)


class _Raw:
    """A message as ``read_message`` gives it (the attributes the decoders read)."""

    __slots__ = ("data_start", "payload")

    def __init__(self, payload: bytes, data_start: int) -> None:
        self.payload = payload
        self.data_start = data_start


def _consumer(dsn: str, slot: str, decoder: str, endpos: int, mode: str, dump: str) -> None:
    """The child: stream ``slot`` to ``endpos`` with psycopg2 only; prints its JSON summary."""
    from cdc.connect import SESSION_OPTIONS, connect_replication

    conn = connect_replication(dsn, options=SESSION_OPTIONS, application_name="cdc-floor")
    cur = conn.cursor()
    cur.start_replication(slot_name=slot, decode=False, options=_options(decoder), status_interval=10)
    kept: list[tuple[bytes, int]] = []
    keep = kept.append if dump else None
    n = size = 0
    copy: Any = None
    if mode in ("libpq", "libpq_call", "libpq_gather"):
        from cdc.reader.replication import copy_stream

        copy = copy_stream(cur, lambda: cur.send_feedback(force=True))
        if copy is None:
            raise RuntimeError("the libpq reader is not there (CDC_NATIVE=0, or not built)")
    waits = 0
    t0 = time.process_time()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    if mode in ("libpq", "libpq_gather"):
        from cdc.reader.replication import GATHER_S

        fd = cur.fileno()
        gather = mode == "libpq_gather"
        while True:
            k, got, last = copy.skim(1024)
            n += k
            size += got
            if k and last >= endpos:
                break
            if k == 1024:
                continue
            waits += 1
            if k and gather:  # the reader's wait: drained after messages, read again in a moment
                time.sleep(GATHER_S)
            else:
                select.select([fd], [], [], 1.0)
    elif mode in ("libpq_call", "read"):
        read = copy if mode == "libpq_call" else cur.read_message
        fd = cur.fileno()
        while True:
            msg = read()
            if msg is None:
                select.select([fd], [], [], 1.0)
                waits += 1
                continue
            n += 1
            size += len(msg.payload)
            if keep is not None:
                keep((msg.payload, msg.data_start))
            if msg.data_start >= endpos:
                break
    else:
        import psycopg2.extras

        seen = [0]

        def noop(msg: Any) -> None:
            seen[0] += 1
            if msg.data_start >= endpos:
                raise psycopg2.extras.StopReplication

        with contextlib.suppress(psycopg2.extras.StopReplication):
            cur.consume_stream(noop)
        n = seen[0]
    cpu = time.process_time() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    if copy is not None:
        copy.close()
    conn.close()
    if dump:
        with open(dump, "wb") as fh:
            pickle.dump(kept, fh, protocol=pickle.HIGHEST_PROTOCOL)
    summary = {"cpu": cpu, "messages": n, "bytes": size, "waits": waits}
    summary |= {"user": ru1.ru_utime - ru0.ru_utime, "sys": ru1.ru_stime - ru0.ru_stime}
    print(orjson.dumps(summary).decode(), flush=True)


def _stream_floor(
    dsn: str, slot: str, decoder: str, endpos: int, mode: str, dump: Path | None, base: Path
) -> Any:
    cmd = [sys.executable, "-m", "bench.capture_floor", "--consume", slot, "--dsn", dsn]
    cmd += ["--decoder", decoder, "--endpos", str(endpos), "--mode", mode, "--dump", str(dump or "")]
    return _consume(cmd, dsn, slot, dict(os.environ), base)


def _per_message(name: str, summary: dict[str, Any], figures: dict[str, float]) -> None:
    """A standalone reader's CPU per message, split into user and kernel time, and the messages it
    found per wake-up (select): a reader faster than its walsender wakes up for a few messages at a
    time, and the wake-ups (kernel) then weigh as much as the reading."""
    msgs = summary["messages"]
    figures[f"{name}, per message"] = summary["cpu"] / msgs * 1e6
    figures[f"{name}, per message: user / kernel"] = summary["user"] / msgs * 1e6
    figures[f"_{name} kernel"] = summary["sys"] / msgs * 1e6
    if summary.get("waits") is not None:
        figures[f"_{name} per wake-up"] = msgs / max(1, summary["waits"])


def _cpu_per(fn: Callable[[], int]) -> tuple[float, int]:
    """(CPU seconds of ``fn``, what it counted), the best of 3 (the machine is shared)."""
    best, count = float("inf"), 0
    for _ in range(3):
        t0 = time.process_time()
        count = fn()
        best = min(best, time.process_time() - t0)
    return best, count


def _world(dsn: str, decoder: str, base: Path) -> Any:
    """A builder and its codec for ``public.bench``, as the reader sets them up (images staged under
    ``base``, which the bench removes at its end)."""
    from cdc.codec.envelope import EventBuilder, TableCodec
    from cdc.codec.pgoutput import PgOutput
    from cdc.codec.wal2json import DECODER
    from cdc.logstore.images import Images
    from cdc.registry import Column, TableReg

    with psycopg.connect(dsn) as conn:
        cols = conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute "
            "WHERE attrelid = 'bench'::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum"
        ).fetchall()
        version = int(conn.execute("SHOW server_version_num").fetchone()[0])  # type: ignore[index]

    @functools.cache
    def type_name(oid: int, typmod: int) -> str:
        with psycopg.connect(dsn) as c:
            return str(c.execute("SELECT format_type(%s, %s)", [oid, typmod]).fetchone()[0])  # type: ignore[index]

    dec: Any = PgOutput(type_name, "recv_pub", version) if decoder == "pgoutput" else DECODER
    reg = TableReg(
        "public", "bench", "cdc.public.bench", ("id",), columns=tuple(Column(n, t) for n, t in cols)
    )
    codec = TableCodec(reg, prefix="cdc", db="bench", partitions=4, decoder=dec)
    images = Images(Path(tempfile.mkdtemp(prefix="cdc-floor-img-", dir=base)) / "images.sqlite")
    images.follow("cdc.public.bench", 0.0)
    builder = EventBuilder({("public", "bench"): codec}, images=images, staging=images.staging())
    return dec, codec, builder


def _messages(dec: Any, kept: list[tuple[bytes, int]]) -> list[_Raw]:
    """The messages as the stream loop sees them (pgoutput's streamed transactions de-spooled)."""
    it = iter(kept)

    def read() -> _Raw | None:
        nxt = next(it, None)
        return None if nxt is None else _Raw(*nxt)

    source = dec.source(read)
    out = []
    while (m := source()) is not None:
        out.append(m)
    return out


def _in_process(
    dsn: str, decoder: str, kept: list[tuple[bytes, int]], changes: int, base: Path
) -> dict[str, float]:
    """(b) and (c), and the Python path, over the messages kept: CPU µs per change."""
    from cdc.codec.compiled import native_module
    from cdc.codec.fastpath import PYTHON, build_plan, native_changes

    native = native_module()
    out: dict[str, float] = {}
    dec, codec, builder = _world(dsn, decoder, base)
    msgs = _messages(dec, kept)
    if decoder == "pgoutput":
        rows = [m for m in msgs if m.payload[:1] in (b"I", b"U", b"D")]
    else:
        rows = [m for m in msgs if m.payload[:13] in (b'{"action":"I"', b'{"action":"U"', b'{"action":"D"')]

    py_records: list[Any] = []

    def python_path() -> int:
        py_records.clear()
        k = 0
        for m in msgs:
            d = dec.decode(m.payload, m.data_start)
            if d is None:
                continue
            if d.action == "B":
                builder.begin(d)
            elif d.action in ("I", "U", "D"):
                got = builder.change(d)
                if got is not None:
                    py_records.extend(got[1])  # type: ignore[index]
                k += 1
        return k

    cpu, k = _cpu_per(python_path)
    out["python path (decode + EventBuilder.change)"] = cpu / k * 1e6
    fast = native_changes(dec, builder, native=native)
    records: list[Any] = []
    if fast is not None and decoder == "pgoutput":
        first_b = next(m for m in msgs if m.payload[:1] == b"B")
        for m in msgs:  # the Relation message, the transaction's state
            if m.payload[:1] == b"R":
                dec.decode(m.payload, m.data_start)
        builder.begin(dec.decode(first_b.payload, first_b.data_start))
        rel = next(iter(dec.relations.values()))
        plan = build_plan(native, rel, codec)
        enc = native.Encoder()
        head, tx, now = codec.source_head, builder.tx_part, builder.now

        def encode_alone() -> int:
            change = enc.change
            for i, m in enumerate(rows):
                change(m.payload, plan, head, tx, m.data_start, 1, i + 1, now, True)
            return len(rows)

        cpu, k = _cpu_per(encode_alone)
        out["(c) compiled encode alone (Encoder.change)"] = cpu / k * 1e6
    elif fast is not None:  # wal2json: parse and encode are one call, measured apart here
        first_b = next(m for m in msgs if m.payload.startswith(b'{"action":"B"'))
        builder.begin(dec.decode(first_b.payload, first_b.data_start))
        out.update(_wal2json_stages(native, fast, dec, codec, builder, rows))
    if fast is not None:

        def compiled_path() -> int:
            records.clear()
            builder.seq = 0
            for m in rows:
                got = fast(m.payload, m.data_start)
                if got is not PYTHON and got is not None:
                    records.extend(got[1])
            return len(rows)

        cpu, k = _cpu_per(compiled_path)
        out["compiled path as the loop calls it (Changes: encode, builder, Record)"] = cpu / k * 1e6
        out["compiled path through pump (the stream loop's drain into the batch)"] = _pumped(
            fast, builder, rows
        )
    if not records:  # no compiled path: the Python path's records
        records = py_records

    out["(b) durable append into the embedded store (append_many, per record)"] = _append_floor(
        records, codec.topic, base
    )
    out["_records"] = float(len(records))
    return out


def _append_floor(records: list[Any], topic: str, base: Path) -> float:
    """(b): CPU µs per record of appending ``records`` into a durable embedded store, per batch of
    ``batch_max_events``, in the form the reader's batch holds them (:func:`records_form`: the
    compiled ``Records``), compaction off (best of 3)."""
    from cdc.logstore import TopicConfig
    from cdc.logstore.batch import records_form
    from cdc.logstore.embedded import EmbeddedLogStore

    form = records_form()
    batches = [form(records[i : i + BATCH]) for i in range(0, len(records), BATCH)]

    def append() -> int:
        path = Path(tempfile.mkdtemp(prefix="cdc-floor-log-", dir=base))
        store = EmbeddedLogStore(path, writer=True, compaction_interval_s=None)
        try:
            store.create_topic(topic, TopicConfig(partitions=4, compacted=True))
            for chunk in batches:
                store.append_many({topic: chunk})
        finally:
            store.close()
            shutil.rmtree(path, ignore_errors=True)
        return len(records)

    cpu, k = _cpu_per(append)
    return cpu / k * 1e6


def _pumped(fast: Any, builder: Any, rows: list[_Raw]) -> float:
    """CPU µs per change of ``Changes.pump`` draining ``rows`` into a batch, as the stream loop
    calls it (best of 3)."""

    def pumped() -> int:
        it = iter(rows)
        batch = _Batch()
        builder.seq = 0
        fast.pump(lambda: next(it, None), batch, len(rows) * 2 + 1, len(rows))
        if batch.count < len(rows):
            raise RuntimeError(f"pump took {batch.count} of {len(rows)} changes")
        return len(rows)

    cpu, k = _cpu_per(pumped)
    return cpu / k * 1e6


class _Batch:
    """What ``Changes.pump`` fills of a ``cdc.logstore.batch.Batch`` (no writer behind it; each
    topic's records in the compiled ``Records``, which the pump creates)."""

    def __init__(self) -> None:
        self.records: dict[str, Any] = {}
        self.count = 0
        self.started = 0.0


def _wal2json_stages(
    native: Any, fast: Any, dec: Any, codec: Any, builder: Any, rows: list[_Raw]
) -> dict[str, float]:
    """wal2json's per-change path apart (``cdc.codec._native.wal2json_stages``, each stage's loop
    timed in C, best of 3) beside what any reader of the same bytes spends: every byte touched in
    C, ``orjson.loads`` (the message to Python objects), and the Python path's parse (msgspec)."""
    from cdc.codec.fastpath import build_wal2json_plan

    plan = build_wal2json_plan(native, codec)
    payloads = [m.payload for m in rows]
    want_image = builder.staging is not None
    out: dict[str, float] = {}
    stages = (
        ("(w) floor: every byte of the message touched in C (quotes and commas counted)", native.STAGE_SCAN),
        ("(w) compiled JSON parse alone (the message walked into its columns' tokens)", native.STAGE_PARSE),
        ("(w) compiled encode alone (columns mapped, values, envelope, key, value)", native.STAGE_ENCODE),
        ("(w) compiled parse + encode (as one change is taken, no Record)", native.STAGE_BOTH),
    )
    for name, stage in stages:
        best = float("inf")
        for _ in range(3):
            k, cpu = native.wal2json_stages(
                fast, payloads, plan, stage, codec.source_head, builder.tx_part, want_image
            )
            best = min(best, cpu)
        out[name] = best / k * 1e6

    def loads() -> int:
        for p in payloads:
            orjson.loads(p)
        return len(payloads)

    def msgspec_decode() -> int:
        for m in rows:
            dec.decode(m.payload, m.data_start)
        return len(rows)

    cpu, k = _cpu_per(loads)
    out["(w) orjson.loads of the message (to Python objects)"] = cpu / k * 1e6
    cpu, k = _cpu_per(msgspec_decode)
    out["(w) the Python path's parse alone (wal2json.decode: msgspec)"] = cpu / k * 1e6
    return out


def _report(decoder: str, n: int, figures: dict[str, float]) -> None:
    say(f"--- {decoder}: CPU µs per change ({n:,} changes); load {loadavg()}")
    for name, v in figures.items():
        if name.endswith("user / kernel"):
            base = name.removesuffix(", per message: user / kernel")
            wake = figures.get(f"_{base} per wake-up")
            say(
                f"  {name}: {v:.2f} / {figures[f'_{base} kernel']:.2f}"
                + (f" ({wake:.1f} messages a wake-up)" if wake is not None else "")
            )
        elif not name.startswith("_"):
            say(f"  {name}: {v:.2f}")
    reader = figures.get("cdc run --once, net of start-up")
    # the read as the reader does it: the libpq reader with its wait (GATHER_S)
    read = figures.get("(a') libpq reader, dropped in C, the reader's wait (GATHER_S)")
    read = read if read is not None else figures.get("(a') libpq reader, dropped in C (skim)")
    read = read if read is not None else figures.get("(a) psycopg2 read_message alone")
    enc = figures.get("compiled path through pump (the stream loop's drain into the batch)")
    enc = enc if enc is not None else figures.get("python path (decode + EventBuilder.change)")
    app = figures.get("(b) durable append into the embedded store (append_many, per record)", 0.0)
    recs = figures.get("_records", float(n)) / n
    if reader is not None and read is not None and enc is not None:
        floors = read + enc + app * recs
        say(
            f"  reader {reader:.2f} = read {read:.2f} + per-change path {enc:.2f} + append "
            f"{app * recs:.2f} ({recs:.2f} records a change) = {floors:.2f}; above them (the loop, "
            f"batching, the writer thread's hand-off, images): {reader - floors:.2f}"
        )


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench.capture_floor")
    ap.add_argument("--changes", type=int, default=300_000)
    ap.add_argument("--decoders", default="pgoutput,wal2json")
    # the child consumer (internal)
    ap.add_argument("--consume", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dsn", default="", help=argparse.SUPPRESS)
    ap.add_argument("--decoder", default="", help=argparse.SUPPRESS)
    ap.add_argument("--endpos", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="read", help=argparse.SUPPRESS)
    ap.add_argument("--dump", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.consume:
        _consumer(args.dsn, args.consume, args.decoder, args.endpos, args.mode, args.dump)
        return
    updates = args.changes // 3 // 1000 * 1000  # whole transactions of the workload
    inserts = (args.changes - updates) // 10 * 10
    n = inserts + updates
    decoders = args.decoders.split(",")
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-floor-"))
    pg = start_cluster(Path(tempfile.mkdtemp(prefix="cdc-bench-pg-")))
    say(f"load {loadavg()} (the machine is shared)")
    try:
        dsn, idle = _setup_source(pg, base)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE bench")
        labels = []
        for d in decoders:
            labels += [(f"recv_{d}", d), (f"read_{d}", d), (f"stream_{d}", d), (f"cdc_{d}", d)]
            labels += [(f"libpq_{d}", d), (f"libpqcall_{d}", d), (f"libpqgather_{d}", d)]
        _create_slots(dsn, labels)
        _workload(dsn, inserts, updates)
        endpos = _wal_lsn(dsn)
        hi, _, lo = endpos.partition("/")
        end_int = (int(hi, 16) << 32) | int(lo, 16)
        say(f"{n:,} changes written; load {loadavg()}")
        for d in decoders:
            figures: dict[str, float] = {}
            run = _pg_recvlogical(
                dsn, f"recv_{d}", endpos, WAL2JSON_OPTS if d == "wal2json" else PGOUTPUT_OPTS, base
            )
            figures["pg_recvlogical (libpq, to /dev/null), whole process"] = run.cpu / n * 1e6
            figures["walsender (serving pg_recvlogical)"] = run.walsender_cpu / n * 1e6
            dump = base / f"{d}.pickle"
            run = _stream_floor(dsn, f"read_{d}", d, end_int, "read", dump, base)
            msgs = run.summary["messages"]
            figures["(a) psycopg2 read_message alone"] = run.summary["cpu"] / n * 1e6
            _per_message("(a) psycopg2 read_message alone", run.summary, figures)
            say(f"  {d}: {msgs:,} messages, {run.summary['bytes'] / msgs:.0f} B each")
            run = _stream_floor(dsn, f"stream_{d}", d, end_int, "stream", None, base)
            figures["(a) psycopg2 consume_stream, no-op callback"] = run.summary["cpu"] / n * 1e6
            if native_module() is not None:
                run = _stream_floor(dsn, f"libpq_{d}", d, end_int, "libpq", None, base)
                figures["(a') libpq reader, dropped in C (skim)"] = run.summary["cpu"] / n * 1e6
                _per_message("(a') libpq reader, dropped in C (skim)", run.summary, figures)
                run = _stream_floor(dsn, f"libpqcall_{d}", d, end_int, "libpq_call", None, base)
                _per_message("(a') libpq reader, a RawMessage per message", run.summary, figures)
                run = _stream_floor(dsn, f"libpqgather_{d}", d, end_int, "libpq_gather", None, base)
                name = "(a') libpq reader, dropped in C, the reader's wait (GATHER_S)"
                figures[name] = run.summary["cpu"] / n * 1e6
                _per_message(name, run.summary, figures)
            env = _cdc_state(base, dsn, f"cdc_{d}", decoder=d)
            run = _cdc_once(env, dsn)
            if run.summary.get("changes") != n:
                raise RuntimeError(f"cdc_{d} streamed {run.summary.get('changes')} changes, expected {n}")
            figures["cdc run --once, net of start-up"] = (run.cpu - idle[d].cpu) / n * 1e6
            figures["walsender (serving cdc)"] = run.walsender_cpu / n * 1e6
            with open(dump, "rb") as fh:
                kept = pickle.load(fh)
            figures.update(_in_process(dsn, d, kept, n, base))
            _report(d, n, figures)
        _drop_slots(dsn, [label for label, _ in labels])
    finally:
        discard_cluster(pg, base)


if __name__ == "__main__":
    main(sys.argv[1:])
