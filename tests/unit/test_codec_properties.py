"""Property tests (hypothesis): any row of the supported types survives capture encoding (a wal2json
v2 message decoded by :func:`cdc.codec.wal2json.decode` and the column converters, or Postgres' text
output through the snapshot's text converters), the topic (JSON bytes), and the warehouse type mapping
(:func:`sinks.types.to_array`) exactly."""

from __future__ import annotations

import datetime as dt
import itertools
import math
from decimal import Decimal
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc.codec.values import text_converter_for
from cdc.codec.wal2json import converter_for, decode
from sinks.types import to_array

UTC = dt.UTC
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)


def _pg_array(items: list[Any], elem_text: Any) -> str:
    """Postgres' text output of a one-dimensional array."""

    def one(v: Any) -> str:
        if v is None:
            return "NULL"
        s = elem_text(v)
        if s == "" or s.upper() == "NULL" or any(c in s for c in '{},"\\ \t\n\r\x0b\x0c'):
            return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return s

    return "{" + ",".join(one(v) for v in items) + "}"


def _ts_text(v: dt.datetime) -> str:
    base = f"{v.year:04d}-{v.month:02d}-{v.day:02d} {v.hour:02d}:{v.minute:02d}:{v.second:02d}"
    if v.microsecond:
        base += f".{v.microsecond:06d}".rstrip("0")
    return base + ("+00" if v.tzinfo else "")


def _decimal_text(d: Decimal, scale: int) -> str:
    return f"{d:.{scale}f}"


# (pg type, strategy of stored Python values, Postgres text output, how wal2json writes it in JSON)
def _number_json(text: str) -> bytes:
    return text.encode()


def _string_json(text: str) -> bytes:
    return orjson.dumps(text)


CASES: dict[str, tuple[st.SearchStrategy[Any], Any, Any]] = {
    "smallint": (st.integers(-(2**15), 2**15 - 1), str, _number_json),
    "integer": (st.integers(-(2**31), 2**31 - 1), str, _number_json),
    "bigint": (st.integers(-(2**63), 2**63 - 1), str, _number_json),
    "numeric(38,9)": (
        st.decimals(min_value=Decimal("-1e28") + 1, max_value=Decimal("1e28") - 1, places=9, allow_nan=False),
        lambda d: _decimal_text(d, 9),
        _number_json,
    ),
    "numeric": (
        st.decimals(allow_nan=False, allow_infinity=False).map(lambda d: format(d, "f")),
        str,
        _number_json,
    ),
    "double precision": (st.floats(allow_nan=False, allow_infinity=False), repr, _number_json),
    "real": (st.floats(width=32, allow_nan=False, allow_infinity=False), repr, _number_json),
    "boolean": (st.booleans(), lambda b: "true" if b else "false", _number_json),
    "text": (_text, str, _string_json),
    "bytea": (st.binary(max_size=40), lambda b: b.hex(), _string_json),
    "timestamp with time zone": (
        st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30)).map(
            lambda d: d.replace(tzinfo=UTC)
        ),
        _ts_text,
        _string_json,
    ),
    "timestamp without time zone": (
        st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 58)),
        _ts_text,
        _string_json,
    ),
    "date": (st.dates(), lambda d: f"{d.year:04d}-{d.month:02d}-{d.day:02d}", _string_json),
    "integer[]": (
        st.lists(st.none() | st.integers(-(2**31), 2**31 - 1), max_size=6),
        lambda xs: _pg_array(xs, str),
        _string_json,
    ),
    "text[]": (st.lists(st.none() | _text, max_size=6), lambda xs: _pg_array(xs, str), _string_json),
    "double precision[]": (
        st.lists(st.none() | st.floats(allow_nan=False, allow_infinity=False), max_size=6),
        lambda xs: _pg_array(xs, repr),
        _string_json,
    ),
    "numeric[]": (
        st.lists(
            st.none()
            | st.decimals(allow_nan=False, allow_infinity=False).map(lambda d: format(d, "f"))
            | st.sampled_from(["NaN", "Infinity", "-Infinity"]),
            max_size=6,
        ),
        lambda xs: _pg_array(xs, str),
        _string_json,
    ),
    "boolean[]": (
        st.lists(st.none() | st.booleans(), max_size=6),
        lambda xs: _pg_array(xs, lambda b: "t" if b else "f"),
        _string_json,
    ),
}


