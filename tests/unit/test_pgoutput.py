"""The pgoutput decoder on hand-built protocol messages (pure logic: no server).

The messages are built here from the protocol ("Logical Replication Message Formats"); the
real-server comparison with wal2json is tests/capture/test_pgoutput_differential.py.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdc.codec import Col, Message
from cdc.codec.pgoutput import PgOutput, RawMessage
from cdc.codec.values import text_converter_for
from cdc.errors import DecodeError
from cdc.events import commit_ts_ms, pg_time_ms

TYPES = {(23, -1): "integer", (25, -1): "text", (701, -1): "double precision", (1700, -1): "numeric"}


def _type_name(oid: int, typmod: int) -> str:
    return TYPES[(oid, typmod)]


def cstr(s: str) -> bytes:
    return s.encode() + b"\0"


def relation(
    relid: int, schema: str, table: str, cols: list[tuple[str, int, bool]], ident: bytes = b"d"
) -> bytes:
    out = b"R" + struct.pack(">I", relid) + cstr(schema) + cstr(table) + ident + struct.pack(">h", len(cols))
    for name, oid, key in cols:
        out += bytes([1 if key else 0]) + cstr(name) + struct.pack(">Ii", oid, -1)
    return out


def tup(*values: Any) -> bytes:
    """TupleData: str/bytes -> 't', None -> 'n', ... (Ellipsis) -> 'u'."""
    out = struct.pack(">h", len(values))
    for v in values:
        if v is None:
            out += b"n"
        elif v is ...:
            out += b"u"
        else:
            raw = v.encode() if isinstance(v, str) else v
            out += b"t" + struct.pack(">i", len(raw)) + raw
    return out


def begin(final_lsn: int, ts: int, xid: int) -> bytes:
    return b"B" + struct.pack(">QqI", final_lsn, ts, xid)


def commit(commit_lsn: int, end_lsn: int, ts: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, commit_lsn, end_lsn, ts)


def insert(relid: int, *values: Any) -> bytes:
    return b"I" + struct.pack(">I", relid) + b"N" + tup(*values)


def update(relid: int, new: tuple[Any, ...], old: tuple[Any, ...] | None = None, kind: bytes = b"K") -> bytes:
    head = b"U" + struct.pack(">I", relid)
    if old is not None:
        head += kind + tup(*old)
    return head + b"N" + tup(*new)


def delete(relid: int, old: tuple[Any, ...], kind: bytes = b"K") -> bytes:
    return b"D" + struct.pack(">I", relid) + kind + tup(*old)


def truncate(*relids: int) -> bytes:
    return b"T" + struct.pack(">iB", len(relids), 0) + b"".join(struct.pack(">I", r) for r in relids)


def message(prefix: str, content: bytes, lsn: int, transactional: bool = True) -> bytes:
    return (
        b"M"
        + struct.pack(">BQ", 1 if transactional else 0, lsn)
        + cstr(prefix)
        + struct.pack(">i", len(content))
        + content
    )


def in_stream(msg: bytes, xid: int) -> bytes:
    """A message as pgoutput sends it inside a stream block: the (sub)xid after the type."""
    return msg[:1] + struct.pack(">I", xid) + msg[1:]


def stream_start(xid: int, first: bool = True) -> bytes:
    return b"S" + struct.pack(">IB", xid, 1 if first else 0)


def stream_commit(xid: int, commit_lsn: int, end_lsn: int, ts: int) -> bytes:
    return b"c" + struct.pack(">IBQQq", xid, 0, commit_lsn, end_lsn, ts)


def stream_abort(xid: int, subxid: int) -> bytes:
    return b"A" + struct.pack(">II", xid, subxid)


TS = 817_093_738_744_379  # 2025-11-22 02:28:58.744379 UTC in microseconds since 2000-01-01
TS_MS = 1_763_778_538_744  # the same instant in epoch milliseconds
T_COLS = [("id", 23, True), ("v", 25, False), ("f", 701, False)]


def decoder(tmp_path: Path | None = None) -> PgOutput:
    return PgOutput(_type_name, "cdc_pub", 150000, spool_dir=str(tmp_path) if tmp_path else None)


def run(dec: PgOutput, msgs: list[bytes], lsn0: int = 0x1_0000_0000) -> list[Message]:
    """Feed raw messages through source() and decode() as the reader's loop does."""
    raws: Iterator[RawMessage] = iter(RawMessage(m, lsn0 + i * 8) for i, m in enumerate(msgs))
    read = dec.source(lambda: next(raws, None))
    out: list[Message] = []
    while (raw := read()) is not None:
        m = dec.decode(raw.payload, raw.data_start)
        if m is not None:
            out.append(m)
    return out


