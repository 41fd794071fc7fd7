"""The non-finite recorder's stream side (pure logic: messages as wal2json sends them; the triggers
themselves are tested against Postgres in tests/capture/test_special_floats.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cdc.codec import NONFINITE_PREFIX, Message
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.codec.nonfinite import key_comparable
from cdc.codec.wal2json import decode
from cdc.errors import DecodeError
from cdc.recorders.nonfinite import trigger_statements
from cdc.registry import Column, TableReg

COLS = (Column("id", "integer"), Column("d", "double precision"), Column("n", "numeric"), Column("t", "text"))


def _builder(key: tuple[str, ...] = ("id",), cols: tuple[Column, ...] = COLS) -> EventBuilder:
    reg = TableReg("public", "t", "cdc.public.t", key, columns=cols)
    codec = TableCodec(reg, prefix="cdc", db="app", partitions=1)
    b = EventBuilder({("public", "t"): codec})
    b.begin(decode(b'{"action":"B","xid":7,"lsn":"0/100","nextlsn":"0/110"}'))
    return b


def _msg(image: str, key: list[Any], values: dict[str, str], table: str = "t") -> Message:
    content = {"v": 1, "image": image, "schema": "public", "table": table, "key": key, "values": values}
    return decode(
        orjson.dumps(
            {
                "action": "M",
                "transactional": True,
                "prefix": NONFINITE_PREFIX,
                "content": orjson.dumps(content).decode(),
            }
        )
    )


def _change(action: str, i: int, d: Any = None, n: Any = None, identity: list[Any] | None = None) -> Message:
    cols = [
        {"name": "id", "type": "integer", "value": i},
        {"name": "d", "type": "double precision", "value": d},
        {"name": "n", "type": "numeric", "value": n},
        {"name": "t", "type": "text", "value": "x"},
    ]
    body: dict[str, Any] = {
        "action": action,
        "lsn": "0/100",
        "schema": "public",
        "table": "t",
        "columns": cols,
    }
    if identity is not None:
        body["identity"] = identity
    return decode(orjson.dumps(body))


def _after(b: EventBuilder, msg: Message) -> dict[str, Any]:
    out = b.change(msg)
    assert out is not None
    return dict(orjson.loads(out[1][-1].value or b"null")["after"])


def test_held_values_fill_the_next_change_of_the_same_key() -> None:
    b = _builder()
    b.nonfinite(_msg("new", ["1"], {"d": "NaN", "n": "-Infinity"}))
    after = _after(b, _change("I", 1))
    assert (after["d"], after["n"], after["t"]) == ("NaN", "-Infinity", "x")
    assert _after(b, _change("I", 2))["d"] is None  # taken: the next row's null stays null


def test_another_key_or_a_value_sent_is_never_overwritten() -> None:
    b = _builder()
    b.nonfinite(_msg("new", ["1"], {"d": "NaN"}))  # a write that did not happen (ON CONFLICT DO NOTHING)
    assert _after(b, _change("I", 2))["d"] is None  # another key: not its row
    assert _after(b, _change("I", 1))["d"] is None  # dropped by the change of the table above
    b.nonfinite(_msg("new", ["3"], {"d": "Infinity"}))
    assert _after(b, _change("I", 3, d=1.5))["d"] == 1.5  # only nulls are filled


def test_held_values_end_with_their_transaction() -> None:
    b = _builder()
    b.nonfinite(_msg("new", ["1"], {"d": "NaN"}))
    b.commit(decode(b'{"action":"C","lsn":"0/100","nextlsn":"0/110"}'))
    b.begin(decode(b'{"action":"B","xid":8,"lsn":"0/200","nextlsn":"0/210"}'))
    assert _after(b, _change("I", 1))["d"] is None


def test_the_old_image_fills_the_identity() -> None:
    b = _builder()
    b.nonfinite(_msg("old", ["4"], {"n": "NaN"}))
    identity = [
        {"name": "id", "type": "integer", "value": 4},
        {"name": "d", "type": "double precision", "value": 2.0},
        {"name": "n", "type": "numeric", "value": None},
        {"name": "t", "type": "text", "value": "x"},
    ]
    out = b.change(
        decode(
            orjson.dumps(
                {"action": "D", "lsn": "0/100", "schema": "public", "table": "t", "identity": identity}
            )
        )
    )
    assert out is not None
    assert orjson.loads(out[1][0].value or b"null")["before"]["n"] == "NaN"


def test_a_key_printed_differently_is_not_compared() -> None:
    assert key_comparable(("id",), {"id": "integer"}) and key_comparable(("u",), {"u": "uuid"})
    assert not key_comparable(("ts",), {"ts": "timestamp with time zone"})  # to_jsonb prints a 'T'
    b = _builder(("id", "t"))  # text + integer: comparable
    b.nonfinite(_msg("new", ["5", "x"], {"d": "NaN"}))
    assert _after(b, _change("I", 5))["d"] == "NaN"


@pytest.mark.parametrize(
    "content",
    [
        '{"v": 2, "image": "new", "schema": "public", "table": "t", "key": [], "values": {}}',
        "not json",
        '{"v": 1, "image": "new", "schema": "public", "table": "t", "key": [], "values": {"d": "1.5"}}',
    ],
)
def test_a_message_this_reader_does_not_know_is_a_decode_error(content: str) -> None:
    msg = decode(
        orjson.dumps({"action": "M", "transactional": True, "prefix": NONFINITE_PREFIX, "content": content})
    )
    with pytest.raises(DecodeError) as err:
        _builder().nonfinite(msg)
    assert err.value.fix and "cdc check --fix" in err.value.fix


def test_the_triggers_test_only_the_tracked_columns_and_only_tables_with_floats_get_them() -> None:
    """The WHEN clause compares each tracked column (never the whole row printed as text: that
    costs the row's width on every write and Postgres refuses it with generated columns)."""
    reg = TableReg("public", "t", "cdc.public.t", ("id",), columns=COLS)
    text = " ".join(s.as_string(None) for s in trigger_statements(reg, full_identity=False, when="columns"))
    assert "zzz_cdc_nonfinite_old" not in text  # no old row in the events without REPLICA IDENTITY FULL
    specials = "IN ('NaN', 'Infinity', '-Infinity')"
    assert f'WHEN (NEW."d" {specials} OR NEW."n" {specials})' in text and "::text" not in text
    assert "cdc_record_nonfinite\"('new', 'id')" in text and 'NEW."t"' not in text
    text = " ".join(s.as_string(None) for s in trigger_statements(reg, full_identity=True, when="columns"))
    assert "BEFORE UPDATE OR DELETE" in text and "cdc_record_nonfinite\"('old', 'id')" in text
    assert f'WHEN (OLD."d" {specials} OR OLD."n" {specials})' in text
    plain = TableReg("public", "u", "x", ("id",), columns=(Column("id", "integer"), Column("a", "float8[]")))
    assert trigger_statements(plain, full_identity=True, when="columns") == []
    # a stored generated column: Postgres refuses it in a BEFORE trigger's WHEN on NEW (and
    # computes it after the trigger), so only the new-row trigger leaves it out
    text = " ".join(
        s.as_string(None)
        for s in trigger_statements(reg, full_identity=True, generated=frozenset({"n"}), when="columns")
    )
    assert f'WHEN (NEW."d" {specials}) EXECUTE' in text
    assert f'WHEN (OLD."d" {specials} OR OLD."n" {specials})' in text
    # every tracked column generated: the new-row trigger has nothing to test
    text = " ".join(
        s.as_string(None) for s in trigger_statements(reg, False, frozenset({"d", "n"}), when="columns")
    )
    assert "WHEN (false)" in text
    # the row form (nonfinite_recorder_when = "row"): the row as text, none with generated columns
    text = " ".join(s.as_string(None) for s in trigger_statements(reg, True, when="row"))
    assert "WHEN (NEW::text ~ 'NaN|Infinity')" in text and "WHEN (OLD::text ~ 'NaN|Infinity')" in text
    text = " ".join(s.as_string(None) for s in trigger_statements(reg, True, frozenset({"g"}), when="row"))
    assert "WHEN (NEW" not in text and "WHEN (OLD::text ~ 'NaN|Infinity')" in text
    # identifiers are quoted
    odd = TableReg("public", "v", "x", ("id",), columns=(Column("id", "integer"), Column('a"b c', "real")))
    assert 'NEW."a""b c" IN' in trigger_statements(odd, False, when="columns")[0].as_string(None)


def test_only_float_and_numeric_columns_are_filled() -> None:
    b = _builder()
    b.nonfinite(_msg("new", ["1"], {"t": "NaN", "d": "Infinity"}))  # a text column holding the word
    msg = _change("I", 1)
    assert msg.columns is not None
    msg.columns[3].value = None
    after = _after(b, msg)
    assert (after["d"], after["t"]) == ("Infinity", None)
