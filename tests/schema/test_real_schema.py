"""A realistic schema end to end (issue 16, "What a real schema runs into"): monthly range
partitions, domains (over a number, over a domain, arrays of them), a trigger, arrays and bytea,
through the real reader (``cdc run``) and the real apply (Spark, Delta).

* A domain column is stored as its base type: ``CREATE DOMAIN year AS integer`` is an integer in the
  warehouse, in the snapshot and the stream, for a column added while streaming too.
* Attaching a pre-loaded partition while ``cdc run`` streams reads only that partition's rows: no
  TRUNCATE marker, no history version for a row that did not change. Detaching one deletes its rows.
"""

from __future__ import annotations

import signal
from typing import Any

import orjson
import pyarrow as pa
import pytest

from cdc.events import TRUNCATE_KEY_FIELD
from sinks.warehouse import END_OP, KEY, WarehouseSink
from tests.plugins.apply import apply_clean
from tests.plugins.capture import CaptureEnv, materialize, progress, wait_caught_up, wait_streaming
from tests.plugins.postgres import wait_for

SCHEMA = [
    "CREATE DOMAIN year AS integer CHECK (VALUE BETWEEN 1901 AND 2155)",
    "CREATE DOMAIN film_year AS year",  # a domain over a domain
    "CREATE DOMAIN price AS numeric(5,2) CHECK (VALUE >= 0)",
    "CREATE DOMAIN bool_flag AS boolean",
    "CREATE TABLE film (film_id int PRIMARY KEY, title text NOT NULL, release_year year,"
    " remake_year film_year, rental_rate price NOT NULL DEFAULT 4.99, special_features text[],"
    " award_years year[], prices price[], poster bytea, active bool_flag,"
    " last_update timestamptz NOT NULL DEFAULT now())",
    "CREATE FUNCTION touch() RETURNS trigger LANGUAGE plpgsql AS"
    " $$ BEGIN NEW.last_update := now(); RETURN NEW; END $$",
    "CREATE TRIGGER film_touch BEFORE UPDATE ON film FOR EACH ROW EXECUTE FUNCTION touch()",
]

pytestmark = pytest.mark.decoders("wal2json", "pgoutput")


def test_domains_are_stored_as_their_base_types(env: CaptureEnv, spark_clean: Any) -> None:
    for stmt in SCHEMA:
        env.sql(stmt)
    env.sql(
        "INSERT INTO film (film_id, title, release_year, remake_year, rental_rate, special_features,"
        " award_years, prices, poster, active) SELECT g, 'Film ' || g, 1990 + g % 30, 2000 + g % 20,"
        " (g % 5) + 0.99, ARRAY['Trailers', 'say \"hi\", then\\n'], ARRAY[1999 + g, 2001], ARRAY[1.5, g],"
        " decode(repeat('00ff5c22', g), 'hex'), g % 2 = 0 FROM generate_series(1, 40) g"
    )
    env.add_table("public.film")
    reg = env.reg("public", "film")
    assert {c.name: c.type for c in reg.columns}["release_year"] == "integer"  # not the domain "year"
    types = {c.name: (c.type, c.domain) for c in reg.columns}
    assert types["release_year"] == ("integer", "year")
    assert types["remake_year"] == ("integer", "film_year")
    assert types["award_years"] == ("integer[]", "year[]")
    assert types["prices"] == ("numeric(5,2)[]", "price[]")
    assert types["rental_rate"] == ("numeric(5,2)", "price")
    proc = env.spawn("run")
    try:
        wait_streaming(env, proc)
        # the stream: wal2json names a domain column by its domain and sends its value as text
        env.sql(
            "UPDATE film SET release_year = 2006, award_years = '{2007,NULL}', prices = '{0.99}' WHERE film_id <= 5"
        )
        env.sql(
            "INSERT INTO film (film_id, title, release_year, remake_year, active) VALUES (41, 'New', 2020, 2021, true)"
        )
        env.sql("ALTER TABLE film ADD COLUMN sequel_year film_year")  # a domain column added while streaming
        env.sql("UPDATE film SET sequel_year = 2030 WHERE film_id = 41")
        wait_caught_up(env)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, env.proc_log()
    reg = env.reg("public", "film")
    types = {c.name: (c.type, c.domain) for c in reg.columns}
    assert types["sequel_year"] == ("integer", "film_year"), types
    values = [orjson.loads(r.value) for r in env.records(reg.topic) if r.value]
    streamed = [v["after"] for v in values if v["op"] != "r" and v.get("after")]
    assert streamed and all(type(a["release_year"]) is int for a in streamed), streamed[:2]
    (new,) = [a for a in streamed if a["film_id"] == 41 and a.get("sequel_year") is not None]
    assert new["sequel_year"] == 2030 and new["remake_year"] == 2021 and new["active"] is True
    assert next(a for a in streamed if a["film_id"] == 1)["award_years"] == [2007, None]

    apply_clean(spark_clean, env.state)
    sink = WarehouseSink(env.state)
    table = sink.current_rows(reg, meta=False)
    schema = table.schema
    assert schema.field("release_year").type == pa.int32(), schema
    assert schema.field("sequel_year").type == pa.int32(), schema
    assert schema.field("award_years").type == pa.list_(pa.int32()), schema
    assert schema.field("rental_rate").type == pa.decimal128(5, 2), schema
    assert schema.field("active").type == pa.bool_(), schema
    rows = table.to_pylist()
    want = env.fetch("SELECT sum(release_year)::int, sum(sequel_year)::int, count(*)::int FROM film")[0]
    got = (
        sum(r["release_year"] for r in rows if r["release_year"] is not None),
        sum(r["sequel_year"] for r in rows if r["sequel_year"] is not None),
        len(rows),
    )
    assert got == want
    by_id = {r["film_id"]: r for r in rows}
    assert by_id[3]["poster"] == bytes.fromhex("00ff5c22" * 3)
    assert by_id[2]["special_features"] == ["Trailers", 'say "hi", then\\n']


