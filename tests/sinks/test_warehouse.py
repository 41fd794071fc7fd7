"""The warehouse sink against real Delta tables (deltalake): version guard, deletes, truncate, TOAST,
types, schema evolution, idempotent replay, history validity, maintenance, bounded merges."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import random
import time
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pytest
from deltalake import DeltaTable, WriterProperties, write_deltalake

from cdc.config import Settings
from cdc.errors import ApplyError, ConfigError
from cdc.events import encode_key
from sinks import RawRecord, shard_of
from sinks import warehouse as W
from sinks.warehouse import WarehouseOptions, WarehouseSink, leases, reclaim
from sinks.warehouse import delta as D
from tests.sinks.conftest import FeedMaker
from tests.sinks.events import events_of
from tests.sinks.feed import BASE_TS_MS, Feed, mixed_batches, table

# every test runs on both batch forms (per-event and columnar)
pytestmark = pytest.mark.usefixtures("columnar")

APP = "cdc-apply-test"


def current(sink: WarehouseSink, reg: Any) -> dict[Any, dict[str, Any]]:
    rows = sink.current_rows(reg).to_pylist()
    assert len({r[W.KEY] for r in rows}) == len(rows), "one row per key"
    return {r["id"]: r for r in rows}


def history(sink: WarehouseSink, reg: Any, key: Any = None) -> list[dict[str, Any]]:
    rows = sink.history_rows(reg).to_pylist()
    if key is not None:
        rows = [r for r in rows if r["id"] == key]
    return sorted(rows, key=lambda r: (r["id"], r[W.LSN], r[W.SEQ]))


def ts(lsn: int) -> dt.datetime:
    return dt.datetime.fromtimestamp((BASE_TS_MS + lsn) / 1000, tz=dt.UTC)


def test_insert_update_delete_history_validity(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": "x"}, 100)), 1, APP)
    sink.apply(f.batch(f.change("u", {"id": 1, "name": "b", "note": "x"}, 200)), 2, APP)
    assert current(sink, reg)[1]["name"] == "b"
    sink.apply(f.batch(f.delete({"id": 1}, 300)), 3, APP)
    assert current(sink, reg) == {}
    h = history(sink, reg, 1)
    assert [(r["name"], r[W.OP], r[W.END_OP], r[W.IS_CURRENT]) for r in h] == [
        ("a", "c", "u", False),
        ("b", "u", "d", False),
    ]
    assert h[0][W.VALID_FROM] == ts(100) and h[0][W.VALID_TO] == ts(200)
    assert h[1][W.VALID_FROM] == ts(200) and h[1][W.VALID_TO] == ts(300)
    assert (h[1][W.END_LSN], h[1][W.END_SEQ]) == (300, 1)


def test_intermediate_versions_within_one_batch_are_kept_in_history(
    sink: WarehouseSink, feed: FeedMaker
) -> None:
    reg = table()
    f = feed(reg)
    b = f.batch(
        f.change("c", {"id": 1, "name": "a", "note": None}, 100),
        f.change("u", {"id": 1, "name": "b", "note": None}, 100, 2),
        f.change("u", {"id": 1, "name": "c", "note": None}, 110),
    )
    sink.apply(b, 1, APP)
    assert current(sink, reg)[1]["name"] == "c"
    h = history(sink, reg, 1)
    assert [(r["name"], r[W.IS_CURRENT]) for r in h] == [("a", False), ("b", False), ("c", True)]
    assert h[2][W.VALID_TO] is None


def test_version_guard_older_and_repeated_events_ignored(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    new = f.change("u", {"id": 1, "name": "new", "note": None}, 500)
    sink.apply(f.batch(new), 1, APP)
    sink.apply(f.batch(f.change("u", {"id": 1, "name": "old", "note": None}, 400)), 2, APP)
    sink.apply(f.batch(new), 3, APP)  # the same event again, another batch
    rows = current(sink, reg)
    assert rows[1]["name"] == "new" and rows[1][W.LSN] == 500
    assert [r["name"] for r in history(sink, reg, 1)] == ["new"]


def test_delete_not_resurrected_by_older_late_event(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 7, "name": "a", "note": None}, 100)), 1, APP)
    sink.apply(f.batch(f.delete({"id": 7}, 300)), 2, APP)
    late = f.change("u", {"id": 7, "name": "zombie", "note": None}, 200)
    sink.apply(f.batch(late), 3, APP)
    assert current(sink, reg) == {}
    assert [r["name"] for r in history(sink, reg, 7)] == ["a"]
    tomb = sink.tombstone_rows(reg).to_pylist()
    assert [(r["key_json"], r["commit_lsn"]) for r in tomb] == [('{"id":7}', 300)]
    # a newer insert of the same key is applied
    sink.apply(f.batch(f.change("c", {"id": 7, "name": "reborn", "note": None}, 400)), 4, APP)
    assert current(sink, reg)[7]["name"] == "reborn"


def test_primary_key_change(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": None}, 100)), 1, APP)
    b = f.batch(f.delete({"id": 1}, 200, 1), f.change("c", {"id": 2, "name": "a", "note": None}, 200, 2))
    sink.apply(b, 2, APP)
    assert set(current(sink, reg)) == {2}
    assert [(r["id"], r[W.IS_CURRENT]) for r in history(sink, reg)] == [(1, False), (2, True)]


def test_truncate(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": str(i), "note": None}, 100 + i) for i in range(10))), 1, APP
    )
    # one batch: a truncate at 200 (one event per partition), then a new row at 210
    b = f.batch(
        f.change("u", {"id": 3, "name": "before-truncate", "note": None}, 150),
        f.truncate(200),
        f.change("c", {"id": 42, "name": "after", "note": None}, 210),
    )
    sink.apply(b, 2, APP)
    assert set(current(sink, reg)) == {42}
    h = history(sink, reg)
    assert [r for r in h if r[W.IS_CURRENT]] == [r for r in h if r["id"] == 42]
    closed = [r for r in h if r["id"] != 42]
    assert len(closed) == 11 and all(r[W.END_OP] in ("t", "u") for r in closed)
    assert all(r[W.VALID_TO] == ts(200) for r in closed if r[W.END_OP] == "t")
    # an event older than the truncate, arriving late, stays out
    sink.apply(f.batch(f.change("u", {"id": 5, "name": "late", "note": None}, 190)), 3, APP)
    assert set(current(sink, reg)) == {42}
    # a later truncate in its own batch closes the open row of a key not in the batch
    sink.apply(f.batch(f.truncate(300)), 4, APP)
    assert current(sink, reg) == {}
    assert not [r for r in history(sink, reg) if r[W.IS_CURRENT]]
    row42 = history(sink, reg, 42)[0]
    assert (row42[W.END_LSN], row42[W.END_OP], row42[W.VALID_TO]) == (300, "t", ts(300))


def test_a_truncate_whose_markers_come_in_different_batches_keeps_every_version(
    sink: WarehouseSink, feed: FeedMaker
) -> None:
    """A TRUNCATE's markers come one per partition, each after its partition's earlier events, but a
    batch may end past one partition's marker and before another partition's earlier events (Kafka
    makes each partition's appends visible apart; a batch's record budget splits the partitions).
    Those events come in a later batch, older than the truncate, yet the source made them: each is a
    version of the history, closed by the truncate, and none stays in the current table. A repeat of
    an event its own partition's marker came after stays out."""
    reg = table()
    f = feed(reg)

    def home(rec: RawRecord) -> RawRecord:  # a key's records in its partition of the topic's 4
        return replace(rec, partition=shard_of(rec.key.decode(), 4))

    def row(i: int, name: str) -> dict[str, Any]:
        return {"id": i, "name": name, "note": None}

    sink.apply(f.batch(*(home(f.change("c", row(i, "a"), 100 + i)) for i in range(8))), 1, APP)
    # a stored key and a new one, both outside partition 0
    updated, late = (
        next(i for i in range(lo, 100) if shard_of(encode_key({"id": i}).decode(), 4)) for lo in (0, 8)
    )
    markers = f.truncate(500, partitions=4)
    sink.apply(f.batch(*(m for m in markers if m.partition == 0)), 2, APP)
    other = [m for m in markers if m.partition != 0]
    sink.apply(
        f.batch(
            home(f.change("c", row(late, "late"), 450)), home(f.change("u", row(updated, "b"), 460)), *other
        ),
        3,
        APP,
    )
    assert current(sink, reg) == {}
    versions = {(r["id"], r["name"]): (r[W.END_OP], r[W.VALID_TO]) for r in history(sink, reg)}
    assert versions[(late, "late")] == ("t", ts(500)) and versions[(updated, "b")] == ("t", ts(500))
    assert sorted(versions) == sorted([(i, "a") for i in range(8)] + [(late, "late"), (updated, "b")])
    # every partition's marker is stored: a repeat of an event older than the truncate stays out
    sink.apply(f.batch(home(f.change("c", row(late, "late"), 450))), 4, APP)
    assert current(sink, reg) == {} and len(history(sink, reg)) == 10