# --- single messages ---------------------------------------------------------------------------------
def test_begin_commit_integers_as_wal2json_reads() -> None:
    dec = decoder()
    b = dec.decode(begin(0x16_B374D848, TS, 7), 1)
    assert b == Message("B", 7, TS_MS, 0x16_B374D848)
    c = dec.decode(commit(0x16_B374D848, 0x16_B374D878, TS), 2)
    assert c == Message("C", 7, TS_MS, 0x16_B374D848, 0x16_B374D878)
    # the same instant as wal2json writes it, read by its decoder: the same milliseconds
    assert commit_ts_ms("2025-11-22 02:28:58.744379+00") == TS_MS
    assert pg_time_ms(TS - 744_379 + 999) == commit_ts_ms("2025-11-22 02:28:58.000999+00") == TS_MS - 744
    assert pg_time_ms(-1) == commit_ts_ms("1999-12-31 23:59:59.999999+00")  # floored, as the text


def test_relation_insert_text_null_and_special_floats() -> None:
    dec = decoder()
    assert dec.decode(relation(16385, "public", "t", T_COLS), 1) is None
    dec.decode(begin(0x200, TS, 9), 2)
    m = dec.decode(insert(16385, "1", None, "NaN"), 0x1_0000_0010)
    assert m == Message(
        "I",
        9,
        None,  # a change: its commit time is its B's
        0x1_0000_0010,
        schema="public",
        table="t",
        columns=[Col("id", "integer", "1"), Col("v", "text", None), Col("f", "double precision", "NaN")],
    )
    for pg_type, text, value in [("double precision", "-Infinity", "-Infinity"), ("integer", "5", 5)]:
        conv = dec.converter_for(pg_type)
        assert conv is not None and conv(text) == value == text_converter_for(pg_type)(text)  # type: ignore[misc]
    for text in ("12345678901234567890.123456789", "NaN", "-Infinity"):  # numeric: the text is the value
        assert dec.converter_for("numeric(38,9)") is None and text_converter_for("numeric")(text) == text  # type: ignore[misc]


def test_unchanged_toast_is_left_out_never_null() -> None:
    dec = decoder()
    dec.decode(relation(1, "public", "t", T_COLS), 1)
    m = dec.decode(update(1, ("1", ..., "2.5")), 5)
    assert m is not None and m.columns == [Col("id", "integer", "1"), Col("f", "double precision", "2.5")]
    # no old tuple: the key did not change, identity is the new row's key (as wal2json 2.5 sends it)
    assert m.identity == [Col("id", "integer", "1")]


def test_old_key_K_keeps_key_columns_and_O_the_whole_row() -> None:
    dec = decoder()
    dec.decode(relation(1, "public", "t", T_COLS), 1)
    m = dec.decode(update(1, ("2", "x", "1"), old=("1", None, None), kind=b"K"), 5)
    assert m is not None and m.identity == [Col("id", "integer", "1")]
    d = dec.decode(delete(1, ("2", None, None), kind=b"K"), 6)
    assert d == Message("D", lsn=6, schema="public", table="t", identity=[Col("id", "integer", "2")])
    full = [
        ("id", 23, True),
        ("v", 25, True),
        ("f", 701, True),
    ]  # REPLICA IDENTITY FULL: every column flagged
    dec.decode(relation(2, "s", "full", full, b"f"), 7)
    m = dec.decode(update(2, ("1", "b", "Infinity"), old=("1", "a", None), kind=b"O"), 8)
    assert m is not None and m.identity == [
        Col("id", "integer", "1"),
        Col("v", "text", "a"),
        Col("f", "double precision", None),
    ]
    d = dec.decode(delete(2, ("1", "b", "-Infinity"), kind=b"O"), 9)
    assert d is not None and [c.value for c in d.identity or []] == ["1", "b", "-Infinity"]