def _stored(pg_type: str, event_values: list[Any]) -> list[Any]:
    """Through the topic (JSON bytes) and into the warehouse's Arrow type."""
    through_topic = orjson.loads(orjson.dumps(event_values))
    return to_array(through_topic, pg_type).to_pylist()


def _expected(pg_type: str, value: Any) -> Any:
    if pg_type == "numeric(38,9)":
        return Decimal(_decimal_text(value, 9))
    if pg_type == "real":
        return float(value)
    return value


@st.composite
def rows(draw: st.DrawFn) -> dict[str, Any]:
    return {t: draw(st.none() | strategy) for t, (strategy, _, _) in CASES.items()}


@SETTINGS
@given(rows())
def test_a_row_survives_the_stream_encoding_and_the_warehouse_mapping(row: dict[str, Any]) -> None:
    cols = []
    for i, (pg_type, value) in enumerate(row.items()):
        _, text_of, json_of = CASES[pg_type]
        raw = b"null" if value is None else json_of(text_of(value))
        cols.append(b'{"name":"c%d","type":%s,"value":%s}' % (i, orjson.dumps(pg_type), raw))
    message = decode(b'{"action":"I","schema":"s","table":"t","columns":[' + b",".join(cols) + b"]}")
    assert message.columns is not None
    for col, (pg_type, value) in zip(message.columns, row.items(), strict=True):
        conv = converter_for(pg_type)
        event = col.value if conv is None or col.value is None else conv(col.value)
        (stored,) = _stored(pg_type, [event])
        want = None if value is None else _expected(pg_type, value)
        assert stored == want, (pg_type, value, event, stored)


@SETTINGS
@given(rows())
def test_a_row_survives_the_snapshot_text_encoding_and_the_warehouse_mapping(row: dict[str, Any]) -> None:
    for pg_type, value in row.items():
        _, text_of, _ = CASES[pg_type]
        conv = text_converter_for(pg_type)
        if value is None:
            event = None
        else:
            text = text_of(value)
            if pg_type == "boolean":
                text = "t" if value else "f"  # COPY prints booleans as t/f
            if pg_type == "bytea":
                text = "\\x" + text
            event = text if conv is None else conv(text)
        (stored,) = _stored(pg_type, [event])
        assert stored == (None if value is None else _expected(pg_type, value)), (pg_type, value, event)


@SETTINGS
@given(st.sampled_from(["NaN", "Infinity", "-Infinity"]), st.sampled_from(["real", "double precision"]))
def test_special_float_values_survive_as_floats(special: str, pg_type: str) -> None:
    conv = converter_for(pg_type)
    assert conv is not None
    event = conv(special)  # numeric-data-types-as-string sends them as strings
    assert event == special  # never null in the event
    (stored,) = _stored(pg_type, [event])
    want = float(special)
    assert (math.isnan(stored) and math.isnan(want)) or stored == want


@st.composite
def _numeric_typed(draw: st.DrawFn) -> tuple[str, Decimal]:
    """A ``numeric(p,s)`` type of any precision and scale the warehouse holds as a decimal, and a
    value of it."""
    p = draw(st.integers(1, 38))
    scale = draw(st.integers(0, p))
    # built from its digits: Decimal arithmetic (and st.decimals) rounds to the context's 28 digits,
    # which turns 10**31 - 1 into 10**31, a value numeric(31,0) cannot hold
    n = draw(st.integers(-(10**p - 1), 10**p - 1))
    d = Decimal((int(n < 0), tuple(int(c) for c in str(abs(n))), -scale))
    return f"numeric({p},{scale})", d