def test_unavailable_toast_keeps_stored_value(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    big = "z" * 10_000
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": big}, 100)), 1, APP)
    sink.apply(f.batch(f.change("u", {"id": 1, "name": "b"}, 200, unavailable=["note"])), 2, APP)
    assert current(sink, reg)[1]["note"] == big
    assert [r["note"] for r in history(sink, reg, 1)] == [big, big]
    # within one batch: the insert provides the value to the later update
    b = f.batch(
        f.change("c", {"id": 2, "name": "a", "note": "first"}, 300),
        f.change("u", {"id": 2, "name": "b"}, 310, unavailable=["note"]),
    )
    sink.apply(b, 3, APP)
    assert current(sink, reg)[2]["note"] == "first"
    assert [r["note"] for r in history(sink, reg, 2)] == ["first", "first"]


def test_unavailable_toast_without_stored_row_is_an_error(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    with pytest.raises(ApplyError) as err:
        sink.apply(f.batch(f.change("u", {"id": 9, "name": "b"}, 200, unavailable=["note"])), 1, APP)
    assert "note" in str(err.value) and err.value.fix and "snapshot" in err.value.fix


def key_change(f: Feed, old: int, new: int, lsn: int, name: str = "moved", **kw: Any) -> list[Any]:
    """A primary-key change as the reader writes it: ``d`` old + tombstone + ``c`` new, one version;
    the ``c`` lacks the unchanged TOAST column ``note`` and names the old key in ``before``."""
    before = kw.pop("before", {"id": old})
    c = f.change("c", {"id": new, "name": name}, lsn, 1, unavailable=["note"], before=before)
    return [*f.delete({"id": old}, lsn, 1), c]


def test_key_change_takes_unchanged_toast_from_the_old_key(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    big = "z\n'\"\\" * 3_000
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": f"{i}{big}"}, 100 + i) for i in range(1, 8))),
        1,
        APP,
    )
    # across batches: the old key's stored row; within one batch: its earlier (TOAST) update; a chain
    # of two key changes; a legacy event without ``before`` (paired by the delete of its version)
    sink.apply(
        f.batch(
            key_change(f, 1, 100, 200),
            f.change("u", {"id": 2, "name": "b"}, 300, unavailable=["note"]),
            key_change(f, 2, 200, 310),
            key_change(f, 3, 30, 400),
            key_change(f, 30, 300, 410),
            key_change(f, 4, 400, 500, before=None),
        ),
        2,
        APP,
    )
    cur = current(sink, reg)
    assert {k: cur[k]["note"] for k in (100, 200, 300, 400)} == {
        k: f"{k // 100}{big}" for k in (100, 200, 300, 400)
    }
    assert not {1, 2, 3, 4, 30} & set(cur)
    assert [r["note"] for r in history(sink, reg, 30)] == [f"3{big}"]
    # the delete applied by an earlier batch than its create (a batch cut between them)
    d, tomb, c = key_change(f, 5, 500, 600)
    sink.apply(f.batch(d, tomb), 3, APP)
    sink.apply(f.batch(c), 4, APP)
    # the create before its delete (the old key's partition behind)
    d, tomb, c = key_change(f, 6, 600, 700)
    sink.apply(f.batch(c), 5, APP)
    sink.apply(f.batch(d, tomb), 6, APP)
    # REPLICA IDENTITY FULL: the before image holds the value
    sink.apply(f.batch(key_change(f, 9, 900, 800, before={"id": 9, "name": "a", "note": "full"})), 7, APP)
    cur = current(sink, reg)
    assert (cur[500]["note"], cur[600]["note"], cur[900]["note"]) == (f"5{big}", f"6{big}", "full")
    assert not {5, 6} & set(cur)
    # a replayed batch gives the same rows, and nothing is rejected
    b = f.batch(key_change(f, 7, 700, 900))
    sink.apply(b, 8, APP)
    assert sink.reject(b) == []
    sink.apply(b, 8, APP)
    assert current(sink, reg)[700]["note"] == f"7{big}"
    assert [r["note"] for r in history(sink, reg, 700)] == [f"7{big}"]


def test_key_change_without_any_stored_row_is_rejected(sink: WarehouseSink, feed: FeedMaker) -> None:
    """No row anywhere holds the value: the sink rejects exactly those events (the job dead-letters
    them), and the rest of the batch applies."""
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": "kept"}, 100)), 1, APP)
    b = f.batch(
        key_change(f, 1, 10, 200),  # resolvable
        key_change(f, 2, 20, 210),  # key 2 was never stored
        f.change("u", {"id": 20, "name": "later"}, 220, unavailable=["note"]),  # follows the lost row
        f.change("u", {"id": 8, "name": "never"}, 230, unavailable=["note"]),  # never stored
        f.change("c", {"id": 3, "name": "new", "note": "n"}, 240),
    )
    rejected = sink.reject(b)
    assert [(r.offset, "TOAST" in r.reason and "note" in r.reason) for r in rejected] == [
        (e.offset, True) for e in events_of(b) if e.key_json in ('{"id":20}', '{"id":8}')
    ]
    sink.apply(b.without({(r.partition, r.offset) for r in rejected}), 2, APP)
    cur = current(sink, reg)
    assert {k: v["note"] for k, v in cur.items()} == {10: "kept", 3: "n"}


TYPED = (
    ("id", "bigint"),
    ("small", "smallint"),
    ("i", "integer"),
    ("amount", "numeric(38,9)"),
    ("big", "numeric"),
    ("r", "real"),
    ("f", "double precision"),
    ("ok", "boolean"),
    ("ts", "timestamp with time zone"),
    ("lts", "timestamp without time zone"),
    ("d", "date"),
    ("t", "time without time zone"),
    ("doc", "jsonb"),
    ("tags", "text[]"),
    ("nums", "integer[]"),
    ("amounts", "numeric(10,2)[]"),
    ("blob", "bytea"),
    ("u", "uuid"),
    ("iv", "interval"),
)


def test_types_are_faithful(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table("typed", columns=TYPED)
    f = feed(reg)
    row = {
        "id": 2**62 + 1,  # beyond 2^53
        "small": -32768,
        "i": 2147483647,
        "amount": "12345678901234567890123456789.123456789",
        "big": "123456789012345678901234567890123456789012345678901234567890.000000000000000000001",
        "r": 1.5,
        "f": 0.1,
        "ok": True,
        "ts": "2026-11-22 02:28:58.742271+05:30",
        "lts": "2026-11-22 02:28:58.000001",
        "d": "2024-02-29",
        "t": "12:34:56.5",
        "doc": '{"a": [1, 2.50, "x"], "b": null}',
        "tags": ["a", None, "c,d"],
        "nums": [1, 2, None],
        "amounts": ["1.10", "-2.00"],
        "blob": "00ff10",
        "u": "6f1c1b0e-2d7a-4d6c-9a59-3a8a6e9a0c11",
        "iv": "1 day 02:00:00",
    }
    inf = {"id": 1, "ts": "infinity", "lts": "-infinity", "d": "infinity", "amount": None, "big": None}
    sink.apply(f.batch(f.change("r", row, 100, 0), f.change("r", inf, 100, 0)), 1, APP)
    t = sink.current_rows(reg)
    types = {fld.name: str(fld.type) for fld in t.schema}
    assert types["small"] == "int16" and types["i"] == "int32" and types["id"] == "int64"
    assert types["amount"] == "decimal128(38, 9)" and types["big"] == "string"
    assert types["r"] == "float" and types["f"] == "double" and types["ok"] == "bool"
    assert types["ts"] == "timestamp[us, tz=UTC]" and types["lts"] == "timestamp[us]"
    assert types["d"] == "date32[day]" and types["blob"] == "binary"
    assert types["tags"] == "list<element: string>" and types["nums"] == "list<element: int32>"
    assert types["amounts"] == "list<element: decimal128(10, 2)>"
    got = {r["id"]: r for r in t.to_pylist()}[2**62 + 1]
    assert got["amount"] == Decimal("12345678901234567890123456789.123456789")
    assert got["big"] == row["big"]
    assert got["ts"] == dt.datetime(2026, 11, 21, 20, 58, 58, 742271, tzinfo=dt.UTC)
    assert got["lts"] == dt.datetime(2026, 11, 22, 2, 28, 58, 1)
    assert got["d"] == dt.date(2024, 2, 29) and got["t"] == "12:34:56.5"
    assert json.loads(got["doc"]) == {"a": [1, 2.5, "x"], "b": None} and got["doc"] == row["doc"]
    assert got["tags"] == ["a", None, "c,d"] and got["nums"] == [1, 2, None]
    assert got["amounts"] == [Decimal("1.10"), Decimal("-2.00")]
    assert got["blob"] == b"\x00\xff\x10" and got["iv"] == "1 day 02:00:00"
    assert got["r"] == 1.5 and got["f"] == 0.1 and got["small"] == -32768
    clamped = {r["id"]: r for r in t.to_pylist()}[1]
    assert clamped["ts"] == dt.datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=dt.UTC)
    assert clamped["lts"] == dt.datetime(1, 1, 1) and clamped["d"] == dt.date(9999, 12, 31)


def test_unrepresentable_value_is_a_clear_error(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table("typed2", columns=(("id", "bigint"), ("ts", "timestamp with time zone")))
    f = feed(reg)
    with pytest.raises(ApplyError) as err:
        sink.apply(f.batch(f.change("c", {"id": 1, "ts": "0044-03-15 12:00:00+00 BC"}, 100)), 1, APP)
    assert "BC" in str(err.value) or "1..9999" in str(err.value)
    assert err.value.fix


def test_toast_value_of_typed_columns_round_trips(sink: WarehouseSink, feed: FeedMaker) -> None:
    """A value kept for an unavailable column is re-read from the table and stored unchanged."""
    reg = table(
        "typed3",
        columns=(
            ("id", "bigint"),
            ("ts", "timestamp with time zone"),
            ("amount", "numeric(38,9)"),
            ("blob", "bytea"),
            ("name", "text"),
        ),
    )
    f = feed(reg)
    sink.apply(
        f.batch(
            f.change(
                "c",
                {
                    "id": 1,
                    "ts": "2026-01-02 03:04:05.000006+00",
                    "amount": "1.5",
                    "blob": "abcd",
                    "name": "a",
                },
                100,
            )
        ),
        1,
        APP,
    )
    sink.apply(
        f.batch(f.change("u", {"id": 1, "name": "b"}, 200, unavailable=["ts", "amount", "blob"])), 2, APP
    )
    got = current(sink, reg)[1]
    assert got["ts"] == dt.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC)
    assert got["amount"] == Decimal("1.500000000") and got["blob"] == b"\xab\xcd" and got["name"] == "b"


def test_schema_evolution_new_column(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": None}, 100)), 1, APP)
    reg2 = table(columns=(("id", "bigint"), ("name", "text"), ("note", "text"), ("price", "numeric(10,2)")))
    f2 = feed(reg2)
    sink.apply(f2.batch(f2.change("c", {"id": 2, "name": "b", "note": None, "price": "9.99"}, 200)), 2, APP)
    rows = current(sink, reg2)
    assert rows[1]["price"] is None and rows[2]["price"] == Decimal("9.99")
    assert "price" in sink.history_rows(reg2).column_names
    # a column only seen in an event (registration not updated yet) arrives as text
    sink.apply(
        f2.batch(f2.change("c", {"id": 3, "name": "c", "note": None, "price": None, "extra": 5}, 300)), 3, APP
    )
    assert current(sink, reg2)[3]["extra"] == "5"


def test_idempotent_replay_same_batch(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    b = f.batch(
        f.change("c", {"id": 1, "name": "a", "note": None}, 100),
        f.change("u", {"id": 1, "name": "b", "note": None}, 110),
    )
    sink.apply(b, 0, APP)  # Spark's first batch id is 0
    cur_path, hist_path, _ = sink.paths(reg)
    versions = (DeltaTable(str(cur_path)).version(), DeltaTable(str(hist_path)).version())
    sink.apply(b, 0, APP)  # Spark replays batch 0
    assert (DeltaTable(str(cur_path)).version(), DeltaTable(str(hist_path)).version()) == versions
    assert DeltaTable(str(cur_path)).transaction_version(APP) == 0
    assert len(history(sink, reg)) == 2


def test_replay_after_crash_between_commits(
    sink: WarehouseSink, monkeypatch: pytest.MonkeyPatch, feed: FeedMaker
) -> None:
    """History committed, current not (crash): the replay gives what an uninterrupted run gives."""
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": "keep"}, 100)), 1, APP)
    b = f.batch(
        f.change("u", {"id": 1, "name": "b"}, 200, unavailable=["note"]),
        f.delete({"id": 2}, 210),
        f.change("c", {"id": 3, "name": "c", "note": None}, 220),
    )

    def crash(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("crash after the history commit")

    with monkeypatch.context() as m:
        m.setattr(D.Commit, "current", crash)
        with pytest.raises(RuntimeError):
            sink.apply(b, 2, APP)
    assert current(sink, reg)[1]["name"] == "a"  # current untouched
    sink.apply(b, 2, APP)
    rows = current(sink, reg)
    assert rows[1]["name"] == "b" and rows[1]["note"] == "keep" and set(rows) == {1, 3}
    h = history(sink, reg)
    assert [(r["id"], r["name"], r[W.IS_CURRENT]) for r in h] == [
        (1, "a", False),
        (1, "b", True),
        (3, "c", True),
    ]
    assert [r["key_json"] for r in sink.tombstone_rows(reg).to_pylist()] == ['{"id":2}']


def test_maintenance_compacts_vacuums_and_purges_tombstones(tmp_path: Path, feed: FeedMaker) -> None:
    sink = WarehouseSink(
        tmp_path,
        WarehouseOptions(buckets=2, maintain_every=3, tombstone_retention_hours=0, vacuum_retention_hours=0),
    )
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": None}, 100)), 1, APP)
    sink.apply(
        f.batch(f.change("c", {"id": 2, "name": "a", "note": None}, 110), f.delete({"id": 1}, 120)), 2, APP
    )
    cur_path = sink.paths(reg)[0]
    files_before = len(list(cur_path.rglob("*.parquet")))
    assert len(sink.tombstone_rows(reg)) == 1
    sink.apply(
        f.batch(f.change("u", {"id": 2, "name": "b", "note": None}, 130)), 3, APP
    )  # 3 % 3 == 0: maintain
    assert len(sink.tombstone_rows(reg)) == 0  # retention 0: purged
    active = len(DeltaTable(str(cur_path)).file_uris())
    on_disk = len(list(cur_path.rglob("*.parquet")))
    assert active == on_disk, "vacuum removed unreferenced files"
    assert on_disk < files_before + 1
    assert current(sink, reg) == {2: current(sink, reg)[2]} and current(sink, reg)[2]["name"] == "b"


def test_superseded_files_are_vacuumed_between_maintenances(tmp_path: Path, feed: FeedMaker) -> None:
    """Every merge rewrites the files it touches; the old ones are deleted every ``vacuum_every``
    batches (once unreferenced for ``vacuum_retention_hours``), not only by the rarer ``maintain``:
    the full-size fault suite filled the disk with them (67 GB beside 3.3 GB live in 80 minutes)."""
    sink = WarehouseSink(
        tmp_path,
        WarehouseOptions(buckets=2, maintain_every=0, vacuum_every=2, vacuum_retention_hours=0),
    )
    reg = table()
    f = feed(reg)
    paths = sink.paths(reg)
    for batch_id in range(1, 7):
        rows = [
            f.change("u", {"id": i, "name": f"v{batch_id}", "note": None}, 100 * batch_id + i)
            for i in range(4)
        ]
        sink.apply(f.batch(*rows), batch_id, APP)
        if batch_id % 2 == 0:
            for path in paths[:2]:  # current and history
                on_disk = len(list(path.rglob("*.parquet")))
                assert on_disk == _files(path), f"batch {batch_id}: {path.name} keeps superseded files"
    assert {r["name"] for r in current(sink, reg).values()} == {"v6"}


def _files(path: Path) -> int:
    return len(DeltaTable(str(path)).file_uris())


def test_disk_stays_within_the_garbage_ratio_of_the_live_size(tmp_path: Path, feed: FeedMaker) -> None:
    """Random-key rewrites supersede about the whole table every batch; the hourly vacuum would keep
    them all (67 GB beside 3.3 GB live in the full-size fault suite). With ``vacuum_garbage_ratio`` K
    each table's bytes on disk stay within (1 + K) times its live size after every batch."""
    ratio = 1.0
    sink = WarehouseSink(
        tmp_path,
        WarehouseOptions(
            buckets=4,
            clustering="hash",
            maintain_every=0,
            vacuum_every=0,
            vacuum_garbage_ratio=ratio,
            vacuum_min_retention_s=0,
        ),
    )
    reg = table()
    f = feed(reg)
    rng = random.Random(5)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a" * 200, "note": None}, 100) for i in range(400))), 1, APP
    )
    paths = dict(zip(("current", "history", "tombstones"), sink.paths(reg), strict=True))
    peak = dict.fromkeys(paths, 0.0)
    for batch_id in range(2, 18):  # each batch rewrites every file: a reclaim every batch or two
        keys = rng.sample(range(400), 40)
        rows = [
            f.change("u", {"id": i, "name": f"{batch_id}" * 100, "note": None}, 100 * batch_id) for i in keys
        ]
        sink.apply(f.batch(*rows), batch_id, APP)
        for name, path in paths.items():
            use = reclaim.usage(path)
            peak[name] = max(peak[name], use.disk / use.live)
            assert use.disk <= (1 + ratio) * use.live, (
                f"batch {batch_id}: {name} holds {use.disk:,} B on disk for {use.live:,} B live "
                f"({use.disk / use.live:.1f}x, bound {1 + ratio:.1f}x)"
            )
    assert peak["current"] > 1.2  # superseded files did pile up between reclaims
    assert len(history(sink, reg)) == 400 + 16 * 40


def test_vacuum_deletes_files_of_writes_killed_before_their_commit(tmp_path: Path, feed: FeedMaker) -> None:
    """A task or merge killed before its commit leaves files no version references: the periodic
    vacuum deletes them once older than ``vacuum_retention_hours`` (delta-rs's lite vacuum never did),
    and spares a younger one (a write that may still commit)."""
    sink = WarehouseSink(tmp_path, WarehouseOptions(buckets=2, maintain_every=0, vacuum_every=1))
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": None}, 100)), 1, APP)
    part = next(sink.paths(reg)[0].rglob("*.parquet")).parent
    old, young = part / "part-killed-old.parquet", part / "part-killed-young.parquet"
    for orphan in (old, young):
        orphan.write_bytes(b"x" * 100)
    two_hours_ago = time.time() - 2 * 3600
    os.utime(old, (two_hours_ago, two_hours_ago))
    sink.apply(f.batch(f.change("u", {"id": 1, "name": "b", "note": None}, 200)), 2, APP)
    assert not old.exists() and young.exists()
    assert {r["name"] for r in current(sink, reg).values()} == {"b"}


def test_reclaim_spares_what_leased_readers_and_uncommitted_writes_use(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """A version a reader opened under a lease (:mod:`sinks.warehouse.leases`) stays readable however
    far the garbage is over the ratio; a file no commit references yet (a Spark task's before the
    driver commits) is never deleted; once the lease is released, the superseded files go -- those
    of the last ``vacuum_min_retention_s`` too, as far as the ratio needs."""
    sink = WarehouseSink(
        tmp_path,
        WarehouseOptions(
            buckets=2,
            clustering="hash",
            maintain_every=0,
            vacuum_every=0,
            vacuum_garbage_ratio=0.1,
            vacuum_min_retention_s=3600,
        ),
    )
    reg = table()
    f = feed(reg)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(50))), 1, APP
    )
    cur = sink.paths(reg)[0]
    with leases.lease(cur):
        pinned = DeltaTable(str(cur)).version()
        uncommitted = next(cur.rglob("*.parquet")).parent / "part-uncommitted.parquet"
        uncommitted.write_bytes(b"x" * 100)
        for batch_id in range(2, 6):
            rows = [
                f.change("u", {"id": i, "name": f"v{batch_id}", "note": None}, 100 * batch_id)
                for i in range(50)
            ]
            sink.apply(f.batch(*rows), batch_id, APP)
        assert reclaim.usage(cur).garbage > 0.1 * reclaim.usage(cur).live
        old = DeltaTable(str(cur), version=pinned).to_pyarrow_table()
        assert set(old.column("name").to_pylist()) == {"a"}  # the pinned version is whole
    done = reclaim.within_ratio(cur, 0.1, 3600)
    assert done.files >= 4 and done.window_files == done.files and done.leases == 0
    assert uncommitted.exists()
    # an hour later (no window) every superseded file is deleted; the uncommitted one is not
    reclaim.reclaim(cur, 3600, now=time.time() + 3601)
    assert reclaim.usage(cur).disk == reclaim.usage(cur).live + uncommitted.stat().st_size
    assert {r["name"] for r in current(sink, reg).values()} == {"v5"}


def test_hash_layout_merge_rewrites_only_touched_buckets(tmp_path: Path, feed: FeedMaker) -> None:
    """What is bounded (hash layout): a batch whose keys fall in one bucket rewrites only that bucket's file."""
    sink = WarehouseSink(tmp_path, WarehouseOptions(buckets=8, clustering="hash", maintain_every=0))
    reg = table()
    f = feed(reg)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(2000))), 1, APP
    )
    cur_path = sink.paths(reg)[0]
    assert DeltaTable(str(cur_path)).metadata().configuration["cdc.layout"] == "hash:8"
    assert _files(cur_path) == 8
    same_bucket = [i for i in range(2000) if W.bucket_of(f'{{"id":{i}}}', 8) == 3][:50]
    sink.apply(
        f.batch(*(f.change("u", {"id": i, "name": "b", "note": None}, 200) for i in same_bucket)), 2, APP
    )
    m = sink.last_metrics["current"]
    assert m["num_target_files_removed"] == 1 and m["num_target_rows_updated"] == 50
    assert sink.last_metrics["history"]["num_target_files_removed"] == 1
    spread = list(range(0, 2000, 40))  # 50 keys over every bucket
    sink.apply(f.batch(*(f.change("u", {"id": i, "name": "c", "note": None}, 300) for i in spread)), 3, APP)
    assert sink.last_metrics["current"]["num_target_files_removed"] == 8


