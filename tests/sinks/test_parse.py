"""parse_batch and Columns.latest_rows: pure logic on records shaped like the reader's."""

from __future__ import annotations

from typing import Any

import orjson
import pyarrow as pa

from cdc.events import Version
from sinks import ChangeBatch, RawRecord
from sinks.parse import parse, parse_batch, parse_columns
from tests.sinks.events import events_of, latest
from tests.sinks.feed import Feed, columns_of, table


def test_dead_letters_carry_the_record_and_reason() -> None:
    reg = table()
    f = Feed(reg)
    good = f.change("c", {"id": 1, "name": "a", "note": None}, 100)
    src = orjson.loads(good.value or b"")

    def variant(**changes: object) -> bytes:
        v = orjson.loads(good.value or b"")
        for path, value in changes.items():
            if path.startswith("source_"):
                v["source"][path[7:]] = value
            else:
                v[path] = value
        return orjson.dumps(v)

    no_lsn = dict(src)
    no_lsn["source"] = {k: v for k, v in src["source"].items() if k != "commit_lsn"}
    bad = [
        (b'{"id":1}', b"{not json", "value is not JSON"),
        (b'{"id":1}', b"[1]", "not a JSON object"),
        (b'{"id":1}', orjson.dumps(no_lsn), "commit_lsn"),
        (b'{"id":1}', variant(source_seq="x"), "source.seq"),
        (b'{"id":1}', variant(op="x"), "unknown op"),
        (b'{"id":1}', variant(after=None), "without an 'after'"),
        (b'{"other":1}', good.value, "do not match the table's key"),
        (b"nope", good.value, "key is not JSON"),
        (b'{"id":1}', variant(source_table="other"), "source.table"),
        (b'{"id":1}', variant(unavailable=["name"]), "both in 'after' and 'unavailable'"),
    ]
    records = [good] + [RawRecord(reg.topic, 1, 100 + i, k, v, 0) for i, (k, v, _) in enumerate(bad)]
    batch, dead = parse_batch(reg, records)
    assert len(events_of(batch)) == 1 and events_of(batch)[0].version == Version(100, 1)
    assert len(dead) == len(bad)
    for d, (k, v, reason) in zip(dead, bad, strict=True):
        assert reason in d.reason, (reason, d.reason)
        assert (d.key, d.value, d.partition) == (k, v, 1)


def test_tombstones_dropped_and_events_sorted() -> None:
    reg = table()
    f = Feed(reg)
    recs = [
        f.change("u", {"id": 1, "name": "b", "note": None}, 200),
        *f.delete({"id": 2}, 150),
        f.change("c", {"id": 1, "name": "a", "note": None}, 100),
    ]
    batch, dead = parse_batch(reg, recs)
    assert dead == []
    assert [(e.op, e.version.commit_lsn) for e in events_of(batch)] == [("c", 100), ("d", 150), ("u", 200)]
    d = events_of(batch)[1]
    assert d.after is None and d.key == {"id": 2} and d.key_json == '{"id":2}'


def test_latest_keeps_newest_per_key_and_every_truncate() -> None:
    reg = table(key=("a", "b"), columns=(("a", "integer"), ("b", "text"), ("v", "text")))
    f = Feed(reg)
    recs = [
        f.change("c", {"a": 1, "b": "x", "v": "1"}, 100),
        f.change("u", {"a": 1, "b": "x", "v": "2"}, 300),
        f.change("u", {"a": 1, "b": "x", "v": "old"}, 200),  # out of order
        f.change("c", {"a": 2, "b": "y", "v": "1"}, 100, 2),
        *f.truncate(250, partitions=2),
    ]
    batch, dead = parse_batch(reg, recs)
    assert dead == []
    newest = latest(batch)
    assert [(e.key_json, e.op, e.version.commit_lsn) for e in newest] == [
        ('{"a":2,"b":"y"}', "c", 100),
        ('{"__truncate__":0}', "t", 250),
        ('{"__truncate__":1}', "t", 250),
        ('{"a":1,"b":"x"}', "u", 300),
    ]
    assert batch.truncate_version() == Version(250, 1)
    assert newest[-1].after == {"a": 1, "b": "x", "v": "2"}
    # the canonical key follows the key-column order whatever the record's order
    first = recs[0]
    swapped = RawRecord(first.topic, 0, 99, b'{"b":"x","a":1}', first.value, 0)
    again, _ = parse_batch(reg, [swapped])
    assert events_of(again)[0].key_json == '{"a":1,"b":"x"}'


def test_unavailable_and_snapshot_flags() -> None:
    reg = table()
    f = Feed(reg)
    batch, _ = parse_batch(
        reg,
        [
            f.change("u", {"id": 1, "name": "a"}, 100, unavailable=["note"]),
            f.change("r", {"id": 2, "name": "a", "note": None}, 50, 0),
        ],
    )
    snap, upd = events_of(batch)
    assert upd.unavailable == ("note",) and not upd.snapshot
    assert snap.snapshot and snap.version == Version(50, 0)