def test_names_with_quotes_dots_spaces_and_a_new_relation_replaces_the_old() -> None:
    dec = decoder()
    dec.decode(relation(3, 'we"ird.sch ema', 'ta"b.le x', [('c"o.l 1', 23, True), ("é", 25, False)]), 1)
    m = dec.decode(insert(3, "5", "ü"), 2)
    assert m is not None and (m.schema, m.table) == ('we"ird.sch ema', 'ta"b.le x')
    assert m.columns == [Col('c"o.l 1', "integer", "5"), Col("é", "text", "ü")]
    dec.decode(relation(3, 'we"ird.sch ema', 'ta"b.le x', [('c"o.l 1', 23, True)]), 3)  # a column dropped
    m = dec.decode(insert(3, "6"), 4)
    assert m is not None and m.columns == [Col('c"o.l 1', "integer", "6")]


def test_multi_megabyte_value_with_newlines_quotes_backslashes() -> None:
    dec = decoder()
    dec.decode(relation(1, "public", "t", T_COLS), 1)
    big = ('line "one"\n\\ back\\slash \\x00 \t tab \r ' * 100_000) + "é" * 1000
    assert len(big.encode()) > 3_000_000
    m = dec.decode(insert(1, "1", big, "1e+30"), 2)
    assert m is not None and m.columns is not None and m.columns[1].value == big
    assert m.columns[2].value == "1e+30"


def test_logical_messages_ours_only() -> None:
    dec = decoder()
    dec.decode(begin(0x300, TS, 11), 1)
    m = dec.decode(message("cdc.ddl", b'{"a": "x\\ny"}', 0x2F0), 2)
    assert m == Message(
        "M",
        11,
        None,  # a change: its commit time is its B's
        0x2F0,
        transactional=True,
        prefix="cdc.ddl",
        content='{"a": "x\\ny"}',
    )
    assert dec.decode(message("pgstream", b"x", 0x2F8), 3) is None
    hb = dec.decode(message("cdc_heartbeat", b"", 0x400, transactional=False), 4)
    assert hb == Message("M", lsn=0x400, transactional=False, prefix="cdc_heartbeat", content="")


def test_type_and_origin_only_update_state() -> None:
    dec = decoder()
    assert dec.decode(b"Y" + struct.pack(">I", 50000) + cstr("public") + cstr("mood"), 1) is None
    assert dec.decode(b"O" + struct.pack(">Q", 5) + cstr("origin"), 2) is None


def test_bad_messages_raise_decode_error_with_the_bytes() -> None:
    dec = decoder()
    with pytest.raises(DecodeError, match="unknown message type"):
        dec.decode(b"Zxx", 1)
    with pytest.raises(DecodeError, match="before its Relation message"):
        dec.decode(insert(99, "1"), 1)
    dec.decode(relation(1, "public", "t", T_COLS), 1)
    with pytest.raises(DecodeError, match="2 columns"):
        dec.decode(insert(1, "1", "2"), 1)
    with pytest.raises(DecodeError, match="binary"):
        dec.decode(b"I" + struct.pack(">I", 1) + b"N" + struct.pack(">h", 3) + b"b", 1)
    with pytest.raises(DecodeError) as exc:
        dec.decode(insert(1, "1", "x", "1")[:-2], 0x10)
    assert exc.value.lsn == "0/10" and exc.value.raw  # type: ignore[attr-defined]


def test_options_by_server_version() -> None:
    assert PgOutput(_type_name, "p", 180006).replication_options([])["proto_version"] == "4"
    assert PgOutput(_type_name, "p", 140000).replication_options([])["proto_version"] == "2"
    assert PgOutput(_type_name, 'my "pub"', 150000).replication_options([("public", "t")]) == {
        "proto_version": "3",
        "publication_names": '"my ""pub"""',
        "messages": "true",
        "streaming": "on",
    }
    old = PgOutput(_type_name, "p", 130000).replication_options([])
    assert old == {"proto_version": "1", "publication_names": '"p"', "messages": "true"}
    assert PgOutput(_type_name, "a,b", 150000).replication_options([])["publication_names"] == '"a,b"'


