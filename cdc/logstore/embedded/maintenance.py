"""Compaction and retention of the embedded store's topics (what Kafka's log cleaner does).

* Compaction (compacted topics) keeps the newest record of every key, drops a tombstone once it is
  older than ``delete_retention_ms`` and never removes a record younger than ``min_compaction_lag_ms``,
  nor one at or past the committed position of a consumer of the topic (one that committed a position
  in it within :data:`CONSUMER_HOLD_MS`): what a consumer has not read yet is kept for it, however old
  (a change event may need the one before it: an update without its unchanged TOAST columns needs the
  key's insert, and the apply job may be down for longer than the lag).
  Ages are measured from the time the record was appended to the store (not from its
  ``timestamp_ms``, which the producer may set to the source's commit time). It rewrites a few batches
  per transaction (:data:`BATCHES_PER_TXN`), so appends and reads wait at most for one small
  transaction, and lets a waiting appender take the GIL between batches. Offsets never change.
* Retention (non-compacted topics) drops whole batches appended more than ``retention_ms`` ago, or
  oldest first while a partition holds more than ``retention_bytes`` of stored batch data, and moves
  the start offset to the first batch kept.

Both run under the topic's ``maintenance`` lock, on the store's connection (``compact()``,
``enforce_retention()``) or the background thread's own (:func:`maintenance_conn`). The clock is
:func:`cdc.logstore.now_ms`, looked up at each call (tests move it forward instead of sleeping).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from contextlib import AbstractContextManager
from typing import Any

from cdc import logstore
from cdc.logstore.embedded.codec import MSGPACK_NIL, RAW_DECODER, RawRecord, pack, unpack
from cdc.logstore.embedded.files import CONSUMERS_FILE, Guard, TopicHandle, connect, tombstone_wait, write_txn

__all__ = [
    "BATCHES_PER_TXN",
    "CONSUMER_HOLD_MS",
    "DIRTY_RATIO",
    "apply_retention",
    "compact_topic",
    "consumer_holds",
    "maintenance_conn",
]

#: background compaction of a partition starts when the records appended since its last compaction
#: and older than ``min_compaction_lag_ms`` (cleanable) reach this fraction of its live records
#: (Kafka's min.cleanable.dirty.ratio), or a tombstone is due
DIRTY_RATIO = 0.5
#: batches rewritten per compaction transaction (keeps each write transaction short)
BATCHES_PER_TXN = 16
#: a consumer that has committed no position in a topic for this long no longer holds its compaction
#: back (as Kafka forgets a group's offsets after ``offsets.retention.minutes``, 7 days by default)
CONSUMER_HOLD_MS = 7 * 24 * 3600 * 1000


def _yield_gil() -> None:
    """Let a waiting thread (the writer's appends) take the GIL now rather than after the switch
    interval: maintenance runs beside appends in the same process and must not hold them up."""
    time.sleep(0)


def consumer_holds(t: TopicHandle, now: int) -> dict[int, int]:
    """Per partition of ``t``, the lowest next offset of the consumers that committed one within
    :data:`CONSUMER_HOLD_MS` of ``now``: compaction removes nothing at or past it. Partitions without
    such a position are absent (compacted by age alone)."""
    path = t.path.parent / CONSUMERS_FILE
    if not path.exists():
        return {}
    with Guard(path):
        conn = connect(path)
        try:
            rows = conn.execute(
                "SELECT partition, min(next_offset) FROM positions WHERE topic = ? AND committed_ms >= ? "
                "GROUP BY partition",
                (t.name, now - CONSUMER_HOLD_MS),
            ).fetchall()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):  # created a moment ago, its table not yet
                return {}
            raise
        finally:
            conn.close()
    return {int(p): int(o) for p, o in rows}


def maintenance_conn(t: TopicHandle, conn: sqlite3.Connection | None) -> sqlite3.Connection:
    """``conn``, or the background thread's own connection to ``t`` (call under ``t.maintenance``)."""
    if conn is not None:
        return conn
    if t.bg_conn is None:
        with t.guard:
            t.bg_conn = connect(t.path, writer=True)
    return t.bg_conn


def compact_topic(
    t: TopicHandle,
    conn: sqlite3.Connection | None,
    *,
    store_lock: AbstractContextManager[Any],
    compress: bool,
    only_if_due: bool = False,
) -> int:
    """Compact every partition of ``t`` (see the module docstring); return the records removed.
    ``conn`` is the store's connection to ``t`` (used under ``store_lock``) or None for the
    background thread's own connection."""
    removed = 0
    with t.maintenance:
        if t.deleted:
            return 0
        c = maintenance_conn(t, conn)
        lock = store_lock if c is t.conn else contextlib.nullcontext()
        holds = consumer_holds(t, logstore.now_ms())
        for p in range(t.config.partitions):
            removed += _compact_partition(
                t, c, p, lock=lock, compress=compress, only_if_due=only_if_due, hold=holds.get(p)
            )
    return removed


def _compact_partition(
    t: TopicHandle,
    conn: sqlite3.Connection,
    p: int,
    *,
    lock: AbstractContextManager[Any],
    compress: bool,
    only_if_due: bool,
    hold: int | None = None,
) -> int:
    """Compact partition ``p``; records at or past ``hold`` (a consumer's position) are kept."""
    cfg = t.config
    held = hold if hold is not None else 1 << 63
    now = logstore.now_ms()
    horizon = now - cfg.min_compaction_lag_ms  # batches appended at or before it are cleanable
    with t.guard:
        with lock:
            records, dirty, due = conn.execute(
                "SELECT records, dirty, tombstone_due_ms FROM partitions WHERE partition = ?", (p,)
            ).fetchone()
            if only_if_due and not (due is not None and due <= now):
                if not (dirty > 0 and dirty >= DIRTY_RATIO * records):
                    return 0
                if _cleanable_dirt(conn, p, dirty, horizon) < DIRTY_RATIO * records:
                    return 0
        tomb_horizon = now - cfg.delete_retention_ms
        newest, cleanable = _newest_offsets(conn, p, lock=lock, horizon=horizon)
        # Pass 2, a few batches at a time: rewrite the cleanable batches that hold superseded records
        # or expired tombstones (only this instance writes the topic, so they are as pass 1 saw them).
        removed = 0
        for i in range(0, len(cleanable), BATCHES_PER_TXN):
            chunk = cleanable[i : i + BATCHES_PER_TXN]
            changes = _superseded(
                conn, p, chunk, lock=lock, newest=newest, held=held, tomb_horizon=tomb_horizon
            )
            if changes:
                with lock, t.write_lock:
                    removed += _rewrite_batches(conn, p, changes, compress=compress)
        with lock, t.write_lock:
            _update_bookkeeping(conn, p, horizon=horizon, tombstone_wait_ms=tombstone_wait(cfg))
            if removed:
                with contextlib.suppress(sqlite3.OperationalError):
                    conn.execute("PRAGMA incremental_vacuum(256)").fetchall()
    return removed


def _cleanable_dirt(conn: sqlite3.Connection, p: int, dirty: int, horizon: int) -> int:
    """Of partition ``p``'s ``dirty`` records (appended since its last compaction: the newest
    batches, which that compaction left as they were), those appended at or before ``horizon``:
    what a compaction now could clean. Reads the dirty batches' counts only (not their data), newest
    first. A compaction reads every batch, the young ones too, so it is due when this dirt is
    :data:`DIRTY_RATIO` of the partition's records: not while the dirt is all younger than the lag
    (a hot key's updates, a snapshot just written), whose pass would clean nothing."""
    seen = cleanable = 0
    cur = conn.execute(f"SELECT count, append_ms FROM p{p} ORDER BY last_offset DESC")
    try:
        for count, append_ms in cur:
            if seen >= dirty:
                break
            seen += count
            if append_ms <= horizon:
                cleanable += count
    finally:
        cur.close()
    return cleanable


def _newest_offsets(
    conn: sqlite3.Connection, p: int, *, lock: AbstractContextManager[Any], horizon: int
) -> tuple[dict[bytes, int], list[int]]:
    """Pass 1 (one read snapshot): the newest offset of every key of partition ``p``, and the last
    offsets of the batches appended at or before ``horizon`` (the cleanable ones). Only keys and
    offsets are kept, so memory is bounded by the number of keys."""
    newest: dict[bytes, int] = {}
    cleanable: list[int] = []
    with lock:
        conn.execute("BEGIN")
        try:
            cur = conn.execute(f"SELECT last_offset, append_ms, data FROM p{p} ORDER BY last_offset")
            for last, append_ms, data in cur:
                for row in RAW_DECODER.decode(unpack(data)):
                    newest[row.key] = row.offset
                if append_ms <= horizon:
                    cleanable.append(last)
                _yield_gil()
        finally:
            conn.execute("COMMIT")
    return newest, cleanable


#: a batch to rewrite: its last offset, its stored size, the records it loses, the records it keeps
_Change = tuple[int, int, int, list[RawRecord]]


def _superseded(
    conn: sqlite3.Connection,
    p: int,
    chunk: list[int],
    *,
    lock: AbstractContextManager[Any],
    newest: dict[bytes, int],
    held: int,
    tomb_horizon: int,
) -> list[_Change]:
    """The batches of ``chunk`` (last offsets) that hold a record superseded by a newer one of its
    key, or a tombstone appended at or before ``tomb_horizon``; records at or past ``held`` stay."""
    with lock:
        stored = conn.execute(
            f"SELECT last_offset, append_ms, data FROM p{p} WHERE last_offset IN ({','.join('?' * len(chunk))})",
            chunk,
        ).fetchall()
    changes: list[_Change] = []
    for last, append_ms, data in stored:
        rows = RAW_DECODER.decode(unpack(data))
        expired = append_ms <= tomb_horizon
        keep = [
            r
            for r in rows
            if r.offset >= held or (newest[r.key] == r.offset and not (expired and r.value == MSGPACK_NIL))
        ]
        if len(keep) != len(rows):
            changes.append((last, len(data), len(rows) - len(keep), keep))
        _yield_gil()
    return changes


def _rewrite_batches(conn: sqlite3.Connection, p: int, changes: list[_Change], *, compress: bool) -> int:
    """Rewrite (or delete, when nothing is kept) the batches of ``changes`` in one transaction and
    update the partition's counts; return the records removed. Call under the topic's write lock."""
    delta_bytes = 0
    delta_records = 0
    with write_txn(conn):
        for last, nbytes, gone, keep in changes:
            if keep:
                data = pack(keep, compress)
                tombs = sum(1 for r in keep if r.value == MSGPACK_NIL)
                conn.execute(
                    f"UPDATE p{p} SET count = ?, tombstones = ?, data = ? WHERE last_offset = ?",
                    (len(keep), tombs, data, last),
                )
                delta_bytes += nbytes - len(data)
            else:
                conn.execute(f"DELETE FROM p{p} WHERE last_offset = ?", (last,))
                delta_bytes += nbytes
            delta_records += gone
        conn.execute(
            "UPDATE partitions SET records = records - ?, bytes = bytes - ? WHERE partition = ?",
            (delta_records, delta_bytes, p),
        )
    return delta_records


def _update_bookkeeping(conn: sqlite3.Connection, p: int, *, horizon: int, tombstone_wait_ms: int) -> None:
    """Record what is left dirty in partition ``p`` (batches appended after ``horizon``) and when its
    oldest kept tombstone is due. Call under the topic's write lock."""
    with write_txn(conn):
        young, oldest_tomb = conn.execute(
            f"SELECT coalesce(sum(CASE WHEN append_ms > ? THEN count END), 0), "
            f"min(CASE WHEN tombstones > 0 THEN append_ms END) FROM p{p}",
            (horizon,),
        ).fetchone()
        conn.execute(
            "UPDATE partitions SET dirty = ?, tombstone_due_ms = ? WHERE partition = ?",
            (young, None if oldest_tomb is None else oldest_tomb + tombstone_wait_ms, p),
        )


def apply_retention(
    t: TopicHandle, conn_or_none: sqlite3.Connection | None, *, store_lock: AbstractContextManager[Any]
) -> int:
    """Drop whole batches of a non-compacted topic past ``retention_ms``/``retention_bytes``
    (see the module docstring); return the records removed. ``conn_or_none`` as for
    :func:`compact_topic`."""
    cfg = t.config
    removed = 0
    with t.maintenance, t.guard:
        if t.deleted:
            return 0
        conn = maintenance_conn(t, conn_or_none)
        lock = store_lock if conn is t.conn else contextlib.nullcontext()
        for p in range(cfg.partitions):
            cutoff = None if cfg.retention_ms is None else logstore.now_ms() - cfg.retention_ms
            while True:
                with lock, t.write_lock, write_txn(conn):
                    total, end = conn.execute(
                        "SELECT bytes, end_offset FROM partitions WHERE partition = ?", (p,)
                    ).fetchone()
                    rows = conn.execute(
                        f"SELECT last_offset, count, append_ms, length(data) FROM p{p} "
                        f"ORDER BY last_offset LIMIT {BATCHES_PER_TXN}"
                    ).fetchall()
                    drop: list[tuple[int, int, int]] = []
                    for last, count, append_ms, nbytes in rows:
                        too_old = cutoff is not None and append_ms <= cutoff
                        too_big = cfg.retention_bytes is not None and total > cfg.retention_bytes
                        if not (too_old or too_big):
                            break
                        drop.append((last, count, nbytes))
                        total -= nbytes
                    if drop:
                        conn.executemany(f"DELETE FROM p{p} WHERE last_offset = ?", [(d[0],) for d in drop])
                        nxt = conn.execute(f"SELECT min(base_offset) FROM p{p}").fetchone()[0]
                        conn.execute(
                            "UPDATE partitions SET start_offset = ?, records = records - ?, bytes = bytes - ? "
                            "WHERE partition = ?",
                            (
                                end if nxt is None else nxt,
                                sum(d[1] for d in drop),
                                sum(d[2] for d in drop),
                                p,
                            ),
                        )
                if not drop:
                    break
                removed += sum(d[1] for d in drop)
        if removed:
            with lock, t.write_lock, contextlib.suppress(sqlite3.OperationalError):
                conn.execute("PRAGMA incremental_vacuum(256)").fetchall()
    return removed
