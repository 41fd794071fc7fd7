"""The compiled per-change path (cdc.codec._native, driven by cdc.codec.fastpath) against the Python
path it replaces (PgOutput.decode, then EventBuilder.change): the same pgoutput messages through
both give byte-identical records and image changes, for every type of the edge-value tests
(tests/snapshot/test_encoding.py), NULLs, multi-MB values with quotes, newlines and backslashes,
NaN and +-Infinity, arrays, unchanged TOAST values, key changes, deletes; and randomized rows
(hypothesis). A change the compiled path declines is taken by the Python path: the tests also
check that the compiled path took what it should (else they would compare Python with itself)."""

from __future__ import annotations

import functools
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc.codec.compiled import native_module
from cdc.codec.envelope import TableCodec
from cdc.codec.fastpath import PYTHON
from cdc.codec.pgoutput import PgOutput
from cdc.errors import DecodeError
from cdc.registry import Column, TableReg
from tests import native_world
from tests.codec_fakes import settled
from tests.native_world import Batch, differential, every_table, packed_alike
from tests.unit.test_pgoutput import begin, cstr, delete, insert, update

native = native_module()
pytestmark = pytest.mark.skipif(native is None, reason="cdc.codec._native is not built (or CDC_NATIVE=0)")


#: (name, format_type) of a table with every type of the edge-value tests, and a domain
COLS: list[tuple[str, str]] = [
    ("id", "bigint"),
    ("s", "smallint"),
    ("i", "integer"),
    ("big", "bigint"),
    ("n", "numeric(38,9)"),
    ("nn", "numeric"),
    ("f4", "real"),
    ("f8", "double precision"),
    ("ok", "boolean"),
    ("b", "bytea"),
    ("j", "jsonb"),
    ("js", "json"),
    ("t", "text"),
    ("vc", "character varying(20)"),
    ("ch", "character(5)"),
    ("ts", "timestamp with time zone"),
    ("tsn", "timestamp without time zone"),
    ("d", "date"),
    ("tm", "time without time zone"),
    ("tz", "time with time zone"),
    ("u", "uuid"),
    ("iv", "interval"),
    ("ip", "inet"),
    ("e", "mood2"),
    ("ia", "integer[]"),
    ("ta", "text[]"),
    ("na", "numeric[]"),
    ("fa", "double precision[]"),
    ("ba", "boolean[]"),
    ("dom", "posint"),
]
DOMAINS = {"posint": "integer"}
OIDS = {t: 10_000 + i for i, (_, t) in enumerate(COLS)}
BY_OID = {oid: t for t, oid in OIDS.items()}
RELID = 16_384

ROW1 = [
    "1", "-32768", "2147483647", "9223372036854775807", "12345678901234567890123456789.123456789",
    "123456789012345678901234567890.123456789012345678901234567890", "1.5", "0.1", "t", "\\x00ff10",
    '{"a": [1, 2.50, "x\\ny"], "é": null}', '{ "keep" :  "spacing" }',
    'emoji 😀 é, newline\n tab\t cr\r back\\slash quote" ctrl\x01\x1f del\x7f \u2028', "v'c", "ch   ",
    "2026-11-22 02:28:58.744379+00", "2026-11-22 02:28:58.123", "2026-02-28", "13:14:15.5", "13:14:15+02",
    "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "1 year 2 mons 3 days 04:05:06.7", "192.168.0.1/24",
    'a "quoted" label', "{1,NULL,3}", '{"a,b","q\\"x",NULL,""}', "{1.50,NaN}", "{1e+300,-0.5}",
    "{t,f,NULL}", "7",
]  # fmt: skip
ROW2 = [
    "2", None, None, "-9223372036854775808", "NaN", "Infinity", "NaN", "Infinity", "f", "\\x", "[]",
    "null", "", "", None, "infinity", "-infinity", "0044-03-15 BC", "24:00:00", None, None, "-1 days", None,
    "ok", "{}", "{}", None, "{NaN,Infinity,-Infinity}", None, None,
]  # fmt: skip
ROW3 = [
    "3", "0", "0", "0", "-0.000000001", "-Infinity", "-Infinity", "-Infinity", None, None, None, None, None,
    None, None, "4713-01-01 00:00:00+00 BC", "294276-12-31 23:59:59", "infinity", None, None, None, None,
    None, None, "{{1,2},{3,4}}", None, None, "{1e-300,3.14159265358979}", None, "0",
]  # fmt: skip
ROW4 = [
    "4", "1", "1", "1", "0", "0", "1e+30", "1.2345678901234567e-300", "t", "\\xdeadbeef", '{"n": 1.0}', "1",
    "\\x", "x", "a    ", "1999-12-31 23:59:59.999999+00", "2000-01-01 00:00:00", "2000-01-01", "00:00:00",
    "00:00:00+00", "00000000-0000-0000-0000-000000000000", "00:00:00", "::1", "ok", None, None, None, None,
    None, "-5",
]  # fmt: skip
BIG = ('"quoted" \\back\\slash\n' * 150_000)[:3_000_000]  # a multi-MB value
ROWS = [ROW1, ROW2, ROW3, ROW4]


