"""Read tables under an exported snapshot with ``COPY (SELECT ...) TO STDOUT`` (text format) and
append ``op=r`` events. See :mod:`snapshot` for the guarantees.

Two ways to read a table, both giving the bytes the stream gives for the same row:

* **JSON built by Postgres** (every column of a type in :data:`SQL_KINDS`): the ``SELECT`` turns each
  column into its JSON value text (:func:`sql_json_value`: ints as they are, numeric as a string with
  every digit or null for NaN/Infinity, bool as ``true``/``false``, bytea as quoted hex, timestamps,
  dates, uuids... as their quoted text output, text/json/jsonb and every other type through
  ``to_json(col::text)``, which escapes exactly as orjson does), NULL as ``null`` (``COPY ... NULL
  'null'``). Python only undoes COPY's backslash doubling and fills a byte template per row: the key
  (``{"id":42}``, :func:`cdc.events.encode_key`'s bytes) and the whole ``op=r`` value. Postgres does
  the encoding on its own core.
* **Encoded in Python** (a table with a float or array column, whose JSON Postgres writes differently
  from orjson): rows are split on newlines and fields on tabs (a tab or newline inside a value is
  always escaped), ``\\N`` is NULL, backslash escapes are undone only in fields that contain a
  backslash, and fields are encoded by column type (:func:`cdc.reader.wal2json.text_converter_for`).

Parallelism: one table per worker thread, each worker its own connection importing the snapshot
(tables are not split into key ranges).
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import orjson
import psycopg
from psycopg import sql

from cdc.errors import SourceError
from cdc.logstore import LogStore, Record
from cdc.reader.envelope import TableCodec
from cdc.reader.replication import SESSION_OPTIONS, Batch
from cdc.reader.wal2json import type_kind
from cdc.registry import Alignment, Column, TableReg
from snapshot import ExportedSnapshot, Progress, TableSnapshot

BATCH_ROWS = 5000

#: column kinds (:func:`cdc.reader.wal2json.type_kind`) whose JSON value Postgres builds in the
#: snapshot's SELECT; floats and arrays are encoded in Python (Postgres' JSON differs from orjson's)
SQL_KINDS = frozenset({"int", "numeric", "bool", "bytea", "json", "text"})
#: types whose text output never holds a character JSON escapes: quoted as they are
_PLAIN_TEXT_TYPES = frozenset(
    {
        "timestamp with time zone",
        "timestamp without time zone",
        "date",
        "time with time zone",
        "time without time zone",
        "uuid",
        "interval",
    }
)
#: types whose cast to text is not their text output: JSON-quoted by ``to_json(col)`` instead
_OUTPUT_TEXT_TYPES = frozenset({"character", "char", "bpchar", "inet", "cidr"})

_COLUMNS = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), NOT a.attnotnull
FROM pg_attribute a
WHERE a.attrelid = (SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE n.nspname = %(schema)s AND c.relname = %(table)s)
  AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""
_ESTIMATE = """
SELECT GREATEST(c.reltuples, 0)::int8 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(table)s
"""

_UNESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def _unescape_sub(m: re.Match[str]) -> str:
    c = m.group(1)
    return _ESCAPES.get(c, c)


def unescape(field: str) -> str | None:
    """One COPY text field: ``\\N`` is NULL, backslash escapes undone."""
    if field == "\\N":
        return None
    return _UNESCAPE.sub(_unescape_sub, field)


def copy_rows(chunks: Iterator[Any]) -> Iterator[list[Any]]:
    """Split COPY text output (chunks of bytes, not aligned to rows) into lists of field values
    (``None`` for NULL)."""
    rest = b""
    for chunk in chunks:
        buf = rest + bytes(chunk) if rest else bytes(chunk)
        cut = buf.rfind(b"\n")
        if cut < 0:
            rest = buf
            continue
        rest = buf[cut + 1 :]
        for line in buf[:cut].decode().split("\n"):
            fields: list[Any] = line.split("\t")
            if "\\" in line:
                fields = [unescape(f) if "\\" in f else f for f in fields]
            yield fields
    if rest:
        raise SourceError("COPY output ended in the middle of a row", fix="retry the snapshot")


def _base_type(pg_type: str) -> str:
    """``timestamp(3) with time zone`` -> ``timestamp with time zone``."""
    t = pg_type.strip().lower()
    if "(" in t:
        head, _, rest = t.partition("(")
        t = (head.rstrip() + " " + rest.partition(")")[2].lstrip()).strip()
    return t


def sql_json_value(name: str, pg_type: str, nullable: bool) -> tuple[sql.Composable, bool] | None:
    """The SELECT expression giving column ``name``'s JSON value text as the stream encodes it (NULL
    stays NULL: COPY writes it as ``null``), and whether the template must put quotes around it;
    None when Python must encode the column (floats, arrays)."""
    kind = type_kind(pg_type)
    col = sql.Identifier(name)
    if kind == "int":
        return col, False
    if kind == "numeric":
        text = sql.SQL("NULLIF(NULLIF(NULLIF({}::text, 'NaN'), 'Infinity'), '-Infinity')").format(col)
        return sql.SQL("'\"' || {} || '\"'").format(text), False
    if kind == "bool":
        return sql.SQL("{}::text").format(col), False
    if kind == "bytea":
        hexed = sql.SQL("encode({}, 'hex')").format(col)
        if nullable:
            return sql.SQL("'\"' || {} || '\"'").format(hexed), False
        return hexed, True
    if kind == "text" and _base_type(pg_type) in _PLAIN_TEXT_TYPES:
        if nullable:
            return sql.SQL("'\"' || {}::text || '\"'").format(col), False
        return sql.SQL("{}::text").format(col), True
    if kind == "text" and _base_type(pg_type) in _OUTPUT_TEXT_TYPES:
        # their cast to text differs from their output (char(n) drops its padding, inet shows the
        # netmask); to_json() of these calls the output function, as wal2json does
        return sql.SQL("to_json({})").format(col), False
    if kind in ("text", "json"):
        return sql.SQL("to_json({}::text)").format(col), False
    return None


def json_copy_query(schema: str, table: str, exprs: Sequence[sql.Composable]) -> sql.Composed:
    """The snapshot's ``COPY`` of a table whose every value's JSON Postgres builds (``exprs`` from
    :func:`sql_json_value`, in column order); NULL is written as ``null``."""
    return sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT WITH (NULL 'null')").format(
        sql.SQL(", ").join(exprs), sql.Identifier(schema, table)
    )


def json_exprs(conn: psycopg.Connection[Any], schema: str, table: str) -> list[sql.Composable] | None:
    """:func:`sql_json_value` of every column of the table, or None when Python must encode one."""
    exprs = []
    for name, pg_type, nullable in conn.execute(_COLUMNS, {"schema": schema, "table": table}):
        e = sql_json_value(str(name), str(pg_type), bool(nullable))
        if e is None:
            return None
        exprs.append(e[0])
    return exprs


def _template(names: Sequence[str], quoted: Sequence[bool]) -> bytes:
    """A ``%b`` template of a JSON object whose members are ``names`` (orjson's bytes: no spaces)."""
    parts = []
    for name, q in zip(names, quoted, strict=True):
        slot = b'"%b"' if q else b"%b"
        parts.append(orjson.dumps(name).replace(b"%", b"%%") + b":" + slot)
    return b"{" + b",".join(parts) + b"}"


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
) -> TableSnapshot:
    """Read one table on ``conn`` (which imported ``snap``) and append its rows to ``store``
    (a writer thread appends batch n while batch n+1 is parsed; ``store_lock`` serialises the
    store between threads). Returns once every row is durable."""
    params = {"schema": reg.schema, "table": reg.table}
    cols = tuple(Column(str(n), str(t), bool(nullable)) for n, t, nullable in conn.execute(_COLUMNS, params))
    if not cols:
        raise SourceError(
            f"table {reg.qualified} does not exist at the source (any more)",
            fix=f"remove its registration with `cdc tables remove {reg.qualified}`, or re-create it",
            table=reg.qualified,
        )
    row = conn.execute(_ESTIMATE, params).fetchone()
    estimate = int(row[0]) if row else 0
    codec = TableCodec(replace(reg, columns=cols), prefix=prefix, db=db, partitions=partitions)
    names = codec.included
    missing = [k for k in codec.key if k not in names]
    if missing:
        raise SourceError(
            f"key column(s) {missing} of {reg.qualified} are not in the table (or are excluded)",
            fix=f"register {reg.qualified} again with a key of existing, not excluded columns",
            table=reg.qualified,
        )
    by_name = {c.name: c for c in cols}
    exprs = [sql_json_value(n, by_name[n].type, by_name[n].nullable) for n in names]
    if all(e is not None for e in exprs):
        return _read_table_sql(
            conn,
            snap,
            reg,
            cols,
            codec,
            [e for e in exprs if e is not None],
            store=store,
            store_lock=store_lock,
            progress=progress,
            ts_ms=ts_ms,
            estimate=estimate,
        )
    convs: list[tuple[int, Callable[[Any], Any]]] = []
    for i, n in enumerate(names):
        conv = codec.text_converters[n]
        if conv is not None:
            convs.append((i, conv))
    src = codec.snapshot_source(snap.consistent_lsn, ts_ms, last=False)
    src_last = codec.snapshot_source(snap.consistent_lsn, ts_ms, last=True)
    topic = codec.topic
    query = sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT").format(
        sql.SQL(", ").join(sql.Identifier(n) for n in names), sql.Identifier(reg.schema, reg.table)
    )
    progress.start(reg.qualified, estimate)
    now = str(int(time.time() * 1000)).encode()
    record = codec.snapshot_record
    batch = Batch(store, store_lock)
    try:
        rows, reported, last = _copy_table(
            conn, query, convs, names, record, src, batch, topic, progress, reg.qualified, now
        )
        if last is not None:
            batch.add(topic, [record(last, src_last, now)])
            rows += 1
        batch.flush()
    finally:
        batch.close()
    progress.advance(reg.qualified, rows - reported)
    with store_lock:
        end = store.end_offsets(topic)
    conn.execute("COMMIT")
    progress.finish(reg.qualified, rows)
    return TableSnapshot(
        reg=reg, columns=cols, rows=rows, alignment=Alignment(snap.consistent_lsn, dict(end))
    )


