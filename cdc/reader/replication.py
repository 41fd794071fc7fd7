"""The psycopg2 streaming loop: one START_REPLICATION session of the reader.

psycopg 3 has no replication support, so this module is the only user of psycopg2. psycopg2 starts
the stream and sends the feedback; the messages are read with ``select()`` and a non-blocking read
(not ``consume_stream``), so the loop can batch, time out, poll the registry generation and send
feedback itself; a stream that is flowing is read again :data:`GATHER_S` after it was drained, not
at its next message, so each wake-up takes many messages. The read is libpq's own from the compiled
module (:class:`cdc.codec._native.CopyStream`: the row changes go into the batch without a Python
object each) or, its Python reference (``CDC_NATIVE=0``, or the module not built), psycopg2's
``read_message()``. Either way a keepalive that asks for a reply is answered as it is read, and a status
update goes out at least every :data:`STATUS_INTERVAL_S`, so ``wal_sender_timeout`` never ends a
session that is alive.

Confirmation rule (docs/architecture.md, "Delivery"): a position is sent as ``flush_lsn`` only when every event
before it is durable in the log store, and only at a transaction boundary:

* after a batch is durable, the ``nextlsn`` of the last ``C`` whose events were all in it (batches
  are appended by :class:`Batch`'s writer thread, in order, while the loop goes on decoding; a
  batch cut in the middle of a transaction carries the previous boundary);
* when nothing is in flight (no open transaction, nothing buffered or being written), the latest
  position received:
  the ``nextlsn`` of a filtered-out transaction's ``C``, a heartbeat ``M``'s LSN, or the keepalive
  ``wal_end``. A keepalive is an event without data whose position must still be confirmed.
"""

from __future__ import annotations

import contextlib
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg2
import psycopg2.errors
import psycopg2.extras

from cdc.codec import DDL_PREFIX, NONFINITE_PREFIX, Decoder
from cdc.codec.compiled import native_module, native_status
from cdc.codec.envelope import ColumnsSeen, EventBuilder
from cdc.codec.fastpath import PYTHON, native_changes
from cdc.codec.pgoutput import RawMessage
from cdc.codec.wal2json import DECODER
from cdc.config import ReaderConfig
from cdc.connect import SESSION_OPTIONS, connect_replication
from cdc.errors import SlotLostError
from cdc.logstore.batch import Batch

#: the reader's defaults, written once in :class:`cdc.config.ReaderConfig`
_DEFAULTS = ReaderConfig()


@dataclass
class StreamControl:
    """What the loop watches besides the stream. ``should_restart`` is polled about every
    ``poll_s`` (registration changes); ``stop`` is set by SIGTERM; ``target``: stop once this
    position is confirmed (``cdc run --once``); ``heartbeat`` emits a logical message."""

    stop: threading.Event
    should_restart: Callable[[], bool]
    heartbeat: Callable[[], object] | None = None
    heartbeat_interval_s: float = _DEFAULTS.heartbeat_interval_s
    target: int | None = None
    poll_s: float = _DEFAULTS.poll_s
    batch_max_events: int = _DEFAULTS.batch_max_events
    batch_max_ms: int = _DEFAULTS.batch_max_ms
    #: a drained batch is submitted once this old (0: at once)
    batch_linger_ms: int = _DEFAULTS.batch_linger_ms
    #: a durable position is sent to the server at most this often (and at every stop/restart)
    feedback_interval_s: float = 0.5
    on_confirm: Callable[[int], None] | None = None
    stats: dict[str, int] = field(default_factory=lambda: {"changes": 0})
    #: chunked snapshots in progress (a :class:`snapshot.chunked.ChunkTracker`), or None
    chunks: Any = None
    #: called with each DDL recorder message (``cdc.ddl``, inside its transaction), or None
    ddl: Callable[[Any], None] | None = None
    #: settles a change whose columns changed (:meth:`cdc.reader.schema.SchemaFollower.settle`):
    #: returns its records, made once the new columns are recorded
    schema: Callable[[ColumnsSeen], tuple[str, list[Any]]] | None = None
    #: called once the server has accepted START_REPLICATION (e.g. starts the chunk driver, whose
    #: reads would be wasted on a session the server refuses)
    on_started: Callable[[], None] | None = None
    #: the reader's log (a line it says once: the stream read without the libpq reader)
    log: Callable[[str], None] | None = None