def test_range_layout_merge_of_recent_keys_rewrites_only_the_newest_buckets(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """An integer key is range-clustered by default: updating the most recent rows (the usual CDC
    pattern) rewrites the newest bucket's file only; keys spread over the range touch every bucket."""
    sink = WarehouseSink(tmp_path, WarehouseOptions(range_width=250, maintain_every=0))
    reg = table()
    f = feed(reg)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100) for i in range(2000))), 1, APP
    )
    cur_path, hist_path, tomb_path = sink.paths(reg)
    for path in (cur_path, hist_path, tomb_path):
        assert DeltaTable(str(path)).metadata().configuration["cdc.layout"] == "range:250"
    assert _files(cur_path) == 8
    assert {r[W.BUCKET] for r in sink.current_rows(reg).to_pylist() if r["id"] in (0, 249, 250, 1999)} == {
        0,
        1,
        7,
    }
    recent = list(range(1950, 2000))
    sink.apply(f.batch(*(f.change("u", {"id": i, "name": "b", "note": None}, 200) for i in recent)), 2, APP)
    m = sink.last_metrics["current"]
    assert m["num_target_files_removed"] == 1 and m["num_target_rows_updated"] == 50
    assert sink.last_metrics["history"]["num_target_files_removed"] == 1
    sink.apply(f.batch(f.change("d", {"id": 1999}, 250)), 3, APP)
    assert sink.last_metrics["current"]["num_target_files_removed"] == 1
    spread = list(range(0, 2000, 40))
    sink.apply(f.batch(*(f.change("u", {"id": i, "name": "c", "note": None}, 300) for i in spread)), 4, APP)
    assert sink.last_metrics["current"]["num_target_files_removed"] == 8
    rows = current(sink, reg)
    assert len(rows) == 1999 and 1999 not in rows
    assert rows[1998]["name"] == "b" and rows[40]["name"] == "c" and rows[41]["name"] == "a"