def _read_table_sql(
    conn: psycopg.Connection[Any],
    snap: ExportedSnapshot,
    reg: TableReg,
    cols: tuple[Column, ...],
    codec: TableCodec,
    exprs: list[tuple[sql.Composable, bool]],
    *,
    store: LogStore,
    store_lock: threading.Lock,
    progress: Progress,
    ts_ms: int,
    estimate: int,
) -> TableSnapshot:
    """:func:`read_table` with every value's JSON built by Postgres (see the module docstring)."""
    names = codec.included
    quoted = [q for _, q in exprs]
    after_t = _template(names, quoted)
    key_idx = [names.index(k) for k in codec.key]
    key_t = _template(list(codec.key), [quoted[i] for i in key_idx])
    now = str(int(time.time() * 1000)).encode()

    def value_template(last: bool) -> bytes:
        src = codec.snapshot_source(snap.consistent_lsn, ts_ms, last=last).replace(b"%", b"%%")
        return (
            b'{"before":null,"after":'
            + after_t
            + b',"source":'
            + src
            + b',"op":"r","ts_ms":'
            + now
            + b',"unavailable":[]}'
        )

    value_t, last_t = value_template(False), value_template(True)
    query = json_copy_query(reg.schema, reg.table, [e for e, _ in exprs])
    topic = codec.topic
    table = reg.qualified
    progress.start(table, estimate)
    single = key_idx[0] if len(key_idx) == 1 else -1
    batch = Batch(store, store_lock)
    rows = reported = 0
    try:
        pending: list[Record] = []
        fields: tuple[bytes, ...] | None = None
        lines: list[bytes] = []
        with conn.cursor().copy(query) as copy:
            read = copy.read
            more = True
            while more:
                data = read()
                if data:
                    lines.append(bytes(data))
                    if len(lines) < 1000:
                        continue
                else:
                    more = False
                if not lines:
                    break
                # 1000 rows at a time: COPY doubles every backslash (JSON escapes are the only ones)
                chunk = b"".join(lines)
                lines = []
                if b"\\" in chunk:
                    chunk = chunk.replace(b"\\\\", b"\\")
                add = pending.append
                for line in chunk[:-1].split(b"\n"):
                    fields = tuple(line.split(b"\t"))
                    key = key_t % (fields[single] if single >= 0 else tuple(fields[i] for i in key_idx))
                    add(Record(key, value_t % fields))
                if len(pending) > BATCH_ROWS:
                    last = pending.pop()  # the table's last row is written with snapshot "last"
                    batch.add(topic, pending)
                    batch.submit(None)
                    rows += len(pending)
                    progress.advance(table, len(pending))
                    reported += len(pending)
                    pending = [last]
        if fields is not None:
            pending[-1] = Record(pending[-1].key, last_t % fields)
            batch.add(topic, pending)
            rows += len(pending)
        batch.flush()
    finally:
        batch.close()
    progress.advance(table, rows - reported)
    with store_lock:
        end = store.end_offsets(topic)
    conn.execute("COMMIT")
    progress.finish(table, rows)
    return TableSnapshot(
        reg=reg, columns=cols, rows=rows, alignment=Alignment(snap.consistent_lsn, dict(end))
    )