def test_fast_path_gives_the_per_record_path_s_event() -> None:
    from sinks.parse import _parse_fast, _parse_one

    reg = table()
    f = Feed(reg)
    good = f.change("u", {"id": 1, "name": "a", "note": None}, 100)
    v = orjson.loads(good.value or b"")
    variants = [
        v,
        {**v, "before": {"id": 1, "name": "z", "note": "n"}},
        {**v, "after": {"id": 1, "name": "a"}, "unavailable": ["note"]},
        {**v, "source": {**v["source"], "snapshot": "last", "ts_ms": None}, "op": "r", "ts_ms": 7},
        {**v, "source": {**v["source"], "snapshot": None}},
        {**v, "op": "d", "after": None, "before": {"id": 1}},
        {**v, "after": {"id": 1, "name": 2.5, "note": [1, {"x": None}], "big": 2**62}},
    ]
    for value in variants:
        rec = RawRecord(reg.topic, 2, 9, b'{"id": 1}', orjson.dumps(value), 0)
        fast = _parse_fast(reg, rec, tuple(reg.key))
        assert fast is not None, value
        assert fast == _parse_one(reg, rec)
    # unusual shapes go to the per-record path (which knows the dead-letter reasons)
    for value in (
        {**v, "op": "t"},
        {**v, "source": {**v["source"], "seq": -1}},
        {**v, "source": {**v["source"], "ts_ms": True}},
        {**v, "after": [1]},
        {**v, "unavailable": ["name"]},
    ):
        rec = RawRecord(reg.topic, 2, 9, b'{"id": 1}', orjson.dumps(value), 0)
        assert _parse_fast(reg, rec, tuple(reg.key)) is None, value


def test_columnar_parse_gives_the_per_record_events() -> None:
    reg = table(
        columns=(
            ("a", "integer"),
            ("b", "text"),
            ("n", "numeric(10,2)"),
            ("f", "double precision"),
            ("ok", "boolean"),
        ),
        key=("a", "b"),
    )
    f = Feed(reg)
    recs = [
        f.change("r", {"a": 1, "b": "x", "n": "1.50", "f": 2.5, "ok": True}, 100, 0),
        f.change("u", {"a": 1, "b": "x", "n": None, "f": 3, "ok": None}, 300, 2),
        f.change("c", {"a": -7, "b": 'q"\\u00e9', "n": "-0.01", "f": -1e300, "ok": False}, 200, 1),
        *f.delete({"a": 1, "b": "x"}, 300, 1),
    ]
    cols = columns_of(reg, recs)
    assert cols is not None
    batch, dead = parse_batch(reg, recs)
    assert dead == []
    events = events_of(ChangeBatch(reg, columns=cols))
    assert [(e.key_json, e.op, e.version, e.partition, e.offset, e.snapshot) for e in events] == [
        (e.key_json, e.op, e.version, e.partition, e.offset, e.snapshot) for e in events_of(batch)
    ]
    for got, want in zip(events, events_of(batch), strict=True):
        assert got.key == want.key and got.ts_ms == want.ts_ms
        assert got.after == want.after  # 3 and 3.0 compare equal; both convert to the same double
    assert [r["key_json"] for r in cols.latest().to_pylist()] == [
        '{"a":-7,"b":"q\\"\\\\u00e9"}',
        '{"a":1,"b":"x"}',
    ]


def test_columnar_parse_declines_what_the_per_record_parse_must_judge() -> None:
    reg = table()
    f = Feed(reg)
    good = f.change("c", {"id": 1, "name": "a", "note": None}, 100)
    assert columns_of(reg, [good]) is not None

    def with_value(**changes: Any) -> RawRecord:
        v = orjson.loads(good.value or b"")
        v.update(changes)
        return RawRecord(reg.topic, 0, 9, good.key, orjson.dumps(v), 0)

    declined = {
        "truncate": f.truncate(200),
        "unavailable column": [f.change("u", {"id": 1, "name": "a"}, 200, unavailable=["note"])],
        "unknown column": [f.change("u", {"id": 1, "name": "a", "note": None, "new": 1}, 200)],
        "wrong type": [f.change("u", {"id": 1, "name": 5, "note": None}, 200)],
        "bad JSON": [RawRecord(reg.topic, 0, 9, good.key, b"{not json", 0)],
        "two objects": [RawRecord(reg.topic, 0, 9, good.key, (good.value or b"") * 2, 0)],
        "raw newline": [
            RawRecord(reg.topic, 0, 9, good.key, (good.value or b"").replace(b",", b",\n", 1), 0)
        ],
        "unknown op": [with_value(op="x")],
        "no source": [with_value(source=None)],
        "no version": [with_value(source={"ts_ms": 1, "schema": reg.schema, "table": reg.table})],
        "no after": [with_value(after=None)],
        "other table": [with_value(source={**orjson.loads(good.value or b"")["source"], "table": "t2"})],
        "key not canonical": [RawRecord(reg.topic, 0, 9, b'{"id": 1}', good.value, 0)],
        "key of other columns": [RawRecord(reg.topic, 0, 9, b'{"other":1}', good.value, 0)],
    }
    for why, bad in declined.items():
        assert columns_of(reg, [good, *bad]) is None, why
    assert parse_columns(reg, *(pa.array([x]) for x in (good.key, good.value, 0, 1)))[0] is None, (
        "too few records"
    )


def test_feed_builds_the_form_asked_for_and_shows_a_fallback() -> None:
    """The sink tests' two forms are real: ``columns`` gives the columnar form for a plain batch, and
    a batch the columnar parse declines comes back per-event with a visible warning and the reason."""
    import pytest

    from tests.sinks.feed import ColumnarFallback

    reg = table()
    f = Feed(reg, "columns")
    plain = f.batch(f.change("c", {"id": 1, "name": "a", "note": None}, 100))
    assert plain.columns.plain and f.fallbacks == []
    with pytest.warns(ColumnarFallback, match="per-event form used"):
        declined = f.batch(f.truncate(200))
    assert not declined.columns.plain and len(f.fallbacks) == 1
    assert not Feed(reg).batch(f.change("c", {"id": 2, "name": "b", "note": None}, 300)).columns.plain
    parsed = parse(reg, [f.change("c", {"id": 3, "name": "c", "note": None}, 400)])
    assert parsed.form == "events" and parsed.declined, "auto: too few records for the columnar parse"