def relation_msg(cols: list[tuple[str, str]], key: tuple[str, ...] = ("id",)) -> bytes:
    out = (
        b"R" + struct.pack(">I", RELID) + cstr("public") + cstr("every") + b"d" + struct.pack(">h", len(cols))
    )
    for name, typ in cols:
        out += bytes([1 if name in key else 0]) + cstr(name) + struct.pack(">Ii", OIDS[typ], -1)
    return out


class World(native_world.World):
    """One path: its decoder, builder (with an image store) and, for the compiled one, its driver."""

    def __init__(
        self, tmp: Path, compiled: bool, exclude: tuple[str, ...] = (), key: tuple[str, ...] = ("id",)
    ):
        self.decoder = PgOutput(lambda oid, _typmod: BY_OID[oid], "cdc_pub", 150000)
        codec = TableCodec(
            every_table(COLS, DOMAINS, key, exclude),
            prefix="cdc",
            db="app",
            partitions=3,
            decoder=self.decoder,
        )
        super().__init__(tmp / f"images-{compiled}.sqlite", codec, self.decoder, native if compiled else None)
        self.lsn = 0x1_0000_0000

    def feed(self, msg: bytes) -> Any:
        """What one message gives: its records and the image changes staged, or the error."""
        self.lsn += 8
        b = self.builder
        b.now = b"1764000000000"
        kind = msg[:1]
        try:
            if kind in (b"I", b"U", b"D"):
                out = PYTHON if self.fast is None else self.fast(msg, self.lsn)
                if out is PYTHON:
                    decoded = self.decoder.decode(msg, self.lsn)
                    assert decoded is not None
                    out = settled(self.schema, b.change(decoded))
            else:
                decoded = self.decoder.decode(msg, self.lsn)
                if decoded is not None and decoded.action == "B":
                    b.begin(decoded)
                out = None
        except DecodeError as exc:
            return ("error", exc.message)
        return self.outcome(out)


def both(tmp: Path, msgs: list[bytes], **kw: Any) -> tuple[list[Any], Any]:
    """Feed ``msgs`` through both paths; assert each message's outcome is identical."""
    head = [relation_msg(COLS, kw.get("key", ("id",))), begin(0x2_0000_0000, 817_093_738_744_379, 727)]
    return differential(World(tmp, False, **kw), World(tmp, True, **kw), head + msgs, 40)


def test_every_type_nulls_and_specials_insert_update_delete(tmp_path: Path) -> None:
    msgs = [insert(RELID, *row) for row in ROWS]
    msgs += [update(RELID, tuple(row)) for row in ROWS]  # no old tuple: the key did not change
    msgs += [update(RELID, tuple(row), (row[0],) + (None,) * (len(row) - 1)) for row in ROWS]  # K
    msgs += [update(RELID, tuple(ROW1), tuple(ROW4[:1] + ROW1[1:]), b"O")]  # O: old row
    msgs += [delete(RELID, (row[0],) + (None,) * (len(row) - 1)) for row in ROWS]
    msgs += [delete(RELID, tuple(ROW2), b"O")]
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 1  # only the O update, whose old key is another (a key change)
    assert fast.python_values > 0  # floats and arrays: their Python converters
    assert all(o[0] is not None for o in outs[2:])


