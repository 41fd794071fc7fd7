"""Chunked snapshots while streaming (DBLog, arXiv 2010.12597; Debezium's incremental snapshots).

Every snapshot after the initial one (a table registered later, ``cdc snapshot SCHEMA.TABLE``, the
recovery after a lost slot) reads the table in primary-key chunks while the stream of every table
goes on. The design, the version rule and the resume state are in ``docs/snapshots.md``; in short:

* The table is streamed from the moment its snapshot starts (it is in wal2json's ``add-tables``,
  together with the watermark table); no stream change of it is dropped.
* A chunk is a key range ``(lo, hi]``. The driver (:class:`ChunkDriver`, a thread per session)
  writes a low watermark (LW) to the watermark table, reads the chunk in a REPEATABLE READ
  transaction S, hands the rows to the :class:`ChunkTracker`, writes a high watermark (HW).
* The stream loop calls :meth:`ChunkTracker.watermark` for changes of the watermark table and
  :meth:`ChunkTracker.saw` for the events of tables under snapshot. Between LW and HW a chunk row
  is dropped when the stream carried an event for its key (or one of S's invisible transactions did,
  just before LW); at HW the remaining rows are emitted as ``op=r`` with version
  ``(commit LSN of HW, 0)``: above every change S saw, below every change after HW.
* Progress (:class:`~snapshot.chunk_state.ChunkProgress`) is in the registry; a chunk counts as done once its rows are
  durable in the log store (the stream confirmed past HW). After kill -9 the snapshot resumes after
  the last done chunk.
* A full snapshot ends with a TRUNCATE marker at version ``(floor - 1, 0)`` (``floor``: the commit
  LSN of the run's first LW): sinks remove every row older than it, i.e. keys the source no longer
  has whose delete never reached the topic (a lost slot, an earlier killed snapshot).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from cdc.catalog import leaf_partitions
from cdc.codec import Message
from cdc.codec.envelope import TableCodec
from cdc.errors import SourceError
from cdc.events import TRUNCATE_KEY_FIELD, encode_key
from cdc.logstore import LogStore, Record
from cdc.registry import Alignment, Column, Registry, TableReg, TableState
from snapshot.chunk_state import ChunkProgress, SnapshotOptions, load_progress, save_progress
from snapshot.table_info import row_estimate, table_columns
from snapshot.where import parse_where, where_sql

if TYPE_CHECKING:
    import pyarrow as pa

    from snapshot.encode import RowEncoder

__all__ = ["ChunkDriver", "ChunkTracker", "truncate_marker", "write_mark"]


# --- the tracker: windows in the stream ------------------------------------------------------------
#: events of a table under snapshot remembered before a window opens (see docs/snapshots.md)
LOOKBACK = 4096
#: how an event with every column ends (:mod:`cdc.codec.envelope`: ``unavailable`` comes last)
_COMPLETE = b'"unavailable":[]}'
#: reads of one chunk at most, when a dropped row's change lacked a TOASTed column
MAX_CHUNK_READS = 3


@dataclass(eq=False)
class _Window:
    nonce: str
    topic: str
    codec: TableCodec
    rows: list[tuple[bytes, bytes, bytes | None]] | None = None  # key, ``after``, packed image
    last: bool = False
    read_ts_ms: int = 0
    xmax: int = 0
    xip: frozenset[int] = frozenset()
    before: list[tuple[int | None, bytes]] = field(default_factory=list)
    seen: set[bytes] = field(default_factory=set)
    partial: set[bytes] = field(default_factory=set)  # keys whose in-window event lacked a column
    redo: bool = False
    poisoned: bool = False
    lw_commit: int = 0
    hw_commit: int = 0
    emitted: int = 0
    durable: bool = False


def _invisible(xid: int | None, xmax: int, xip: frozenset[int]) -> bool:
    """Whether a transaction (32-bit xid from wal2json) was not visible to a snapshot with these
    32-bit ``xmax``/``xip``: in progress at the snapshot, or started after it."""
    if xid is None:
        return True
    return xid in xip or ((xid - xmax) & 0xFFFFFFFF) < 0x80000000


class ChunkTracker:
    """The stream side of chunked snapshots: watermark windows and the events inside them.

    The stream loop (one thread) calls :meth:`watermark`, :meth:`saw` and :meth:`durable`; the
    driver threads call :meth:`begin`, :meth:`put_rows`, :meth:`wait_durable`. ``topics``: topics
    of tables under snapshot (the loop calls :meth:`saw` only for those). :meth:`check` re-raises a
    driver's error in the stream loop.
    """

    def __init__(self, slot: str, watermark: tuple[str, str], topics: set[str]) -> None:
        self.slot = slot
        self.schema, self.table = watermark
        self.topics = topics
        self.open: dict[str, list[_Window]] = {}
        self._pending: dict[str, _Window] = {}
        self._awaiting: list[_Window] = []
        self._recent: dict[str, deque[tuple[int | None, bytes]]] = {t: deque(maxlen=LOOKBACK) for t in topics}
        self._cond = threading.Condition()
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.durable_pos = 0

    @property
    def schema_table(self) -> tuple[str, str]:
        """The watermark table, for wal2json's ``add-tables``."""
        return self.schema, self.table

    # driver side
    def begin(self, nonce: str, codec: TableCodec) -> None:
        with self._cond:
            self._pending[nonce] = _Window(nonce, codec.topic, codec)

    def put_rows(
        self,
        nonce: str,
        rows: list[tuple[bytes, bytes, bytes | None]],
        *,
        last: bool,
        snapshot: str,
        read_ts_ms: int,
    ) -> None:
        """The chunk's rows (key bytes, ``after`` JSON bytes, packed image), read under ``snapshot``
        (``pg_current_snapshot()`` text); called before HW is written."""
        _xmin, xmax_s, xip_s = snapshot.split(":")
        with self._cond:
            w = self._pending[nonce]
            w.rows = rows
            w.last = last
            w.read_ts_ms = read_ts_ms
            w.xmax = int(xmax_s) & 0xFFFFFFFF
            w.xip = frozenset(int(x) & 0xFFFFFFFF for x in xip_s.split(",") if x)

    def wait_durable(self, nonce: str, stop: threading.Event) -> _Window | None:
        """Block until the chunk's rows are durable (None if ``stop`` is set first)."""
        with self._cond:
            while True:
                w = self._pending.get(nonce)
                if w is not None and w.durable:
                    del self._pending[nonce]
                    return w
                if stop.is_set():
                    self._pending.pop(nonce, None)
                    return None
                self._cond.wait(0.2)

    def fail(self, exc: BaseException) -> None:
        self.error = exc

    # stream side
    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def busy(self) -> bool:
        return not self.finished.is_set()

    def saw(self, topic: str, xid: int | None, records: Sequence[Record]) -> None:
        """Events of a table under snapshot (``topic`` in :attr:`topics`), in stream order."""
        windows = self.open.get(topic)
        recent = self._recent[topic]
        for rec in records:
            if rec.partition is not None:  # a TRUNCATE marker: every open chunk of the table is stale
                for w in windows or ():
                    w.poisoned = True
                continue
            recent.append((xid, rec.key))
            if windows:
                lacks = rec.value is not None and not rec.value.endswith(_COMPLETE)
                for w in windows:
                    w.seen.add(rec.key)
                    if lacks:
                        w.partial.add(rec.key)

    def watermark(
        self, msg: Message, commit_lsn: int
    ) -> list[tuple[str, list[Record], list[tuple[bytes, bytes | None]]]]:
        """A change of the watermark table: opens (LW) or closes (HW) a chunk's window. Returns the
        chunk's records to append at HW, with the images of their keys to stage. Marks of other slots and stale marks (a previous session's,
        replayed after a restart) are ignored."""
        values = {c.name: c.value for c in msg.columns or ()}
        if values.get("slot") != self.slot:
            return []
        nonce, _, kind = str(values.get("mark") or "").partition(":")
        with self._cond:
            w = self._pending.get(nonce)
            if w is None:
                return []
            if kind == "lw" and not w.lw_commit:
                w.lw_commit = commit_lsn
                w.before = list(self._recent.get(w.topic, ()))
                self.open.setdefault(w.topic, []).append(w)
                return []
            if kind != "hw" or not w.lw_commit or w.hw_commit:
                return []
            windows = self.open.get(w.topic, [])
            if w in windows:
                windows.remove(w)
            if not windows:
                self.open.pop(w.topic, None)
            w.hw_commit = commit_lsn
            records, images = self._emit(w)
            self._awaiting.append(w)
            return [(w.topic, records, images)] if records else []

    def _emit(self, w: _Window) -> tuple[list[Record], list[tuple[bytes, bytes | None]]]:
        if w.rows is None:
            raise SourceError(
                f"high watermark of chunk {w.nonce} arrived before its rows",
                fix="this is a bug; restart `cdc run` (the snapshot resumes from the last chunk)",
            )
        if w.poisoned:
            w.rows = []
            return [], []
        # a dropped row whose in-window change left an unchanged TOASTed column out: its value
        # reaches the sinks only from a chunk row, so the driver reads the chunk again
        w.redo = bool(w.partial) and any(k in w.partial for k, _, _ in w.rows)
        drop = w.seen
        for xid, key in w.before:
            if _invisible(xid, w.xmax, w.xip):
                drop.add(key)
        codec = w.codec
        now = str(int(time.time() * 1000)).encode()

        def value(after: bytes, src: bytes) -> bytes:
            return (
                b'{"before":null,"after":'
                + after
                + b',"source":'
                + src
                + b',"op":"r","ts_ms":'
                + now
                + b',"unavailable":[]}'
            )

        src = codec.snapshot_source(w.hw_commit, w.read_ts_ms, last=False)
        kept = [(k, a, i) for k, a, i in w.rows if k not in drop]
        out = [Record(k, value(a, src)) for k, a, _ in kept]
        if w.last and kept:
            k, a, _ = kept[-1]
            out[-1] = Record(k, value(a, codec.snapshot_source(w.hw_commit, w.read_ts_ms, last=True)))
        w.emitted = len(out)
        w.rows = None
        w.before = []
        w.seen = set()
        return out, [(k, i) for k, _, i in kept if i is not None]

    def durable(self, pos: int) -> None:
        """Every event before ``pos`` is durable in the log store (called by the stream loop)."""
        if pos <= self.durable_pos:
            return
        self.durable_pos = pos
        if not self._awaiting:
            return
        with self._cond:
            still = []
            for w in self._awaiting:
                if pos > w.hw_commit:
                    w.durable = True
                else:
                    still.append(w)
            if len(still) != len(self._awaiting):
                self._awaiting = still
                self._cond.notify_all()


