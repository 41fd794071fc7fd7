"""The stream loop's confirmation rule, against a scripted replication cursor and a slow store (pure
logic: the real stream is tested in test_reader.py / test_run.py).

Invariant checked at every feedback: every change of every transaction whose commit ends at or
before the confirmed position is already durable in the store, and the position is a transaction
boundary (a commit's ``nextlsn``, a heartbeat, or a keepalive's ``wal_end`` while idle)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.events import int_to_lsn
from cdc.logstore import Record
from cdc.logstore.batch import Batch
from cdc.reader.replication import StreamControl, _loop
from cdc.registry import Column, TableReg


@dataclass
class Msg:
    payload: bytes
    data_start: int = 0  # wal2json repeats it inside the message


class FakeStore:
    """Records appended, durable after a delay (so batches are in flight while the loop goes on)."""

    def __init__(self, delay: float = 0.002) -> None:
        self.delay = delay
        self.keys: list[bytes] = []
        self.appends = 0
        self.lock = threading.Lock()

    def append_many(self, batch: Mapping[str, Sequence[Record]]) -> dict[str, dict[int, int]]:
        time.sleep(self.delay)
        with self.lock:
            self.appends += 1
            for records in batch.values():
                self.keys.extend(r.key for r in records)
        return {}


@dataclass
class FakeCursor:
    """Plays a script of messages; ``None`` entries are "drained" moments (read_message -> None)
    with the given wal_end."""

    script: list[tuple[bytes | None, int]]
    store: FakeStore
    commits: list[tuple[int, set[bytes]]]  # (nextlsn, keys of that transaction)
    stop: threading.Event = field(default_factory=threading.Event)
    feedback: list[int] = field(default_factory=list)
    wal_end: int = 0
    pos: int = 0

    def __post_init__(self) -> None:
        r, w = os.pipe()
        os.write(w, b"x")  # always readable: select() never waits
        self._fd = r
        self.connection = self

    def fileno(self) -> int:
        return self._fd

    def read_message(self) -> Msg | None:
        if self.pos >= len(self.script):
            self.stop.set()  # end of the script: SIGTERM
            return None
        payload, wal_end = self.script[self.pos]
        self.pos += 1
        self.wal_end = wal_end
        return None if payload is None else Msg(payload)

    def send_feedback(self, *, write_lsn: int, flush_lsn: int, reply: bool, force: bool) -> None:
        with self.store.lock:
            durable = set(self.store.keys)
        for nextlsn, keys in self.commits:
            if nextlsn <= flush_lsn:
                missing = keys - durable
                assert not missing, (
                    f"confirmed {int_to_lsn(flush_lsn)} before {sorted(missing)[:3]} were durable"
                )
        # as psycopg2 does: without ``force`` the position is only stored, and sent with the next
        # automatic status message (every ``status_interval``, 10 s): ``feedback`` is what was sent
        if force:
            self.feedback.append(flush_lsn)


Script = list[tuple[bytes | None, int]]


def build_script(
    txns: int, per_txn: int, sizes: Sequence[int] = ()
) -> tuple[Script, list[tuple[int, set[bytes]]], set[int]]:
    """Transactions of inserts (``per_txn`` each, or ``sizes``' counts); returns the script, per
    commit (nextlsn, keys), and the keepalive positions seen between transactions (the only
    non-commit positions that may be confirmed)."""
    script: Script = []
    idle: set[int] = set()
    commits: list[tuple[int, set[bytes]]] = []
    lsn = 0x1000
    key = 0
    for t in range(txns):
        per_txn = sizes[t] if sizes else per_txn
        commit_lsn = lsn + per_txn * 0x100 + 0x80
        nextlsn = commit_lsn + 0x30

        def m(d: dict[str, Any]) -> bytes:
            return orjson.dumps(d)

        script.append(
            (
                m(
                    {
                        "action": "B",
                        "xid": t,
                        "lsn": int_to_lsn(commit_lsn),
                        "nextlsn": int_to_lsn(nextlsn),
                        "timestamp": "2026-11-22 02:28:58+00",
                    }
                ),
                lsn,
            )
        )
        keys: set[bytes] = set()
        for _ in range(per_txn):
            lsn += 0x100
            key += 1
            keys.add(orjson.dumps({"id": key}))
            script.append(
                (
                    m(
                        {
                            "action": "I",
                            "xid": t,
                            "lsn": int_to_lsn(lsn),
                            "schema": "public",
                            "table": "t",
                            "columns": [{"name": "id", "type": "integer", "value": key}],
                        }
                    ),
                    lsn,
                )
            )
            if key % 7 == 0:
                script.append((None, lsn))  # drained mid-transaction: wal_end must not be confirmed
        script.append(
            (
                m({"action": "C", "xid": t, "lsn": int_to_lsn(commit_lsn), "nextlsn": int_to_lsn(nextlsn)}),
                commit_lsn,
            )
        )
        commits.append((nextlsn, keys))
        lsn = nextlsn + 0x10
        if t % 3 == 0:
            script.append((None, lsn))  # drained between transactions: keepalive position
            idle.add(lsn)
    return script, commits, idle


def run_loop(
    script: Script,
    commits: list[tuple[int, set[bytes]]],
    target: int | None,
    batch_max_events: int,
    *,
    batch_max_ms: int = 1,
    batch_linger_ms: int = 0,
    cursor: Callable[[Script, FakeStore, list[tuple[int, set[bytes]]]], FakeCursor] | None = None,
    stats: dict[str, int] | None = None,
) -> tuple[FakeCursor, FakeStore, str, int]:
    store = FakeStore()
    cur = (cursor or FakeCursor)(script, store, commits)
    reg = TableReg("public", "t", "cdc.public.t", ("id",), columns=(Column("id", "integer"),))
    builder = EventBuilder({("public", "t"): TableCodec(reg, prefix="cdc", db="d", partitions=2)})
    batch = Batch(store)  # type: ignore[arg-type]
    ctl = StreamControl(
        stop=cur.stop,
        should_restart=lambda: False,
        target=target,
        batch_max_events=batch_max_events,
        batch_max_ms=batch_max_ms,
        batch_linger_ms=batch_linger_ms,
        feedback_interval_s=0.0,
        stats=stats if stats is not None else {"changes": 0},
    )
    try:
        reason, confirmed = _loop(cur, builder, batch, ctl, 0)
    finally:
        batch.close()
    return cur, store, reason, confirmed


def test_feedback_never_runs_ahead_of_durable_events() -> None:
    script, commits, idle = build_script(txns=40, per_txn=23)
    cur, store, reason, confirmed = run_loop(script, commits, target=commits[-1][0], batch_max_events=10)
    assert reason == "caught_up" and confirmed >= commits[-1][0]
    assert len(store.keys) == 40 * 23
    assert cur.feedback == sorted(cur.feedback) and len(cur.feedback) > 5
    assert set(cur.feedback) <= {n for n, _ in commits} | idle


def test_open_transaction_is_written_in_batches_but_never_confirmed() -> None:
    script, commits, _ = build_script(txns=2, per_txn=500)
    # SIGTERM in the middle of the second transaction: its events are made durable (batches of 50
    # while it streams), the first transaction is confirmed, nothing of the second one is
    cut = next(i for i, (p, _) in enumerate(script) if p is not None and b'"xid":1' in p) + 300
    cur, store, reason, confirmed = run_loop(script[:cut], commits, target=None, batch_max_events=50)
    assert reason == "stopped"
    assert confirmed == commits[0][0] and cur.feedback[-1] == commits[0][0]
    assert len(store.keys) > 500


def test_keepalive_position_is_confirmed_when_idle() -> None:
    script: Script = [(None, 0x5000)]
    cur, _store, reason, confirmed = run_loop(script, [], target=0x5000, batch_max_events=10)
    assert reason == "caught_up" and confirmed == 0x5000 and cur.feedback == [0x5000]


class PacedCursor(FakeCursor):
    """The script's transactions arrive one every :attr:`GAP` seconds, as from a rate-limited
    source: ``read_message`` returns None (drained) while the next one has not arrived, and the
    socket (a pipe a feeder thread writes a byte to as each one arrives) is readable only once one
    has. The script's own drained entries are skipped. :attr:`empty_reads` counts the drained
    reads: one per wake-up of the loop. After the script, SIGTERM comes after 10 s (a safety net:
    the loop ends before, caught up)."""

    GAP = 0.005

    def __post_init__(self) -> None:
        r, w = os.pipe()
        os.set_blocking(r, False)
        self._fd, self._w = r, w
        self.connection = self
        self.empty_reads = 0
        self.arrived = 0  # transactions arrived (the feeder's count)
        self.begun = 0  # transactions read
        self.txns = sum(1 for p, _ in self.script if p is not None and p.startswith(b'{"action":"B"'))
        self.ends = time.monotonic() + self.txns * self.GAP + 10
        threading.Thread(target=self._feed, daemon=True).start()

    def _feed(self) -> None:
        t0 = time.monotonic()
        for k in range(self.txns):
            time.sleep(max(0.0, t0 + k * self.GAP - time.monotonic()))
            self.arrived += 1
            os.write(self._w, b"x")

    def read_message(self) -> Msg | None:
        while self.pos < len(self.script) and self.script[self.pos][0] is None:
            self.pos += 1
        if self.pos >= len(self.script) or (
            self.script[self.pos][0].startswith(b'{"action":"B"') and self.begun >= self._arrived()  # type: ignore[union-attr]
        ):
            self.empty_reads += 1
            if time.monotonic() > self.ends:
                self.stop.set()
            return None
        payload, self.wal_end = self.script[self.pos]
        self.pos += 1
        assert payload is not None
        if payload.startswith(b'{"action":"B"'):
            self.begun += 1
        return Msg(payload)

    def _arrived(self) -> int:
        """The transactions arrived so far, the socket emptied first (so a byte is never taken
        for a transaction left unread)."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._fd, 4096)
        return self.arrived


def test_without_a_linger_each_transaction_is_an_append() -> None:
    """A slow stream (drained after every transaction) without a linger: each transaction is an
    append of its own, every change stored, nothing confirmed before it is durable (FakeCursor's check)."""
    script, commits, _ = build_script(txns=30, per_txn=1)
    drained: Script = []
    for entry in script:
        drained.append(entry)
        if entry[0] is not None and b'"action":"C"' in entry[0]:
            drained.append((None, entry[1]))  # nothing more to read after each commit
    _cur, store, reason, confirmed = run_loop(
        drained, commits, target=commits[-1][0], batch_max_events=1000, batch_max_ms=60_000
    )
    assert reason == "caught_up" and confirmed >= commits[-1][0]
    assert len(store.keys) == 30
    assert store.appends >= 25, store.appends


def test_a_lingering_batch_takes_the_transactions_that_arrive_meanwhile_in_one_wake_up() -> None:
    """Transactions arriving every 5 ms with a 50 ms linger share appends, and the loop does not
    wake for each one while its batch lingers: what arrives meanwhile is read in one go when the
    batch is due (a wake-up costs far more than the read). Every change is stored, nothing is
    confirmed before it is durable."""
    script, commits, _ = build_script(txns=60, per_txn=1)
    cur, store, reason, confirmed = run_loop(
        script,
        commits,
        target=commits[-1][0],
        batch_max_events=1000,
        batch_max_ms=60_000,
        batch_linger_ms=50,
        cursor=PacedCursor,
    )
    assert reason == "caught_up" and confirmed >= commits[-1][0]
    assert len(store.keys) == 60
    assert store.appends <= 20, store.appends
    # woken when a batch's first transaction arrives and when it is due, not per transaction
    assert isinstance(cur, PacedCursor)
    assert cur.empty_reads <= 2 * store.appends + 4, (cur.empty_reads, store.appends)


@dataclass
class StreamedCursor(FakeCursor):
    """The first ``first`` messages of the script (its drained entries dropped) arrive one every
    :attr:`GAP` seconds from the first read (by the clock: message ``i`` is there once ``i * GAP``
    has passed), the socket (a pipe) readable all along, as a busy walsender's is; then the stream
    is idle, the socket emptied, until the loop waits on it (its ``_selects`` count grows: polled
    with a deadline), and only then the rest arrives, a byte written to the socket. ``stats``: the
    loop's (its wake-ups: ``_gathers``, waits of :data:`GATHER_S` while the stream flows, and
    ``_selects``, waits on the socket), copied into :attr:`seen` as the ``first``-th message is
    read (``last``), as the rest arrives (``in``) and as its first message is read (``read``).
    After the script, SIGTERM after 10 s (a safety net: the loop ends before, caught up)."""

    GAP = 0.0001

    stats: dict[str, int] = field(default_factory=dict)
    first: int = 0

    def __post_init__(self) -> None:
        self.script = [e for e in self.script if e[0] is not None]
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.write(w, b"x")
        self._fd, self._w = r, w
        self.connection = self
        self.t0 = 0.0
        self.released = False
        self.seen: dict[str, dict[str, int]] = {}
        self.ends = time.monotonic() + 10
        threading.Thread(target=self._release, daemon=True).start()

    def _release(self) -> None:
        deadline = time.monotonic() + 10
        while "last" not in self.seen and time.monotonic() < deadline:
            time.sleep(0.001)
        waited = self.seen.get("last", {}).get("_selects", 0)
        while self.stats.get("_selects", 0) <= waited and time.monotonic() < deadline:
            time.sleep(0.001)
        self.seen["in"] = dict(self.stats)
        self.released = True
        os.write(self._w, b"x")

    def read_message(self) -> Msg | None:
        if not self.t0:
            self.t0 = time.monotonic()
        if self.pos >= len(self.script):
            if time.monotonic() > self.ends:
                self.stop.set()
            return None
        if self.pos < self.first:
            if self.pos * self.GAP > time.monotonic() - self.t0:
                return None  # not there yet
            if self.pos == self.first - 1:
                self.seen["last"] = dict(self.stats)
        elif not self.released:
            with contextlib.suppress(BlockingIOError):
                os.read(self._fd, 4096)  # idle: the socket emptied
            if not self.released:
                return None
        if self.pos == self.first:
            self.seen["read"] = dict(self.stats)
        payload, self.wal_end = self.script[self.pos]
        self.pos += 1
        assert payload is not None
        return Msg(payload)


def test_a_flowing_stream_is_read_many_messages_a_wake_up_and_an_idle_one_at_once() -> None:
    """A transaction of 300 changes whose messages arrive 0.1 ms apart (a walsender's pace), then,
    once the loop waits on the idle stream, a transaction of one change. While the stream flows,
    the loop does not wake at each message: drained, it waits :data:`GATHER_S` and reads what
    arrived meanwhile, many messages a wake-up. Once the stream is idle, the loop waits on the
    socket, not a wait of its own, after at most one gathering wait: the single change is read at
    the wake-up its arrival causes. Every change stored and confirmed."""
    script, commits, _ = build_script(txns=2, per_txn=0, sizes=(300, 1))
    first = 302  # the first transaction's begin, changes and commit
    stats: dict[str, int] = {"changes": 0}

    def streamed(script: Script, store: FakeStore, commits: list[tuple[int, set[bytes]]]) -> FakeCursor:
        return StreamedCursor(script, store, commits, stats=stats, first=first)

    cur, store, reason, confirmed = run_loop(
        script, commits, commits[-1][0], 10_000, batch_max_ms=60_000, cursor=streamed, stats=stats
    )
    assert reason == "caught_up" and confirmed >= commits[-1][0]
    assert len(store.keys) == 301
    assert isinstance(cur, StreamedCursor)
    flowing, came, read = cur.seen["last"], cur.seen["in"], cur.seen["read"]
    wake_ups = flowing.get("_gathers", 0) + flowing.get("_selects", 0)
    assert flowing.get("_gathers", 0) >= 1 and first / max(1, wake_ups) >= 3, flowing
    # idle: at most one gathering wait after the first transaction's last message, then the
    # socket's; the single change is read at the wake-up its arrival causes
    assert came.get("_selects", 0) > flowing.get("_selects", 0), (flowing, came)
    assert came.get("_gathers", 0) - flowing.get("_gathers", 0) <= 1, (flowing, came)
    assert read.get("_gathers", 0) == came.get("_gathers", 0), (came, read)