def open_replication(dsn: str) -> Any:
    """A psycopg2 LogicalReplicationConnection with the shared session options."""
    return connect_replication(dsn, options=SESSION_OPTIONS, application_name="cdc-reader")


def translate_start_error(exc: Exception, slot: str) -> Exception:
    """Map START_REPLICATION errors that mean the slot is gone to SlotLostError."""
    if isinstance(exc, psycopg2.errors.UndefinedObject | psycopg2.errors.ObjectNotInPrerequisiteState):
        return SlotLostError(
            f"replication slot {slot!r} is gone or invalidated ({str(exc).strip()}); changes since the "
            "last confirmed position cannot be read any more, so the topics may miss changes",
            fix="re-snapshot every table: `cdc snapshot --all`, then `cdc run` (it creates a new slot)",
            slot=slot,
        )
    return exc


def stream(
    dsn: str,
    slot: str,
    tables: list[tuple[str, str]],
    start_lsn: int,
    builder: EventBuilder,
    batch: Batch,
    ctl: StreamControl,
    *,
    numeric_as_string: bool = False,
    decoder: Decoder = DECODER,
) -> tuple[str, int]:
    """Stream from ``start_lsn`` (0: the slot's confirmed position) until stopped; ``decoder``:
    the slot's output plugin's (:mod:`cdc.codec`).

    Returns (reason, confirmed position): ``"stopped"`` (``ctl.stop`` set; the current batch was
    made durable and confirmed), ``"restart"`` (``ctl.should_restart()`` said so; stopped at a
    transaction boundary with everything confirmed), ``"caught_up"`` (``ctl.target`` confirmed).
    psycopg2 errors propagate (the caller retries); a gone slot raises SlotLostError.
    """
    conn = open_replication(dsn)
    try:
        cur = conn.cursor()
        try:
            cur.start_replication(
                slot_name=slot,
                decode=False,
                start_lsn=start_lsn,
                options=decoder.replication_options(tables, numeric_as_string=numeric_as_string),
                status_interval=STATUS_INTERVAL_S,
            )
            if ctl.on_started is not None:
                ctl.on_started()
            return _loop(cur, builder, batch, ctl, start_lsn, decoder, libpq=True)
        except psycopg2.Error as exc:
            raise translate_start_error(exc, slot) from exc
    finally:
        with contextlib.suppress(psycopg2.Error):
            conn.close()


#: the standby status update goes out at least this often (psycopg2's ``status_interval``)
STATUS_INTERVAL_S = 10

#: a stream found drained after it gave messages (it is flowing: a reader faster than its walsender
#: drains it every few messages) is read again after this long, waited without watching the socket
#: (``select()`` would wake at its next message), so each wake-up finds what arrived meanwhile:
#: tens of messages, not 3-20, and the wake-up's cost (the select, the recv, the loop around them:
#: more than the read of a message) is paid once for them. 1 ms: the most a change waits for it (a
#: change that arrives after a wait found nothing is read at once: ``select()``), far below the
#: batch's own ``batch_linger_ms`` / ``batch_max_ms`` (the wait never runs past the batch's due time)
#: and a keepalive's deadline (``wal_sender_timeout``); at the walsender's pace (3-11 µs a message)
#: 75-200 messages a wake-up (``bench.capture_floor``), 40 KB of wal2json's: well inside the
#: socket's buffer.
GATHER_S = 0.001


def stream_error(message: str, sqlstate: str | None) -> psycopg2.Error:
    """What the libpq reader raises: the exception psycopg2 raises for the same failure (its class
    by SQLSTATE; OperationalError for a connection lost), with libpq's message."""
    cls: type[psycopg2.Error] = psycopg2.OperationalError
    if sqlstate:
        with contextlib.suppress(KeyError):
            cls = psycopg2.errors.lookup(sqlstate)
    return cls(message)


def copy_stream(cur: Any, on_keepalive: Callable[[], object]) -> Any:
    """The libpq reader of ``cur``'s started stream (:class:`cdc.codec._native.CopyStream`), or None
    where the compiled module is not there (``CDC_NATIVE=0``, not built) or cannot find the
    functions of psycopg2's libpq: psycopg2's ``read_message`` then. ``on_keepalive``: sends the status update a keepalive asks for."""
    native = native_module()
    if native is None:
        return None
    try:
        return native.CopyStream(
            cur.connection, psycopg2._psycopg.__file__, on_keepalive, RawMessage, stream_error
        )
    except ImportError:  # psycopg2's libpq does not export its functions: the same stream, slower
        return None


