"""wal2json decoding and value encoding (pure logic)."""

from __future__ import annotations

import pytest

from cdc.codec.values import parse_array, text_converter_for
from cdc.codec.wal2json import NO_TABLE, add_tables_option, converter_for, decode, escape_name
from cdc.errors import DecodeError
from cdc.pgtypes import type_kind


def test_decode_keeps_every_numeric_digit_and_big_ints() -> None:
    msg = decode(
        b'{"action":"I","columns":[{"name":"n","type":"numeric(38,9)","value":12345678901234567890123456789.123456789},'
        b'{"name":"z","type":"numeric","value":0.000000001},{"name":"b","type":"bigint","value":9007199254740993},'
        b'{"name":"h","type":"numeric","value":123456789012345678901234567890}]}'
    )
    values = [c.value for c in msg.columns or []]
    assert values[0] == "12345678901234567890123456789.123456789"
    assert values[1] == "0.000000001"
    assert values[2] == 9007199254740993
    assert converter_for("numeric")(values[3]) == "123456789012345678901234567890"  # type: ignore[misc]


def test_decode_rejects_garbage_with_decode_error() -> None:
    with pytest.raises(DecodeError):
        decode(b"{not json")
    with pytest.raises(DecodeError):
        decode(b"[1,2]")


@pytest.mark.parametrize(
    ("pg_type", "kind"),
    [
        ("integer", "int"),
        ("bigint", "int"),
        ("smallint", "int"),
        ("numeric(38,9)", "numeric"),
        ("numeric", "numeric"),
        ("double precision", "float"),
        ("real", "float"),
        ("boolean", "bool"),
        ("bytea", "bytea"),
        ("jsonb", "json"),
        ("json", "json"),
        ("integer[]", "array"),
        ("timestamp with time zone", "text"),
        ("uuid", "text"),
        ("character varying(10)", "text"),
    ],
)
def test_type_kind(pg_type: str, kind: str) -> None:
    assert type_kind(pg_type) == kind


def test_add_tables_escapes_commas_dots_wildcards_and_backslashes() -> None:
    assert escape_name("a.b,c*d\\e f") == "a\\.b\\,c\\*d\\\\e\\ f"
    assert add_tables_option([("public", "t"), ("Mixed Case", "tab.le")]) == "Mixed\\ Case.tab\\.le,public.t"
    assert add_tables_option([]) == NO_TABLE
    assert add_tables_option([("public", "it's")]) == "public.it\\'s"  # wal2json's documented set


def test_parse_array_simple_null_quoted_nested() -> None:
    assert parse_array("{1,2,NULL}", int) == [1, 2, None]
    assert parse_array('{"a,b","q\\"x","NULL",NULL,"back\\\\slash"}') == [
        "a,b",
        'q"x',
        "NULL",
        None,
        "back\\slash",
    ]
    assert parse_array("{{1,2},{3,4}}", int) == [[1, 2], [3, 4]]
    assert parse_array("{}") == []
    assert parse_array("[0:1]={7,8}", int) == [7, 8]
    assert parse_array('{"emoji 😀","e\u0301"}') == ["emoji 😀", "e\u0301"]


def test_parse_array_malformed_raises() -> None:
    with pytest.raises(DecodeError):
        parse_array("1,2")
    with pytest.raises(DecodeError):
        parse_array("{1,2")


def test_array_converters_encode_elements_by_type() -> None:
    num = converter_for("numeric(10,2)[]")
    assert num is not None and num("{1.50,NULL,NaN,Infinity,-Infinity}") == [
        "1.50",
        None,
        "NaN",
        "Infinity",
        "-Infinity",
    ]
    flt = converter_for("double precision[]")
    assert flt is not None and flt("{1.5,NaN,Infinity,-Infinity,NULL}") == [
        1.5,
        "NaN",
        "Infinity",
        "-Infinity",
        None,
    ]
    bools = converter_for("boolean[]")
    assert bools is not None and bools("{t,f}") == [True, False]
    byt = converter_for("bytea[]")
    assert byt is not None and byt('{"\\\\x0102"}') == ["0102"]
    txt = converter_for("text[]")
    assert txt is not None and txt('{"a b",c}') == ["a b", "c"]


def test_text_converters_match_stream_encoding() -> None:
    assert text_converter_for("text") is None
    assert text_converter_for("jsonb") is None
    assert text_converter_for("bigint")("9007199254740993") == 9007199254740993  # type: ignore[misc]
    assert text_converter_for("numeric(38,9)")("1.000000000") == "1.000000000"  # type: ignore[misc]
    for special in ("NaN", "Infinity", "-Infinity"):  # never null (issue 9)
        assert text_converter_for("numeric")(special) == special  # type: ignore[misc]
        assert text_converter_for("real")(special) == special  # type: ignore[misc]
        assert converter_for("double precision")(special) == special  # type: ignore[misc]
        assert converter_for("numeric")(special) == special  # type: ignore[misc]
    # numeric-data-types-as-string (wal2json 2.6+): numbers as strings of their text output
    assert converter_for("double precision")("0.1") == 0.1  # type: ignore[misc]
    assert converter_for("real")("3.4028235e+38") == 3.4028235e38  # type: ignore[misc]
    assert converter_for("numeric")("1.000000000000000000001") == "1.000000000000000000001"  # type: ignore[misc]
    assert converter_for("bigint", numeric_as_string=True)("9007199254740993") == 9007199254740993  # type: ignore[misc]
    assert converter_for("bigint", numeric_as_string=True)(7) == 7  # type: ignore[misc]
    assert converter_for("bigint") is None
    assert text_converter_for("boolean")("t") is True  # type: ignore[misc]
    assert text_converter_for("bytea")("\\x0102ff") == "0102ff"  # type: ignore[misc]
    assert text_converter_for("double precision")("1.5") == 1.5  # type: ignore[misc]
    assert converter_for("double precision")("1.5") == 1.5  # type: ignore[misc]
    assert converter_for("double precision")(2) == 2.0  # type: ignore[misc]


def test_parse_array_keeps_characters_python_but_not_postgres_calls_space() -> None:
    # Postgres quotes array elements only for its own white space (array_isspace): a non-breaking
    # space or a unit separator at an element's edge comes unquoted and must be kept
    assert parse_array("{\xa0a\xa0,\x1f,b\u3000}") == ["\xa0a\xa0", "\x1f", "b\u3000"]
    assert parse_array("{ a , b }") == ["a", "b"]
