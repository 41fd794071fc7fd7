"""One classifier of Postgres types (:mod:`cdc.pgtypes`), asked by the codec, the sinks and
``cdc verify`` alike: they agree on every integer type, ``oid`` and ``xid`` included (unsigned
32-bit: held in 8 signed bytes), where their copies used to disagree."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cdc.cli.verify.ranges import unsupported
from cdc.codec.values import text_converter_for
from cdc.pgtypes import element_type, is_blank_padded, type_kind
from cdc.registry import Column, TableReg
from sinks.types import arrow_type, to_array

INTEGERS = {
    "smallint": pa.int16(),
    "integer": pa.int32(),
    "bigint": pa.int64(),
    "oid": pa.int64(),
    "xid": pa.int64(),
}


def _reg(pg_type: str) -> TableReg:
    return TableReg("public", "t", "cdc.public.t", ("k",), columns=(Column("k", pg_type),))


@pytest.mark.parametrize("pg_type", [*INTEGERS, "INT4", " int8 ", "int2"])
def test_every_integer_type_is_an_integer_to_every_stage(pg_type: str) -> None:
    assert type_kind(pg_type) == "int"
    convert = text_converter_for(pg_type)  # the codec: Postgres' text output -> a JSON integer
    assert convert is not None and convert("4294967295") == 4294967295
    assert unsupported(_reg(pg_type)) is None  # verify: an integer key has key ranges
    assert pa.types.is_integer(arrow_type(pg_type))


def test_oid_and_xid_hold_their_largest_value_in_the_warehouse() -> None:
    for pg_type, arrow in INTEGERS.items():
        assert arrow_type(pg_type) == arrow
    top = 2**32 - 1  # oid and xid are unsigned 32-bit
    assert to_array([top, 0, None], "oid").to_pylist() == [top, 0, None]
    assert to_array([top], "xid").type == pa.int64()


def test_the_other_kinds() -> None:
    assert [type_kind(t) for t in ("numeric(38,9)", "real", "double precision", "bool", "bytea", "jsonb")] == [
        "numeric", "float", "float", "bool", "bytea", "json",
    ]  # fmt: skip
    assert type_kind("integer[]") == "array" and element_type("integer[][]") == "integer"
    assert type_kind("uuid") == type_kind("character varying(20)") == type_kind("xid8") == "text"
    assert unsupported(_reg("uuid")) is not None and unsupported(_reg("text")) is None
    assert (
        is_blank_padded("character(3)")
        and is_blank_padded("bpchar")
        and not is_blank_padded("character varying")
    )