#: the stats' (and metrics') counter of sessions read without the libpq reader
FALLBACKS = "libpq_reader_fallbacks"


def copy_stream_missing() -> str:
    """Why :func:`copy_stream` gives no libpq reader (what the log says when it does not)."""
    native = native_module()
    if native is None:
        return f"the compiled module is not used: {native_status()[1]}"
    try:
        native.libpq_resolve(psycopg2._psycopg.__file__)
    except ImportError as exc:
        return f"psycopg2's libpq cannot be used ({exc})"
    return "the libpq reader could not be made"


def _fell_back(ctl: StreamControl) -> None:
    """The session reads with psycopg2's ``read_message`` (no libpq reader): counted in
    ``libpq_reader_fallbacks`` (sessions, running total; ``cdc status --json`` shows it) and said
    once in the reader's log."""
    stats = ctl.stats
    stats[FALLBACKS] = stats.get(FALLBACKS, 0) + 1
    if stats[FALLBACKS] == 1 and ctl.log is not None:
        ctl.log(
            f"reading the stream with psycopg2's read_message, not the libpq reader: {copy_stream_missing()} "
            "(slower per message; the same events)"
        )


class _Positions:
    """The loop's stream positions and its time-based duties. ``durable``: every event before it is
    durable; ``sent``: the last position confirmed to the server; ``pending``: the transaction
    boundary covered once the current batch is durable; ``in_txn``: inside a transaction."""

    def __init__(self, cur: Any, batch: Batch, ctl: StreamControl, start_lsn: int) -> None:
        self.cur = cur
        self.batch = batch
        self.ctl = ctl
        self.chunks = ctl.chunks
        self.durable = self.sent = self.pending = start_lsn
        self.in_txn = False
        self.want_restart = False
        now = time.monotonic()
        self.next_poll = now + ctl.poll_s
        self.next_heartbeat = (
            now + ctl.heartbeat_interval_s if ctl.heartbeat and ctl.heartbeat_interval_s > 0 else None
        )
        self.last_feedback = self.last_status = now
        #: the libpq reader (or None: psycopg2's read_message, which sends the status itself)
        self.copy: Any = None
        self.max_s = ctl.batch_max_ms / 1000.0
        #: the messages read (the loop's count) when the stream was last found drained, and whether
        #: any were read since: the stream is flowing (:data:`GATHER_S`)
        self.read_at = 0
        self.flowing = False
        self.linger_s = min(ctl.batch_linger_ms, ctl.batch_max_ms) / 1000.0
        self.fileno = cur.connection.fileno()

    def confirm(self, force: bool = False) -> None:
        if self.batch.durable > self.durable:
            self.durable = self.batch.durable
        if self.chunks is not None:
            self.chunks.durable(self.durable)
        t = time.monotonic()
        if self.durable > self.sent and (force or t - self.last_feedback >= self.ctl.feedback_interval_s):
            # force=True: without it psycopg2 only stores the position and sends it at the next
            # ``status_interval`` (10 s), so the slot's confirmed position (what `cdc status` and the
            # WAL the source keeps go by) would trail the store by up to 10 s; the pace is ours
            self.cur.send_feedback(write_lsn=self.durable, flush_lsn=self.durable, reply=force, force=True)
            self.sent = self.durable
            self.last_feedback = self.last_status = t
            if self.ctl.on_confirm:
                self.ctl.on_confirm(self.durable)
        elif self.copy is not None and t - self.last_status >= STATUS_INTERVAL_S:
            self.status()

    def status(self) -> None:
        """The standby status update with the positions confirmed so far (those psycopg2 holds,
        from the last ``send_feedback``; nothing new is confirmed): a keepalive's answer, and the
        periodic update psycopg2's ``read_message`` sent every ``status_interval``."""
        self.cur.send_feedback(force=True)
        self.last_status = time.monotonic()

    def flush(self) -> None:
        """Everything received is durable: the last boundary seen may be confirmed."""
        self.batch.flush(self.pending if self.pending > self.durable else None)
        if self.pending > self.durable:
            self.durable = self.pending

    def boundary(self, pos: int) -> None:
        """A transaction boundary (or heartbeat) at ``pos``: every event before it was received."""
        if pos > self.pending:
            self.pending = pos
        if self.batch.idle and self.pending > self.durable:
            self.durable = self.pending

    def drained(self, read: int) -> None:
        """Nothing more to read right now (``read``: the messages read so far): outside a
        transaction with nothing in flight, the server's ``wal_end`` (a keepalive's position) is
        received and durable."""
        self.flowing = read > self.read_at
        self.read_at = read
        self.batch.check()
        if not self.in_txn and self.batch.idle:
            wal_end = (self.copy if self.copy is not None else self.cur).wal_end
            if wal_end and wal_end > self.durable:
                self.durable = self.pending = wal_end

    def duties(self, drained: bool) -> str | None:
        """Submit, confirm, poll, heartbeat and wait; the reason to end the loop, or None."""
        batch, ctl, chunks = self.batch, self.ctl, self.chunks
        now = time.monotonic()
        age = now - batch.started
        if batch.count and (age >= self.max_s or (drained and not self.in_txn and age >= self.linger_s)):
            batch.submit(self.pending if self.pending > batch.submitted else None)
        elif (
            not batch.count
            and not self.in_txn
            and batch.inflight
            and self.pending > batch.submitted
            and self.pending > self.durable
        ):
            batch.submit(self.pending)  # a boundary after the last submitted batch
        self.confirm()
        if ctl.stop.is_set():
            return self._end("stopped")
        if now >= self.next_poll:
            self.next_poll = now + ctl.poll_s
            if chunks is not None:
                chunks.check()
            if not self.want_restart and ctl.should_restart():
                self.want_restart = True
        if self.want_restart and not self.in_txn:
            return self._end("restart")
        if (
            ctl.target is not None
            and not self.in_txn
            and max(self.durable, self.pending) >= ctl.target
            and (chunks is None or not chunks.busy())
        ):
            return self._end("caught_up")
        if self.next_heartbeat is not None and now >= self.next_heartbeat and ctl.heartbeat is not None:
            ctl.heartbeat()
            self.next_heartbeat = time.monotonic() + ctl.heartbeat_interval_s
        if drained:
            timeout = 0.2 if chunks is None or not chunks.busy() else 0.05
            if batch.count:  # until the batch is due: held (linger) outside a transaction
                due = self.max_s if self.in_txn else self.linger_s
                timeout = max(0.0, min(timeout, batch.started + due - now))
                if not self.in_txn:
                    # lingering: nothing that arrives before the batch is due can join an earlier
                    # append, so it waits in the socket and is read in one go when the batch is due
                    # (a wake-up per batch, not per transaction: each costs far more than the read)
                    ctl.stop.wait(timeout)
                    return None
            stats = ctl.stats
            if self.flowing:  # read again in a moment, what arrived meanwhile in one go
                stats["_gathers"] = stats.get("_gathers", 0) + 1
                time.sleep(min(GATHER_S, timeout))
                return None
            stats["_selects"] = stats.get("_selects", 0) + 1
            select.select([self.fileno], [], [], timeout)
        return None

    def _end(self, reason: str) -> str:
        self.flush()
        self.confirm(force=True)
        return reason