def test_multi_megabyte_values_are_imaged_alike(tmp_path: Path) -> None:
    rows = [list(ROW1), list(ROW2)]
    rows[0][12] = BIG  # t
    rows[1][10] = '{"k": "' + BIG.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"}'  # j
    msgs = [insert(RELID, *r) for r in rows] + [update(RELID, tuple(r)) for r in rows]
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 0
    staged = [o[1] for o in outs[2:]]
    assert all(any(v for v in s.values()) for s in staged)  # the rows' images were kept


def test_unchanged_toast_and_key_changes_take_the_python_path(tmp_path: Path) -> None:
    big = list(ROW1)
    big[12] = BIG
    toasted = tuple(v if i != 12 else ... for i, v in enumerate(ROW1))
    moved = ("99", *ROW1[1:12], ..., *ROW1[13:])
    msgs = [
        insert(RELID, *big),
        update(RELID, toasted),  # t unchanged: filled in from the image
        update(RELID, moved, ("1",) + (None,) * (len(ROW1) - 1)),  # key change, t unchanged
        update(RELID, tuple(ROW2), ("2",) + (None,) * (len(ROW2) - 1)),  # same key, K tuple
        delete(RELID, ("99",) + (None,) * (len(ROW1) - 1)),
    ]
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 2
    assert b'"unavailable":[]' in outs[3][0][1][0][1]  # filled in, by the Python path


def test_excluded_columns_and_a_two_column_key(tmp_path: Path) -> None:
    msgs = [insert(RELID, *row) for row in ROWS] + [update(RELID, tuple(row)) for row in ROWS]
    msgs += [delete(RELID, tuple(row), b"O") for row in ROWS]
    outs, fast = both(tmp_path, msgs, exclude=("t", "j", "fa"), key=("id", "u"))
    assert fast.declined == 0
    assert all(b'"t":' not in rec[1] for o in outs[2:] for rec in o[0][1] if rec[1])


def test_bad_utf8_and_non_canonical_integers(tmp_path: Path) -> None:
    bad = list(ROW1)
    msgs = [
        insert(RELID, *bad[:12], b"\xff\xfe", *bad[13:]),  # not UTF-8: the reference's DecodeError
        insert(RELID, "007", *ROW1[1:]),  # int() reads it; orjson writes 7
        insert(RELID, *ROW1[:1], "+1", *ROW1[2:]),
    ]
    outs, _ = both(tmp_path, msgs)
    assert outs[2][0] == "error"


def test_a_changed_relation_takes_the_python_path_and_records_the_columns(tmp_path: Path) -> None:
    cols = [*COLS, ("extra", "text")]
    relid_msg = relation_msg(cols)
    msgs = [relid_msg, insert(RELID, *ROW1, "new column")]
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 0 and outs[-1][0] is not None


# -- randomized ------------------------------------------------------------------------------------------
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_INT = st.integers(-(2**63), 2**63 - 1).map(str)
_FLOAT = st.one_of(
    st.floats(allow_nan=False).map(repr), st.sampled_from(["NaN", "Infinity", "-Infinity", "-0"])
)
_NUM = st.one_of(
    st.decimals(allow_nan=False, allow_infinity=False).map(str), st.sampled_from(["NaN", "Infinity"])
)


