"""The libpq reader (cdc.codec._native.CopyStream: the stream read with libpq from the compiled
module, the row changes into the batch without a Python object each) against its Python reference
(psycopg2's ``read_message`` and the Python per-change path, ``CDC_NATIVE=0``), on a real server,
with both decoders:

* the same raw messages (payload and ``data_start``) as ``read_message`` reads from a slot of the
  same start;
* the whole session (:func:`cdc.reader.replication.stream`) writes byte-identical records: multi-MB
  values with quotes, newlines and backslashes, an unchanged TOAST value, a key change, deletes, a
  TRUNCATE, a logical message, and (pgoutput) a transaction large enough to be streamed in blocks,
  which pgoutput's ``source()`` spools and returns at its commit;
* an idle session outlives a ``wal_sender_timeout`` of 2 s: the keepalives that ask for a reply
  are answered;
* a connection lost raises the psycopg2 exception the reader's caller retries, with libpq's message.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import psycopg2
import psycopg2.errors
import pytest

from cdc.catalog import describe_table
from cdc.codec import Decoder
from cdc.codec.compiled import native_module
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.codec.pgoutput import PgOutput
from cdc.codec.wal2json import DECODER as WAL2JSON
from cdc.connect import SESSION_OPTIONS, connect_replication
from cdc.logstore import Record, TopicConfig
from cdc.logstore.batch import Batch
from cdc.logstore.embedded import EmbeddedLogStore
from cdc.reader import replication
from cdc.reader.replication import StreamControl, stream
from cdc.registry import TableReg
from tests.plugins.postgres import PgCluster

pytestmark = pytest.mark.skipif(
    native_module() is None, reason="cdc.codec._native is not built (or CDC_NATIVE=0)"
)

PUBLICATION = "cdc_pub"
TABLES = ("t", "full_t", "tr")
SCHEMA = [
    "CREATE TABLE t (id int PRIMARY KEY, a text, big text, n numeric, f float8, ok boolean, b bytea, j jsonb)",
    "CREATE TABLE full_t (id int, v text)",
    "ALTER TABLE full_t REPLICA IDENTITY FULL",
    "CREATE TABLE tr (id int PRIMARY KEY)",
    f"CREATE PUBLICATION {PUBLICATION} FOR TABLE t, full_t, tr",
]
UGLY = "quote ' \" back\\slash \\x41 new\nline tab\t é ü 中 {braces}, [1,2]"
#: rows of the streamed transaction (logical_decoding_work_mem 64 kB: sent in stream blocks)
STREAMED = 3000
CHANGES: list[tuple[str, tuple[Any, ...]]] = [
    (
        "INSERT INTO t VALUES (1, %s, (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 1000) g),"
        " 12345678901234567890.5, 'NaN', true, '\\x00ff275c'::bytea, '{\"k\": \"x\\ny\"}')",
        (UGLY,),
    ),
    ("INSERT INTO t (id, a) VALUES (2, repeat(%s, 60000))", (UGLY,)),  # ~4 MB of ugly text
    ("INSERT INTO t (id, a, n) VALUES (3, %s, 'Infinity')", (UGLY,)),
    ("UPDATE t SET a = 'changed' WHERE id = 1", ()),  # big: an unchanged TOAST value
    ("UPDATE t SET id = 10, f = 2.5 WHERE id = 3", ()),  # a primary-key change
    ("UPDATE t SET a = a || 'x' WHERE id = 2", ()),  # a multi-MB update
    ("DELETE FROM t WHERE id = 10", ()),
    ("INSERT INTO full_t VALUES (1, 'a'), (2, %s)", (UGLY,)),
    ("UPDATE full_t SET v = 'a2' WHERE id = 1", ()),
    ("DELETE FROM full_t WHERE id = 2", ()),
    ("INSERT INTO tr VALUES (1), (2)", ()),
    ("TRUNCATE tr", ()),
    ("SELECT pg_logical_emit_message(true, 'cdc_heartbeat', 'in a transaction')", ()),
    (
        f"INSERT INTO t (id, a) SELECT g, 'row ' || g || %s FROM generate_series(100, {99 + STREAMED}) g",
        (UGLY,),
    ),
    ("DELETE FROM t WHERE id >= 100 AND id % 7 = 0", ()),
]
#: the libpq reader's constructor (the tests wrap it to keep what it made)
COPY_STREAM = replication.copy_stream
#: the session's options: small decoding memory (pgoutput streams the big transaction in blocks)
OPTIONS = SESSION_OPTIONS + " -c logical_decoding_work_mem=64kB"


def _decoder(name: str, dsn: str) -> Decoder:
    if name == "wal2json":
        return WAL2JSON
    conn = psycopg.connect(dsn, autocommit=True)

    def type_name(oid: int, typmod: int) -> str:
        row = conn.execute("SELECT format_type(%s, %s)", (oid, typmod)).fetchone()
        assert row is not None
        return str(row[0])

    return PgOutput(type_name, PUBLICATION, conn.info.server_version)


def _lsn(text: str) -> int:
    hi, _, lo = text.partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


@pytest.fixture
def source(pg: PgCluster, pg_db: str) -> Iterator[Callable[[str, int], int]]:
    """Makes the schema; returns ``changes(plugin, slots)``: that many slots of ``plugin``
    (``s0``, ``s1``, ...) created, then the changes made; the position after them."""
    dsn = pg.dsn(pg_db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stmt in SCHEMA:
            conn.execute(stmt)

    def changes(plugin: str, slots: int) -> int:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for i in range(slots):
                conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", (f"s{i}", plugin))
            for stmt, args in CHANGES:
                conn.execute(stmt, args or None)
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            assert row is not None
            return _lsn(row[0])

    yield changes


def _raw(dsn: str, slot: str, decoder: Decoder, end: int, libpq: bool) -> list[tuple[bytes, int]]:
    """The raw messages of ``slot`` up to ``end``, read with the libpq reader or ``read_message``."""
    conn = connect_replication(dsn, options=OPTIONS, application_name="cdc-test")
    try:
        cur = conn.cursor()
        cur.start_replication(
            slot_name=slot,
            decode=False,
            options=decoder.replication_options([("public", t) for t in TABLES]),
            status_interval=10,
        )
        copy = replication.copy_stream(cur, lambda: cur.send_feedback(force=True)) if libpq else None
        read = copy if copy is not None else cur.read_message
        out: list[tuple[bytes, int]] = []
        deadline = time.monotonic() + 120
        while True:
            raw = read()
            if raw is None:
                if (copy.wal_end if copy is not None else cur.wal_end) >= end and out:
                    return out
                assert time.monotonic() < deadline, f"timed out reading slot {slot}"
                select.select([conn], [], [], 0.5)  # wait for the server (not a sleep)
                continue
            out.append((raw.payload, raw.data_start))
    finally:
        if copy is not None:
            copy.close()
        conn.close()


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
def test_the_libpq_reader_reads_what_read_message_reads(
    pg: PgCluster, pg_db: str, source: Callable[[str, int], int], plugin: str
) -> None:
    dsn = pg.dsn(pg_db)
    end = source(plugin, 2)
    decoder = _decoder(plugin, dsn)
    ref = _raw(dsn, "s0", decoder, end, libpq=False)
    got = _raw(dsn, "s1", decoder, end, libpq=True)
    assert len(ref) > STREAMED
    assert max(len(p) for p, _ in ref) > 3_500_000  # the multi-MB value
    if plugin == "pgoutput":
        assert any(p[:1] == b"S" for p, _ in ref)  # the big transaction came in stream blocks
    assert got == ref


class _Kept:
    """A store's appends, kept (the records the session wrote, in order)."""

    def __init__(self, store: EmbeddedLogStore) -> None:
        self.store = store
        self.records: list[tuple[str, Record]] = []

    def append_many(self, batch: Any) -> Any:
        for topic, records in batch.items():
            self.records.extend((topic, r) for r in records)
        return self.store.append_many(batch)