@SETTINGS
@given(_numeric_typed())
def test_a_numeric_of_any_precision_and_scale_survives(typed: tuple[str, Decimal]) -> None:
    pg_type, d = typed
    scale = int(pg_type.split(",")[1].rstrip(")"))
    text = _decimal_text(d, scale)
    message = decode(b'{"action":"I","columns":[{"name":"n","type":"numeric","value":%s}]}' % text.encode())
    assert message.columns is not None
    conv = converter_for(pg_type)
    assert conv is not None
    event = conv(message.columns[0].value)
    assert event == text  # every digit, as a string
    (stored,) = _stored(pg_type, [event])
    assert stored == Decimal(text) and stored.as_tuple().exponent == -scale  # exact, to the scale


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(["r", "d", "n"]), st.sampled_from(["NaN", "Infinity", "-Infinity"]), min_size=1
    ),
    st.integers(1, 2**31 - 1),
)
def test_special_values_survive_the_non_finite_recorder(values: dict[str, str], key: int) -> None:
    """wal2json 2.5 sends null; the recorder's message carries the value; the event and the
    warehouse hold it (floats as IEEE values, unbounded numeric as its text)."""
    from cdc.codec.envelope import EventBuilder, TableCodec
    from cdc.registry import Column, TableReg

    types = {"r": "real", "d": "double precision", "n": "numeric"}
    reg = TableReg(
        "public",
        "t",
        "cdc.public.t",
        ("id",),
        columns=(Column("id", "integer"), *(Column(c, t) for c, t in types.items())),
    )
    builder = EventBuilder({("public", "t"): TableCodec(reg, prefix="cdc", db="d", partitions=1)})
    builder.begin(decode(b'{"action":"B","xid":1,"lsn":"0/10","nextlsn":"0/20"}'))
    content = {"v": 1, "image": "new", "schema": "public", "table": "t", "key": [str(key)], "values": values}
    builder.nonfinite(
        decode(
            orjson.dumps(
                {
                    "action": "M",
                    "transactional": True,
                    "prefix": "cdc.nonfinite",
                    "content": orjson.dumps(content).decode(),
                }
            )
        )
    )
    cols = [{"name": "id", "type": "integer", "value": key}] + [
        {"name": c, "type": t, "value": None if c in values else 1.5} for c, t in types.items()
    ]
    out = builder.change(
        decode(
            orjson.dumps({"action": "I", "lsn": "0/10", "schema": "public", "table": "t", "columns": cols})
        )
    )
    assert out is not None
    after = orjson.loads(out[1][0].value or b"null")["after"]
    for c, t in types.items():
        if c not in values:
            assert after[c] in (1.5, "1.5")
            continue
        assert after[c] == values[c]  # never null
        (stored,) = _stored(t, [after[c]])
        if t == "numeric":
            assert stored == values[c]
        else:
            want = float(values[c])
            assert (math.isnan(stored) and math.isnan(want)) or stored == want


# --- the snapshot's COPY path: COPY CSV bytes -> read_csv_batches -> RowEncoder --------------------
# (name, pg type, strategy of Postgres' text output, how wal2json writes that text in its JSON)
_ugly = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
_ugly_text = st.text(_ugly, max_size=20) | st.sampled_from(
    ['"', '""', ",", "\n", "\r\n", "\\", "\t", "\\N", "\\."]
)


@st.composite
def _long_text(draw: st.DrawFn) -> str:
    """A value from a few bytes to thousands (repeated pieces: quotes, commas, newlines, CR,
    backslashes), so that rows span many of the small blocks the property uses."""
    unit = draw(st.lists(_ugly_text, min_size=1, max_size=4).map("".join))
    return unit * draw(st.sampled_from([1, 2, 7, 300, 3000]))


def _json_text(value: Any) -> str:
    return orjson.dumps(value).decode().replace(":", ": ").replace(",", ", ")  # jsonb's spacing


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | _ugly_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_ugly_text, inner, max_size=3),
    max_leaves=8,
)
_specials = st.sampled_from(["NaN", "Infinity", "-Infinity"])

