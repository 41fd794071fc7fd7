"""One batch form: every :class:`sinks.ChangeBatch` holds :class:`sinks.columnar.Columns`, also for the
batches the columnar parse declines (TRUNCATE, unchanged TOAST, new columns, type changes, key changes);
the events read back from those columns (tests/sinks/events.py) are exactly the per-record parse's."""

from __future__ import annotations

from typing import Any

import orjson
import pyarrow as pa

from cdc.events import Version
from sinks import ChangeBatch, ChangeEvent, RawRecord, columns_of, touched_of
from sinks.columnar import concat
from sinks.parse import parse, parse_batch, parse_events
from tests.sinks.events import batch_of, events_of
from tests.sinks.feed import Feed, table

BIG = "x" * (3 << 20) + '"quoted"\n\\newline\u00e9'


def _with(rec: RawRecord, **changes: Any) -> RawRecord:
    """``rec`` with envelope fields replaced (``after_<col>``: one value of ``after``)."""
    v = orjson.loads(rec.value or b"")
    for name, value in changes.items():
        if name.startswith("after_"):
            v["after"][name[6:]] = value
        else:
            v[name] = value
    return RawRecord(rec.topic, rec.partition, rec.offset, rec.key, orjson.dumps(v), rec.timestamp_ms)


def _ugly() -> tuple[Any, list[RawRecord]]:
    reg = table(columns=(("id", "bigint"), ("name", "text"), ("note", "text"), ("tags", "text[]")))
    f = Feed(reg)
    row = {"id": 1, "name": 'a "b"\nc', "note": BIG, "tags": ["x", None, 'q"']}
    recs = [
        f.change("r", row, 100, 0),
        f.change("u", {"id": 1, "name": "a2", "tags": None}, 110, unavailable=["note"]),
        *f.delete({"id": 1}, 120),
        # a key change: the new key lacks the unchanged TOAST column; its before holds the old key only
        f.change("c", {"id": 2, "name": "moved", "tags": []}, 120, 2, unavailable=["note"], before={"id": 1}),
        # REPLICA IDENTITY FULL: a before image with a null and an absent column
        f.change(
            "u", {"id": 2, "name": "m2", "note": "n", "tags": None}, 130, before={"id": 2, "note": None}
        ),
        *f.truncate(140),
        f.change("c", {"id": 3, "name": None, "note": None, "tags": None}, 150),
    ]
    # a column new to the registration, a value of another JSON type than its column's (a type change
    # at the source), a column absent from the object, an integer too large for a double
    recs.append(
        _with(f.change("u", {"id": 3, "name": "n", "note": None, "tags": None}, 160), after_new={"j": [1]})
    )
    recs.append(_with(f.change("u", {"id": 3, "name": "n", "note": None, "tags": None}, 170), after_name=5))
    absent = f.change("u", {"id": 4, "name": "z", "note": None, "tags": None}, 180)
    v = orjson.loads(absent.value or b"")
    del v["after"]["note"]
    recs.append(RawRecord(absent.topic, absent.partition, absent.offset, absent.key, orjson.dumps(v), 0))
    recs.append(_with(f.change("c", {"id": 5, "name": "w", "note": None, "tags": None}, 190), after_id=2**62))
    return reg, recs