def _array(elem: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    def lit(items: list[str | None]) -> str:
        out = []
        for v in items:
            out.append("NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"')
        return "{" + ",".join(out) + "}"

    return st.lists(st.one_of(st.none(), elem), max_size=5).map(lit)


VALUE = {
    "bigint": _INT,
    "smallint": st.integers(-32768, 32767).map(str),
    "integer": st.integers(-(2**31), 2**31 - 1).map(str),
    "posint": st.integers(0, 2**31 - 1).map(str),
    "numeric(38,9)": _NUM,
    "numeric": _NUM,
    "real": _FLOAT,
    "double precision": _FLOAT,
    "boolean": st.sampled_from(["t", "f"]),
    "bytea": st.binary(max_size=20).map(lambda b: "\\x" + b.hex()),
    "integer[]": _array(st.integers(-5, 5).map(str)),
    "text[]": _array(_TEXT),
    "numeric[]": _array(_NUM),
    "double precision[]": _array(_FLOAT),
    "boolean[]": _array(st.sampled_from(["t", "f"])),
}


@st.composite
def rows(draw: Any, key: int) -> tuple[Any, ...]:
    out: list[Any] = [str(key)]
    for _, typ in COLS[1:]:
        if draw(st.integers(0, 5)) == 0:
            out.append(None)
        else:
            out.append(draw(VALUE.get(typ, _TEXT)))
    return tuple(out)


@st.composite
def changes(draw: Any) -> list[bytes]:
    msgs = []
    for k in range(draw(st.integers(1, 6))):
        row = draw(rows(k + 1))
        msgs.append(insert(RELID, *row))
        op = draw(st.sampled_from(["update", "update_k", "delete", "toast", "none"]))
        new = draw(rows(k + 1))
        if op == "update":
            msgs.append(update(RELID, new))
        elif op == "update_k":
            msgs.append(update(RELID, new, (str(k + 1),) + (None,) * (len(COLS) - 1)))
        elif op == "toast":
            msgs.append(update(RELID, tuple(v if i != 12 else ... for i, v in enumerate(new))))
        elif op == "delete":
            msgs.append(delete(RELID, (str(k + 1),) + (None,) * (len(COLS) - 1)))
    return msgs


# 150 random examples in all, in two shares: ``make check`` runs the first, ``make test`` both (the
# second is marked ``full_size``, tests/plugins/markers.py). Drawing the examples is most of the cost:
# 20 took 8.4 s, 2.0 s of it feeding them through both paths (2026-11-29, a loaded machine)
_RANDOM = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(_RANDOM, max_examples=40)
@given(msgs=changes())
def test_randomized_rows_are_byte_identical(tmp_path_factory: Any, msgs: list[bytes]) -> None:
    both(tmp_path_factory.mktemp("native"), msgs)


@pytest.mark.full_size
@settings(_RANDOM, max_examples=110)
@given(msgs=changes())
def test_randomized_rows_are_byte_identical_full_size(tmp_path_factory: Any, msgs: list[bytes]) -> None:
    both(tmp_path_factory.mktemp("native"), msgs)


# -- the snapshot: COPY's text rows to op=r records ---------------------------------------------------
_COPY_ESC = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f", "\v": "\\v"}


def copy_text(rows: list[list[str | None]]) -> bytes:
    """Rows as ``COPY ... TO STDOUT`` writes them (text format)."""
    out = []
    for row in rows:
        fields = ["\\N" if v is None else "".join(_COPY_ESC.get(c, c) for c in v) for v in row]
        out.append("\t".join(fields) + "\n")
    return "".join(out).encode()


def snapshot_reference(codec: TableCodec, rows: list[list[str | None]], source: bytes) -> Any:
    """The stream's encoding of each row (TableCodec.snapshot_record), and the images it keeps."""
    records, images = [], []
    for row in rows:
        after = {}
        for name, v in zip(codec.included, row, strict=True):
            conv = codec.text_converters[name]
            after[name] = v if v is None or conv is None else conv(v)
        rec = codec.snapshot_record(after, source, b"1764000000000")
        records.append((rec.key, rec.value))
        if codec.imaged and codec.holds_out_of_line(after):
            images.append((rec.key, codec.image(after)))
    return records, images


def snapshot_both(rows: list[list[str | None]], exclude: tuple[str, ...] = ()) -> Any:
    from cdc.codec.fastpath import copy_plan

    columns = tuple(Column(n, DOMAINS.get(t, t)) for n, t in COLS)
    reg = TableReg("public", "every", "cdc.public.every", ("id",), columns=columns, exclude=exclude)
    codec = TableCodec(reg, prefix="cdc", db="app", partitions=3)
    source = codec.snapshot_source(0x2_0000_0000, 1_764_000_000_000, last=False)
    tail = b',"source":' + source + b',"op":"r","ts_ms":1764000000000,"unavailable":[]}'
    keep = [i for i, (n, _) in enumerate(COLS) if n not in exclude]
    rows = [[row[i] for i in keep] for row in rows]
    encoder = native.CopyRows(
        copy_plan(native, codec, list(codec.included)),
        b'{"before":null,"after":',
        tail,
        lambda k, v: (k, v),
        True,
    )
    recs, images = encoder.rows(copy_text(rows))
    assert ([tuple(r) for r in recs], images) == snapshot_reference(codec, rows, source)
    return recs, images, encoder


def test_snapshot_rows_are_the_streams_encoding() -> None:
    rows = [list(r) for r in ROWS]
    big = list(ROW1)
    big[12] = BIG
    _, images, encoder = snapshot_both([*rows, big])
    assert images and images[-1][0] == b'{"id":1}' and encoder.python_values > 0
    snapshot_both(rows, exclude=("t", "fa"))


def test_snapshot_refuses_a_row_of_other_columns_and_names_a_bad_value() -> None:
    from cdc.codec.fastpath import copy_plan

    columns = tuple(Column(n, DOMAINS.get(t, t)) for n, t in COLS)
    codec = TableCodec(
        TableReg("public", "every", "cdc.public.every", ("id",), columns=columns),
        prefix="c",
        db="d",
        partitions=1,
    )
    encoder = native.CopyRows(
        copy_plan(native, codec, list(codec.included)), b"", b"", lambda k, v: (k, v), False
    )
    with pytest.raises(ValueError, match="columns"):
        encoder.rows(b"1\t2\n")
    bad = list(ROW1)
    bad[24] = "{1,2"  # ia: a malformed array literal
    with pytest.raises(ValueError, match="column 24") as info:
        encoder.rows(copy_text([bad]))
    assert isinstance(info.value.__cause__, DecodeError)


@settings(max_examples=60, deadline=None)
@given(data=st.lists(rows(1), min_size=1, max_size=4))
def test_snapshot_randomized_rows(data: list[tuple[Any, ...]]) -> None:
    snapshot_both([[*r[:1], *r[1:]] for r in data])


def test_pump_takes_what_the_per_message_path_takes(tmp_path: Path) -> None:
    """The stream loop's drain (``Changes.pump``) appends the same records, in order, as the Python
    path gives message by message; it hands back what it does not take (a Begin, a key change) and
    stops at its budget and at a full batch."""
    from cdc.codec.pgoutput import RawMessage

    msgs = [insert(RELID, *row) for row in ROWS]
    msgs += [update(RELID, tuple(ROW1), tuple(ROW4[:1] + ROW1[1:]), b"O")]  # a key change: declined
    msgs += [update(RELID, tuple(row)) for row in ROWS]
    msgs += [begin(0x2_0000_0100, 817_093_738_744_379, 728)]  # not a row change: handed back
    msgs += [delete(RELID, (row[0],) + (None,) * (len(row) - 1)) for row in ROWS]
    head = [relation_msg(COLS, ("id",)), begin(0x2_0000_0000, 817_093_738_744_379, 727)]
    py, nat = World(tmp_path, False), World(tmp_path, True)
    try:
        want = py.records(head + msgs)
        nat.ready(head)
        raws = iter([RawMessage(m, nat.lsn + 8 * (i + 1)) for i, m in enumerate(msgs)])
        batch = Batch()
        got_back: list[bytes] = []
        stops: list[Any] = []
        flushed: list[Any] = []
        while True:
            that, taken = nat.fast.pump(lambda: next(raws, None), batch, 4, 3)
            stops.append((that if that is None or that is PYTHON else that.payload[:1], taken))
            if that is not None and that is not PYTHON:  # the loop's Python path: decode, then the builder
                got_back.append(that.payload[:1])
                decoded = nat.decoder.decode(that.payload, that.data_start)
                assert decoded is not None
                if decoded.action == "B":
                    nat.builder.begin(decoded)
                else:
                    out = settled(nat.schema, nat.builder.change(decoded))
                    assert out is not None
                    batch.records.setdefault(out[0], []).extend(out[1])
                    batch.count += len(out[1])
            if batch.count >= 4 or that is None:  # the loop submits a full batch
                flushed += [(t, r.key, r.value, r.partition) for t, rs in batch.records.items() for r in rs]
                batch.records, batch.count = {}, 0
            if that is None:
                break
        assert flushed == want
        assert got_back == [b"U", b"B"]
        assert all(taken <= 3 for _, taken in stops) and (PYTHON, 3) in stops
        assert batch.started > 0
    finally:
        py.close()
        nat.close()


def test_pump_into_the_batchs_records_is_byte_identical_in_the_store(tmp_path: Path) -> None:
    """``Changes.pump`` writes each change's key and value straight into the batch's compiled
    ``Records`` (no ``Record`` per change), and the Python path's records of a change it hands back
    (a key change) join the same ``Records``: multi-MB values with quotes, newlines and backslashes,
    deletes and their tombstones give the Python path's records, and the embedded store's compiled
    append packs them to the same stored batches as a list of them."""
    from cdc.codec.pgoutput import RawMessage

    rows_ = [list(ROW1), list(ROW2)]
    rows_[0][12] = BIG  # t
    rows_[1][10] = '{"k": "' + BIG.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"}'  # j
    msgs = [insert(RELID, *r) for r in rows_] + [update(RELID, tuple(r)) for r in rows_]
    msgs += [update(RELID, tuple(ROW1), tuple(ROW4[:1] + ROW1[1:]), b"O")]  # a key change: handed back
    msgs += [delete(RELID, (r[0],) + (None,) * (len(r) - 1)) for r in rows_]
    head = [relation_msg(COLS, ("id",)), begin(0x2_0000_0000, 817_093_738_744_379, 727)]
    py, nat = World(tmp_path, False), World(tmp_path, True)
    try:
        want = py.records(head + msgs)
        nat.ready(head)
        raws = iter([RawMessage(m, nat.lsn + 8 * (i + 1)) for i, m in enumerate(msgs)])
        batch = Batch()
        while (that := nat.fast.pump(lambda: next(raws, None), batch, 1000, 1000)[0]) is not None:
            decoded = nat.decoder.decode(that.payload, that.data_start)
            assert decoded is not None
            out = settled(nat.schema, nat.builder.change(decoded))
            assert out is not None
            batch.records[out[0]].extend(out[1])  # the Python path's records, as Batch.add adds them
        packed_alike(batch, want, [3, 0, 2**32])
    finally:
        py.close()
        nat.close()


def test_every_control_character_is_escaped_as_orjson_does(tmp_path: Path) -> None:
    """Each byte below 0x20 (``\\b`` and ``\\f`` too), quotes and backslashes, through the escape
    table of the compiled path: the same JSON as orjson's."""
    text = "".join(chr(c) + "x" for c in range(1, 32)) + '"\\' + "\x7f end"
    row = list(ROW4)
    row[12] = text  # t
    row[13] = "\b\f"  # vc
    outs, fast = both(tmp_path, [insert(RELID, *row), update(RELID, tuple(row))])
    assert fast.declined == 0 and outs[2][0] is not None
    assert b"\\b\\f" in outs[2][0][1][0][1]


def _pumped(nat: World, steps: list[Any], budget: int, max_count: int) -> list[Any]:
    """The records ``Changes.pump`` appends for ``steps`` (messages, and callables applied to the
    world between them, when the stream has nothing ready), the messages it hands back taken by the
    Python path as the stream loop takes them."""
    from cdc.codec.pgoutput import RawMessage

    assert nat.fast is not None
    batch = Batch()
    flushed: list[Any] = []
    i = 0
    while i < len(steps):
        j = i
        while j < len(steps) and not callable(steps[j]):
            j += 1
        raws = iter([RawMessage(m, nat.lsn + 8 * (k + 1)) for k, m in enumerate(steps[i:j])])
        read = functools.partial(next, raws, None)
        nat.lsn += 8 * (j - i)
        while True:
            that, _ = nat.fast.pump(read, batch, max_count, budget)
            if that is not None and that is not PYTHON:
                decoded = nat.decoder.decode(that.payload, that.data_start)
                if decoded is not None and decoded.action == "B":
                    nat.builder.begin(decoded)
                elif decoded is not None and decoded.action in ("I", "U", "D"):
                    out = settled(nat.schema, nat.builder.change(decoded))
                    if out is not None:
                        batch.records.setdefault(out[0], []).extend(out[1])
                        batch.count += len(out[1])
            if batch.count >= max_count or that is None:
                flushed += [(t, r.key, r.value, r.partition) for t, rs in batch.records.items() for r in rs]
                batch.records, batch.count = {}, 0
            if that is None:
                break
        if j < len(steps):
            steps[j](nat)
        i = j + 1
    return flushed


@pytest.mark.parametrize("budget", [1, 3, 1024])
def test_pump_follows_the_builders_state_between_calls(tmp_path: Path, budget: int) -> None:
    """``Changes.pump`` reads the builder's state once per call and checks a table's codec once per
    call: what the Python path changes between two calls (a new transaction, a Relation message
    with other columns and the schema change it settles, the table's snapshot position, a table
    detached and attached again) is what the next call's changes see; multi-MB values, unchanged
    TOAST values and key changes among them. The same records in order,
    the same images staged and version, and the same ``seq`` as the Python path message by
    message."""
    changed = [(n, "text" if n == "i" else t) for n, t in COLS]  # i: integer -> text (a retype)

    def snapshot_at(lsn: int) -> Any:
        def step(w: World) -> None:
            w.codec.snapshot_lsn = lsn

        return step

    def detach(w: World) -> None:
        w.builder.detach(w.codec)

    def reattach(w: World) -> None:
        w.builder.reattach(("public", "every"))

    tx2 = begin(0x3_0000_0000, 817_093_738_744_400, 728)
    tx3 = begin(0x4_0000_0000, 817_093_738_744_500, 729)
    tx4 = begin(0x5_0000_0000, 817_093_738_744_600, 730)
    steps: list[Any] = [relation_msg(COLS, ("id",)), begin(0x2_0000_0000, 817_093_738_744_379, 727)]
    steps += [insert(RELID, *row) for row in ROWS]
    steps += [snapshot_at(0x3_0000_0001), tx2]  # the table's snapshot holds tx2: skipped, seq counted
    steps += [update(RELID, tuple(row)) for row in ROWS]
    steps += [snapshot_at(0), tx3, relation_msg(changed, ("id",))]  # a retyped column mid-stream
    steps += [insert(RELID, *row) for row in ROWS[:2]]
    steps += [detach]  # no longer decoded: skipped by the Python path, seq counted
    steps += [update(RELID, tuple(row)) for row in ROWS[:2]]
    steps += [reattach, tx4]
    steps += [delete(RELID, (row[0],) + (None,) * (len(row) - 1)) for row in ROWS]
    steps += [insert(RELID, *row) for row in ROWS]
    big = list(ROW1)
    big[12] = BIG  # a multi-MB value: its image staged by pump
    toasted = tuple(v if i != 12 else ... for i, v in enumerate(ROW1))
    moved = ("99", *ROW1[1:12], ..., *ROW1[13:])
    steps += [insert(RELID, *big), update(RELID, tuple(big))]
    steps += [update(RELID, toasted)]  # t unchanged: declined, filled in by the Python path
    steps += [update(RELID, moved, ("1",) + (None,) * (len(ROW1) - 1))]  # a key change: declined
    steps += [insert(RELID, *ROW2), delete(RELID, ("3",) + (None,) * (len(ROW1) - 1))]
    py, nat = World(tmp_path, False), World(tmp_path, True)
    try:
        want: list[Any] = []
        for s in steps:
            if callable(s):
                s(py)
                continue
            out = py.feed(s)
            if out[0] is not None:
                want += [(out[0][0], *r) for r in out[0][1]]
        nat.builder.now = py.builder.now = b"1764000000000"
        got = _pumped(nat, steps, budget, 5)
        assert got == want
        assert nat.builder.seq == py.builder.seq
        assert nat.changed == py.changed and py.changed  # the retype was recorded, once
        assert nat.builder.staging is not None and py.builder.staging is not None
        assert nat.builder.staging.changes == py.builder.staging.changes
        assert nat.builder.staging.version == py.builder.staging.version
        assert nat.fast is not None and nat.fast.declined == 2  # the TOAST fill and the key change
        assert len(want) > 2 * len(ROWS)
        assert any(v is not None and len(v) > 2_000_000 for v in nat.builder.staging.changes.values())
    finally:
        py.close()
        nat.close()