def test_layout_choice(tmp_path: Path, feed: FeedMaker) -> None:
    """auto: range for a single integer key, hash for sparse integer keys (range buckets would hold a
    row each) and for other keys; range asked for a key it cannot serve is refused."""
    sink = WarehouseSink(tmp_path, WarehouseOptions(buckets=4, maintain_every=0))
    sparse = table("sparse")
    f = feed(sparse)
    sink.apply(
        f.batch(*(f.change("c", {"id": i << 40, "name": "a", "note": None}, 100) for i in range(50))), 1, APP
    )
    assert DeltaTable(str(sink.paths(sparse)[0])).metadata().configuration["cdc.layout"] == "hash:4"
    texts = table("texts", columns=(("code", "text"), ("name", "text")), key=("code",))
    f = feed(texts)
    sink.apply(f.batch(f.change("c", {"code": "a", "name": "x"}, 100)), 1, APP)
    assert DeltaTable(str(sink.paths(texts)[0])).metadata().configuration["cdc.layout"] == "hash:4"
    ranged = WarehouseSink(tmp_path / "r", WarehouseOptions(clustering="range", maintain_every=0))
    with pytest.raises(ApplyError) as err:
        ranged.apply(f.batch(f.change("c", {"code": "b", "name": "y"}, 200)), 2, APP)
    assert "single integer key" in str(err.value) and "hash" in (err.value.fix or "")
    with pytest.raises(ConfigError) as bad:
        WarehouseOptions.from_settings(
            Settings(state_dir=tmp_path, extra={"warehouse": {"clustering": "zorder"}})
        )
    assert "clustering" in (bad.value.fix or "")


