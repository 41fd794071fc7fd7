"""pgoutput against wal2json on a real server: the same changes through both decoders give the
same decoded messages and the same event values, except where wal2json 2.5 loses information
(NaN/+-Infinity as null: pgoutput is exact) or says it differently (a partition's changes under the
leaf's name; a B without ``nextlsn``; an empty B/C pair for a transaction without a published
change; a stored generated column, which only wal2json sends), each asserted explicitly. And a
transaction larger than ``logical_decoding_work_mem`` arrives through stream blocks and comes out
of ``source()`` as the committed rows, in order.

Both slots are read with psycopg2's replication protocol, the reader's session options
(``cdc.connect.SESSION_OPTIONS``) and each decoder's own ``replication_options``.
"""

from __future__ import annotations

import select
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import psycopg
import psycopg.sql
import pytest

from cdc.catalog import describe_table
from cdc.codec import Decoder, Message
from cdc.codec.envelope import TableCodec
from cdc.codec.pgoutput import PgOutput
from cdc.codec.values import FLOAT_SPECIALS, text_converter_for
from cdc.codec.wal2json import DECODER as WAL2JSON
from cdc.connect import SESSION_OPTIONS, connect_replication
from cdc.pgtypes import type_kind
from cdc.registry import TableReg
from tests.codec_fakes import SettlingBuilder
from tests.plugins.postgres import PgCluster

PUBLICATION = 'cdc "pub", x.y'  # pgoutput splits publication_names as SQL identifiers
PUB = psycopg.sql.Identifier(PUBLICATION).as_string(None)
BIG = 100_000

SCHEMA = [
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
    "CREATE DOMAIN posint AS integer CHECK (VALUE > 0)",
    "CREATE TABLE t (id int PRIMARY KEY, a text, big text, f float8, r real, n numeric, n2 numeric(40,20),"
    " arr float8[], tags text[], m mood, j jsonb, b bytea, d posint, ts timestamptz, ok boolean,"
    " g int GENERATED ALWAYS AS (id * 2) STORED)",
    "CREATE TABLE full_t (id int, v text, f float8, n numeric)",
    "ALTER TABLE full_t REPLICA IDENTITY FULL",
    "CREATE TABLE p (id int, k int, v text, PRIMARY KEY (id, k)) PARTITION BY RANGE (k)",
    "CREATE TABLE p1 PARTITION OF p FOR VALUES FROM (0) TO (100)",
    "CREATE TABLE p2 PARTITION OF p FOR VALUES FROM (100) TO (200)",
    "CREATE TABLE tr1 (id int PRIMARY KEY)",
    "CREATE TABLE tr2 (id int PRIMARY KEY)",
    "CREATE TABLE bulk (id int PRIMARY KEY, v text)",
    "CREATE TABLE other (id int PRIMARY KEY)",  # not published
    f"CREATE PUBLICATION {PUB} FOR TABLE t, full_t, p, tr1, tr2, bulk"
    " WITH (publish_via_partition_root = true)",
]
#: wal2json's add-tables: the leaves of ``p`` (wal2json names a partition's changes by its leaf)
WAL2JSON_TABLES = [("public", n) for n in ("t", "full_t", "p1", "p2", "tr1", "tr2", "bulk")]