# --- the raw stream: TRUNCATE split, stream blocks ----------------------------------------------------
def test_truncate_of_several_relations_becomes_one_per_relation() -> None:
    dec = decoder()
    out = run(
        dec,
        [
            relation(1, "public", "a", T_COLS),
            relation(2, "s", "b", T_COLS),
            begin(0x500, TS, 12),
            truncate(1, 2),
            commit(0x500, 0x530, TS),
        ],
    )
    assert [(m.action, m.schema, m.table) for m in out] == [
        ("B", None, None),
        ("T", "public", "a"),
        ("T", "s", "b"),
        ("C", None, None),
    ]
    assert out[1].lsn == out[2].lsn == 0x1_0000_0018
    with pytest.raises(DecodeError, match="source"):
        dec.decode(truncate(1, 2), 1)


def _streamed(tmp_path: Path) -> list[bytes]:
    """Top xid 100 with subxacts 101 (rolled back) and 102 (kept), across two blocks, while
    transaction 200 commits in between; then top xid 300 streamed and aborted."""
    rel = relation(1, "public", "t", T_COLS)
    return [
        stream_start(100),
        in_stream(rel, 100),
        in_stream(insert(1, "1", "a", "1"), 100),
        in_stream(insert(1, "2", "b", "2"), 101),
        b"E",
        begin(0x600, TS, 200),  # another transaction commits between the blocks
        rel,
        insert(1, "9", "z", "9"),
        commit(0x600, 0x630, TS),
        stream_start(100, first=False),
        in_stream(relation(2, "public", "u", [("k", 23, True)]), 101),  # state: kept though 101 aborts
        in_stream(insert(2, "7"), 101),
        in_stream(delete(1, ("1", None, None)), 101),
        b"E",
        stream_abort(100, 101),
        stream_start(300),
        in_stream(insert(1, "3", "c", "3"), 300),
        b"E",
        stream_start(100, first=False),
        in_stream(insert(2, "8"), 102),
        in_stream(truncate(1, 2), 100),
        in_stream(message("cdc.ddl", b"{}", 0x6F0), 100),
        b"E",
        stream_abort(300, 300),
        stream_commit(100, 0x700, 0x730, TS),
    ]


def test_stream_blocks_return_the_committed_transaction_in_order(tmp_path: Path) -> None:
    dec = decoder(tmp_path)
    out = run(dec, _streamed(tmp_path))
    got = [(m.action, m.table, [c.value for c in m.columns or m.identity or []], m.xid) for m in out]
    assert got == [
        ("B", None, [], 200),
        ("I", "t", ["9", "z", "9"], 200),
        ("C", None, [], 200),
        ("B", None, [], 100),
        ("I", "t", ["1", "a", "1"], 100),
        ("I", "u", ["8"], 100),
        ("T", "t", [], 100),
        ("T", "u", [], 100),
        ("M", None, [], 100),
        ("C", None, [], 100),
    ]
    assert (out[3].lsn, out[3].ts_ms, out[4].ts_ms) == (0x700, TS_MS, None)  # B; a change: None
    assert (out[-1].lsn, out[-1].nextlsn) == (0x700, 0x730)
    assert dec.stream_blocks == 4
    assert not list(tmp_path.iterdir())  # temporary files: never a name in the directory
    assert not dec._spools  # committed and aborted: both spools gone


def test_spool_is_on_disk_and_close_drops_it(tmp_path: Path) -> None:
    dec = decoder(tmp_path)
    msgs = [stream_start(100), in_stream(relation(1, "public", "t", T_COLS), 100)]
    msgs += [in_stream(insert(1, str(i), "x" * 100, "1"), 100) for i in range(2000)]
    run(dec, [*msgs, b"E"])
    spool = dec._spools[100]
    assert spool.file.tell() > 200_000  # the messages are in the file, not in memory
    dec.close()
    assert spool.file.closed and not dec._spools


