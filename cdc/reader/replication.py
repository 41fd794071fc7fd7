"""The psycopg2 streaming loop: one START_REPLICATION session of the reader.

psycopg 3 has no replication support, so this module is the only user of psycopg2. It reads with
``read_message()`` + ``select()`` (not ``consume_stream``) so it can batch, time out, poll the
registry generation and send feedback itself.

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
from cdc.codec.envelope import EventBuilder
from cdc.codec.wal2json import DECODER
from cdc.connect import SESSION_OPTIONS, connect_replication
from cdc.errors import SlotLostError
from cdc.events import lsn_to_int
from cdc.logstore.batch import Batch


@dataclass
class StreamControl:
    """What the loop watches besides the stream. ``should_restart`` is polled about every
    ``poll_s`` (registration changes); ``stop`` is set by SIGTERM; ``target``: stop once this
    position is confirmed (``cdc run --once``); ``heartbeat`` emits a logical message."""

    stop: threading.Event
    should_restart: Callable[[], bool]
    heartbeat: Callable[[], object] | None = None
    heartbeat_interval_s: float = 10.0
    target: int | None = None
    poll_s: float = 1.0
    batch_max_events: int = 5000
    batch_max_ms: int = 100
    #: a durable position is sent to the server at most this often (and at every stop/restart)
    feedback_interval_s: float = 0.5
    on_confirm: Callable[[int], None] | None = None
    stats: dict[str, int] = field(default_factory=lambda: {"changes": 0})
    #: chunked snapshots in progress (a :class:`snapshot.chunked.ChunkTracker`), or None
    chunks: Any = None
    #: called with each DDL recorder message (``cdc.ddl``, inside its transaction), or None
    ddl: Callable[[Any], None] | None = None
    #: called once the server has accepted START_REPLICATION (e.g. starts the chunk driver, whose
    #: reads would be wasted on a session the server refuses)
    on_started: Callable[[], None] | None = None


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
                status_interval=10,
            )
            if ctl.on_started is not None:
                ctl.on_started()
            return _loop(cur, builder, batch, ctl, start_lsn, decoder)
        except psycopg2.Error as exc:
            raise translate_start_error(exc, slot) from exc
    finally:
        with contextlib.suppress(psycopg2.Error):
            conn.close()


def _loop(
    cur: Any,
    builder: EventBuilder,
    batch: Batch,
    ctl: StreamControl,
    start_lsn: int,
    decoder: Decoder = DECODER,
) -> tuple[str, int]:
    durable = start_lsn  # every event before this position is durable
    sent = start_lsn
    pending = start_lsn  # boundary position covered once the current batch is durable
    in_txn = False
    want_restart = False
    now = time.monotonic()
    next_poll = now + ctl.poll_s
    next_heartbeat = (
        now + ctl.heartbeat_interval_s if ctl.heartbeat and ctl.heartbeat_interval_s > 0 else None
    )
    last_feedback = now
    max_events = ctl.batch_max_events
    max_s = ctl.batch_max_ms / 1000.0
    stats = ctl.stats
    read = cur.read_message
    decode = decoder.decode
    change = builder.change
    changes = 0
    fileno = cur.connection.fileno()
    n = 0
    chunks = ctl.chunks
    wm_schema, wm_table = (chunks.schema, chunks.table) if chunks is not None else (None, None)
    chunk_topics = chunks.topics if chunks is not None else frozenset()
    ddl = ctl.ddl

    def confirm(force: bool = False) -> None:
        nonlocal sent, last_feedback, durable
        if batch.durable > durable:
            durable = batch.durable
        if chunks is not None:
            chunks.durable(durable)
        t = time.monotonic()
        if durable > sent and (force or t - last_feedback >= ctl.feedback_interval_s):
            # force=True: without it psycopg2 only stores the position and sends it at the next
            # ``status_interval`` (10 s), so the slot's confirmed position (what `cdc status` and the
            # WAL the source keeps go by) would trail the store by up to 10 s; the pace is ours
            cur.send_feedback(write_lsn=durable, flush_lsn=durable, reply=force, force=True)
            sent = durable
            last_feedback = t
            if ctl.on_confirm:
                ctl.on_confirm(durable)

    def flush() -> None:
        """Everything received is durable: the last boundary seen may be confirmed."""
        nonlocal durable
        batch.flush(pending if pending > durable else None)
        if pending > durable:
            durable = pending

    def boundary(pos: int) -> None:
        """A transaction boundary (or heartbeat) at ``pos``: every event before it was received."""
        nonlocal pending, durable
        if pos > pending:
            pending = pos
        if batch.idle and pending > durable:
            durable = pending

    while True:
        msg = read()
        if msg is not None:
            n += 1
            data = decode(msg.payload)
            action = data.action
            if action == "B":
                builder.begin(data)
                in_txn = True
            elif action == "C":
                in_txn = False
                boundary(builder.commit(data))
            elif action == "M":
                if in_txn:
                    if data.prefix == NONFINITE_PREFIX:
                        builder.nonfinite(data)  # held for the table's next change
                    elif data.prefix == DDL_PREFIX and ddl is not None:
                        ddl(data)  # the recorder's: in order with the transaction's changes
                else:
                    boundary(lsn_to_int(data.lsn or "0/0"))
            elif data.table == wm_table and data.schema == wm_schema:
                # a chunked snapshot's watermark: at a high watermark, the chunk's rows
                for topic, records in chunks.watermark(data, builder.commit_lsn):
                    batch.add(topic, records)
            else:
                out = change(data)
                changes += 1
                if out is not None:
                    if out[0] in chunk_topics:
                        chunks.saw(out[0], builder.xid, out[1])
                    batch.add(out[0], out[1])
                    if batch.count >= max_events:
                        # mid-transaction the last complete boundary is still `pending`
                        batch.submit(pending if pending > batch.submitted else None)
            if n & 0x3FF:
                continue
            # every 1024 messages: time-based duties while the stream is busy
            builder.tick()
            stats["changes"] += changes
            changes = 0
        else:
            # drained: nothing more to read right now
            builder.tick()
            stats["changes"] += changes
            changes = 0
            batch.check()
            if not in_txn and batch.idle:
                wal_end = cur.wal_end
                if wal_end and wal_end > durable:
                    durable = pending = wal_end
        now = time.monotonic()
        if batch.count and (now - batch.started >= max_s or (msg is None and not in_txn)):
            batch.submit(pending if pending > batch.submitted else None)
        elif (
            not batch.count
            and not in_txn
            and batch.inflight
            and pending > batch.submitted
            and pending > durable
        ):
            batch.submit(pending)  # a boundary after the last submitted batch
        confirm()
        if ctl.stop.is_set():
            flush()
            confirm(force=True)
            stats["changes"] += changes
            return "stopped", durable
        if now >= next_poll:
            next_poll = now + ctl.poll_s
            if chunks is not None:
                chunks.check()
            if not want_restart and ctl.should_restart():
                want_restart = True
        if want_restart and not in_txn:
            flush()
            confirm(force=True)
            stats["changes"] += changes
            return "restart", durable
        if (
            ctl.target is not None
            and not in_txn
            and max(durable, pending) >= ctl.target
            and (chunks is None or not chunks.busy())
        ):
            flush()
            confirm(force=True)
            stats["changes"] += changes
            return "caught_up", durable
        if next_heartbeat is not None and now >= next_heartbeat and ctl.heartbeat is not None:
            ctl.heartbeat()
            next_heartbeat = time.monotonic() + ctl.heartbeat_interval_s
        if msg is None:
            timeout = 0.2 if chunks is None or not chunks.busy() else 0.05
            if batch.count:
                timeout = max(0.0, min(timeout, batch.started + max_s - now))
            select.select([fileno], [], [], timeout)
