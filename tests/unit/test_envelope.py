"""Building events from wal2json messages (pure logic; the real stream is tested in tests/capture)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cdc.codec import Message
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.codec.wal2json import decode
from cdc.errors import DecodeError
from cdc.events import Version, commit_ts_ms, lsn_to_int
from cdc.registry import Alignment, Column, TableReg
from tests.codec_fakes import SettlingBuilder

COLS = (
    Column("id", "integer"),
    Column("n", "numeric(38,9)"),
    Column("big", "text"),
    Column("secret", "text"),
)


def make(
    reg_kw: dict[str, Any] | None = None, columns: tuple[Column, ...] = COLS
) -> tuple[EventBuilder, list[Any]]:
    reg = TableReg("public", "t", "cdc.public.t", ("id",), columns=columns, **(reg_kw or {}))
    changed: list[Any] = []
    codec = TableCodec(reg, prefix="cdc", db="app", partitions=3)
    builder = SettlingBuilder({("public", "t"): codec}, lambda r, cols, told: changed.append(cols))
    builder.begin(
        decode(
            b'{"action":"B","xid":727,"timestamp":"2026-11-22 02:28:58.744379+00",'
            b'"lsn":"0/1507B78","nextlsn":"0/1507BA8"}'
        )
    )
    return builder, changed


def col(name: str, typ: str, value: Any) -> dict[str, Any]:
    return {"name": name, "type": typ, "value": value}


def row(i: int, n: str = "1.000000000", big: str | None = "x") -> list[dict[str, Any]]:
    out = [col("id", "integer", i), col("n", "numeric(38,9)", n)]
    if big is not None:
        out.append(col("big", "text", big))
    out.append(col("secret", "text", "s"))
    return out


def M(d: dict[str, Any]) -> Message:
    return decode(orjson.dumps(d))


def change(
    action: str, columns: list[Any] | None = None, identity: list[Any] | None = None, lsn: str = "0/1507940"
) -> Message:
    msg: dict[str, Any] = {"action": action, "xid": 727, "lsn": lsn, "schema": "public", "table": "t"}
    if columns is not None:
        msg["columns"] = columns
    if identity is not None:
        msg["identity"] = identity
    return M(msg)


def values(records: list[Any]) -> list[Any]:
    return [None if r.value is None else orjson.loads(r.value) for r in records]


def test_insert_envelope_source_and_version() -> None:
    b, _ = make()
    topic, recs = b.change(change("I", row(42)))  # type: ignore[misc]
    assert topic == "cdc.public.t"
    assert recs[0].key == b'{"id":42}'
    (v,) = values(recs)
    assert v["op"] == "c" and v["before"] is None
    assert v["after"] == {"id": 42, "n": "1.000000000", "big": "x", "secret": "s"}
    src = v["source"]
    assert src["connector"] == "postgresql" and src["name"] == "cdc" and src["db"] == "app"
    assert src["schema"] == "public" and src["table"] == "t" and src["snapshot"] == "false"
    assert src["txId"] == 727 and src["lsn"] == lsn_to_int("0/1507940")
    assert src["commit_lsn"] == lsn_to_int("0/1507B78") and src["seq"] == 1
    assert orjson.loads(src["sequence"]) == [str(lsn_to_int("0/1507B78")), str(lsn_to_int("0/1507940"))]
    assert src["ts_ms"] == commit_ts_ms("2026-11-22 02:28:58.744379+00") == 1795314538744
    assert v["unavailable"] == []
    assert Version.of(v) == Version(lsn_to_int("0/1507B78"), 1)
    _, recs2 = b.change(change("I", row(43)))  # type: ignore[misc]
    assert values(recs2)[0]["source"]["seq"] == 2


def test_update_with_absent_toast_column_is_unavailable_not_null() -> None:
    b, _ = make()
    _, recs = b.change(change("U", row(1, big=None), identity=[col("id", "integer", 1)]))  # type: ignore[misc]
    (v,) = values(recs)
    assert v["op"] == "u"
    assert "big" not in v["after"] and v["unavailable"] == ["big"]
    assert v["before"] == {"id": 1}


def test_delete_is_followed_by_tombstone() -> None:
    b, _ = make()
    _, recs = b.change(change("D", identity=[col("id", "integer", 7)]))  # type: ignore[misc]
    assert [r.key for r in recs] == [b'{"id":7}', b'{"id":7}']
    d, tomb = values(recs)
    assert d["op"] == "d" and d["before"] == {"id": 7} and d["after"] is None
    assert tomb is None


def test_primary_key_change_is_delete_tombstone_create() -> None:
    b, _ = make()
    _, recs = b.change(change("U", row(100), identity=[col("id", "integer", 3)]))  # type: ignore[misc]
    assert [r.key for r in recs] == [b'{"id":3}', b'{"id":3}', b'{"id":100}']
    d, tomb, c = values(recs)
    assert d["op"] == "d" and tomb is None and c["op"] == "c" and c["after"]["id"] == 100
    # the create names the old key (its before), where a sink finds unchanged TOAST values
    assert c["before"] == d["before"] == {"id": 3}


def test_truncate_is_one_event_per_partition() -> None:
    b, _ = make()
    _, recs = b.change(M({"action": "T", "xid": 727, "lsn": "0/1507940", "schema": "public", "table": "t"}))  # type: ignore[misc]
    assert [r.partition for r in recs] == [0, 1, 2]
    assert [orjson.loads(r.key) for r in recs] == [{"__truncate__": p} for p in range(3)]
    assert {v["op"] for v in values(recs)} == {"t"}
    assert all(v["before"] is None and v["after"] is None for v in values(recs))


def test_excluded_columns_are_dropped_everywhere() -> None:
    b, _ = make({"exclude": ("secret",)})
    _, recs = b.change(change("U", row(1), identity=[col("id", "integer", 1), col("secret", "text", "old")]))  # type: ignore[misc]
    (v,) = values(recs)
    assert "secret" not in v["after"] and "secret" not in v["before"] and v["unavailable"] == []


def test_added_column_updates_registry_before_the_event() -> None:
    b, changed = make()
    cols = [*row(5), col("extra", "integer", 9)]
    _, recs = b.change(change("I", cols))  # type: ignore[misc]
    assert changed and [c.name for c in changed[-1]] == ["id", "n", "big", "secret", "extra"]
    assert values(recs)[0]["after"]["extra"] == 9


def test_column_type_change_is_recorded() -> None:
    b, changed = make()
    cols = [col("id", "bigint", 5), *row(5)[1:]]
    b.change(change("I", cols))
    assert changed[-1][0] == Column("id", "bigint")


def test_changes_older_than_the_tables_snapshot_are_dropped() -> None:
    commit = lsn_to_int("0/1507B78")
    b, _ = make({"alignment": Alignment(commit + 1, {}), "snapshot_state": "done"})
    assert b.change(change("I", row(1))) is None
    b2, _ = make({"alignment": Alignment(commit, {}), "snapshot_state": "done"})
    assert b2.change(change("I", row(1))) is not None


def test_replica_identity_full_with_explicit_key() -> None:
    cols = (Column("a", "text"), Column("b", "integer"), Column("c", "text"))
    reg = TableReg("public", "t", "cdc.public.t", ("a", "b"), columns=cols)
    codec = TableCodec(reg, prefix="cdc", db="app", partitions=2)
    b = EventBuilder({("public", "t"): codec})
    b.begin(M({"action": "B", "xid": 1, "lsn": "0/10", "nextlsn": "0/20", "timestamp": None}))
    full_old = [col("a", "text", "k"), col("b", "integer", 1), col("c", "text", "old")]
    full_new = [col("a", "text", "k"), col("b", "integer", 1), col("c", "text", "new")]
    _, recs = b.change(change("U", full_new, identity=full_old))  # type: ignore[misc]
    (v,) = values(recs)
    assert recs[0].key == b'{"a":"k","b":1}'
    assert v["before"] == {"a": "k", "b": 1, "c": "old"} and v["after"]["c"] == "new"
    _, recs = b.change(change("D", identity=full_new))  # type: ignore[misc]
    assert recs[0].key == b'{"a":"k","b":1}' and recs[1].value is None


def test_delete_without_identity_is_an_error_not_a_skip() -> None:
    b, _ = make()
    with pytest.raises(DecodeError):
        b.change(change("D"))


def test_change_of_unregistered_table_is_an_error() -> None:
    b, _ = make()
    with pytest.raises(DecodeError):
        b.change(M({"action": "I", "lsn": "0/1", "schema": "public", "table": "other", "columns": []}))


def test_commit_returns_end_of_commit_record() -> None:
    b, _ = make()
    assert b.commit(M({"action": "C", "lsn": "0/1507B78", "nextlsn": "0/1507BA8"})) == lsn_to_int("0/1507BA8")


def test_snapshot_record_is_op_r_with_consistent_point_version() -> None:
    reg = TableReg("public", "t", "cdc.public.t", ("id",), columns=COLS)
    codec = TableCodec(reg, prefix="cdc", db="app", partitions=2)
    rec = codec.snapshot_record({"id": 1, "n": "2.5"}, codec.snapshot_source(1000, 5, last=True), b"7")
    v = orjson.loads(rec.value)  # type: ignore[arg-type]
    assert rec.key == b'{"id":1}' and v["op"] == "r" and v["source"]["snapshot"] == "last"
    assert Version.of(v) == Version(1000, 0) and v["source"]["lsn"] == 1000 and v["ts_ms"] == 7


def test_change_records_from_rows_are_the_readers_events() -> None:
    """:meth:`TableCodec.change_records` (what tests and benchmarks build events with) gives the bytes
    the reader appends for the same change, in each shape: insert, update, key change (d +
    tombstone + c), delete (+ tombstone), truncate (one marker per partition)."""
    from cdc.codec.envelope import transaction_part

    b, _ = make()
    codec = b.codecs[("public", "t")]
    b.now = b"5"
    lsn = lsn_to_int("0/1507940")
    commit = lsn_to_int("0/1507B78")
    tx = transaction_part(commit_ts_ms("2026-11-22 02:28:58.744379+00"), 727, commit)
    new = {"id": 1, "n": "2.000000000", "big": "x", "secret": "s"}
    cases = [
        (change("I", row(1, "2.000000000")), b"c", None, new),
        (change("U", row(1, "2.000000000"), identity=[col("id", "integer", 1)]), b"u", {"id": 1}, new),
        (change("U", row(1, "2.000000000"), identity=[col("id", "integer", 9)]), b"u", {"id": 9}, new),
        (change("D", identity=[col("id", "integer", 9)]), b"d", {"id": 9}, None),
        (change("T"), b"t", None, None),
    ]
    for seq, (msg, op, before, after) in enumerate(cases, start=1):
        _, got = b.change(msg)  # type: ignore[misc]
        source = codec.change_source(tx, lsn, commit, seq)
        assert got == codec.change_records(op, before, after, source, b"5", lsn=lsn), op
    assert [len(codec.change_records(op, before, after, b"{}", b"5")) for _, op, before, after in cases] == [
        1,
        1,
        3,
        2,
        3,
    ]