def test_wide_rows_get_narrower_range_buckets(tmp_path: Path, feed: FeedMaker) -> None:
    """A new range-clustered table's width is sized from its first batch's rows so that a bucket of
    dense keys holds about ``target_file_size``: a power of two of rows, at least 1,024 keys, at most
    ``range_width`` (what a batch changing one key of a bucket rewrites)."""

    def layout(name: str, note: str, options: WarehouseOptions, rows: int = 20) -> str:
        reg = table(name)
        f = feed(reg)
        sink = WarehouseSink(tmp_path / name, options)
        sink.apply(
            f.batch(*(f.change("c", {"id": i, "name": "a", "note": note}, 100) for i in range(rows))), 1, APP
        )
        return str(DeltaTable(str(sink.paths(reg)[0])).metadata().configuration["cdc.layout"])

    small_target = WarehouseOptions(maintain_every=0, target_file_size=1 << 20)
    ugly = 'q"\\\n,' * 60  # 300 characters of quotes, backslashes, newlines
    assert layout("medium", ugly, small_target) == "range:2048"  # 1 MiB / ~310 B: 3,3xx rows fit
    narrow = layout("narrow", "n", WarehouseOptions(maintain_every=0))
    assert narrow == "range:65536"  # 8 MiB holds more than range_width of them
    huge = "x" * (2 << 20)  # multi-MB values: never narrower than 1,024 keys
    assert layout("huge", huge, WarehouseOptions(maintain_every=0), rows=3) == "range:1024"
    capped = WarehouseOptions(maintain_every=0, target_file_size=1 << 20, range_width=500)
    assert layout("capped", ugly, capped) == "range:500"  # a smaller range_width is kept


def test_columns_clashing_with_meta_columns_are_refused(sink: WarehouseSink, feed: FeedMaker) -> None:
    for bad in ("_cdc_key", "valid_from"):
        reg = table(f"clash_{bad}", columns=(("id", "bigint"), (bad, "text")))
        f = feed(reg)
        with pytest.raises(ApplyError) as err:
            sink.apply(f.batch(f.change("c", {"id": 1, bad: "x"}, 100)), 1, APP)
        assert bad in str(err.value) and "exclude" in (err.value.fix or "")


@pytest.mark.parametrize("seed", [1, 2])
def test_columnar_and_per_event_forms_write_the_same_tables(tmp_path: Path, seed: int) -> None:
    reg = table()
    got: dict[bool, list[Any]] = {False: [], True: []}
    for form in (False, True):
        sink = WarehouseSink(tmp_path / str(form), WarehouseOptions(buckets=4, maintain_every=0))
        f = Feed(reg, "columns" if form else "events")
        for batch_id, recs in enumerate(mixed_batches(f, seed)):
            batch = f.batch(recs)
            assert batch.columns.plain == (form and batch_id != 3)
            sink.apply(batch, batch_id, APP)
            if batch_id == 2:  # a replayed batch changes nothing
                sink.apply(f.batch(recs), batch_id, APP)
            got[form].append(
                [
                    sorted(rows(reg).to_pylist(), key=lambda r: (r.get(W.KEY) or r["key_json"], str(r)))
                    for rows in (sink.current_rows, sink.history_rows, sink.tombstone_rows)
                ]
            )
    assert all(got[True][-1])
    for batch_id, (fast, slow) in enumerate(zip(got[True], got[False], strict=True)):
        assert fast == slow, f"after batch {batch_id}"


