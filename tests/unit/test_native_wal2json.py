"""The compiled wal2json path (cdc.codec._native.Wal2JsonChanges, driven by cdc.codec.fastpath)
against the Python path it replaces (cdc.codec.wal2json.decode, then EventBuilder.change): the same
wal2json format-version 2 messages through both give byte-identical records and image changes (or
the same error), for every type of the edge-value tests, NULLs, multi-MB values with quotes,
newlines, backslashes and unicode escapes, NaN and +-Infinity (null from wal2json 2.5, strings with
numeric-data-types-as-string), arrays, unchanged TOAST values, key changes, deletes, excluded
columns, a two-column key, JSON the reader never gets from wal2json (fields reordered, whitespace,
escapes in odd places, malformed); and randomized rows (hypothesis). The tests also check that the
compiled path took what it should (else they would compare Python with itself)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc.codec.compiled import native_module
from cdc.codec.envelope import TableCodec
from cdc.codec.fastpath import PYTHON
from cdc.codec.wal2json import DECODER, decode
from tests import native_world
from tests.codec_fakes import settled
from tests.native_world import Batch, differential, every_table, packed_alike
from tests.unit.test_native import BIG, COLS, DOMAINS, ROW1, ROW2, ROW4, ROWS, rows

native = native_module()
pytestmark = pytest.mark.skipif(native is None, reason="cdc.codec._native is not built (or CDC_NATIVE=0)")

TYPES = dict(COLS)
_INTS = ("smallint", "integer", "bigint")
_SPECIAL = ("NaN", "Infinity", "-Infinity", "inf", "-inf", "nan")
_PG_ESC = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def jstr(s: str, style: str = "pg") -> str:
    """A JSON string as wal2json writes it (Postgres' escape_json: ``pg``), or with every
    non-ASCII character and ``/`` escaped too (``u``: surrogate pairs above the BMP)."""
    out = []
    for ch in s:
        if ch in _PG_ESC:
            out.append(_PG_ESC[ch])
        elif ord(ch) < 0x20:
            out.append(f"\\u{ord(ch):04x}")
        elif style == "u" and ch == "/":
            out.append("\\/")
        elif style == "u" and ord(ch) > 0x7F:
            cp = ord(ch)
            if cp > 0xFFFF:
                cp -= 0x10000
                out.append(f"\\u{0xD800 + (cp >> 10):04X}\\u{0xDC00 + (cp & 0x3FF):04x}")
            else:
                out.append(f"\\u{cp:04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def value(typ: str, text: str | None, style: str = "pg", nas: bool = False) -> str:
    """The JSON wal2json sends for a value of ``typ`` whose text output is ``text``; ``nas``:
    numeric-data-types-as-string (numbers of the numeric family as strings)."""
    if text is None:
        return "null"
    numeric = typ.startswith("numeric") and not typ.endswith("[]")
    if typ in _INTS or numeric or typ in ("real", "double precision"):
        if nas:
            return jstr(text)
        return "null" if text in _SPECIAL else text
    if typ == "boolean":
        return "true" if text == "t" else "false"
    if typ == "bytea":
        return jstr(text[2:], style)
    return jstr(text, style)


def cols_json(row: Any, style: str = "pg", nas: bool = False, skip: tuple[int, ...] = ()) -> str:
    parts = []
    for i, ((name, typ), text) in enumerate(zip(COLS, row, strict=True)):
        if i in skip or text is ...:
            continue
        parts.append(f'{{"name":{jstr(name)},"type":{jstr(typ)},"value":{value(typ, text, style, nas)}}}')
    return "[" + ",".join(parts) + "]"


def key_json(key: str, names: tuple[str, ...] = ("id",), row: Any = None) -> str:
    row = row if row is not None else [key] + [None] * (len(COLS) - 1)
    idx = [i for i, (n, _) in enumerate(COLS) if n in names]
    return cols_json([row[i] if i in idx else ... for i in range(len(COLS))])


_LSN = [0x2_0000_0000]


def msg(action: str, columns: str | None = None, identity: str | None = None, **extra: Any) -> bytes:
    _LSN[0] += 8
    lsn = _LSN[0]
    out = f'{{"action":"{action}","xid":727,"timestamp":"2026-11-22 02:28:58.744379+00",'
    out += f'"lsn":"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}","schema":"public","table":"every"'
    if columns is not None:
        out += f',"columns":{columns}'
    if identity is not None:
        out += f',"identity":{identity}'
    out += ',"pk":[{"name":"id","type":"bigint"}]'
    for k, v in extra.items():
        out += f',"{k}":{v}'
    return (out + "}").encode()


def ins(row: Any, style: str = "pg", nas: bool = False) -> bytes:
    return msg("I", cols_json(row, style, nas))


def upd(row: Any, identity: str | None, style: str = "pg", nas: bool = False) -> bytes:
    return msg("U", cols_json(row, style, nas), identity)


def dele(identity: str) -> bytes:
    return msg("D", None, identity)


BEGIN = b'{"action":"B","xid":727,"timestamp":"2026-11-22 02:28:58.744379+00","lsn":"2/0","nextlsn":"2/100"}'


class World(native_world.World):
    """One path: its builder (with an image store) and, for the compiled one, its driver."""

    def __init__(
        self,
        tmp: Path,
        compiled: bool,
        exclude: tuple[str, ...] = (),
        key: tuple[str, ...] = ("id",),
        nas: bool = False,
    ):
        reg = every_table(COLS, DOMAINS, key, exclude)
        codec = TableCodec(reg, prefix="cdc", db="app", partitions=3, numeric_as_string=nas)
        super().__init__(tmp / f"images-w2j-{compiled}.sqlite", codec, DECODER, native if compiled else None)

    def feed(self, m: bytes) -> Any:
        """What one message gives: its records and the image changes staged, or the error."""
        b = self.builder
        b.now = b"1764000000000"
        try:
            out = PYTHON if self.fast is None else self.fast(m, 0)
            if out is PYTHON:
                decoded = decode(m)
                if decoded.action == "B":
                    b.begin(decoded)
                    out = None
                else:
                    out = settled(self.schema, b.change(decoded))
        except Exception as exc:  # the same error from both paths
            return ("error", type(exc).__name__, getattr(exc, "message", str(exc)))
        return (*self.outcome(out), b.seq)


def both(tmp: Path, msgs: list[bytes], **kw: Any) -> tuple[list[Any], Any]:
    """Feed ``msgs`` through both paths; assert each message's outcome is identical."""
    return differential(World(tmp, False, **kw), World(tmp, True, **kw), [BEGIN, *msgs], 200)


def taken(fast: Any, n: int) -> int:
    """How many of ``n`` row changes the compiled path took."""
    return int(n - fast.declined)


def test_every_type_nulls_and_specials_insert_update_delete(tmp_path: Path) -> None:
    msgs = [ins(row) for row in ROWS]
    msgs += [upd(row, key_json(row[0])) for row in ROWS]  # identity: the key
    msgs += [upd(row, cols_json(row)) for row in ROWS]  # REPLICA IDENTITY FULL: the old row
    msgs += [dele(key_json(row[0])) for row in ROWS]
    msgs += [dele(cols_json(ROW2))]
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 0
    assert fast.python_values > 0  # floats and arrays: their Python converters
    assert all(o[0] is not None and o[0] != "error" for o in outs[1:])


def test_unicode_escapes_and_numbers_as_strings(tmp_path: Path) -> None:
    msgs = [ins(row, "u") for row in ROWS] + [upd(row, key_json(row[0]), "u") for row in ROWS]
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 0
    outs, fast = both(tmp_path, [ins(row, nas=True) for row in ROWS], nas=True)
    assert fast.declined == 0
    assert b'"f4":"NaN"' in outs[2][0][1][0][1]


def test_multi_megabyte_values_are_imaged_alike(tmp_path: Path) -> None:
    rows_ = [list(ROW1), list(ROW2)]
    rows_[0][12] = BIG  # t
    rows_[1][10] = '{"k": "' + BIG.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"}'  # j
    rows_[1][12] = "é😀\u2028" * 300_000
    msgs = [ins(r) for r in rows_] + [upd(r, key_json(r[0]), "u") for r in rows_]
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 0
    staged = [o[1] for o in outs[1:]]
    assert all(any(v for v in s.values()) for s in staged)  # the rows' images were kept


def test_unchanged_toast_and_key_changes_take_the_python_path(tmp_path: Path) -> None:
    big = list(ROW1)
    big[12] = BIG
    toasted = [v if i != 12 else ... for i, v in enumerate(ROW1)]
    moved = ["99", *ROW1[1:12], ..., *ROW1[13:]]
    msgs = [
        ins(big),
        upd(toasted, key_json("1")),  # t unchanged: filled in from the image
        upd(moved, key_json("1")),  # key change, t unchanged
        upd(ROW2, key_json("2")),  # same key
        upd(ROW4, key_json("3")),  # key change, every column sent
        upd(ROW4, None),  # no identity: the general path
        dele(key_json("99")),
    ]
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 4
    assert b'"unavailable":[]' in outs[2][0][1][0][1]  # filled in, by the Python path


def test_excluded_columns_and_a_two_column_key(tmp_path: Path) -> None:
    key = ("id", "u")
    msgs = [ins(row) for row in ROWS] + [upd(row, key_json(row[0], key, row)) for row in ROWS]
    msgs += [dele(cols_json(row)) for row in ROWS]
    outs, fast = both(tmp_path, msgs, exclude=("t", "j", "fa", "n"), key=key)
    assert fast.declined == 0
    assert all(b'"t":' not in rec[1] for o in outs[1:] for rec in o[0][1] if rec[1])
    # an excluded column's converter still runs on the new row (TableCodec.fast_row): its error
    bad = msg("I", cols_json(ROW1).replace('"value":12345678901234567890123456789.123456789', '"value":true'))
    outs, fast = both(tmp_path, [bad], exclude=("n",))
    assert outs[1][0] == "error"


def test_columns_not_the_codecs_are_the_python_paths(tmp_path: Path) -> None:
    extra = cols_json(ROW1)[:-1] + ',{"name":"extra","type":"text","value":"new"}]'
    retyped = cols_json(ROW1).replace('"name":"i","type":"integer"', '"name":"i","type":"bigint"')
    twice = cols_json(ROW1)[:-1] + ',{"name":"t","type":"text","value":"again"}]'
    escaped_name = cols_json(ROW1).replace('"name":"t"', '"name":"\\u0074"')
    msgs = [
        msg("I", cols_json(ROW1, skip=(3,))),  # an INSERT without a column
        msg("I", retyped),
        msg("I", twice),
        msg("I", escaped_name),
        msg("I", extra),  # a new column: recorded, and from now on the codec's
        msg("I", extra),
    ]
    _, fast = both(tmp_path, msgs)
    assert fast.declined == 5  # the last one is compiled: the new column is the codec's now


def test_columns_in_another_order_after_the_tables_layout(tmp_path: Path) -> None:
    """The compiled path looks for each column where the table's last change had it (wal2json's
    order, name and type as it writes them): cells in another order, a type written otherwise, or
    a column's cell with more fields are read by name, and give the same bytes."""
    cells = orjson.loads(cols_json(ROW1))
    turned = orjson.dumps(cells[1:] + cells[:1]).decode()  # every column one place off
    swapped = orjson.dumps([cells[1], cells[0], *cells[2:]]).decode()
    optional = cols_json(ROW1).replace('"type":"integer","value"', '"type":"integer","optional":true,"value"')
    spaced_type = cols_json(ROW1).replace('{"name":"i","type":"integer"', '{"name":"i", "type":"integer"')
    msgs = [ins(ROW1), msg("I", turned), ins(ROW2), msg("I", swapped), msg("I", optional)]
    msgs += [msg("I", spaced_type), msg("U", swapped, key_json(ROW1[0])), ins(ROW4)]
    _, fast = both(tmp_path, msgs)
    assert fast.declined == 0


def test_a_pk_array_other_than_the_last_one_read_is_read_whole(tmp_path: Path) -> None:
    """The last ``pk`` array read is not read again when the next message has the same bytes; one
    that only starts like it is read whole (and a message that is not JSON after it, declined)."""
    pk = ',"pk":[{"name":"id","type":"bigint"}]'
    longer = ',"pk":[{"name":"id","type":"bigint"},{"name":"s","type":"smallint"}]'
    msgs = [ins(ROW1), ins(ROW2), ins(ROW1).replace(pk.encode(), longer.encode())]
    msgs += [ins(ROW4).replace(pk.encode(), (pk + "]").encode())]  # not JSON: both paths fail alike
    msgs += [ins(ROW4).replace(pk.encode(), b',"pk":[{"name":"id","type":"bigint"}] ')]
    assert all(pk.encode() in m or longer.encode() in m for m in msgs)
    outs, fast = both(tmp_path, msgs)
    assert fast.declined == 1
    assert outs[4][0] == "error"


def test_json_the_reader_never_gets_is_read_as_msgspec_reads_it(tmp_path: Path) -> None:
    good = ins(ROW1).decode()
    pretty = orjson.dumps(orjson.loads(good), option=orjson.OPT_INDENT_2).decode()
    # whitespace wherever JSON allows it (after the prefix the compiled path looks for)
    spaced = good[:14] + re.sub(r'(?<!\\)":', '" :\r ', re.sub(r',"', ' ,\n\t"', good[14:]))
    spaced = spaced.replace("[{", "[ {").replace("}]", "} ]").replace("}", " }")
    reordered = '{"action":"I","columns":%s,"table":"every","xid":1,"lsn":"2/10","schema":"public"}'
    msgs = [
        ins(ROW1),
        pretty.encode(),  # handed to the Python path: not the prefix wal2json writes
        spaced.encode(),
        (reordered % cols_json(ROW4)).encode(),
        good.replace('"xid":727', '"xid":null').encode(),
        good.replace('"xid":727', '"xid":"727"').encode(),  # not an int: msgspec refuses
        good.replace('"xid":727', '"xid":7.5').encode(),
        good.replace('"lsn":"', '"lsn":"0x').encode(),  # int(x, 16) takes it
        good.replace('"lsn":"', '"lsn":" ').encode(),
        good.replace('"lsn":"2/', '"lsn":"2:').encode(),
        good.replace('"lsn":"2/', '"lsn":"123456789/').encode(),
        good.replace('"action":"I",', "").encode(),  # no action
        good[:-1].encode(),  # truncated
        (good + " ").encode(),
        (good + "x").encode(),
        good.replace('"timestamp":"', '"timestamp":1,"x":"').encode(),
        good.replace('"pk":[', '"pk":[1,2.5e3,{"a":[null,true,false,{}]},').encode(),
        good.replace('"pk":[', '"pk":[01,').encode(),
        good.replace('"value":"a \\"quoted\\" label"', '"value":"a \\ud83d\\ude00 label"').encode(),
        good.replace('"value":"a \\"quoted\\" label"', '"value":"a \\ud83d label"').encode(),  # lone
        good.replace('"value":"a \\"quoted\\" label"', '"value":"a \\x label"').encode(),
        good.replace('"value":"a \\"quoted\\" label"', '"value":"tab\tinside"').encode(),  # raw control
        good.replace('"value":"a \\"quoted\\" label"', '"value":"ok"')
        .encode()
        .replace(b'"ok"', b'"\xff\xfe"'),
        good.replace('"value":"a \\"quoted\\" label"', '"value":{"x":[1]}').encode(),
        good.replace('"value":"a \\"quoted\\" label"', '"value":12').encode(),  # a number for an enum
        good.replace(
            '"name":"e","type":"mood2","value":"a \\"quoted\\" label"', '"type":"mood2","name":"e"'
        ).encode(),
        good.replace('"columns":[', '"columns":[{"name":"x"},').encode(),
        good.replace(',"columns":[', ',"identity":null,"columns":[').encode(),
        good.replace(',"columns":[', ',"columns":null,"columns":[').encode(),  # a field twice
        good.replace('"action":"I"', '"action":"I","action":"D"').encode(),
        good.replace('"act', '"\\u0061ct').encode(),  # an escaped field name
        good.replace('"table":"every"', '"table":"ev\\u0065ry"').encode(),
        good.replace('"table":"every"', '"table":"other"').encode(),  # not registered
        good.replace('"schema":"public",', "").encode(),
        good.replace('"value":2147483647', '"value":-0').encode(),  # i
        good.replace('"value":2147483647', '"value":2147483647.0').encode(),
        good.replace('"value":2147483647', '"value":1e3').encode(),
        good.replace('"value":2147483647', '"value":"12"').encode(),
        good.replace('"value":9223372036854775807', '"value":123456789012345678901234567890').encode(),
        good.replace('"value":12345678901234567890123456789.123456789', '"value":-0').encode(),
        good.replace('"value":12345678901234567890123456789.123456789', '"value":1E+5').encode(),
        good.replace('"value":12345678901234567890123456789.123456789', '"value":"1.50"').encode(),
        good.replace(
            '"value":12345678901234567890123456789.123456789', '"value":12345678901234567890'
        ).encode(),
        good.replace('"value":1.5', '"value":15').encode(),  # f4 an integer
        good.replace('"value":1.5', '"value":"NaN"').encode(),
        good.replace('"value":1.5', '"value":"1.5x"').encode(),  # float() refuses
        good.replace('"value":true', '"value":"t"').encode(),  # ok
        good.replace('"value":true', '"value":1').encode(),
        good.replace('"value":"7"', '"value":7').encode(),  # the domain: int() of an int
        good.replace('"value":"7"', '"value":" 7"').encode(),
        good.replace('"value":"7"', '"value":"007"').encode(),
    ]
    outs, fast = both(tmp_path, msgs)
    errors = [i for i, o in enumerate(outs[1:]) if o[0] == "error"]
    assert len(errors) >= 10  # the malformed ones: the reference's DecodeError, from both paths
    # taken by the compiled path: the spaced and the reordered message, and the values it reads
    assert 0 < fast.declined < len(msgs) - 25
    (tmp_path / "w").mkdir()
    world = World(tmp_path / "w", True)
    try:
        world.feed(BEGIN)
        for m in (spaced.encode(), (reordered % cols_json(ROW4)).encode()):
            assert world.fast.declined == 0 and world.feed(m)[0] is not None and world.fast.declined == 0
    finally:
        world.close()


@pytest.mark.parametrize("action", ["B", "C", "M", "T", "X"])
def test_other_messages_are_handed_back(tmp_path: Path, action: str) -> None:
    world = World(tmp_path, True)
    try:
        assert world.fast is not None
        m = f'{{"action":"{action}","xid":1,"lsn":"0/10","schema":"public","table":"every"}}'.encode()
        assert world.fast(m, 0) is PYTHON
    finally:
        world.close()


class _Raw:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.data_start = 0


def test_pump_takes_wal2json_changes_and_hands_back_the_rest(tmp_path: Path) -> None:
    msgs = [ins(row) for row in ROWS] + [upd(ROW4, key_json("3"))]  # a key change: handed back
    msgs += [b'{"action":"C","xid":727,"lsn":"2/0","nextlsn":"2/100"}']
    py, nat = World(tmp_path, False), World(tmp_path, True)
    try:
        want = py.records([BEGIN, *msgs[:-1]])
        py.feed(msgs[-1])  # the commit: no record
        nat.ready([BEGIN])
        raws = iter([_Raw(m) for m in msgs])
        batch = Batch()
        that, k = nat.fast.pump(lambda: next(raws, None), batch, 100, 100)
        assert k == len(ROWS) and that.payload.startswith(b'{"action":"U"')
        got = [(t, r.key, r.value, r.partition) for t, rs in batch.records.items() for r in rs]
        assert got == want[: len(got)] and len(got) == len(ROWS)
    finally:
        py.close()
        nat.close()


def test_pump_into_the_batchs_records_is_byte_identical_in_the_store(tmp_path: Path) -> None:
    """``Changes.pump`` writes each change's key and value straight into the batch's compiled
    ``Records`` (no ``Record`` per change): ugly rows (multi-MB values with quotes, newlines and
    backslashes, deletes and their tombstones) give the Python path's records, and the embedded
    store's compiled append packs them to the same stored batches as the Python path's list."""
    rows_ = [list(ROW1), list(ROW2), list(ROW4)]
    rows_[0][12] = BIG  # t
    rows_[1][10] = '{"k": "' + BIG.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"}'
    rows_[2][12] = 'say "hi"\n\\ back\r\t' * 1000
    msgs = [ins(r) for r in rows_] + [upd(r, key_json(r[0]), "u") for r in rows_]
    msgs += [dele(key_json(r[0])) for r in rows_]
    py, nat = World(tmp_path, False), World(tmp_path, True)
    try:
        want = py.records([BEGIN, *msgs])
        nat.ready([BEGIN])
        raws = iter([_Raw(m) for m in msgs])
        batch = Batch()
        that, k = nat.fast.pump(lambda: next(raws, None), batch, 100, 100)
        assert that is None and k == len(msgs)
        assert len(want) == 4 * len(rows_)  # a delete: its event and tombstone
        packed_alike(batch, want, [0, 7, 2**33])
    finally:
        py.close()
        nat.close()


def test_pump_alternating_tables_and_the_builders_state_between_calls(tmp_path: Path) -> None:
    """Two tables' changes interleaved within one ``pump`` call (each change looks its table up by
    name: the one before it, or another), then a table detached between calls (its changes the
    Python path's, skipped) and a new transaction: the same records per topic, the same ``seq``,
    images and staging version as the Python path message by message."""

    def other(m: bytes) -> bytes:
        return m.replace(b'"table":"every"', b'"table":"other"')

    msgs = [m for row in ROWS for m in (ins(row), other(ins(row)))]
    msgs += [m for row in ROWS for m in (other(upd(row, key_json(row[0]))), upd(row, key_json(row[0])))]
    tail = [other(dele(key_json("1"))), dele(key_json("2")), other(ins(ROW1))]
    begin2 = BEGIN.replace(b'"xid":727', b'"xid":728').replace(b'"2/0"', b'"3/0"')
    py, nat = World(tmp_path, False), World(tmp_path, True)
    try:
        for w in (py, nat):
            reg = every_table(COLS, DOMAINS, ("id",), ())
            reg = type(reg)("public", "other", "cdc.public.other", ("id",), columns=reg.columns)
            w.builder.codecs[("public", "other")] = TableCodec(reg, prefix="cdc", db="app", partitions=3)
            w.images.follow("cdc.public.other", 0.0)
        want: list[Any] = []
        steps = [BEGIN, *msgs, "detach", begin2, *tail]
        for m in steps:
            if m == "detach":
                py.builder.detach(py.builder.codecs[("public", "other")])
                continue
            out = py.feed(m)
            if out[0] is not None:
                want += [(out[0][0], *r) for r in out[0][1]]
        nat.feed(BEGIN)
        assert nat.fast is not None
        nat.builder.now = b"1764000000000"
        batch = Batch()
        raws = iter([_Raw(m) for m in msgs])
        that, k = nat.fast.pump(lambda: next(raws, None), batch, 1000, 1000)
        assert that is None and k == len(msgs)  # every change taken in one call
        nat.builder.detach(nat.builder.codecs[("public", "other")])
        nat.feed(begin2)
        nat.builder.now = b"1764000000000"
        raws = iter([_Raw(m) for m in tail])
        while (that := nat.fast.pump(lambda: next(raws, None), batch, 1000, 1000)[0]) is not None:
            out = settled(nat.schema, nat.builder.change(decode(that.payload)))  # the detached table's
            assert out is None
        got = [(t, r.key, r.value, r.partition) for t, rs in batch.records.items() for r in rs]
        for topic in ("cdc.public.every", "cdc.public.other"):
            assert [g for g in got if g[0] == topic] == [w for w in want if w[0] == topic], topic
        assert len(got) == len(want) > 4 * len(ROWS)
        b, pb = nat.builder, py.builder
        assert b.seq == pb.seq and b.staging is not None and pb.staging is not None
        assert b.staging.changes == pb.staging.changes and b.staging.version == pb.staging.version
    finally:
        py.close()
        nat.close()


# -- randomized ------------------------------------------------------------------------------------------
@st.composite
def changes(draw: Any) -> tuple[list[bytes], bool]:
    nas = draw(st.booleans())
    style = draw(st.sampled_from(["pg", "u"]))
    msgs = []
    for k in range(draw(st.integers(1, 6))):
        row = list(draw(rows(k + 1)))
        msgs.append(ins(row, style, nas))
        op = draw(st.sampled_from(["update", "update_full", "delete", "toast", "key_change", "none"]))
        new = list(draw(rows(k + 1)))
        if op == "update":
            msgs.append(upd(new, key_json(str(k + 1)), style, nas))
        elif op == "update_full":
            msgs.append(upd(new, cols_json(row, style, nas), style, nas))
        elif op == "toast":
            msgs.append(
                upd([v if i != 12 else ... for i, v in enumerate(new)], key_json(str(k + 1)), style, nas)
            )
        elif op == "key_change":
            msgs.append(upd([str(k + 100), *new[1:]], key_json(str(k + 1)), style, nas))
        elif op == "delete":
            msgs.append(dele(key_json(str(k + 1))))
    return msgs, nas


_RANDOM = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(_RANDOM, max_examples=40)
@given(data=changes())
def test_randomized_rows_are_byte_identical(tmp_path_factory: Any, data: tuple[list[bytes], bool]) -> None:
    msgs, nas = data
    _, fast = both(tmp_path_factory.mktemp("w2j"), msgs, nas=nas)
    assert fast.declined <= sum(not m.startswith(b'{"action":"I"') for m in msgs)  # inserts: compiled


@pytest.mark.full_size
@settings(_RANDOM, max_examples=110)
@given(data=changes())
def test_randomized_rows_are_byte_identical_full_size(
    tmp_path_factory: Any, data: tuple[list[bytes], bool]
) -> None:
    msgs, nas = data
    both(tmp_path_factory.mktemp("w2j"), msgs, nas=nas)


def test_mutated_messages_get_the_same_outcome(tmp_path: Path) -> None:
    """Valid messages with a few bytes replaced, removed or inserted (JSON's own characters,
    controls, bytes that are not UTF-8) after the prefix the compiled path looks for: it takes
    none that msgspec would refuse, and whatever it takes gives the reference's bytes."""
    import random

    rnd = random.Random(34)
    base = [ins(r) for r in ROWS] + [upd(r, key_json(r[0])) for r in ROWS] + [ins(r, "u") for r in ROWS]
    base += [dele(key_json(r[0])) for r in ROWS]
    alphabet = b'{}[]",:\\ \t\n0123456789-+.eEtrufalsnxuU/\x00\x1f\x7f\xc3\xa9\xff'
    msgs = []
    for _ in range(3000):
        m = bytearray(rnd.choice(base))
        for _ in range(rnd.randint(1, 3)):
            i = rnd.randrange(13, len(m))
            op = rnd.random()
            if op < 0.4:
                m[i] = rnd.choice(alphabet)
            elif op < 0.7:
                del m[i]
            else:
                m.insert(i, rnd.choice(alphabet))
        msgs.append(bytes(m))
    _, fast = both(tmp_path, msgs)
    assert 0 < fast.declined < len(msgs)  # some mutations leave a message the compiled path takes
