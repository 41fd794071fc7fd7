"""The psycopg2 streaming loop: one START_REPLICATION session of the reader.

psycopg 3 has no replication support, so this module is the only user of psycopg2. It reads with
``read_message()`` + ``select()`` (not ``consume_stream``) so it can batch, time out, poll the
registry generation and send feedback itself.

Confirmation rule (DESIGN.md "Delivery"): a position is sent as ``flush_lsn`` only when every event
before it is durable in the log store, and only at a transaction boundary:

* after a batch is durable, the ``nextlsn`` of the last ``C`` whose events were all in it;
* when nothing is in flight (no open transaction, nothing buffered), the latest position received:
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

from cdc.errors import SlotLostError
from cdc.events import int_to_lsn, lsn_to_int
from cdc.logstore import LogStore, Record
from cdc.reader.envelope import EventBuilder
from cdc.reader.wal2json import decode, replication_options

#: session options for every source connection, so text output (timestamps, floats) is the same in
#: the stream and in the snapshot's COPY
SESSION_OPTIONS = "-c TimeZone=UTC -c DateStyle=ISO,MDY -c IntervalStyle=postgres -c extra_float_digits=1"

HEARTBEAT_PREFIX = "cdc_heartbeat"


class Batch:
    """Events waiting to be appended to the log store, per topic. :meth:`flush` returns only when
    they are durable (LogStore.append_many)."""

    def __init__(self, store: LogStore, lock: threading.Lock | None = None) -> None:
        self.store = store
        self.lock = lock or threading.Lock()
        self.records: dict[str, list[Record]] = {}
        self.count = 0
        self.started = 0.0
        self.written = 0

    def add(self, topic: str, records: list[Record]) -> None:
        if not self.count:
            self.started = time.monotonic()
        lst = self.records.get(topic)
        if lst is None:
            self.records[topic] = records
        else:
            lst.extend(records)
        self.count += len(records)

    def flush(self) -> None:
        if not self.count:
            return
        with self.lock:
            self.store.append_many(self.records)
        self.written += self.count
        self.records = {}
        self.count = 0


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
    feedback_interval_s: float = 0.5
    on_confirm: Callable[[int], None] | None = None
    stats: dict[str, int] = field(default_factory=lambda: {"changes": 0})


def open_replication(dsn: str) -> Any:
    """A psycopg2 LogicalReplicationConnection with the shared session options."""
    return psycopg2.connect(
        dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection,
        options=SESSION_OPTIONS, application_name="cdc-reader",
    )


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
) -> tuple[str, int]:
    """Stream from ``start_lsn`` (0: the slot's confirmed position) until stopped.

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
                slot_name=slot, decode=False, start_lsn=start_lsn,
                options=replication_options(tables), status_interval=10,
            )
            return _loop(cur, builder, batch, ctl, start_lsn)
        except psycopg2.Error as exc:
            raise translate_start_error(exc, slot) from exc
    finally:
        with contextlib.suppress(psycopg2.Error):
            conn.close()


def _loop(cur: Any, builder: EventBuilder, batch: Batch, ctl: StreamControl, start_lsn: int) -> tuple[str, int]:
    durable = start_lsn  # every event before this position is durable
    sent = start_lsn
    pending = start_lsn  # boundary position covered once the current batch is durable
    in_txn = False
    want_restart = False
    now = time.monotonic()
    next_poll = now + ctl.poll_s
    next_heartbeat = now + ctl.heartbeat_interval_s if ctl.heartbeat and ctl.heartbeat_interval_s > 0 else None
    last_feedback = now
    max_events = ctl.batch_max_events
    max_s = ctl.batch_max_ms / 1000.0
    stats = ctl.stats
    read = cur.read_message
    fileno = cur.connection.fileno()
    n = 0

    def confirm(force: bool = False) -> None:
        nonlocal sent, last_feedback
        t = time.monotonic()
        if durable > sent and (force or t - last_feedback >= ctl.feedback_interval_s):
            cur.send_feedback(write_lsn=durable, flush_lsn=durable, reply=force, force=force)
            sent = durable
            last_feedback = t
            if ctl.on_confirm:
                ctl.on_confirm(durable)

    def flush() -> None:
        nonlocal durable
        batch.flush()
        if pending > durable:
            durable = pending

    while True:
        msg = read()
        if msg is not None:
            n += 1
            data = decode(msg.payload)
            action = data["action"]
            if action == "B":
                builder.begin(data)
                in_txn = True
            elif action == "C":
                pos = builder.commit(data)
                in_txn = False
                if pos > pending:
                    pending = pos
                if not batch.count and pending > durable:
                    durable = pending
            elif action == "M":
                if not in_txn:
                    pos = lsn_to_int(data["lsn"])
                    if pos > pending:
                        pending = pos
                    if not batch.count and pending > durable:
                        durable = pending
            else:
                out = builder.change(data)
                stats["changes"] += 1
                if out is not None:
                    batch.add(out[0], out[1])
                    if batch.count >= max_events:
                        flush()
                        confirm()
            if n & 0x3FF:
                continue
            # every 1024 messages: time-based duties while the stream is busy
        else:
            # drained: nothing more to read right now
            if not in_txn and not batch.count:
                wal_end = cur.wal_end
                if wal_end and wal_end > durable:
                    durable = pending = wal_end
        now = time.monotonic()
        if batch.count and (now - batch.started >= max_s or (msg is None and not in_txn)):
            flush()
        confirm()
        if ctl.stop.is_set():
            flush()
            confirm(force=True)
            return "stopped", durable
        if now >= next_poll:
            next_poll = now + ctl.poll_s
            if not want_restart and ctl.should_restart():
                want_restart = True
        if want_restart and not in_txn:
            flush()
            confirm(force=True)
            return "restart", durable
        if ctl.target is not None and durable >= ctl.target and not in_txn:
            flush()
            confirm(force=True)
            return "caught_up", durable
        if next_heartbeat is not None and now >= next_heartbeat and ctl.heartbeat is not None:
            ctl.heartbeat()
            next_heartbeat = time.monotonic() + ctl.heartbeat_interval_s
        if msg is None:
            timeout = 0.2
            if batch.count:
                timeout = max(0.0, min(timeout, batch.started + max_s - now))
            select.select([fileno], [], [], timeout)


def describe_lsn(value: int) -> str:
    return int_to_lsn(value)