SNAPSHOT_CASES: list[tuple[str, str, st.SearchStrategy[str], Any]] = [
    ("e", "mood", st.sampled_from(["ok", 'a "quoted", label', "new\nline", "back\\slash"]), _string_json),
    ("j", "jsonb", _json_values.map(_json_text), _string_json),
    (
        "x",
        "xml",
        _long_text().map(lambda s: "<a>" + s.replace("<", "").replace("&", "") + "</a>"),
        _string_json,
    ),
    (
        "ta",
        "text[]",
        st.lists(st.none() | _ugly_text, max_size=5).map(lambda xs: _pg_array(xs, str)),
        _string_json,
    ),
    ("b", "bytea", st.binary(max_size=3000).map(lambda b: "\\x" + b.hex()), lambda t: _string_json(t[2:])),
    (
        "iv",
        "interval",
        st.sampled_from(["1 year 2 mons 3 days 04:05:06.7", "-1 days", "00:00:00"]),
        _string_json,
    ),
    ("ip", "inet", st.sampled_from(["192.168.0.1/24", "::1", "10.0.0.1"]), _string_json),
    (
        "f8",
        "double precision",
        st.floats(allow_nan=False, allow_infinity=False).map(repr) | _specials,
        lambda t: _string_json(t) if t in ("NaN", "Infinity", "-Infinity") else _number_json(t),
    ),
    (
        "n",
        "numeric",
        st.decimals(allow_nan=False, allow_infinity=False).map(lambda d: format(d, "f")) | _specials,
        _string_json,
    ),
    ("t", "text", _long_text(), _string_json),
    ("t2", "character varying", _ugly_text, _string_json),
]


def _csv_field(text: str | None) -> str:
    """A value as ``COPY ... (FORMAT csv)`` writes it: NULL unquoted and empty, quoted when it is
    empty or holds the delimiter, a quote, a newline or a carriage return (quotes doubled)."""
    if text is None:
        return ""
    if text == "" or any(c in text for c in ',"\n\r') or text == "\\.":
        return '"' + text.replace('"', '""') + '"'
    return text


@st.composite
def snapshot_rows(draw: st.DrawFn) -> list[list[str | None]]:
    """Rows of the Postgres text output of every SNAPSHOT_CASES column (the first column: the key)."""
    n = draw(st.integers(1, 6))
    return [
        [str(k + 1)] + [draw(st.none() | strategy) for _, _, strategy, _ in SNAPSHOT_CASES] for k in range(n)
    ]


def _stream_after(row: list[str | None]) -> bytes:
    """The ``after`` bytes the stream writes for ``row`` (a wal2json insert through the reader's
    EventBuilder: the reader's own encoding)."""
    from cdc.codec.envelope import EventBuilder, TableCodec
    from cdc.registry import Column, TableReg

    columns = [Column("id", "integer")] + [Column(name, typ) for name, typ, _, _ in SNAPSHOT_CASES]
    reg = TableReg("public", "t", "cdc.public.t", ("id",), columns=tuple(columns))
    builder = EventBuilder({("public", "t"): TableCodec(reg, prefix="cdc", db="d", partitions=1)})
    builder.begin(decode(b'{"action":"B","xid":1,"lsn":"0/10","nextlsn":"0/20"}'))
    cols = [b'{"name":"id","type":"integer","value":%s}' % (row[0] or "").encode()]
    for (name, typ, _, json_of), text in zip(SNAPSHOT_CASES, row[1:], strict=True):
        raw = b"null" if text is None else json_of(text)
        cols.append(b'{"name":%s,"type":%s,"value":%s}' % (orjson.dumps(name), orjson.dumps(typ), raw))
    msg = b'{"action":"I","lsn":"0/10","schema":"public","table":"t","columns":[' + b",".join(cols) + b"]}"
    out = builder.change(decode(msg))
    assert out is not None
    value = out[1][0].value
    assert value is not None
    return value.split(b'"after":', 1)[1].split(b',"source":', 1)[0]


def _pieces(data: bytes, rows: list[bytes], how: str, cuts: list[int]) -> list[bytes]:
    """The COPY output as psycopg yields it (one piece a row) or cut anywhere."""
    if how == "rows":
        return rows
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, int | float) and isinstance(b, int | float) and float(a) == float(b)
    return bool(a == b)