POISON = (
    ("id", "bigint"),
    ("ts", "timestamp with time zone"),
    ("d", "date"),
    ("amount", "numeric(10,2)"),
    ("name", "text"),
)


def test_reject_names_each_poison_record_and_the_rest_applies(sink: WarehouseSink, feed: FeedMaker) -> None:
    """A value the warehouse cannot hold is rejected per record, with the column and the reason; the
    batch without it applies (what the apply job does with :meth:`Sink.reject`)."""
    reg = table("poison", columns=POISON)
    f = feed(reg)
    good = {"ts": "2026-01-01 00:00:00+00", "d": "2026-01-01", "amount": "1.50", "name": "ok"}
    recs = [f.change("c", {"id": i, **good}, 100 + i) for i in range(1, 80)]
    recs[9] = f.change("c", {"id": 10, **good, "ts": "0044-03-15 12:00:00+00 BC"}, 110)
    recs[19] = f.change("c", {"id": 20, **good, "d": "12000-01-01"}, 120)
    recs[29] = f.change("c", {"id": 30, **good, "amount": "NaN"}, 130)
    recs[39] = f.change("c", {"id": 40, **good, "amount": "123456789.5"}, 140)
    batch = f.batch(recs)
    rejected = sink.reject(batch)
    by_offset = {r.offset: r.reason for r in rejected}
    assert sorted(by_offset) == [recs[i].offset for i in (9, 19, 29, 39)]
    assert "column ts" in by_offset[recs[9].offset] and "1..9999" in by_offset[recs[9].offset]
    assert "column d" in by_offset[recs[19].offset]
    assert "column amount" in by_offset[recs[29].offset] and "not finite" in by_offset[recs[29].offset]
    assert "column amount" in by_offset[recs[39].offset]
    rest = batch.without({(r.partition, r.offset) for r in rejected})
    assert rest.columns.plain == batch.columns.plain
    sink.apply(rest, 1, APP)
    assert sorted(current(sink, reg)) == [i for i in range(1, 80) if i not in (10, 20, 30, 40)]
    assert sink.reject(f.batch(f.change("u", {"id": 1, **good, "name": "x"}, 300))) == []


def test_excluded_columns_never_reach_the_warehouse(sink: WarehouseSink, feed: FeedMaker) -> None:
    """``--exclude`` is honoured even when events (written before the exclusion) carry the column."""
    reg = replace(table("excl", columns=(*POISON, ("_cdc_clash", "text"))), exclude=("ts", "_cdc_clash"))
    f = feed(reg)
    row = {"id": 1, "ts": "0044-03-15 12:00:00+00 BC", "d": "2026-01-01", "amount": "1", "name": "a"}
    batch = f.batch(f.change("c", {**row, "_cdc_clash": "x"}, 100))
    assert all("ts" not in (ev.after or {}) for ev in events_of(batch))
    assert sink.reject(batch) == []
    sink.apply(batch, 1, APP)
    t = sink.current_rows(reg, meta=False)
    assert "ts" not in t.column_names and "_cdc_clash" not in t.column_names
    assert t.to_pylist()[0]["name"] == "a"


def test_special_floats_are_stored_as_floats_and_special_numerics_rejected(
    sink: WarehouseSink, feed: FeedMaker
) -> None:
    """Issue 9 item 9: NaN/Infinity/-Infinity arrive as JSON strings; float columns hold the float
    values (never null), a numeric(p,s) column cannot hold them (the record is rejected with the
    reason), an unconstrained numeric keeps the text."""
    reg = table(
        "special",
        columns=(
            ("id", "bigint"),
            ("r", "real"),
            ("f", "double precision"),
            ("n", "numeric"),
            ("d", "numeric(8,2)"),
        ),
    )
    f = feed(reg)
    specials = ["NaN", "Infinity", "-Infinity"]
    recs = [
        f.change("c", {"id": i, "r": s, "f": specials[(i + 1) % 3], "n": s, "d": "1.25"}, 100 + i)
        for i, s in enumerate(specials)
    ]
    recs += [
        f.change("c", {"id": 10 + i, "r": 1.5, "f": -2.25, "n": "3", "d": s}, 200 + i)
        for i, s in enumerate(specials)
    ]
    batch = f.batch(recs)
    if f.form == "columns":
        assert not batch.columns.plain, "the columnar parse declines a float column holding a string"
    rejected = sink.reject(batch)
    assert sorted(r.offset for r in rejected) == [r.offset for r in recs[3:]]
    assert all("column d" in r.reason and "not finite" in r.reason for r in rejected)
    sink.apply(batch.without({(r.partition, r.offset) for r in rejected}), 1, APP)
    got = current(sink, reg)
    assert sorted(got) == [0, 1, 2]
    assert math.isnan(got[0]["r"]) and got[1]["r"] == math.inf and got[2]["r"] == -math.inf
    assert got[0]["f"] == math.inf and got[1]["f"] == -math.inf and math.isnan(got[2]["f"])
    assert [got[i]["n"] for i in range(3)] == specials


# -- what a batch reads and rewrites (docs/warehouse.md, "What is bounded") ------------------------------


def test_open_rows_are_looked_up_in_the_current_table_never_in_the_history(
    sink: WarehouseSink, feed: FeedMaker
) -> None:
    """A key's open history row has its current row's version: the lookup reads the current table
    (one row per live key), and no batch -- updates, deletes, re-inserts, TOAST values, a TRUNCATE --
    reads a history row, however long the history is."""
    reg = table()
    f = feed(reg)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": f"n{i}"}, 100) for i in range(20))), 1, APP
    )
    for lsn in range(200, 260, 10):  # a long history: every key updated six times
        sink.apply(
            f.batch(*(f.change("u", {"id": i, "name": f"v{lsn}", "note": f"n{i}"}, lsn) for i in range(20))),
            lsn,
            APP,
        )
    batches = [
        f.batch(
            f.change("u", {"id": 1, "name": "b", "note": "x"}, 300),
            f.delete({"id": 2}, 300, 2),
            f.change("c", {"id": 99, "name": "new", "note": None}, 300, 3),
        ),
        f.batch(f.change("c", {"id": 2, "name": "again", "note": None}, 310)),  # re-insert
        f.batch(f.change("u", {"id": 3, "name": "toast"}, 320, unavailable=["note"])),  # per-event form
        f.batch(f.truncate(330), f.change("c", {"id": 4, "name": "after", "note": None}, 340)),
    ]
    for batch_id, batch in enumerate(batches, start=1000):
        D.ROWS_READ.clear()
        sink.apply(batch, batch_id, APP)
        assert D.ROWS_READ["history"] == 0, f"batch {batch_id} read the history"
        assert D.ROWS_READ["current"] > 0
    rows = current(sink, reg)
    assert set(rows) == {4}
    h = history(sink, reg)
    assert [(r["id"], r["name"]) for r in h if r[W.IS_CURRENT]] == [(4, "after")]
    assert [(r["name"], r["note"], r[W.END_OP]) for r in history(sink, reg, 3)][-1] == ("toast", "n3", "t")
    assert [(r["name"], r[W.END_OP]) for r in history(sink, reg, 2)][-2:] == [("v250", "d"), ("again", "t")]
    assert len({(r["id"], r[W.LSN], r[W.SEQ]) for r in h}) == len(h), "no version twice"