UGLY = "quote ' \" back\\slash \\x41 new\nline tab\t é ü 中 {braces}, [1,2]"
ROW = (
    "INSERT INTO t VALUES (%s, %s, (SELECT string_agg(md5(g::text), '') FROM generate_series(1, 1000) g),"
    " %s::float8, %s::real, %s::numeric, 12345678901234567890.12345678901234567891,"
    " ARRAY[%s, 1.5, NULL]::float8[], ARRAY['a b', 'c,d', NULL, 'q\"x', 'NULL', '']::text[], 'happy',"
    """ '{"k": [1, 2.50, null], "s": "x\\ny"}', '\\x00ff275c'::bytea, 7, '2026-11-26 01:02:03.5+00', true)"""
)
CHANGES = [
    (ROW, (1, UGLY, "NaN", "Infinity", "-Infinity", "NaN")),
    (ROW, (2, "two", "1e-300", "3.25", "12345678901234567890123456789.123456789", "-Infinity")),
    (ROW, (3, None, None, None, None, None)),
    ("INSERT INTO t (id, a) VALUES (4, repeat(%s, 60000))", (UGLY,)),  # ~4 MB of ugly text
    ("UPDATE t SET a = 'changed' WHERE id = 1", ()),  # big: an unchanged TOAST value
    ("UPDATE t SET id = 10, f = 'Infinity' WHERE id = 2", ()),  # a primary-key change
    ("DELETE FROM t WHERE id = 3", ()),
    ("INSERT INTO full_t VALUES (1, 'a', 'NaN', 'NaN'), (2, 'b', 0.1, 1)", ()),
    ("UPDATE full_t SET v = 'a2', f = 2.5 WHERE id = 1", ()),  # the old row's NaN
    ("DELETE FROM full_t WHERE id = 2", ()),
    ("INSERT INTO p VALUES (1, 5, 'leaf one'), (2, 150, 'leaf two')", ()),
    ("UPDATE p SET v = 'moved' WHERE id = 1", ()),
    ("DELETE FROM p WHERE id = 2", ()),
    ("INSERT INTO tr1 VALUES (1)", ()),
    ("INSERT INTO tr2 VALUES (1)", ()),
    ("TRUNCATE tr1, tr2", ()),
    ("INSERT INTO other VALUES (1)", ()),  # wal2json: an empty B/C; pgoutput: nothing
    ("SELECT pg_logical_emit_message(true, 'cdc.ddl', %s)", ('{"k": "é\\n"}',)),
    ("SELECT pg_logical_emit_message(true, 'not.ours', 'x')", ()),
    (f"INSERT INTO bulk SELECT g, 'row ' || g FROM generate_series(1, {BIG}) g", ()),
]
#: (table, column) that wal2json 2.5 sends as null where the value is NaN or +-Infinity, and the
#: exact values pgoutput sends (after the converters)
NONFINITE = {
    ("t", "f", "NaN"),
    ("t", "r", "Infinity"),
    ("t", "n", "-Infinity"),
    ("t", "f", "Infinity"),
    ("full_t", "f", "NaN"),
    ("full_t", "n", "NaN"),
}
END = "end of the change set"


@pytest.fixture
def type_names(pg: PgCluster, pg_db: str) -> Iterator[Callable[[int, int], str]]:
    """``format_type(oid, typmod)``, cached: what the reader gives the pgoutput decoder."""
    with psycopg.connect(pg.dsn(pg_db), autocommit=True) as conn:
        cache: dict[tuple[int, int], str] = {}

        def type_name(oid: int, typmod: int) -> str:
            if (oid, typmod) not in cache:
                row = conn.execute("SELECT format_type(%s, %s)", (oid, typmod)).fetchone()
                assert row is not None
                cache[(oid, typmod)] = str(row[0])
            return cache[(oid, typmod)]

        yield type_name


def _read(
    dsn: str,
    slot: str,
    decoder: Decoder,
    options: dict[str, str],
    on_message: Callable[[Message], bool],
    session: str = SESSION_OPTIONS,
    timeout: float = 180.0,
) -> None:
    """Stream ``slot`` as the reader does until ``on_message`` returns True."""
    conn = connect_replication(dsn, options=session, application_name="cdc-test")
    try:
        cur = conn.cursor()
        cur.start_replication(slot_name=slot, decode=False, options=options, status_interval=10)
        read = decoder.source(cur.read_message)
        deadline = time.monotonic() + timeout
        while True:
            raw = read()
            if raw is None:
                assert time.monotonic() < deadline, f"timed out reading slot {slot}"
                select.select([conn], [], [], 0.5)  # wait for the server (not a sleep)
                continue
            msg = decoder.decode(raw.payload, raw.data_start)
            if msg is not None and on_message(msg):
                return
    finally:
        decoder.close()
        conn.close()


def _collect(dsn: str, slot: str, decoder: Decoder, options: dict[str, str]) -> list[Message]:
    out: list[Message] = []

    def keep(msg: Message) -> bool:
        if msg.action == "M" and msg.content == END:
            return True
        out.append(msg)
        return False

    _read(dsn, slot, decoder, options, keep)
    return out


def _converted(msgs: list[Message], decoder: Decoder, domains: dict[str, str]) -> list[dict[str, Any]]:
    """Each message as a dict, column values as event values (a domain's by its base type's text
    converter, as :class:`cdc.codec.envelope.TableCodec` does)."""

    def conv(typ: str, value: Any) -> Any:
        f = text_converter_for(domains[typ]) if typ in domains else decoder.converter_for(typ)
        return value if f is None or value is None else f(value)

    out = []
    for m in msgs:
        d = {f: getattr(m, f) for f in m.__struct_fields__}
        for f in ("columns", "identity"):
            if d[f] is not None:
                d[f] = [(c.name, c.type, conv(c.type, c.value)) for c in d[f]]
        out.append(d)
    return out