def _session(
    dsn: str, slot: str, plugin: str, end: int, tmp: Path, monkeypatch: pytest.MonkeyPatch, *, native: bool
) -> tuple[list[tuple[str, Record]], dict[str, int], Any]:
    """One :func:`stream` session of ``slot`` to ``end``: the records written, its stats and the
    libpq reader it used (None: psycopg2's ``read_message``)."""
    monkeypatch.setenv("CDC_NATIVE", "1" if native else "0")
    decoder = _decoder(plugin, dsn)
    codecs: dict[tuple[str, str], TableCodec] = {}
    with psycopg.connect(dsn) as conn:
        for name in TABLES:
            desc = describe_table(conn, "public", name)
            reg = TableReg(
                "public", name, f"cdc.public.{name}", desc.primary_key or ("id",), columns=desc.columns
            )
            codecs[("public", name)] = TableCodec(reg, prefix="cdc", db="app", partitions=2, decoder=decoder)
    store = EmbeddedLogStore(tmp / slot, writer=True, compaction_interval_s=None)
    for codec in codecs.values():
        store.create_topic(codec.topic, TopicConfig(partitions=2, compacted=True))
    kept = _Kept(store)
    builder = EventBuilder(codecs)
    batch = Batch(kept)  # type: ignore[arg-type]
    made: list[Any] = []

    def keep(cur: Any, on_keepalive: Callable[[], object]) -> Any:
        made.append(COPY_STREAM(cur, on_keepalive))
        return made[-1]

    monkeypatch.setattr(replication, "copy_stream", keep)
    monkeypatch.setattr(replication, "SESSION_OPTIONS", OPTIONS)
    ctl = StreamControl(stop=threading.Event(), should_restart=lambda: False, target=end)
    try:
        reason, _ = stream(
            dsn, slot, [("public", t) for t in TABLES], 0, builder, batch, ctl, decoder=decoder
        )
    finally:
        batch.close()
        store.close()
        decoder.close()
    assert reason == "caught_up"
    return kept.records, ctl.stats, made[0]