#: pgoutput's Insert, Update and Delete: what the compiled path takes
_ROW_CHANGES = frozenset(b"IUD")


def _account(builder: EventBuilder, stats: dict[str, int], changes: int, fast: Any) -> None:
    """The loop's periodic bookkeeping: the envelope's clock, the changes counted, the fallbacks."""
    builder.tick()
    stats["changes"] += changes
    if fast is not None:
        _count_fallbacks(stats, fast)


def _count_fallbacks(stats: dict[str, int], fast: Any) -> None:
    """The compiled path's fallbacks into ``stats`` (running totals over the sessions):
    ``native_python_values``, values converted by their Python converter (a type without a compiled
    one), and ``native_python_changes``, changes it handed to the Python path (unchanged TOAST, key
    changes, new columns, ...)."""
    for name, now in (("native_python_values", fast.python_values), ("native_python_changes", fast.declined)):
        seen = stats.get(f"_{name}_seen", 0)
        stats[name] = stats.get(name, 0) + now - seen
        stats[f"_{name}_seen"] = now


def _unsettled(seen: ColumnsSeen) -> tuple[str, list[Any]]:
    raise RuntimeError(f"the columns of {seen.codec.reg.qualified} changed, and nothing settles it (a bug)")


def _loop(
    cur: Any,
    builder: EventBuilder,
    batch: Batch,
    ctl: StreamControl,
    start_lsn: int,
    decoder: Decoder = DECODER,
    *,
    libpq: bool = False,
) -> tuple[str, int]:
    """The session's loop over the started stream of ``cur``; ``libpq``: read it with the compiled
    module's libpq reader where there is one (else, and by default, ``cur.read_message``)."""
    at = _Positions(cur, batch, ctl, start_lsn)
    at.copy = copy_stream(cur, at.status) if libpq else None
    if libpq and at.copy is None:
        _fell_back(ctl)
    try:
        return _run(at, builder, decoder)
    finally:
        if at.copy is not None:
            at.copy.close()