def _copy_table(
    conn: psycopg.Connection[Any],
    query: sql.Composed,
    convs: list[tuple[int, Callable[[Any], Any]]],
    names: list[str],
    record: Callable[[dict[str, Any], bytes, bytes], Record],
    src: bytes,
    batch: Batch,
    topic: str,
    progress: Progress,
    table: str,
    now: bytes,
) -> tuple[int, int, dict[str, Any] | None]:
    """COPY the rows into ``batch``, all but the last row, which is returned so the caller can
    mark it ``last``. Returns (rows added, rows reported to ``progress``, last row)."""
    pending: list[Record] = []
    previous: dict[str, Any] | None = None
    rows = reported = 0
    with conn.cursor().copy(query) as copy:
        for fields in copy_rows(iter(copy)):
            for i, f in convs:
                v = fields[i]
                if v is not None:
                    fields[i] = f(v)
            after = dict(zip(names, fields, strict=True))
            if previous is not None:
                pending.append(record(previous, src, now))
                if len(pending) >= BATCH_ROWS:
                    batch.add(topic, pending)
                    batch.submit(None)
                    rows += len(pending)
                    progress.advance(table, len(pending))
                    reported += len(pending)
                    pending = []
            previous = after
    if pending:
        batch.add(topic, pending)
        rows += len(pending)
    return rows, reported, previous


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
) -> list[TableSnapshot]:
    """Snapshot ``regs`` under ``snap`` with up to ``workers`` threads (each its own connection
    importing the snapshot). Returns one TableSnapshot per table, in the order of ``regs``. The
    alignment's end offsets are the topic's end offsets right after the table's last row."""
    lock = store_lock or threading.Lock()
    ts_ms = int(time.time() * 1000)

    todo: queue.Queue[tuple[int, TableReg]] = queue.Queue()
    for i, reg in enumerate(regs):
        todo.put((i, reg))
    results: dict[int, TableSnapshot] = {}

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
                )
        finally:
            if conn is not None:
                conn.close()

    n = max(1, min(workers, len(regs)))
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="cdc-snapshot") as pool:
        futures = [pool.submit(worker) for _ in range(n)]
        for fut in futures:
            fut.result()
    return [results[i] for i in range(len(regs))]