@pytest.mark.parametrize("plugin", ["pgoutput", "wal2json"])
def test_a_session_through_the_libpq_reader_writes_the_reference_records(
    pg: PgCluster,
    pg_db: str,
    source: Callable[[str, int], int],
    plugin: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dsn = pg.dsn(pg_db)
    end = source(plugin, 2)
    monkeypatch.setattr(EventBuilder, "tick", lambda self: setattr(self, "now", b"1700000000000"))
    ref, ref_stats, none = _session(dsn, "s0", plugin, end, tmp_path, monkeypatch, native=False)
    got, stats, copy = _session(dsn, "s1", plugin, end, tmp_path, monkeypatch, native=True)
    assert none is None and copy is not None  # the reference read with psycopg2, the other with libpq
    # the fallback to read_message is counted (the reader's metric), the libpq reader's session not
    assert ref_stats[replication.FALLBACKS] == 1 and replication.FALLBACKS not in stats
    assert copy.messages > STREAMED
    # read into the batch without an object per change (pgoutput: not the streamed transaction's,
    # which its source spools and returns at the commit; the deletes after it)
    assert copy.direct > (STREAMED if plugin == "wal2json" else STREAMED // 7)
    # the compiled path took the row changes (else this compares the Python path with itself)
    assert stats["changes"] == ref_stats["changes"] > STREAMED
    assert stats.get("native_python_changes", 0) < 20
    assert max(len(r.value or b"") for _, r in ref) > 3_500_000
    # per topic, in order (a batch holds its topics' records apart: how the topics interleave
    # depends on where the batches were cut, which is time)
    for topic in {t for t, _ in ref}:
        mine = [(r.key, r.value) for t, r in got if t == topic]
        assert mine == [(r.key, r.value) for t, r in ref if t == topic], topic
    assert len(got) == len(ref)


@pytest.mark.parametrize("native", [True, False], ids=["libpq", "read_message"])
def test_an_idle_session_outlives_a_short_wal_sender_timeout(
    pg: PgCluster, pg_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """wal_sender_timeout 2 s (status updates every 10 s): the walsender asks for a reply after 1 s
    of silence; the session must answer every time, and still stream after 3 timeouts."""
    dsn = pg.dsn(pg_db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stmt in SCHEMA:
            conn.execute(stmt)
        conn.execute("SELECT pg_create_logical_replication_slot('idle', 'pgoutput')")
    monkeypatch.setenv("CDC_NATIVE", "1" if native else "0")
    monkeypatch.setattr(replication, "SESSION_OPTIONS", SESSION_OPTIONS + " -c wal_sender_timeout=2s")
    decoder = _decoder("pgoutput", dsn)
    with psycopg.connect(dsn) as conn:
        desc = describe_table(conn, "public", "tr")
    reg = TableReg("public", "tr", "cdc.public.tr", ("id",), columns=desc.columns)
    codec = TableCodec(reg, prefix="cdc", db="app", partitions=1, decoder=decoder)
    store = EmbeddedLogStore(tmp_path / "log", writer=True, compaction_interval_s=None)
    store.create_topic(codec.topic, TopicConfig(partitions=1, compacted=True))
    kept = _Kept(store)
    batch = Batch(kept)  # type: ignore[arg-type]
    made: list[Any] = []
    monkeypatch.setattr(
        replication, "copy_stream", lambda cur, k: made.append(COPY_STREAM(cur, k)) or made[-1]
    )
    ctl = StreamControl(stop=threading.Event(), should_restart=lambda: False)
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(
                stream(
                    dsn,
                    "idle",
                    [("public", "tr")],
                    0,
                    EventBuilder({("public", "tr"): codec}),
                    batch,
                    ctl,
                    decoder=decoder,
                )
            )
        except BaseException as exc:  # handed to the test's thread
            result.append(exc)

    def walsender() -> int | None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'idle'"
            ).fetchone()
            return None if row is None else row[0]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while (pid := walsender()) is None:
            assert time.monotonic() < deadline and not result, result
            select.select([], [], [], 0.1)  # poll with a deadline
        idle_until = time.monotonic() + 7  # > 3 timeouts of silence from the source
        while time.monotonic() < idle_until:
            assert not result, f"the session ended while idle: {result}"
            assert walsender() == pid, "the walsender was replaced: the session was timed out"
            select.select([], [], [], 0.2)  # poll with a deadline
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO tr VALUES (42)")
        deadline = time.monotonic() + 30
        while not any(t == codec.topic for t, _ in kept.records):
            assert time.monotonic() < deadline and not result, result
            select.select([], [], [], 0.1)
        assert walsender() == pid
    finally:
        ctl.stop.set()
        thread.join(30)
        batch.close()
        store.close()
    assert result and result[0][0] == "stopped", result
    if native:
        (copy,) = made
        assert copy.replies >= 2, "no keepalive asked for a reply: the test did not test it"
    else:
        assert made == [None]


def test_a_lost_connection_raises_the_psycopg2_error_the_caller_retries(
    pg: PgCluster, pg_db: str, source: Callable[[str, int], int]
) -> None:
    dsn = pg.dsn(pg_db)
    source("pgoutput", 1)
    decoder = _decoder("pgoutput", dsn)
    conn = connect_replication(dsn, options=OPTIONS, application_name="cdc-test-lost")
    try:
        cur = conn.cursor()
        cur.start_replication(
            slot_name="s0", decode=False, options=decoder.replication_options([]), status_interval=10
        )
        copy = replication.copy_stream(cur, lambda: cur.send_feedback(force=True))
        assert copy is not None
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 's0'"
            )
        deadline = time.monotonic() + 30
        with pytest.raises(psycopg2.OperationalError) as info:
            while True:  # the messages already sent, then the error
                if copy() is None:
                    assert time.monotonic() < deadline
                    select.select([conn], [], [], 0.5)
        assert "terminat" in str(info.value) or "closed" in str(info.value), str(info.value)
        copy.close()
        with pytest.raises(psycopg2.OperationalError, match="closed"):
            copy()
    finally:
        conn.close()


def test_the_libpq_readers_errors_are_psycopg2s_classes() -> None:
    """As psycopg2 raises them: the class of the SQLSTATE, else OperationalError (lost connection)."""
    assert type(replication.stream_error("x", "57P01")) is psycopg2.errors.AdminShutdown
    assert type(replication.stream_error("x", "42704")) is psycopg2.errors.UndefinedObject  # slot gone
    for sqlstate in (None, "", "ZZ999"):
        err = replication.stream_error("server closed the connection unexpectedly", sqlstate)
        assert (
            type(err) is psycopg2.OperationalError and str(err) == "server closed the connection unexpectedly"
        )


def test_a_session_read_without_the_libpq_reader_says_so_once_and_counts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fallback to psycopg2's ``read_message`` is no longer silent: each session counts in
    ``libpq_reader_fallbacks`` (the reader's metric, in ``cdc status --json``), and the reader's log
    says it once, with why."""
    monkeypatch.setenv("CDC_NATIVE", "0")
    logged: list[str] = []
    ctl = StreamControl(stop=threading.Event(), should_restart=lambda: False, log=logged.append)
    for _ in range(3):  # three sessions (a restart each)
        replication._fell_back(ctl)
    assert ctl.stats[replication.FALLBACKS] == 3
    assert len(logged) == 1 and "read_message" in logged[0] and "CDC_NATIVE=0" in logged[0], logged
    native = native_module()
    if native is None:
        return
    monkeypatch.setenv("CDC_NATIVE", "1")

    def missing(_module: str) -> None:
        raise ImportError("libpq's PQgetCopyData is not found through psycopg2's module")

    monkeypatch.setattr(native, "libpq_resolve", missing)
    why = replication.copy_stream_missing()
    assert "psycopg2's libpq cannot be used" in why and "PQgetCopyData" in why
