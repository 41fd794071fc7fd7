"""Schema versions and dropped columns in the registry, and ``source.schema_version`` in events
(pure: no Postgres)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson

from cdc.codec import Col, Message
from cdc.codec.envelope import ColumnsSeen, EventBuilder, TableCodec
from cdc.events import commit_ts_ms
from cdc.reader.schema import SchemaFollower
from cdc.registry import Column, Registry, TableReg
from tests.codec_fakes import StaticCatalog


def _reg() -> TableReg:
    cols = (Column("id", "integer"), Column("name", "text"), Column("note", "text"))
    return TableReg("public", "t", "cdc.public.t", ("id",), search=("name", "note"), columns=cols)


def test_set_columns_bumps_the_version_and_remembers_dropped_columns(tmp_path: Path) -> None:
    with Registry(tmp_path) as r:
        r.add(_reg())
        assert r.get("public", "t").schema_version == 1
        same = r.set_columns("public", "t", _reg().columns)
        assert same.schema_version == 1  # unchanged columns: no new version
        new = r.set_columns("public", "t", (Column("id", "integer"), Column("name", "text")))
        assert new.schema_version == 2 and new.dropped_columns == ("note",) and new.search == ("name",)
        assert new.extra["dropped_types"] == {"note": "text"}
        back = r.set_columns(
            "public", "t", (Column("id", "bigint"), Column("name", "text"), Column("note", "text"))
        )
        assert back.schema_version == 3 and back.dropped_columns == ()
        assert r.get("public", "t") == back


def test_events_carry_the_schema_version_and_follow_a_change() -> None:
    reg = _reg()
    codec = TableCodec(reg, prefix="cdc", db="db", partitions=1)
    seen: list[tuple[Column, ...]] = []

    def changed(old: TableReg, cols: tuple[Column, ...], told: dict[str, str] | None) -> TableReg:
        assert told is None  # inferred from the rows
        seen.append(cols)
        return replace(old, columns=cols, extra={"schema_version": 2})

    b = EventBuilder({("public", "t"): codec}, report_left_out=True)
    schema = SchemaFollower(b, StaticCatalog(gone=True), changed)
    b.begin(Message(action="B", xid=7, lsn=0x10))

    def ins(cols: list[Col]) -> dict[str, object]:
        msg = Message(action="I", schema="public", table="t", lsn=0x11, columns=cols)
        out = b.change(msg)
        assert out is not None and not isinstance(out, ColumnsSeen)
        return dict(orjson.loads(out[1][0].value or b"null"))

    ev = ins([Col("id", "integer", 1), Col("name", "text", "a"), Col("note", "text", "n")])
    assert ev["source"]["schema_version"] == 1  # type: ignore[index]
    # an UPDATE without "note": the catalog (here: the callback) says it is gone, not TOASTed
    msg = Message(
        action="U",
        schema="public",
        table="t",
        lsn=0x12,
        columns=[Col("id", "integer", 1), Col("name", "text", "b")],
        identity=[Col("id", "integer", 1)],
    )
    seen_ = b.change(msg)
    assert isinstance(seen_, ColumnsSeen) and seen_.unsent == ["note"]  # reported, nothing recorded
    assert seen == [] and codec.columns == reg.columns
    out = schema.settle(seen_)
    ev = orjson.loads(out[1][0].value or b"null")
    assert ev["source"]["schema_version"] == 2 and ev["unavailable"] == [] and "note" not in ev["after"]
    assert [c.name for c in seen[-1]] == ["id", "name"]


def test_one_change_settles_its_column_steps_in_order_before_any_event() -> None:
    """An UPDATE with a new column, a column left out (an unchanged TOAST value: the catalog has
    it) and an identity with yet another new column: reported step by step, each recorded before
    the change's event, which carries the last schema version; ``unavailable`` is the one the new
    row showed before the identity's column was known."""
    reg = _reg()
    codec = TableCodec(reg, prefix="cdc", db="db", partitions=1)
    recorded: list[list[str]] = []

    def record(old: TableReg, cols: tuple[Column, ...], told: dict[str, str] | None) -> TableReg:
        recorded.append([c.name for c in cols])
        return replace(old, columns=cols, extra={"schema_version": old.schema_version + 1})

    b = EventBuilder({("public", "t"): codec}, report_left_out=True)
    schema = SchemaFollower(b, StaticCatalog(), record)
    b.begin(Message(action="B", xid=7, lsn=0x10))
    new_row = [Col("id", "integer", 1), Col("name", "text", "b"), Col("extra", "integer", 5)]
    identity = [*new_row[:2], Col("note", "text", "n"), Col("extra", "integer", 4), Col("more", "integer", 3)]
    msg = Message(action="U", schema="public", table="t", lsn=0x11, columns=new_row, identity=identity)
    steps = []
    out = b.change(msg)
    while isinstance(out, ColumnsSeen):
        steps.append("left out" if out.unsent is not None else "identity" if out.row else "new row")
        assert b.seq == 1 and codec.reg.schema_version == 1 + len(recorded)
        schema._step(out)
        out = b.resume(out)
    assert steps == ["new row", "left out", "identity"]
    assert recorded == [["id", "name", "note", "extra"], ["id", "name", "note", "extra", "more"]]
    assert out is not None
    (rec,) = out[1]
    ev = orjson.loads(rec.value or b"null")
    assert ev["source"]["schema_version"] == 3 and ev["source"]["seq"] == 1
    assert ev["unavailable"] == ["note"] and ev["after"] == {"id": 1, "name": "b", "extra": 5}
    assert ev["before"] == {"id": 1, "name": "b", "note": "n", "extra": 4, "more": 3}