def _same(got: list[ChangeEvent], want: list[ChangeEvent]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g == w
        # == says 3 == 3.0 and True == 1: the values keep their JSON types too
        assert orjson.dumps(g.after) == orjson.dumps(w.after)
        assert orjson.dumps(g.before) == orjson.dumps(w.before)
        assert orjson.dumps(g.key) == orjson.dumps(w.key)


def test_the_events_come_back_exactly_from_their_columns() -> None:
    reg, recs = _ugly()
    batch, dead = parse_batch(reg, recs)
    assert dead == []
    parsed, _ = parse_events(reg, recs)  # the per-record parse's own events
    _same(events_of(batch), parsed)
    ops = [e.op for e in parsed]
    assert "t" in ops and any(e.unavailable for e in parsed) and any(e.before for e in parsed)
    cols = batch.columns
    assert not cols.plain
    assert {"name", "tags", "new"} <= cols.json_fields, "a retyped, an array and a new column: JSON text"
    assert "note" not in cols.json_fields and "id" not in cols.json_fields
    again = ChangeBatch(reg, columns_of(reg, parsed))  # built again from the events: the same rows
    _same(events_of(again), parsed)
    kept = {(e.partition, e.offset) for e in events_of(batch)[2:5]}
    _same(events_of(again.without(kept)), events_of(batch.without(kept)))
    assert again.truncate_version() == Version(140, 1) == batch.truncate_version()
    assert again.ts_ms() == [e.ts_ms for e in events_of(batch)]
    assert touched_of([again])[reg.qualified] == touched_of([batch])[reg.qualified]
    assert touched_of([again])[reg.qualified].truncated


def test_a_values_json_type_survives_the_columns() -> None:
    reg = table(columns=(("id", "bigint"), ("f", "double precision"), ("ok", "boolean"), ("t", "text")))
    f = Feed(reg)
    recs = [
        f.change("c", {"id": 1, "f": 3, "ok": True, "t": "1"}, 100),  # an integer in a double column
        f.change("c", {"id": 2, "f": 2.5, "ok": 1, "t": 1.5}, 110),  # 1 for a boolean, a number for text
    ]
    batch, dead = parse_batch(reg, recs)
    assert dead == []
    cols = columns_of(reg, events_of(batch))
    assert cols.json_fields == frozenset({"f", "ok", "t"})
    _same(events_of(ChangeBatch(reg, cols)), parse_events(reg, recs)[0])
    # the stored values are those of the events' values, whichever form the column took
    from sinks import types as T

    for name, pg in (("f", "double precision"), ("t", "text"), ("id", "bigint")):
        want = T.to_array([e.after.get(name) if e.after else None for e in events_of(batch)], pg)
        assert cols.stored_values(name, pg).equals(want)


def test_every_parse_gives_columns_and_the_plain_ones_say_so() -> None:
    reg, recs = _ugly()
    parsed = parse(reg, recs, form="columns")
    assert parsed.form == "events" and parsed.batch is not None and not parsed.batch.columns.plain
    assert parsed.batch.columns.table.num_rows == len(parsed.batch) == len(recs) - 1  # the tombstone
    reg2 = table()
    f2 = Feed(reg2)
    ok = parse(reg2, [f2.change("c", {"id": 9, "name": "p", "note": None}, 100)], form="columns")
    assert ok.form == "columns" and ok.batch is not None and ok.batch.columns.plain
    empty = batch_of(reg2, [])
    assert len(empty) == 0 and empty.newest_ts_ms() is None and empty.truncate_version() is None
    assert empty.columns.table.column("after").type == pa.struct(
        [("id", pa.int64()), ("name", pa.string()), ("note", pa.string())]
    )


def test_a_key_changes_values_are_written_into_the_columns() -> None:
    """:meth:`Columns.with_values` (a Spark task's completed key change): the row then lacks
    nothing and holds the values given, a value of another JSON type turns its field into JSON text
    (the key's too), and every other row reads back as before."""
    reg, recs = _ugly()
    batch, _ = parse_batch(reg, recs)
    before = events_of(batch)
    moved = next(i for i, e in enumerate(before) if e.op == "c" and e.unavailable)
    full = {"id": 2, "name": "moved", "tags": [], "note": BIG}
    cols = batch.columns.with_values([moved], [full])
    got = events_of(cols)
    assert got[moved].after == full and got[moved].unavailable == ()
    _same(got[:moved] + got[moved + 1 :], before[:moved] + before[moved + 1 :])
    retyped = batch.columns.with_values([moved], [{**full, "note": 7, "id": "2"}])
    assert {"note", "id"} <= retyped.json_fields
    again = events_of(retyped)
    assert again[moved].after == {**full, "note": 7, "id": "2"}
    _same(again[:moved] + again[moved + 1 :], before[:moved] + before[moved + 1 :])


def test_batches_of_both_forms_concatenate_to_the_per_record_parse() -> None:
    """:func:`sinks.columnar.concat` (a task's slice and its key changes' old keys): a plain batch
    and a per-record one -- a TRUNCATE, unchanged TOAST, a new column, a retyped value -- read back
    as the per-record parse of all their records, in version order."""
    reg = table()
    f = Feed(reg)
    plain = [
        f.change("c", {"id": i, "name": f"n{i}", "note": BIG if i == 1 else None}, 100 + i) for i in range(3)
    ]
    other = [
        f.change("u", {"id": 1, "name": "m"}, 101, 1, unavailable=["note"]),  # a tie: partition
        *f.truncate(150),
        _with(f.change("c", {"id": 7, "name": "x", "note": None}, 160), after_new={"j": 1}),
        _with(f.change("c", {"id": 8, "name": "x", "note": None}, 90), after_name=3),
    ]
    a = parse(reg, plain, form="columns").batch
    b = parse(reg, other, form="events").batch
    assert a is not None and b is not None and a.columns.plain and not b.columns.plain
    both = concat([a.columns, b.columns])
    assert not both.plain and {"name", "new"} <= both.json_fields
    _same(events_of(both), parse_events(reg, [*plain, *other])[0])