def write_mark(conn: psycopg.Connection[Any], watermark: tuple[str, str], slot: str, mark: str) -> None:
    """Write a watermark (``<nonce>:lw`` or ``<nonce>:hw``): upsert the slot's row of the watermark
    table, in a transaction of its own (``conn`` in autocommit)."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {} (slot, mark) VALUES (%s, %s) "
            "ON CONFLICT (slot) DO UPDATE SET mark = excluded.mark, written_at = now()"
        ).format(sql.Identifier(*watermark)),
        [slot, mark],
    )


def truncate_marker(codec: TableCodec, commit_lsn: int) -> list[Record]:
    """The TRUNCATE marker records (one per partition) at version ``(commit_lsn, 0)`` that end a
    full snapshot: sinks remove every row of the table older than it (docs/snapshots.md)."""
    src = codec.snapshot_source(commit_lsn, int(time.time() * 1000), last=False)
    value = codec.value(None, None, src, b"t", [], str(int(time.time() * 1000)).encode())
    return [
        Record(encode_key({TRUNCATE_KEY_FIELD: part}), value, partition=part)
        for part in range(codec.partitions)
    ]


# --- the driver: reads chunks between watermarks ---------------------------------------------------


class _Stopped(Exception):
    pass


class _Missing(Exception):
    pass


def _leaves_source(
    conn: psycopg.Connection[Any], reg: TableReg, partitions: list[list[str]], names: list[str]
) -> sql.Composable:
    """The rows of those of ``partitions`` that are leaves of ``reg`` now (one detached or dropped
    since is left out: its rows are not the parent's), as a FROM item; none left: no rows."""
    now = {tuple(leaf) for leaf in leaf_partitions(conn, reg.schema, reg.table)}
    cols = sql.SQL(", ").join(sql.Identifier(n) for n in names)
    parts = [
        sql.SQL("SELECT {} FROM {}").format(cols, sql.Identifier(s, t))
        for s, t in partitions
        if (s, t) in now
    ]
    if not parts:
        parts = [sql.SQL("SELECT {} FROM {} WHERE false").format(cols, sql.Identifier(reg.schema, reg.table))]
    return sql.SQL("({}) AS {}").format(sql.SQL(" UNION ALL ").join(parts), sql.Identifier("_cdc_leaves"))


def _key_tuple(key: Sequence[str]) -> sql.Composable:
    return sql.SQL("({})").format(sql.SQL(", ").join(sql.Identifier(k) for k in key))


def _values_tuple(values: Sequence[str]) -> sql.Composable:
    # untyped literals: Postgres reads each as its key column's type
    return sql.SQL("({})").format(sql.SQL(", ").join(sql.Literal(v) for v in values))


@dataclass
class _TablePlan:
    reg: TableReg
    codec: TableCodec
    names: list[str]
    where: sql.Composable
    progress: ChunkProgress
    ident: sql.Composable
    encoder: RowEncoder


@dataclass
class _Read:
    """One read of a chunk: its nonce (its watermarks), rows, snapshot and upper bound."""

    nonce: str
    rows: list[tuple[bytes, bytes, bytes | None]]
    snapshot: str
    read_ts_ms: int
    hi: list[str] | None
    read: int = 0


def _null_key_error(reg: TableReg, column: str) -> SourceError:
    return SourceError(
        f"{reg.qualified}: key column {column!r} is NULL in a row; a chunked snapshot pages through the "
        "table in key order (row comparison), which never reaches a NULL key",
        fix=f"register {reg.qualified} with a key of NOT NULL columns (its primary key), or fill the "
        f"NULLs and set {column} NOT NULL; then `cdc snapshot {reg.qualified}`",
        table=reg.qualified,
        column=column,
    )


def _refuse_null_keys(
    conn: psycopg.Connection[Any], reg: TableReg, nullable: list[str], where: sql.Composable
) -> None:
    """Raise when a nullable key column (a ``--key`` under REPLICA IDENTITY FULL) holds a NULL in a
    row the snapshot would read: those rows could never be reached by a chunk."""
    for column in nullable:
        found = conn.execute(
            sql.SQL("SELECT 1 FROM {} WHERE {} IS NULL AND {} LIMIT 1").format(
                sql.Identifier(reg.schema, reg.table), sql.Identifier(column), where
            )
        ).fetchone()
        if found is not None:
            raise _null_key_error(reg, column)


def _last_key(plan: _TablePlan, batch: pa.RecordBatch) -> list[str]:
    """The key (text values, key-column order) of a batch's last row: the upper bound of the chunk
    it ends. The text is Postgres' output of each key column, which it reads back as the same value."""
    values: list[str] = []
    for k in plan.codec.key:
        v = batch.column(plan.names.index(k))[batch.num_rows - 1].as_py()
        if v is None:  # a NULL written after the plan's check
            raise _null_key_error(plan.reg, k)
        values.append(str(v))
    return values


class ChunkDriver:
    """Reads the chunks of ``regs`` (one table after another, ``parallel_chunks`` chunks of a table
    at a time) between watermarks; started by the reader for a stream session and stopped with it
    (:meth:`stop`: the chunk in flight is abandoned; its table resumes from its last done chunk).

    ``on_done(reg, columns, rows, alignment)`` is called when a table's snapshot is complete and
    durable (the caller records it in the registry). Errors are handed to the tracker, which
    re-raises them in the stream loop.
    """

    def __init__(
        self,
        *,
        dsn: str,
        slot: str,
        registry: Registry,
        store: LogStore,
        store_lock: threading.Lock,
        tracker: ChunkTracker,
        options: SnapshotOptions,
        regs: list[TableReg],
        codec_for: Callable[[TableReg], TableCodec],
        session_options: str,
        on_done: Callable[[TableReg, tuple[Column, ...], int, Alignment], None],
        log: Callable[[str], None],
    ) -> None:
        self.dsn = dsn
        self.slot = slot
        self.registry = registry
        self.store = store
        self.store_lock = store_lock
        self.tracker = tracker
        self.options = options
        self.regs = regs
        self.codec_for = codec_for
        self.session_options = session_options
        self.on_done = on_done
        self.log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cdc-chunks", daemon=True)
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started (the stream may have been refused before)
            self._thread.join(timeout=60)

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn,
            autocommit=True,
            options=self.session_options,
            application_name="cdc-snapshot",
            connect_timeout=15,
        )

    def _run(self) -> None:
        try:
            for reg in self.regs:
                if self._stop.is_set():
                    return
                try:
                    self._table(reg)
                except _Missing:
                    # dropped or renamed at the source: recorded, skipped; the other tables go on
                    self.log(
                        f"{reg.qualified} does not exist at the source (dropped or renamed): its snapshot waits; "
                        f"`cdc tables remove {reg.qualified}` if it is gone for good"
                    )
                    self.registry.set_table_state(
                        TableState.SOURCE_MISSING, reg.schema, reg.table, str(int(time.time()))
                    )
            self.tracker.finished.set()
        except _Stopped:
            return
        except BaseException as exc:
            self.tracker.fail(exc)

    # -- one table ------------------------------------------------------------------------------
    def _plan(self, conn: psycopg.Connection[Any], reg: TableReg) -> _TablePlan:
        cols = table_columns(conn, reg.schema, reg.table)
        if not cols:
            raise _Missing(reg.qualified)
        from snapshot.encode import encoder_for  # deferred: pyarrow, only once a table's chunks start

        codec = self.codec_for(replace(reg, columns=cols))
        encoder = encoder_for(codec, cols)
        names = encoder.names
        progress = load_progress(self.registry, reg.schema, reg.table)
        if progress is None:
            raise SourceError(f"no snapshot progress for {reg.qualified}", fix="this is a bug; run again")
        where = (
            where_sql(parse_where(progress.where, [c.name for c in cols]))
            if progress.where
            else sql.SQL("TRUE")
        )
        if progress.estimate == 0:
            progress.estimate = row_estimate(conn, reg.schema, reg.table)
        progress.chunk_size = self.options.chunk_size
        _refuse_null_keys(conn, reg, [c.name for c in cols if c.nullable and c.name in codec.key], where)
        ident: sql.Composable = sql.Identifier(reg.schema, reg.table)
        if progress.partitions is not None:
            ident = _leaves_source(conn, reg, progress.partitions, names)
        return _TablePlan(reg, codec, names, where, progress, ident, encoder)

    def _table(self, reg: TableReg) -> None:
        first_conn = self._connect()  # the plan's, then the first worker's
        try:
            plan = self._plan(first_conn, reg)
        except BaseException:
            first_conn.close()
            raise
        p = plan.progress
        self.log(
            f"chunked snapshot of {reg.qualified}: "
            + (f"resuming after chunk {p.chunks}" if p.chunks else "starting")
            + (f" (where {p.where})" if p.where else "")
        )
        state: dict[str, Any] = {
            "next_lo": p.after,
            "index": 0,
            "planned_last": False,
            "done": {},
            "commit": 0,
            "finished": False,
        }
        errors: list[BaseException] = []
        # chunks are read one after another (the next chunk starts after the last key read); with
        # parallel_chunks > 1 a chunk's high watermark and its wait for durability overlap the next reads
        turn = threading.Lock()

        def worker(given: psycopg.Connection[Any] | None) -> None:
            try:
                with given or self._connect() as conn:
                    while not self._stop.is_set() and not errors:
                        with turn:
                            if state["planned_last"] or errors:
                                return
                            lo = state["next_lo"]
                            i = state["index"]
                            first = self._read(conn, plan, lo, None, limit=self.options.chunk_size)
                            state["index"] = i + 1
                            state["next_lo"] = first.hi
                            state["planned_last"] = first.hi is None
                        w, read = self._chunk(conn, plan, lo, first)
                        with self._lock:
                            state["done"][i] = (first.hi, w, read)
                            while state["commit"] in state["done"]:
                                hi_c, w_c, read_c = state["done"].pop(state["commit"])
                                state["commit"] += 1
                                p.after = hi_c
                                p.chunks += 1
                                p.rows += w_c.emitted
                                p.read += read_c
                                p.floor = p.floor or w_c.lw_commit
                                p.last_lsn = w_c.hw_commit
                                p.updated = time.time()
                                if hi_c is None:
                                    state["finished"] = True
                                save_progress(self.registry, reg.schema, reg.table, p)
            except _Stopped:
                return
            except BaseException as exc:
                errors.append(exc)

        n = max(1, self.options.parallel_chunks)
        threads = [
            threading.Thread(
                target=worker, args=(first_conn if i == 0 else None,), name=f"cdc-chunk-{i}", daemon=True
            )
            for i in range(n)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        if self._stop.is_set() or not state["finished"]:
            raise _Stopped()
        self._finish(plan)

    def _mark(self, conn: psycopg.Connection[Any], mark: str) -> None:
        write_mark(conn, self.tracker.schema_table, self.slot, mark)

    def _chunk(
        self, conn: psycopg.Connection[Any], plan: _TablePlan, lo: list[str] | None, first: _Read
    ) -> tuple[_Window, int]:
        """Close the chunk ``first`` read (its HW) and wait until its rows are durable; read it again
        (``(lo, hi]``, up to :data:`MAX_CHUNK_READS` reads) when a dropped row's in-window change
        lacked a TOASTed column."""
        hi = first.hi
        w = self._close(conn, first)
        first_lw = w.lw_commit
        total = first.read
        attempt = 1
        while w.redo:
            if attempt == MAX_CHUNK_READS:
                self.log(
                    f"{plan.reg.qualified}: a row of the chunk after {lo} changed during each of "
                    f"{MAX_CHUNK_READS} reads without its TOASTed column; its next change or a "
                    "`cdc snapshot --where` fills it"
                )
                break
            attempt += 1
            again = self._read(conn, plan, lo, hi, limit=None)
            total += again.read
            w = self._close(conn, again)
        w.lw_commit = first_lw
        return w, total

    def _read(
        self,
        conn: psycopg.Connection[Any],
        plan: _TablePlan,
        lo: list[str] | None,
        hi: list[str] | None,
        *,
        limit: int | None,
    ) -> _Read:
        """Write a chunk's LW, then read its rows in a REPEATABLE READ transaction with one ``COPY``
        in key order: the rows in ``(lo, hi]``, or with ``limit`` the first ``limit`` rows after
        ``lo``, whose last key is then the chunk's upper bound (None when fewer rows are left: the
        last chunk, unbounded)."""
        from snapshot.encode import copy_query, read_csv_batches  # deferred: pyarrow (see _plan)

        key = plan.codec.key
        conds: list[sql.Composable] = [plan.where]
        if lo is not None:
            conds.append(sql.SQL("{} > {}").format(_key_tuple(key), _values_tuple(lo)))
        if hi is not None:
            conds.append(sql.SQL("{} <= {}").format(_key_tuple(key), _values_tuple(hi)))
        query = copy_query(
            plan.reg.schema,
            plan.reg.table,
            plan.names,
            sql.SQL(" AND ").join(conds),
            source=None if plan.progress.partitions is None else plan.ident,
            order_by=key,
            limit=limit,
        )
        encoder = plan.encoder
        nonce = uuid.uuid4().hex
        self.tracker.begin(nonce, plan.codec)
        self._mark(conn, nonce + ":lw")
        rows: list[tuple[bytes, bytes, bytes | None]] = []
        last: pa.RecordBatch | None = None
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        try:
            srow = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
            assert srow is not None
            snapshot = str(srow[0])
            read_ts = int(time.time() * 1000)
            with conn.cursor().copy(query) as copy:
                for batch in read_csv_batches(copy, plan.names, table=plan.reg.qualified):
                    keys, afters, blobs = encoder.encode_rows(batch)
                    images = [None] * len(batch) if blobs is None else blobs.to_pylist()
                    rows.extend(zip(keys.to_pylist(), afters.to_pylist(), images, strict=True))
                    if batch.num_rows:
                        last = batch
        finally:
            conn.execute("COMMIT")
        if limit is not None:
            hi = _last_key(plan, last) if last is not None and len(rows) >= limit else None
        return _Read(nonce, rows, snapshot, read_ts, hi, len(rows))

    def _close(self, conn: psycopg.Connection[Any], r: _Read) -> _Window:
        """Hand a read's rows to the tracker, write the chunk's HW and wait until the rows are durable."""
        self.tracker.put_rows(
            r.nonce, r.rows, last=r.hi is None, snapshot=r.snapshot, read_ts_ms=r.read_ts_ms
        )
        r.rows = []  # the tracker's now
        self._mark(conn, r.nonce + ":hw")
        w = self.tracker.wait_durable(r.nonce, self._stop)
        if w is None:
            raise _Stopped()
        return w

    def _finish(self, plan: _TablePlan) -> None:
        reg, p, codec = plan.reg, plan.progress, plan.codec
        with self.store_lock:
            if p.full and p.floor:
                self.store.append_many({codec.topic: truncate_marker(codec, p.floor - 1)})
            end = dict(self.store.end_offsets(codec.topic))
        p.done = True
        p.updated = time.time()
        save_progress(self.registry, reg.schema, reg.table, p)
        self.log(f"chunked snapshot of {reg.qualified} done: {p.chunks} chunks, {p.rows} rows written")
        self.on_done(reg, codec.columns, p.rows, Alignment(p.last_lsn or 0, end))