def test_a_renamed_search_column_keeps_its_index_field(tmp_path: Path) -> None:
    with Registry(tmp_path) as r:
        r.add(_reg())
        cols = (Column("id", "integer"), Column("title", "text"), Column("note", "text"))
        new = r.set_columns("public", "t", cols, {"name": "title"})
        assert new.search == ("title", "note") and new.search_field("title") == "name"
        assert new.dropped_columns == ("name",) and new.search_field("note") == "note"
        again = r.set_columns(
            "public", "t", (Column("id", "integer"), Column("head", "text")), {"title": "head"}
        )
        assert again.search == ("head",) and again.search_field("head") == "name"


def test_events_with_a_schema_version_take_the_columnar_parse() -> None:
    import pyarrow as pa

    from sinks import RawRecord
    from sinks.parse import MIN_RECORDS, parse_columns

    reg = replace(_reg(), extra={"schema_version": 3})
    codec = TableCodec(reg, prefix="cdc", db="db", partitions=1)
    b = EventBuilder({("public", "t"): codec})
    records = []
    for i in range(MIN_RECORDS):
        b.begin(Message(action="B", xid=7 + i, lsn=16 + i, ts_ms=commit_ts_ms("2026-11-23 09:00:00+00")))
        cols = [Col("id", "integer", i), Col("name", "text", f"n{i}"), Col("note", "text", None)]
        out = b.change(Message(action="I", schema="public", table="t", lsn=16 + i, columns=cols))
        assert out is not None and not isinstance(out, ColumnsSeen)
        records.append(RawRecord(reg.topic, 0, i, out[1][0].key, out[1][0].value, 0))
    assert orjson.loads(records[0].value or b"")["source"]["schema_version"] == 3
    arrays = (
        pa.array([r.key for r in records], pa.binary()),
        pa.array([r.value for r in records], pa.binary()),
        pa.array([0] * len(records), pa.int32()),
        pa.array(range(len(records)), pa.int64()),
    )
    cols = parse_columns(reg, *arrays)[0]
    assert cols is not None and len(cols) == MIN_RECORDS