def test_pgoutput_and_wal2json_give_the_same_messages(
    pg: PgCluster, pg_db: str, type_names: Callable[[int, int], str]
) -> None:
    dsn = pg.dsn(pg_db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for stmt in SCHEMA:
            conn.execute(stmt)
        domains = dict(
            conn.execute(
                "SELECT format_type(oid, NULL), format_type(typbasetype, typtypmod) FROM pg_type WHERE typtype = 'd'"
            ).fetchall()
        )
        conn.execute("SELECT pg_create_logical_replication_slot('w', 'wal2json')")
        conn.execute("SELECT pg_create_logical_replication_slot('p', 'pgoutput')")
        for stmt, args in CHANGES:
            conn.execute(stmt, args)
        conn.execute("SELECT pg_logical_emit_message(false, 'cdc_heartbeat', %s)", (END,))
        version = conn.info.server_version
    pgo = PgOutput(type_names, PUBLICATION, version)
    assert pgo.replication_options([])["streaming"] == "on"
    w_msgs = _collect(dsn, "w", WAL2JSON, WAL2JSON.replication_options(WAL2JSON_TABLES))
    p_msgs = _collect(dsn, "p", pgo, pgo.replication_options([]))
    w = _known_differences(_converted(w_msgs, WAL2JSON, domains), _converted(p_msgs, pgo, domains))
    p = _converted(p_msgs, pgo, domains)
    assert len(w) == len(p) > BIG
    nonfinite: set[tuple[str, str, Any]] = set()
    for a, b in zip(w, p, strict=True):
        for f in ("columns", "identity"):
            if a[f] is not None and b[f] is not None and a[f] != b[f]:
                a[f] = _nonfinite_patched(a["table"], a[f], b[f], nonfinite)
        assert a == b
    assert nonfinite == NONFINITE  # wal2json 2.5 loses these; pgoutput sends them exact
    _spot_checks(p)
    # and the events the reader's envelope makes of them
    w_events = _events(dsn, w_msgs, WAL2JSON, generated=True)
    p_events = _events(dsn, p_msgs, pgo, generated=False)
    assert len(w_events) == len(p_events) > BIG
    nonfinite_events = set()
    for (wt, wk, wv), (pt, pk, pv) in zip(w_events, p_events, strict=True):
        assert (wt, wk) == (pt, pk)
        for image in ("before", "after"):
            if wv and wv[image] and wt == "cdc.public.t" and image == "after":
                assert wv[image].pop("g") == wv[image]["id"] * 2  # only wal2json sends it
            if wv and wv[image] and pv[image] != wv[image]:
                for name, value in pv[image].items():
                    if wv[image][name] is None and value in FLOAT_SPECIALS:
                        nonfinite_events.add((wt.rsplit(".", 1)[1], name, value))
                        wv[image][name] = value
        assert wv == pv
    assert nonfinite_events == NONFINITE


def _events(
    dsn: str, msgs: list[Message], decoder: Decoder, *, generated: bool
) -> list[tuple[str, bytes, Any]]:
    """The log-store records (topic, key, value without its processing time) that the reader's
    envelope makes of ``msgs``, the tables registered from the catalog (``generated``: with the
    stored generated column, which only wal2json sends)."""
    codecs: dict[tuple[str, str], TableCodec] = {}
    with psycopg.connect(dsn) as conn:
        for name in ("t", "full_t", "p", "tr1", "tr2", "bulk"):
            desc = describe_table(conn, "public", name)
            cols = tuple(c for c in desc.columns if generated or c.name != "g")
            reg = TableReg("public", name, f"cdc.public.{name}", desc.primary_key or ("id",), columns=cols)
            codec = TableCodec(reg, prefix="cdc", db="app", partitions=1, decoder=decoder)
            for key in (("public", name), *desc.leaf_partitions):
                codecs[key] = codec
    changed: list[Any] = []
    builder = SettlingBuilder(codecs, lambda reg, cols, told: changed.append((reg.table, cols)))
    out: list[tuple[str, bytes, Any]] = []
    for m in msgs:
        if m.action == "B":
            builder.begin(m)
        elif m.action == "C":
            builder.commit(m)
        elif m.action != "M" and (res := builder.change(m)) is not None:
            for rec in res[1]:
                value = None if rec.value is None else orjson.loads(rec.value)
                if value is not None:
                    del value["ts_ms"]
                out.append((res[0], rec.key, value))
    assert not changed, f"the envelope saw columns change: {changed}"
    return out


def _known_differences(w: list[dict[str, Any]], p: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """wal2json's messages with the known differences asserted, then removed."""
    # B: pgoutput's Begin has no end LSN (the reader takes it from the C)
    assert all(m["nextlsn"] for m in w if m["action"] == "B")
    assert all(m["nextlsn"] is None for m in p if m["action"] == "B")
    for m in w:
        if m["action"] == "B":
            m["nextlsn"] = None
    # an empty transaction (no published change): wal2json sends B/C, pgoutput 15+ nothing; both send
    # one for a transaction whose only change is a logical message of another prefix
    w_empty, p_empty = _empty(w), _empty(p)
    assert p_empty < w_empty, "the INSERT into the unpublished table: an empty B/C pair from wal2json only"
    drop = {i for i, m in enumerate(w) if m["xid"] in w_empty - p_empty and m["action"] in "BC"}
    w = [m for i, m in enumerate(w) if i not in drop]
    # a partition's changes: wal2json names the leaf, pgoutput (publish_via_partition_root) the root
    assert {m["table"] for m in w if m["table"] in ("p", "p1", "p2")} == {"p1", "p2"}
    assert {m["table"] for m in p if m["table"] in ("p", "p1", "p2")} == {"p"}
    for m in w:
        if m["table"] in ("p1", "p2"):
            m["table"] = "p"
    # a stored generated column: wal2json sends it, pgoutput (PostgreSQL < 18) does not
    generated = [m for m in w if m["table"] == "t" and m["columns"]]
    assert generated and all(m["columns"][-1][0] == "g" for m in generated)
    assert not [m for m in p if m["table"] == "t" and "g" in {n for n, _, _ in m["columns"] or []}]
    for m in generated:
        m["columns"] = m["columns"][:-1]
    return w


def _empty(msgs: list[dict[str, Any]]) -> set[int]:
    """The xids of B/C pairs with nothing between them."""
    return {
        msgs[i]["xid"]
        for i in range(len(msgs) - 1)
        if msgs[i]["action"] == "B" and msgs[i + 1]["action"] == "C"
    }


def _nonfinite_patched(
    table: str, w: list[tuple[str, str, Any]], p: list[tuple[str, str, Any]], seen: set[tuple[str, str, Any]]
) -> list[tuple[str, str, Any]]:
    """wal2json's columns with its nulls for NaN/+-Infinity replaced by pgoutput's values (each
    recorded in ``seen``); any other difference is left for the caller's assertion. Both list as many
    columns: one that either lacks, a trailing one too, fails here (zipped strictly, nothing cut off)."""
    out = []
    assert len(w) == len(p), (
        f"{table}: wal2json sent the columns {[n for n, _, _ in w]}, pgoutput {[n for n, _, _ in p]}"
    )
    for (name, typ, a), (pname, ptyp, b) in zip(w, p, strict=True):
        if (name, typ) == (pname, ptyp) and a is None and b in FLOAT_SPECIALS:
            assert type_kind(typ) in ("float", "numeric")
            seen.add((table, name, b))
            a = b
        out.append((name, typ, a))
    return out


def _spot_checks(p: list[dict[str, Any]]) -> None:
    """What the equality above stands on, checked by hand on pgoutput's messages."""
    rows = {(m["action"], m["table"], m["columns"][0][2] if m["columns"] else None): m for m in p}
    first = rows[("I", "t", 1)]
    values = {name: v for name, _, v in first["columns"]}
    assert values["a"] == UGLY and values["f"] == "NaN" and values["n"] == "-Infinity"
    assert values["n2"] == "12345678901234567890.12345678901234567891"
    assert values["arr"] == ["NaN", 1.5, None]
    assert values["tags"] == ["a b", "c,d", None, 'q"x', "NULL", ""]
    assert values["b"] == "00ff275c" and values["d"] == 7 and values["ok"] is True
    assert len(values["big"]) == 32_000
    assert rows[("I", "t", 4)]["columns"][1] == ("a", "text", UGLY * 60_000)
    toast = rows[("U", "t", 1)]
    assert "big" not in {n for n, _, _ in toast["columns"]}  # unchanged TOAST: absent, not null
    key_change = rows[("U", "t", 10)]
    assert key_change["identity"] == [("id", "integer", 2)]
    full = rows[("U", "full_t", 1)]
    assert [v for _, _, v in full["identity"]] == [1, "a", "NaN", "NaN"]
    assert [(m["action"], m["table"]) for m in p if m["action"] == "T"] == [("T", "tr1"), ("T", "tr2")]
    (ddl,) = [m for m in p if m["action"] == "M"]
    assert (ddl["prefix"], ddl["content"], ddl["transactional"]) == ("cdc.ddl", '{"k": "é\\n"}', True)
    assert sum(1 for m in p if m["table"] == "bulk") == BIG


def _insert(conn: psycopg.Connection[Any], lo: int, hi: int, v: str = "row ") -> None:
    conn.execute("INSERT INTO s SELECT g, %s || g FROM generate_series(%s::int, %s::int) g", (v, lo, hi))


def _streamed_with_savepoints(conn: psycopg.Connection[Any], rows: int) -> None:
    """Rows 1..``rows`` committed, in order, around savepoints: one rolled back holding a released
    one (its changes carry their own xid: pgoutput must abort them too), one released holding a
    rolled-back one."""
    half, q = rows // 2, rows * 3 // 4
    _insert(conn, 1, half)
    with conn.transaction(force_rollback=True):  # savepoint a: rolled back
        _insert(conn, rows + 1, rows + 5000, "aborted a ")
        with conn.transaction():  # savepoint b inside a: released, then gone with a
            _insert(conn, rows + 5001, rows + 9999, "aborted b ")
    with conn.transaction():  # savepoint c: released
        _insert(conn, half + 1, q)
        with conn.transaction(force_rollback=True):  # savepoint d inside c: rolled back
            _insert(conn, rows + 10000, rows + 15000, "aborted d ")
        _insert(conn, q + 1, rows)


@pytest.mark.parametrize("rows", [BIG])
def test_a_streamed_transaction_comes_out_whole_and_committed_only(
    pg: PgCluster, pg_db: str, type_names: Callable[[int, int], str], rows: int
) -> None:
    """logical_decoding_work_mem = 64kB: a top-level transaction rolled back after streaming, then
    one of ``rows`` rows with a rolled-back savepoint in the middle; ``source()`` returns exactly
    the committed rows, in order, between one B and one C, with flat memory (the spool is on disk)."""
    dsn = pg.dsn(pg_db)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE s (id int PRIMARY KEY, v text)")
        conn.execute(f"CREATE PUBLICATION {PUB} FOR TABLE s")
        conn.execute("SELECT pg_create_logical_replication_slot('w', 'wal2json')")
        conn.execute("SELECT pg_create_logical_replication_slot('p', 'pgoutput')")
        with conn.transaction(force_rollback=True):
            conn.execute("INSERT INTO s SELECT g, 'aborted ' || g FROM generate_series(-20000, -1) g")
        with conn.transaction():
            _streamed_with_savepoints(conn, rows)
        conn.execute("SELECT pg_logical_emit_message(false, 'cdc_heartbeat', %s)", (END,))
        version = conn.info.server_version
    pgo = PgOutput(type_names, PUBLICATION, version)
    seen: list[Message] = []
    state = {"next": 1}

    def check(msg: Message) -> bool:
        if msg.action == "M":
            return msg.content == END
        if msg.action in ("B", "C"):
            seen.append(msg)
            return False
        assert msg.action == "I" and msg.columns is not None
        assert msg.columns[0].value == str(state["next"]) and msg.columns[1].value == f"row {state['next']}"
        state["next"] += 1
        return False

    tracemalloc.start()
    try:
        _read(
            dsn,
            "p",
            pgo,
            pgo.replication_options([]),
            check,
            session=SESSION_OPTIONS + " -c logical_decoding_work_mem=64kB",
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert pgo.stream_blocks > 1, "the transaction did not arrive in stream blocks"
    assert [m.action for m in seen] == ["B", "C"] and state["next"] == rows + 1
    assert peak < 8_000_000, f"{peak} bytes allocated at the peak: the streamed rows are held in memory"
    # the B and C made up at the stream commit are wal2json's (B: but for its end LSN)
    w = [
        m
        for m in _collect(dsn, "w", WAL2JSON, WAL2JSON.replication_options([("public", "s")]))
        if m.action in "BC"
    ]
    assert [m.action for m in w] == ["B", "C"]  # the rolled-back transaction: from neither
    w[0].nextlsn = None
    assert seen == w