def _topic_ops(
    env: CaptureEnv, topic: str, after: dict[int, int] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """(op, key) of the topic's records (``t`` for a TRUNCATE marker), after the offsets ``after``."""
    out = []
    for r in env.records(topic):
        if r.value is None or r.offset < (after or {}).get(r.partition, 0):
            continue
        key = orjson.loads(r.key)
        out.append(("t" if TRUNCATE_KEY_FIELD in key else orjson.loads(r.value)["op"], key))
    return out


def _ends(env: CaptureEnv, topic: str) -> dict[int, int]:
    with env.store() as store:
        return dict(store.end_offsets(topic))


def _payment_rows(env: CaptureEnv) -> dict[str, str]:
    """The source's payment notes by key (as the topic's key JSON)."""
    return {
        orjson.dumps({"payment_id": i, "payment_date": str(d)}).decode(): n
        for i, d, n in env.fetch("SELECT payment_id, payment_date, note FROM payment p")
    }


def _topic_rows(env: CaptureEnv, topic: str) -> dict[str, str]:
    return {k: row["note"] for k, row in materialize(env.records(topic)).items()}


def test_attach_reads_only_the_partition_and_detach_deletes_its_rows(
    env: CaptureEnv, spark_clean: Any
) -> None:
    env.sql(SCHEMA[2])  # the price domain
    env.sql(
        "CREATE TABLE payment (payment_id int, payment_date date, amount price NOT NULL, note text,"
        " PRIMARY KEY (payment_id, payment_date)) PARTITION BY RANGE (payment_date)"
    )
    for m in (1, 2, 3):
        env.sql(
            f"CREATE TABLE payment_2026_0{m} PARTITION OF payment"
            f" FOR VALUES FROM ('2026-0{m}-01') TO ('2026-0{m + 1}-01')"
        )
    env.sql(
        "INSERT INTO payment SELECT g, date '2026-01-01' + (g % 90), (g % 50) + 0.99, 'p' || g"
        " FROM generate_series(1, 900) g"
    )
    env.add_table("public.payment")
    reg = env.reg("public", "payment")
    proc = env.spawn("run")
    try:
        wait_streaming(env, proc)
        env.sql("UPDATE payment SET note = 'changed' WHERE payment_id <= 10")
        wait_caught_up(env)
        assert [op for op, _ in _topic_ops(env, reg.topic) if op == "t"] == []
        before = _ends(env, reg.topic)

        # a pre-loaded partition attached while streaming: only its rows are read
        env.sql("CREATE TABLE payment_2026_04 (LIKE payment INCLUDING ALL)")
        env.sql(
            "INSERT INTO payment_2026_04 SELECT g, date '2026-04-01' + (g % 30), 1.50, 'april ' || g"
            " FROM generate_series(2001, 2300) g"
        )
        env.sql(
            "ALTER TABLE payment ATTACH PARTITION payment_2026_04 FOR VALUES FROM ('2026-04-01') TO ('2026-05-01')"
        )
        wait_for(
            lambda: (p := progress(env, "payment")) is not None and p.done,
            timeout=120,
            what="the attached partition's rows read",
        )
        env.sql("UPDATE payment SET note = 'april changed' WHERE payment_id = 2001")
        wait_caught_up(env)
        added = _topic_ops(env, reg.topic, before)
        assert not progress(env, "payment").full  # type: ignore[union-attr]
        assert [op for op, _ in added if op == "t"] == [], "no TRUNCATE marker for an attach"
        read = [k for op, k in added if op == "r"]
        assert len(read) == 300 and all(k["payment_date"].startswith("2026-04") for k in read)
        wait_for(
            lambda: _topic_rows(env, reg.topic) == _payment_rows(env),
            timeout=60,
            what="topic = source",
        )

        # a partition detached: its rows are deleted (deletes, not a truncate)
        jan = {k for k in _payment_rows(env) if '"2026-01' in k}
        before_detach = _ends(env, reg.topic)
        env.sql("ALTER TABLE payment DETACH PARTITION payment_2026_01")
        wait_for(lambda: _topic_rows(env, reg.topic) == _payment_rows(env), timeout=90, what="rows deleted")
        gone = _topic_ops(env, reg.topic, before_detach)
        assert [op for op, _ in gone if op == "t"] == []
        assert {orjson.dumps(k).decode() for op, k in gone if op == "d"} == jan
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, env.proc_log()

    apply_clean(spark_clean, env.state)
    sink = WarehouseSink(env.state)
    reg = env.reg("public", "payment")
    current = sink.current_rows(reg, meta=True).to_pylist()
    history = sink.history_rows(reg, meta=True).to_pylist()
    assert len(current) == len(_payment_rows(env)) == 900 - len(jan) + 300
    assert not [h for h in history if h[END_OP] == "t"], "no history row closed by a truncate"
    versions: dict[str, int] = {}
    for h in history:
        versions[h[KEY]] = versions.get(h[KEY], 0) + 1
    feb = {k for k in _payment_rows(env) if '"2026-02' in k}
    untouched = {k for k in feb if orjson.loads(k)["payment_id"] > 10}
    assert untouched and all(versions[k] == 1 for k in untouched), "one version per unchanged row"
    closed = [h for h in history if h[KEY] in jan]
    assert closed and not [h for h in closed if h["is_current"]], "a detached row is not current"
    assert {h[KEY] for h in closed if h[END_OP] == "d"} == jan, "each detached row ends in a delete"
