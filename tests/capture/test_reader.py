"""The reader end to end against the real Postgres (wal2json and pgoutput) and both log-store backends."""

from __future__ import annotations

import orjson
import pytest

from tests.plugins.capture import CaptureEnv, assert_versions_monotonic, materialize, rows_of
from tests.plugins.logstore import BACKENDS

pytestmark = pytest.mark.decoders("wal2json", "pgoutput", "pgoutput@pg18")


@pytest.mark.parametrize("env", BACKENDS, indirect=True)
def test_snapshot_then_stream_end_to_end(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE items (id bigint PRIMARY KEY, name text, qty int, price numeric(12,2))")
    env.sql("INSERT INTO items SELECT g, 'item ' || g, g % 7, g * 1.25 FROM generate_series(1, 500) g")
    env.add_table("public.items")
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.items": 500}
    reg = env.reg("public", "items")
    assert reg.snapshot_state == "done" and reg.alignment is not None
    records = env.records(reg.topic)
    assert len(records) == 500 and {orjson.loads(r.value)["op"] for r in records if r.value} == {"r"}
    assert sum(reg.alignment.end_offsets.values()) == 500

    env.sql("INSERT INTO items SELECT g, 'new ' || g, 1, 0.5 FROM generate_series(501, 600) g")
    env.sql("UPDATE items SET qty = qty + 100 WHERE id % 10 = 0")
    env.sql("DELETE FROM items WHERE id BETWEEN 50 AND 59")
    env.sql("UPDATE items SET id = 10000 WHERE id = 1")  # primary-key change
    env.sql(
        "BEGIN; UPDATE items SET name = 'in tx' WHERE id = 2; UPDATE items SET name = 'in tx 2' WHERE id = 2; COMMIT"
    )
    summary = env.run_once()
    assert summary["changes"] == 100 + 60 + 10 + 1 + 2
    records = env.records(reg.topic)
    assert_versions_monotonic(records)
    got = materialize(records)
    want = rows_of(env, "items")
    assert got.keys() == want.keys()
    for k, row in want.items():
        assert got[k]["name"] == row["name"] and got[k]["qty"] == row["qty"]
        assert got[k]["price"] == f"{row['price']:.2f}"
    # the PK change: delete of the old key + tombstone + create of the new one
    old = [r for r in records if r.key == b'{"id":1}']
    assert [orjson.loads(r.value)["op"] if r.value else None for r in old] == ["r", "d", None]


def test_truncate_reaches_every_partition(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 20) g")
    env.add_table("public.t")
    env.run_once()
    env.sql("TRUNCATE t")
    env.sql("INSERT INTO t VALUES (5, 'after truncate')")
    env.run_once()
    reg = env.reg("public", "t")
    records = env.records(reg.topic)
    truncs = [r for r in records if b"__truncate__" in r.key]
    assert sorted(r.partition for r in truncs) == list(range(env.settings().partitions))
    assert materialize(records) == {'{"id":5}': {"id": 5, "v": "after truncate"}}


TYPES_DDL = """
CREATE TABLE typed (
  id bigint PRIMARY KEY, n numeric(38,9), big bigint, j jsonb, ia integer[], ta text[], na numeric[],
  nested integer[], b bytea, ts timestamptz, d date, u uuid, t text, f double precision, ok boolean,
  nan numeric
)"""
TYPES_ROW = """
INSERT INTO typed VALUES (%s, 12345678901234567890123456789.123456789, 9007199254740993,
  '{"a": [1, 2.50, "x\\ny"], "b": null}', '{1,NULL,3}', ARRAY['a,b', 'q"x', 'NULL', NULL, 'back\\slash', 'tab	here'],
  '{1.10,NaN}', '{{1,2},{3,4}}', '\\x00ff10', '2026-11-22 02:28:58.744379+00', '2026-02-28',
  'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', 'emoji 😀 combining é and ǅ, newline\n and tab	and back\\slash', 1.5, true,
  'NaN')
"""
TYPES_EXPECTED = {
    "n": "12345678901234567890123456789.123456789",
    "big": 9007199254740993,
    "j": '{"a": [1, 2.50, "x\\ny"], "b": null}',
    "ia": [1, None, 3],
    "ta": ["a,b", 'q"x', "NULL", None, "back\\slash", "tab\there"],
    "na": ["1.10", "NaN"],
    "nested": [[1, 2], [3, 4]],
    "b": "00ff10",
    "ts": "2026-11-22 02:28:58.744379+00",
    "d": "2026-02-28",
    "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
    "t": "emoji 😀 combining é and ǅ, newline\n and tab\tand back\\slash",
    "f": 1.5,
    "ok": True,
    "nan": "NaN",
}


def test_value_encoding_is_exact_and_identical_in_snapshot_and_stream(env: CaptureEnv) -> None:
    env.sql(TYPES_DDL)
    env.sql(TYPES_ROW, [1])
    env.add_table("public.typed")
    env.run_once()
    env.sql(TYPES_ROW, [2])
    env.run_once()
    records = env.records(env.reg("public", "typed").topic)
    by_op = {orjson.loads(r.value)["op"]: orjson.loads(r.value)["after"] for r in records if r.value}
    assert set(by_op) == {"r", "c"}
    old_wal2json = "this wal2json (< 2.6) sends NaN/Infinity" in env.last_stderr
    for op, after in by_op.items():
        for col, want in TYPES_EXPECTED.items():
            if col == "nan" and op == "c" and old_wal2json:
                want = None  # wal2json 2.5 streams a scalar numeric NaN as null (warned about)
            assert after[col] == want, f"{op}: {col} = {after[col]!r}, expected {want!r}"
    # bigint beyond 2^53 is an exact JSON integer in the raw bytes
    raw = next(r.value for r in records if r.value)
    assert b'"big":9007199254740993' in raw


def test_unchanged_toast_value_is_filled_in_never_null(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE docs (id int PRIMARY KEY, body text, n int)")
    env.sql("ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")
    env.sql("INSERT INTO docs SELECT 1, string_agg(md5(random()::text), '') FROM generate_series(1, 3200)")
    body = env.fetch("SELECT body FROM docs")[0][0]
    assert len(body) > 100_000
    env.add_table("public.docs")
    env.run_once()
    env.sql("UPDATE docs SET n = 7 WHERE id = 1")
    env.run_once()
    records = env.records(env.reg("public", "docs").topic)
    events = [orjson.loads(r.value) for r in records if r.value]
    update = next(e for e in events if e["op"] == "u")
    # wal2json left body out; the reader filled it in from the snapshot's row
    assert update["after"] == {"id": 1, "body": body, "n": 7} and update["unavailable"] == []
    assert materialize(records)['{"id":1}'] == {"id": 1, "body": body, "n": 7}


def test_compaction_keeps_what_the_apply_job_has_not_read_before_it_ever_ran(
    env: CaptureEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cdc run`` streams for longer than ``min_compaction_lag_ms`` before ``cdc apply`` first
    starts: the reader made the apply job a consumer from the topic's first record, so compaction
    keeps every record it has not read (the insert under a TOAST update too, though the update now
    carries the whole row)."""
    import cdc.logstore
    from cdc.logstore import APPLY_CONSUMER
    from cdc.logstore.factory import open_log_store

    env.sql("CREATE TABLE docs (id int PRIMARY KEY, body text, n int)")
    env.sql("ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL")
    env.add_table("public.docs")
    env.run_once()
    topic = env.reg("public", "docs").topic
    with env.store() as store:
        assert store.committed(APPLY_CONSUMER, topic) == store.start_offsets(topic)
    env.sql("INSERT INTO docs SELECT 1, string_agg(md5(random()::text), ''), 0 FROM generate_series(1, 3200)")
    env.sql("UPDATE docs SET n = 7 WHERE id = 1")
    env.run_once()
    real = cdc.logstore.now_ms  # two minutes on: past the topic's min_compaction_lag_ms (60 s)
    monkeypatch.setattr(cdc.logstore, "now_ms", lambda: real() + 120_000)
    with open_log_store(env.settings(), writer=True) as store:
        store.compact(topic)
    events = [orjson.loads(r.value) for r in env.records(topic) if r.value]
    assert [e["op"] for e in events] == ["c", "u"] and events[1]["unavailable"] == []
    assert events[1]["after"]["body"] == events[0]["after"]["body"]


def test_replica_identity_full_table_with_explicit_key(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE nopk (code text NOT NULL, region int NOT NULL, v text)")
    env.sql("CREATE UNIQUE INDEX nopk_key ON nopk (code, region)")
    env.sql("ALTER TABLE nopk REPLICA IDENTITY FULL")
    env.sql("INSERT INTO nopk VALUES ('a', 1, 'x'), ('b', 2, 'y'), ('c', 3, 'z')")
    env.add_table("public.nopk", "--key", "code,region")
    env.run_once()
    env.sql("UPDATE nopk SET v = 'x2' WHERE code = 'a'")
    env.sql("DELETE FROM nopk WHERE code = 'b'")
    env.sql("UPDATE nopk SET region = 30 WHERE code = 'c'")
    env.run_once()
    records = env.records(env.reg("public", "nopk").topic)
    events = [orjson.loads(r.value) for r in records if r.value]
    upd = next(e for e in events if e["op"] == "u")
    assert upd["before"] == {"code": "a", "region": 1, "v": "x"} and upd["after"]["v"] == "x2"
    got = materialize(records)
    assert got == {
        '{"code":"a","region":1}': {"code": "a", "region": 1, "v": "x2"},
        '{"code":"c","region":30}': {"code": "c", "region": 30, "v": "z"},
    }


def test_column_added_at_source_is_recorded_and_captured(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t VALUES (1, 'a')")
    env.add_table("public.t")
    env.run_once()
    env.sql("ALTER TABLE t ADD COLUMN extra numeric(5,1)")
    env.sql("INSERT INTO t VALUES (2, 'b', 3.5)")
    env.run_once()
    reg = env.reg("public", "t")
    assert [c.name for c in reg.columns] == ["id", "v", "extra"]
    got = materialize(env.records(reg.topic))
    assert got['{"id":2}'] == {"id": 2, "v": "b", "extra": "3.5"}


SQL_TYPES_DDL = """
CREATE TYPE mood AS ENUM ('ok', 'a "quoted" label');
CREATE TABLE sqltyped (
  id bigint PRIMARY KEY, s smallint, i integer, big bigint, o oid, n numeric(38,9), nn numeric,
  nan numeric, ok boolean, b bytea, bn bytea NOT NULL, j jsonb, js json, t text, vc varchar(20),
  ch char(5), ts timestamptz, tsn timestamp(3) NOT NULL, d date, tm time, tz timetz, u uuid,
  iv interval, ip inet, e mood
)"""
SQL_TYPES_VALUES = [
    "(%s, -32768, 2147483647, 9007199254740993, 4000000000, 12345678901234567890123456789.123456789, "
    "-0.000000000000000000001, 'NaN', true, '\\x00ff10', '\\x', '{\"a\": [1, 2.50, \"x\\ny\"], \"é\": null}', "
    '\'{ "keep" :  "spacing", "a":1, "a":2 }\', '
    "E'emoji 😀 é, newline\\n tab\\t back\\\\slash quote\" ctrl\\x01 del\\x7f %% %%b', 'v''c', 'ch', "
    "'2026-11-22 02:28:58.744379+00', '2026-11-22 02:28:58.123', '2026-02-28', '13:14:15.5', '13:14:15+02', "
    "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '1 year 2 mons 3 days 04:05:06.7', '192.168.0.1', 'a \"quoted\" label')",
    "(%s, NULL, NULL, NULL, NULL, NULL, 'Infinity', '-Infinity', false, NULL, '\\x0a', NULL, NULL, NULL, NULL, "
    "NULL, NULL, '1999-01-01', NULL, NULL, NULL, NULL, NULL, NULL, NULL)",
]


SPECIALS_LOST_BY_WAL2JSON_25 = (
    (b'"nan":"NaN"', b'"nan":null'),
    (b'"nn":"Infinity"', b'"nn":null'),
    (b'"nan":"-Infinity"', b'"nan":null'),
)


def test_snapshot_json_built_by_postgres_is_byte_identical_to_the_stream(env: CaptureEnv) -> None:
    """Every type the snapshot encodes in SQL (no float or array column: this table takes that path)
    gives the same key bytes and the same ``after`` bytes as the stream's encoding of the same row."""
    env.sql(SQL_TYPES_DDL)
    for k, values in enumerate(SQL_TYPES_VALUES):
        env.sql(f"INSERT INTO sqltyped VALUES {values}", [k + 1])  # snapshot rows 1, 2
    env.add_table("public.sqltyped")
    env.run_once()
    for k, values in enumerate(SQL_TYPES_VALUES):
        env.sql(f"INSERT INTO sqltyped VALUES {values}", [k + 11])  # the same values streamed: 11, 12
    env.run_once()
    records = [r for r in env.records(env.reg("public", "sqltyped").topic) if r.value]
    by_id: dict[int, tuple[bytes, bytes, str]] = {}
    for r in records:
        event = orjson.loads(r.value)
        after = r.value.split(b'"after":', 1)[1].split(b',"source":', 1)[0]  # the raw bytes
        by_id[event["after"]["id"]] = (r.key, after, event["op"])
    assert sorted(by_id) == [1, 2, 11, 12]
    for snap_id, stream_id in ((1, 11), (2, 12)):
        snap_key, snap_after, snap_op = by_id[snap_id]
        stream_key, stream_after, stream_op = by_id[stream_id]
        assert (snap_op, stream_op) == ("r", "c")
        assert snap_key == f'{{"id":{snap_id}}}'.encode() and stream_key == f'{{"id":{stream_id}}}'.encode()
        if orjson.loads(by_id[11][1])["nan"] is None:
            # wal2json 2.5 prints numeric NaN/Infinity as null in the stream (no option to do otherwise,
            # docs/events.md); the snapshot carries them as the contract's strings
            for carried, lost in SPECIALS_LOST_BY_WAL2JSON_25:
                snap_after = snap_after.replace(carried, lost)
        assert snap_after.replace(b'"id":%d' % snap_id, b'"id":%d' % stream_id, 1) == stream_after
    first = orjson.loads(by_id[1][1])
    assert first["nan"] == "NaN" and first["n"] == "12345678901234567890123456789.123456789"
    assert first["big"] == 9007199254740993 and first["ok"] is True and first["b"] == "00ff10"
    assert first["js"] == '{ "keep" :  "spacing", "a":1, "a":2 }' and first["e"] == 'a "quoted" label'
    second = orjson.loads(by_id[2][1])
    assert second["nn"] == "Infinity" and second["nan"] == "-Infinity" and second["ok"] is False
    assert second["bn"] == "0a"