def test_closing_rows_rewrites_only_files_of_open_rows(sink: WarehouseSink, feed: FeedMaker) -> None:
    """The history is partitioned by bucket and ``is_current``: a batch closing rows rewrites only
    files of open rows; the closed rows' files are only ever added to."""
    reg = table()
    f = feed(reg)
    hist_path = sink.paths(reg)[1]
    for lsn in range(100, 160, 10):
        op = "c" if lsn == 100 else "u"
        sink.apply(
            f.batch(*(f.change(op, {"id": i, "name": f"v{lsn}", "note": None}, lsn) for i in range(40))),
            lsn,
            APP,
        )
    assert DeltaTable(str(hist_path)).metadata().partition_columns == [W.BUCKET, W.IS_CURRENT]
    before = set(DeltaTable(str(hist_path)).file_uris())
    closed_before = {u for u in before if "is_current=false" in u}
    assert closed_before
    sink.apply(
        f.batch(f.change("u", {"id": 7, "name": "last", "note": None}, 200), f.delete({"id": 8}, 210)),
        200,
        APP,
    )
    after = set(DeltaTable(str(hist_path)).file_uris())
    removed = before - after
    assert removed and all("is_current=true" in u for u in removed)
    assert closed_before <= after
    assert sink.last_metrics["history"]["num_target_files_removed"] == len(removed)
    h = history(sink, reg)
    assert len(h) == 6 * 40 + 1
    assert [(r["name"], r[W.IS_CURRENT]) for r in history(sink, reg, 8)][-1] == ("v150", False)


@pytest.mark.parametrize("stage", ["current", "tombstones"])
def test_a_replay_after_a_crash_between_commits_writes_what_an_uninterrupted_run_does(
    tmp_path: Path, feed: FeedMaker, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Every batch of a random workload (deletes, re-inserts, late and repeated events, a TRUNCATE)
    crashes once after the history's commit (or the current table's), then is replayed: the tables
    are those of a run without crashes after every batch (the open-row lookup reads the current
    table, which a history commit never changes)."""
    reg = table()
    got: dict[bool, list[Any]] = {False: [], True: []}
    crashes = 0
    for crashing in (False, True):
        sink = WarehouseSink(tmp_path / str(crashing), WarehouseOptions(buckets=4, maintain_every=0))
        f = feed(reg)
        for batch_id, recs in enumerate(mixed_batches(f, 3)):
            if crashing:

                def crash(*args: Any, **kwargs: Any) -> None:
                    raise RuntimeError(f"crash before {stage}")

                with monkeypatch.context() as m:
                    m.setattr(D.Commit, stage, crash)
                    try:
                        sink.apply(f.batch(recs), batch_id, APP)
                    except RuntimeError:
                        crashes += 1
            sink.apply(f.batch(recs), batch_id, APP)
            got[crashing].append(
                [
                    sorted(rows(reg).to_pylist(), key=lambda r: (r.get(W.KEY) or r["key_json"], str(r)))
                    for rows in (sink.current_rows, sink.history_rows, sink.tombstone_rows)
                ]
            )
    assert crashes >= 5  # every batch but those with nothing to write there
    for batch_id, (crashed, straight) in enumerate(zip(got[True], got[False], strict=True)):
        assert crashed == straight, f"after batch {batch_id}"


def test_a_history_partitioned_by_bucket_alone_still_applies(tmp_path: Path, feed: FeedMaker) -> None:
    """A history created before the ``is_current`` partitioning keeps working (its closes rewrite
    whole buckets' files, as they did): the same tables as a new one."""
    reg = table()
    recs = mixed_batches(Feed(reg), 4)
    got = []
    for old in (False, True):
        sink = WarehouseSink(tmp_path / str(old), WarehouseOptions(buckets=4, maintain_every=0))
        f = feed(reg)
        for batch_id, batch_recs in enumerate(recs):
            sink.apply(f.batch(batch_recs), batch_id, APP)
            if old and batch_id == 0:  # as the sink created histories before
                path = sink.paths(reg)[1]
                t = DeltaTable(str(path))
                write_deltalake(
                    t,
                    t.to_pyarrow_table(),
                    mode="overwrite",
                    schema_mode="overwrite",
                    partition_by=[W.BUCKET],
                    configuration=dict(t.metadata().configuration),
                )
                assert DeltaTable(str(path)).metadata().partition_columns == [W.BUCKET]
        got.append(
            [
                sorted(rows(reg).to_pylist(), key=lambda r: (r.get(W.KEY) or r["key_json"], str(r)))
                for rows in (sink.current_rows, sink.history_rows, sink.tombstone_rows)
            ]
        )
    assert got[0] == got[1]


def test_lookups_find_every_key_in_files_of_many_row_groups(tmp_path: Path) -> None:
    """The lookups' key filter runs on each record batch in memory, never as a scan filter (pyarrow's
    row-group pruning of delta-rs's string_view keys lost rows, a62f9f4; this data does not reproduce
    that, so the guard is the count): every row of the asked buckets is scanned, none of the others,
    and every key is found whichever row group holds it."""
    n = 5_000
    keys = [f'{{"id":{i}}}' for i in range(n)]
    data = pa.table(
        {
            W.KEY: pa.array(keys, pa.string_view()),
            W.BUCKET: pa.array([i % 2 for i in range(n)], pa.int64()),
            W.LSN: pa.array(range(n), pa.int64()),
        }
    )
    write_deltalake(
        str(tmp_path / "t"),
        data,
        partition_by=[W.BUCKET],
        writer_properties=WriterProperties(max_row_group_size=64),
    )
    t = DeltaTable(str(tmp_path / "t"))
    want = [*keys[::2][::97], keys[0], keys[n - 2]]  # bucket 0, spread over its row groups
    D.ROWS_READ.clear()
    got = D.read_rows(t, want, [0], columns=[W.KEY, W.LSN])
    assert sorted(got.column(W.KEY).cast(pa.string()).to_pylist()) == sorted(set(want))
    assert D.ROWS_READ["current"] == n // 2  # bucket 0 only
    assert D.read_rows(t, [keys[1]], [0]).num_rows == 0  # a key of another bucket is not there


# an ugly value: quotes, backslashes, newlines, ~2 MB
UGLY = ('a "quoted" \\back\\slash\nnew line \u00e9 ' * 40_000)[:2_000_000]


def _resnapshot_setup(sink: WarehouseSink, f: Feed) -> None:
    """Keys 1-4 inserted at 101-104; key 2 updated at 150."""
    rows = [{"id": i, "name": str(i), "note": UGLY if i == 1 else None} for i in range(1, 5)]
    sink.apply(f.batch(*(f.change("c", r, 100 + r["id"]) for r in rows)), 1, APP)
    sink.apply(f.batch(f.change("u", {"id": 2, "name": "two", "note": "x"}, 150)), 2, APP)


def _resnapshot_reads(f: Feed) -> list[RawRecord]:
    """A full re-snapshot at 310+ (its marker at 299): keys 1 and 2 unchanged, key 3 changed (a
    change the log missed), key 4 gone at the source."""
    return [
        f.change("r", {"id": 1, "name": "1", "note": UGLY}, 310),
        f.change("r", {"id": 2, "name": "two", "note": "x"}, 311),
        f.change("r", {"id": 3, "name": "changed", "note": None}, 312),
    ]


def _assert_resnapshot(sink: WarehouseSink, reg: Any, changed_closed_by: str) -> None:
    cur = current(sink, reg)
    assert sorted(cur) == [1, 2, 3]
    assert {i: cur[i][W.LSN] for i in cur} == {1: 310, 2: 311, 3: 312}  # the version moved
    assert cur[1]["note"] == UGLY
    h1 = history(sink, reg, 1)  # one version, still open, moved to the re-snapshot's version
    assert [(r[W.OP], r[W.LSN], r[W.IS_CURRENT], r[W.VALID_FROM]) for r in h1] == [("c", 310, True, ts(101))]
    assert h1[0]["note"] == UGLY
    h2 = history(sink, reg, 2)
    assert [(r["name"], r[W.LSN], r[W.IS_CURRENT], r[W.END_OP]) for r in h2] == [
        ("2", 102, False, "u"),
        ("two", 311, True, None),
    ]
    assert h2[1][W.VALID_FROM] == ts(150)
    h3 = history(sink, reg, 3)  # the change the log missed: a new version
    assert [(r["name"], r[W.OP], r[W.IS_CURRENT], r[W.END_OP]) for r in h3] == [
        ("3", "c", False, changed_closed_by),
        ("changed", "r", True, None),
    ]
    h4 = history(sink, reg, 4)  # gone at the source: closed by the marker
    assert [(r[W.IS_CURRENT], r[W.END_OP], r[W.END_LSN]) for r in h4] == [(False, "t", 299)]


def test_an_unchanged_resnapshot_keeps_one_history_version(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    _resnapshot_setup(sink, f)
    # the reads in two chunks (batches), the marker in a batch of its own after them
    reads = _resnapshot_reads(f)
    sink.apply(f.batch(*reads[:2]), 3, APP)
    sink.apply(f.batch(reads[2]), 4, APP)
    sink.apply(f.batch(f.truncate(299)), 5, APP)
    _assert_resnapshot(sink, reg, "r")
    # a later change closes the moved row and opens one, as any change does
    sink.apply(f.batch(f.change("u", {"id": 1, "name": "later", "note": UGLY}, 400)), 6, APP)
    h1 = history(sink, reg, 1)
    assert [(r["name"], r[W.LSN], r[W.END_LSN], r[W.IS_CURRENT]) for r in h1] == [
        ("1", 310, 400, False),
        ("later", 400, None, True),
    ]
    # a late event older than the moved version stays out
    sink.apply(f.batch(f.change("u", {"id": 2, "name": "late", "note": "x"}, 305)), 7, APP)
    assert current(sink, reg)[2]["name"] == "two"
    assert len(history(sink, reg, 2)) == 2


def test_an_unchanged_resnapshot_with_its_marker_in_one_batch(sink: WarehouseSink, feed: FeedMaker) -> None:
    reg = table()
    f = feed(reg)
    _resnapshot_setup(sink, f)
    sink.apply(f.batch(*_resnapshot_reads(f), f.truncate(299)), 3, APP)
    # the changed key's old row is closed by the marker, older than the read, in version order
    _assert_resnapshot(sink, reg, "t")


def test_an_unchanged_read_then_a_change_in_one_batch(sink: WarehouseSink, feed: FeedMaker) -> None:
    """The read confirms the stored row, the change in the same batch closes it: one row per value."""
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": None}, 100)), 1, APP)
    b = f.batch(
        f.change("r", {"id": 1, "name": "a", "note": None}, 200),
        f.change("u", {"id": 1, "name": "b", "note": None}, 210),
    )
    sink.apply(b, 2, APP)
    h = history(sink, reg, 1)
    assert [(r["name"], r[W.LSN], r[W.END_LSN], r[W.END_OP]) for r in h] == [
        ("a", 100, 210, "u"),
        ("b", 210, None, None),
    ]


def test_a_read_after_a_change_in_one_batch_confirms_the_changes_row(
    sink: WarehouseSink, feed: FeedMaker
) -> None:
    """The read compares with the row the batch's earlier change left, not the stored one: equal, it
    opens nothing and that row takes its version; different, it opens a version. A replay writes the
    same tables."""
    reg = table()
    f = feed(reg)
    sink.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100 + i) for i in (1, 2))), 1, APP
    )
    b = f.batch(
        f.change("u", {"id": 1, "name": "b", "note": UGLY}, 200),
        f.change("r", {"id": 1, "name": "b", "note": UGLY}, 300),  # equal to the u's row
        f.change("u", {"id": 2, "name": "b", "note": None}, 201),
        f.change("r", {"id": 2, "name": "c", "note": None}, 301),  # a change the log missed
    )
    for _ in range(2):  # the second: a replay of the same batch
        sink.apply(b, 2, APP)
        h1 = history(sink, reg, 1)
        assert [(r["name"], r[W.OP], r[W.LSN], r[W.END_LSN], r[W.IS_CURRENT]) for r in h1] == [
            ("a", "c", 101, 200, False),
            ("b", "u", 300, None, True),
        ]
        assert h1[1][W.VALID_FROM] == ts(200) and h1[1]["note"] == UGLY
        h2 = history(sink, reg, 2)
        assert [(r["name"], r[W.OP], r[W.LSN], r[W.END_LSN], r[W.IS_CURRENT]) for r in h2] == [
            ("a", "c", 102, 201, False),
            ("b", "u", 201, 301, False),
            ("c", "r", 301, None, True),
        ]
        assert {i: r[W.LSN] for i, r in current(sink, reg).items()} == {1: 300, 2: 301}


