"""Read tables under an exported snapshot with a plain ``COPY ... TO STDOUT (FORMAT csv)`` and
append ``op=r`` events. See :mod:`snapshot` for the guarantees.

Postgres does what any COPY does (its output functions); the events are built here, vectorised,
by :mod:`snapshot.encode` (Arrow's CSV reader and compute kernels), with the stream's encoding.
Parallelism: one table per worker thread, each worker its own connection importing the snapshot.

The earlier COPY that built each value's JSON in Postgres is kept only as a benchmark peer
(``bench/sql_json.py``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from cdc.codec.compiled import native_module
from cdc.codec.envelope import TableCodec
from cdc.codec.fastpath import copy_plan
from cdc.connect import SESSION_OPTIONS
from cdc.errors import SourceError
from cdc.logstore import LogStore, Record
from cdc.logstore.batch import Batch
from cdc.logstore.images import Images
from cdc.registry import Alignment, TableReg
from snapshot import ExportedSnapshot, Progress, TableSnapshot, snapshot_error
from snapshot.encode import RowEncoder, copy_query, encoder_for, read_csv_batches, text_copy_query
from snapshot.table_info import row_estimate, table_columns


def connect_snapshot(dsn: str, snap: ExportedSnapshot) -> psycopg.Connection[Any]:
    """A psycopg 3 connection inside a REPEATABLE READ transaction that imported ``snap``."""
    conn = psycopg.connect(dsn, autocommit=True, options=SESSION_OPTIONS, application_name="cdc-snapshot")
    try:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snap.name)))
    except BaseException:
        conn.close()
        raise
    return conn


def read_table(
    conn: psycopg.Connection[Any],
    snap: ExportedSnapshot,
    reg: TableReg,
    *,
    prefix: str,
    db: str,
    partitions: int,
    store: LogStore,
    store_lock: threading.Lock,
    progress: Progress,
    ts_ms: int,
    images: Images | None = None,
) -> TableSnapshot:
    """Read one table on ``conn`` (which imported ``snap``) with a plain COPY and append its rows to
    ``store`` (a writer thread appends batch n while batch n+1 is encoded; ``store_lock`` serialises
    the store between threads). Returns once every row is durable, and with it each row's image
    (``images``, :mod:`cdc.logstore.images`)."""
    cols = table_columns(conn, reg.schema, reg.table)
    if not cols:
        raise SourceError(
            f"table {reg.qualified} does not exist at the source (any more)",
            fix=f"remove its registration with `cdc tables remove {reg.qualified}`, or re-create it",
            table=reg.qualified,
        )
    estimate = row_estimate(conn, reg.schema, reg.table)
    codec = TableCodec(replace(reg, columns=cols), prefix=prefix, db=db, partitions=partitions)
    encoder = encoder_for(codec, cols)
    names = encoder.names
    now = str(int(time.time() * 1000)).encode()
    head = b'{"before":null,"after":'

    def tail(last: bool) -> bytes:
        src = codec.snapshot_source(snap.consistent_lsn, ts_ms, last=last)
        return b',"source":' + src + b',"op":"r","ts_ms":' + now + b',"unavailable":[]}'

    tail_row, tail_last = tail(False), tail(True)
    topic = codec.topic
    table = reg.qualified
    progress.start(table, estimate)
    staging = None if images is None or not codec.imaged else images.staging()
    batch = Batch(store, store_lock, staging=staging)
    rows = 0
    held: Record | None = None  # the newest row: written last, marked "last"
    native = native_module()
    try:
        if native is not None:
            batches = _native_batches(conn, native, codec, names, head, tail_row, staging is not None)
        else:
            batches = _arrow_batches(conn, encoder, codec, head, tail_row, staging is not None)
        for records, blobs in batches:
            if not records:
                continue
            if staging is not None:
                for k, b in blobs:
                    staging.put(topic, k, b)
            if held is not None:
                records.insert(0, held)
            held = records.pop()
            if records:
                batch.add(topic, records)
                batch.submit(None)
                rows += len(records)
                progress.advance(table, len(records))
        if held is not None:
            assert held.value is not None and held.value.endswith(tail_row)
            batch.add(topic, [Record(held.key, held.value[: -len(tail_row)] + tail_last)])
            rows += 1
            progress.advance(table, 1)
        batch.flush()
    finally:
        batch.close()
    with store_lock:
        end = store.end_offsets(topic)
    conn.execute("COMMIT")
    progress.finish(table, rows)
    return TableSnapshot(
        reg=reg, columns=cols, rows=rows, alignment=Alignment(snap.consistent_lsn, dict(end))
    )


def _arrow_batches(
    conn: psycopg.Connection[Any],
    encoder: RowEncoder,
    codec: TableCodec,
    head: bytes,
    tail: bytes,
    want_images: bool,
) -> Iterator[tuple[list[Record], list[tuple[bytes, bytes]]]]:
    """The table's rows as records and the images to keep, through Arrow (:mod:`snapshot.encode`):
    the path when the compiled one (:func:`_native_batches`) is not there."""
    head_s, tail_s, sep = (pa.scalar(x, pa.binary()) for x in (head, tail, b""))
    names, table = encoder.names, codec.reg.qualified
    with conn.cursor().copy(copy_query(codec.reg.schema, codec.reg.table, names)) as copy:
        for rb in read_csv_batches(copy, names, table=table):
            if rb.num_rows == 0:
                continue
            keys, afters, blobs = encoder.encode_rows(rb)
            values = pc.binary_join_element_wise(head_s, afters, tail_s, sep).to_pylist()
            key_list = keys.to_pylist()
            images = []
            if want_images and blobs is not None:
                images = [(k, b) for k, b in zip(key_list, blobs.to_pylist(), strict=True) if b is not None]
            yield [Record(k, v) for k, v in zip(key_list, values, strict=True)], images


#: bytes of COPY output handed to the compiled encoder at once (whole rows)
NATIVE_CHUNK = 1 << 20


def _native_batches(
    conn: psycopg.Connection[Any],
    native: Any,
    codec: TableCodec,
    names: list[str],
    head: bytes,
    tail: bytes,
    want_images: bool,
) -> Iterator[tuple[list[Record], list[tuple[bytes, bytes]]]]:
    """The table's rows as records and the images to keep, through the compiled encoder
    (:class:`cdc.codec._native.CopyRows`, the stream's per-value encoding): a plain ``COPY ... TO
    STDOUT`` in text format, whose rows end at each raw newline (a newline in a value is escaped)."""
    rows = native.CopyRows(copy_plan(native, codec, names), head, tail, Record, want_images)
    query = text_copy_query(codec.reg.schema, codec.reg.table, names)
    table = codec.reg.qualified
    parts: list[bytes] = []
    size = 0

    def encode(buf: bytes) -> tuple[list[Record], list[tuple[bytes, bytes]]]:
        try:
            out: tuple[list[Record], list[tuple[bytes, bytes]]] = rows.rows(buf)
        except ValueError as exc:
            column = None
            if str(exc).startswith("column "):
                column = names[int(str(exc).split()[1].rstrip(":"))]
            raise snapshot_error(table, column, exc.__cause__ or exc) from exc
        return out

    with conn.cursor().copy(query) as copy:
        for data in copy:
            parts.append(bytes(data))
            size += len(data)
            if size < NATIVE_CHUNK:
                continue
            buf = b"".join(parts)
            cut = buf.rfind(b"\n") + 1
            parts, size = ([buf[cut:]] if cut < len(buf) else []), len(buf) - cut
            if cut:
                yield encode(buf[:cut] if cut < len(buf) else buf)
    if size:
        buf = b"".join(parts)
        if not buf.endswith(b"\n"):
            raise SourceError("COPY output ended in the middle of a row", fix="retry the snapshot")
        yield encode(buf)


def read_tables(
    dsn: str,
    snap: ExportedSnapshot,
    regs: Sequence[TableReg],
    store: LogStore,
    *,
    prefix: str,
    db: str,
    partitions: int,
    progress: Progress,
    workers: int = 2,
    store_lock: threading.Lock | None = None,
    images: Images | None = None,
) -> list[TableSnapshot]:
    """Snapshot ``regs`` under ``snap`` with up to ``workers`` threads (each its own connection
    importing the snapshot). Returns one TableSnapshot per table, in the order of ``regs``. The
    alignment's end offsets are the topic's end offsets right after the table's last row.

    A table whose snapshot fails does not stop the others: once every table was tried, the first
    failure is raised as a :class:`snapshot.SnapshotError` (naming the table, and the column when a
    value could not be encoded; the original error is its ``__cause__``) whose ``done`` holds the
    tables that completed, for the caller to record."""
    lock = store_lock or threading.Lock()
    ts_ms = int(time.time() * 1000)

    todo: queue.Queue[tuple[int, TableReg]] = queue.Queue()
    for i, reg in enumerate(regs):
        todo.put((i, reg))
    results: dict[int, TableSnapshot] = {}
    failures: dict[int, Exception] = {}

    def worker() -> None:
        conn: psycopg.Connection[Any] | None = None
        try:
            while True:
                try:
                    i, reg = todo.get_nowait()
                except queue.Empty:
                    return
                if conn is None:
                    conn = connect_snapshot(dsn, snap)
                else:
                    # one transaction per table; later tables need the snapshot again
                    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                    conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snap.name)))
                try:
                    results[i] = read_table(
                        conn,
                        snap,
                        reg,
                        prefix=prefix,
                        db=db,
                        partitions=partitions,
                        store=store,
                        store_lock=lock,
                        progress=progress,
                        ts_ms=ts_ms,
                        images=images,
                    )
                except Exception as exc:  # the others go on; raised below with what completed
                    failures[i] = exc
                    conn.close()  # in the middle of a COPY: a new connection for the next table
                    conn = None
        finally:
            if conn is not None:
                conn.close()

    n = max(1, min(workers, len(regs)))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="cdc-snapshot") as pool:
        futures = [pool.submit(worker) for _ in range(n)]
        for fut in futures:
            fut.result()
    if failures:
        i = min(failures)
        err = snapshot_error(regs[i].qualified, None, failures[i], dsn)
        err.done = [results[j] for j in sorted(results)]
        if err is failures[i]:
            raise err
        raise err from failures[i]
    return [results[i] for i in range(len(regs))]