@SETTINGS
@given(
    snapshot_rows(),
    st.sampled_from([16, 100, 4096]),
    st.sampled_from([1, 16, 64, 1 << 20]),
    st.sampled_from(["rows", "anywhere"]),
    st.lists(st.integers(0, 10**6), max_size=20),
)
def test_a_snapshot_row_of_any_size_and_content_encodes_as_the_stream_does(
    rows_: list[list[str | None]], block_size: int, arrow_block: int, how: str, cuts: list[int]
) -> None:
    """Rows far longer than Arrow's blocks (which Arrow refuses unless the blocks grow with them),
    holding quotes, commas, newlines, CR, backslashes, next to short ones: the snapshot's bytes are
    the stream's (floats: the same numbers)."""
    import pyarrow as pa

    from snapshot.encode import RowEncoder, read_csv_batches

    names = ["id"] + [name for name, _, _, _ in SNAPSHOT_CASES]
    types = {"id": "integer"} | {name: typ for name, typ, _, _ in SNAPSHOT_CASES}
    lines = [(",".join(_csv_field(v) for v in row) + "\n").encode() for row in rows_]
    data = b"".join(lines)
    batches = list(read_csv_batches(_pieces(data, lines, how, cuts), names, block_size, arrow_block))
    table = pa.Table.from_batches(batches)
    assert table.num_rows == len(rows_)
    assert [[table.column(n)[i].as_py() for n in names] for i in range(len(rows_))] == rows_
    encoder = RowEncoder(names, types, ["id"])
    afters: list[bytes] = []
    for rb in batches:
        keys, after = encoder.encode(rb)
        assert keys.to_pylist() == [b'{"id":%s}' % v.encode() for v in rb.column(0).to_pylist()]
        afters += after.to_pylist()
    for row, got in zip(rows_, afters, strict=True):
        want = _stream_after(row)
        if row[names.index("f8")] is None or row[names.index("f8")] in ("NaN", "Infinity", "-Infinity"):
            assert got == want  # no float digits: the very bytes
        else:
            got_obj, want_obj = orjson.loads(got), orjson.loads(want)
            assert list(got_obj) == list(want_obj)
            assert all(_same(got_obj[c], want_obj[c]) for c in want_obj), (got_obj, want_obj)


@st.composite
def _nd_arrays(draw: st.DrawFn) -> tuple[str, list[Any], list[Any]]:
    """A rectangular array of 1 to 4 dimensions (Postgres refuses ragged ones) of text elements
    (NULLs, quotes, commas, braces): (Postgres' text output, nested lists, elements in row-major
    order)."""
    dims = draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    flat = draw(st.lists(st.none() | _ugly_text, min_size=math.prod(dims), max_size=math.prod(dims)))

    def build(level: int, items: list[Any]) -> list[Any]:
        if level == len(dims) - 1:
            return items
        step = len(items) // dims[level]
        return [build(level + 1, items[i * step : (i + 1) * step]) for i in range(dims[level])]

    def text(value: list[Any]) -> str:
        if value and isinstance(value[0], list):
            return "{" + ",".join(text(v) for v in value) + "}"
        return _pg_array(value, str)

    nested = build(0, flat)
    return text(nested), nested, flat


@SETTINGS
@given(_nd_arrays())
def test_an_array_of_any_dimensions_is_stored_with_every_element(
    case: tuple[str, list[Any], list[Any]],
) -> None:
    """The stream and the snapshot carry a multi-dimensional array as nested lists; the warehouse
    stores its elements in row-major order (docs/warehouse.md), never refusing it."""
    text, nested, flat = case
    stream = converter_for("text[]")
    snap = text_converter_for("text[]")
    assert stream is not None and snap is not None
    assert stream(text) == snap(text) == nested
    (stored,) = _stored("text[]", [nested])
    assert stored == flat
    from sinks.types import unstorable

    assert unstorable([nested], "text[]") == {}


def test_a_crlf_on_an_arrow_block_boundary_keeps_every_byte() -> None:
    """Arrow's CSV reader drops a byte of a quoted value when one of its block boundaries falls
    between the CR and the LF of a CRLF in it (with 1 MB blocks: any Windows text that straddles a
    megabyte of the COPY output). The snapshot moves the boundary."""
    from snapshot.encode import read_csv_batches

    value = "line\r\n" * 40
    long = b'0,"' + value.encode() + b'"\n'
    short = [b"%d,s\n" % i for i in range(1, len(long) // 4 + 2)]
    prefix = sum(map(len, short))  # >= len(long): a block that long ends inside the long row
    for j in range(3):
        block = prefix + long.index(b"\r\n") + 1 + 6 * j  # ends between a CR and its LF
        batches = list(read_csv_batches([*short, long], ["id", "v"], 1 << 20, block))
        got = [v for b in batches for v in b.column(1).to_pylist()]
        assert got == ["s"] * len(short) + [value], block