def test_a_long_stream_block_yields_no_ops_not_none() -> None:
    """While it spools, source() returns a message that decodes to None (the reader's loop keeps its
    duties going), and None only when nothing is ready."""
    dec = decoder()
    msgs = [stream_start(5)] + [in_stream(insert(1, "1", "x", "1"), 5)] * 1000
    raws = iter(RawMessage(m, i) for i, m in enumerate(msgs))
    read = dec.source(lambda: next(raws, None))
    seen = []
    while (raw := read()) is not None:
        seen.append(dec.decode(raw.payload, raw.data_start))
    assert len(seen) >= 1000 // 64 and all(s is None for s in seen)
    dec.close()


def test_a_stream_sent_again_from_its_start_replaces_the_spool(tmp_path: Path) -> None:
    """A new session resends an uncommitted streamed transaction from its first segment: the
    spool of the earlier session's part must not be replayed twice."""
    dec = decoder(tmp_path)
    rel = relation(1, "public", "t", T_COLS)
    first = [stream_start(100), in_stream(rel, 100), in_stream(insert(1, "1", "a", "1"), 100), b"E"]
    run(dec, first)
    out = run(
        dec,
        [
            *first,
            stream_start(100, first=False),
            in_stream(insert(1, "2", "b", "2"), 100),
            b"E",
            stream_commit(100, 0x700, 0x730, TS),
        ],
    )
    assert [m.columns[0].value for m in out if m.columns] == ["1", "2"]


def test_close_while_a_committed_stream_is_handed_on(tmp_path: Path) -> None:
    dec = decoder(tmp_path)
    rel = relation(1, "public", "t", T_COLS)
    msgs = [stream_start(100), in_stream(rel, 100), in_stream(insert(1, "1", "a", "1"), 100), b"E"]
    raws = iter(RawMessage(m, i) for i, m in enumerate([*msgs, stream_commit(100, 0x700, 0x730, TS)]))
    read = dec.source(lambda: next(raws, None))
    while (raw := read()) is not None and raw.payload[:1] != b"B":
        pass
    spool = dec._spools[100]
    dec.close()  # the session ends (stopped) in the middle of the transaction
    assert spool.file.closed and not dec._spools


def test_update_without_old_tuple_identity_is_the_new_key_in_column_order() -> None:
    dec = decoder()
    cols = [("v", 25, False), ("k2", 23, True), ("f", 701, False), ("k1", 25, True)]
    dec.decode(relation(4, "public", "two_keys", cols), 1)
    m = dec.decode(update(4, ("a", "2", "1.5", "x")), 2)  # every column sent
    assert m is not None and m.identity == [Col("k2", "integer", "2"), Col("k1", "text", "x")]
    m = dec.decode(update(4, (..., "3", None, "y")), 3)  # an unchanged TOAST value
    assert m is not None and m.identity == [Col("k2", "integer", "3"), Col("k1", "text", "y")]
    assert m.columns == [
        Col("k2", "integer", "3"),
        Col("f", "double precision", None),
        Col("k1", "text", "y"),
    ]


def test_values_are_the_same_whether_the_message_is_all_ascii_or_not() -> None:
    """An all-ASCII message is decoded once and sliced; any other (a non-ASCII value, a length or
    a relation OID with a byte over 127) value by value: the same values either way."""
    dec = decoder()
    dec.decode(relation(1, "public", "t", T_COLS), 1)
    dec.decode(relation(0x80_0080, "public", "t", T_COLS), 1)
    cases = [
        (1, ("7", 'a "q"\n\\b', "1.5")),  # all ASCII
        (1, ("7", "é, ü, 日本, \U0001f600", "1.5")),  # non-ASCII value before an ASCII one
        (1, ("7", "x" * 200 + "\t", None)),  # a length of 201: a byte over 127
        (0x80_0080, ("7", "plain", "2")),  # the relation OID's bytes over 127
        (1, ("7", "", "NaN")),  # an empty value
    ]
    for relid, values in cases:
        data = insert(relid, *values)
        assert data.isascii() == (relid == 1 and values[1] in ('a "q"\n\\b', ""))
        m = dec.decode(data, 2)
        assert m is not None and m.columns is not None
        assert [c.value for c in m.columns] == list(values), values
    u = dec.decode(update(1, ("8", "ü", "3"), ("7", None, None)), 3)
    assert u is not None and u.columns is not None and [c.value for c in u.columns] == ["8", "ü", "3"]
    assert u.identity == [Col("id", "integer", "7")]