def test_a_read_after_a_change_lacking_toast_values_is_compared_with_the_whole_row(
    sink: WarehouseSink, feed: FeedMaker
) -> None:
    """The change lacks its unchanged TOAST value (kept: UGLY); a read with that column null differs
    from the row the change left, so it opens a version (and leaves the column null)."""
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": UGLY}, 100)), 1, APP)
    b = f.batch(
        f.change("u", {"id": 1, "name": "b"}, 200, unavailable=["note"]),
        f.change("r", {"id": 1, "name": "b", "note": None}, 300),
    )
    sink.apply(b, 2, APP)
    h = history(sink, reg, 1)
    assert [(r["name"], r[W.LSN], r[W.END_LSN], r["note"] == UGLY) for r in h] == [
        ("a", 100, 200, True),
        ("b", 200, 300, True),
        ("b", 300, None, False),
    ]
    assert current(sink, reg)[1]["note"] is None


def test_recover_deletes_what_killed_writes_left_and_spares_what_readers_hold(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """``cdc apply`` starting under the apply lock (:meth:`WarehouseSink.recover`): files no commit
    ever referenced (a killed task's or merge's, however young) are deleted at once, where the
    periodic vacuum waits an hour; the superseded files of a version a reader may hold stay, and the
    table reads the same."""
    sink = WarehouseSink(
        tmp_path,
        WarehouseOptions(buckets=2, maintain_every=0, vacuum_every=0, vacuum_min_retention_s=3600),
    )
    reg = table()
    f = feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a" * 500, "note": None}, 100)), 1, APP)
    sink.apply(f.batch(f.change("u", {"id": 1, "name": "b" * 500, "note": None}, 200)), 2, APP)
    cur, hist, _ = sink.paths(reg)
    superseded = {p for p in cur.rglob("*.parquet")} - {
        cur / unquote(a)
        for a in DeltaTable(str(cur)).get_add_actions(flatten=True).column("path").to_pylist()
    }
    assert superseded, "the update superseded a file of the current table"
    part = next(cur.rglob("*.parquet")).parent
    orphans = [
        part / "part-killed-task.parquet",
        next(hist.rglob("*.parquet")).parent / "part-killed.parquet",
    ]
    for orphan in orphans:
        orphan.write_bytes(b"x" * 1000)
    assert sink.recover(reg) == 2000
    assert not any(o.exists() for o in orphans)
    assert all(p.exists() for p in superseded), "a reader of version 1 may still read these"
    assert {r["name"] for r in current(sink, reg).values()} == {"b" * 500}
    assert len(history(sink, reg)) == 2
    assert sink.recover(reg) == 0