def _run(at: _Positions, builder: EventBuilder, decoder: Decoder) -> tuple[str, int]:
    batch, ctl, copy = at.batch, at.ctl, at.copy
    boundary = at.boundary
    max_events = ctl.batch_max_events
    stats = ctl.stats
    read = decoder.source(copy if copy is not None else at.cur.read_message)
    idle = decoder.source_idle
    decode = decoder.decode
    change = builder.change
    changes = 0
    n = 0
    chunks = ctl.chunks
    wm_schema, wm_table = (chunks.schema, chunks.table) if chunks is not None else (None, None)
    chunk_topics = chunks.topics if chunks is not None else frozenset()
    settle = ctl.schema or _unsettled

    def take(out: tuple[str, list[Any]]) -> None:
        """A change's records into the batch (a chunked snapshot's table: told to its tracker)."""
        if out[0] in chunk_topics:
            chunks.saw(out[0], builder.xid, out[1])
        batch.add(out[0], out[1])
        if batch.count >= max_events:
            # mid-transaction the last complete boundary is still `pending`
            batch.submit(at.pending if at.pending > batch.submitted else None)

    # the compiled per-change path (pgoutput's I/U/D straight to records; PYTHON: the Python path's)
    fast = native_changes(decoder, builder, (wm_schema, wm_table))
    # with no chunked snapshot to tell, the compiled path drains row changes into the batch itself
    pump = fast.pump if fast is not None and chunks is None else None
    while True:
        if pump is not None:
            # the libpq reader is read directly while its messages are those `read` gives
            msg, k = pump(
                read, batch, max_events, 0x400 - (n & 0x3FF), copy if copy is not None and idle() else None
            )
            n += k
            changes += k
            if batch.count >= max_events:
                batch.submit(at.pending if at.pending > batch.submitted else None)
            data = None  # PYTHON: 1024 messages taken, or the batch is full
            if msg is not None and msg is not PYTHON:
                n += 1
                data = decode(msg.payload, msg.data_start)  # one the compiled path does not take
        else:
            msg = read()
            if msg is not None:
                n += 1
                if (
                    fast is not None
                    and msg.payload[0] in _ROW_CHANGES
                    and (out := fast(msg.payload, msg.data_start)) is not PYTHON
                ):
                    changes += 1
                    if out is not None:
                        take(out)
                    data = None
                else:
                    data = decode(msg.payload, msg.data_start)
        if msg is not None:
            if data is None:
                pass  # handled above, or a message that only updates the decoder's state
            elif (action := data.action) == "B":
                builder.begin(data)
                at.in_txn = True
            elif action == "C":
                at.in_txn = False
                boundary(builder.commit(data))
            elif action == "M":
                if at.in_txn:
                    if data.prefix == NONFINITE_PREFIX:
                        builder.nonfinite(data)  # held for the table's next change
                    elif data.prefix == DDL_PREFIX and ctl.ddl is not None:
                        ctl.ddl(data)  # the recorder's: in order with the transaction's changes
                else:
                    boundary(data.lsn or 0)
            elif data.table == wm_table and data.schema == wm_schema:
                # a chunked snapshot's watermark: at a high watermark, the chunk's rows
                for topic, records, images in chunks.watermark(data, builder.commit_lsn):
                    batch.add(topic, records)
                    if builder.staging is not None:
                        for key, blob in images:
                            builder.staging.put(topic, key, blob)
            else:
                out = change(data)
                changes += 1
                if out is not None:
                    take(out if not isinstance(out, ColumnsSeen) else settle(out))
            if n & 0x3FF:
                continue
            # every 1024 messages: time-based duties while the stream is busy
        _account(builder, stats, changes, fast)
        changes = 0
        if msg is None:
            at.drained(n)  # nothing more to read right now
        reason = at.duties(msg is None)
        if reason is not None:
            return reason, at.durable
