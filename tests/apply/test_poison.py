"""A poison record never stops the others, on the apply job fed by hand-built records
(:class:`tests.plugins.changes.ChangeWriter` writes the events to the log store; not ``cdc run``): a
value the warehouse cannot hold goes to the dead-letter topic with its reason, table, key, version
and source offset; every other record and table applies, and the job, running continuously on a
thread of this process (:func:`tests.plugins.apply.continuous_job`: real Spark, Delta and tantivy),
keeps going on later batches. Poison values captured from a real source by ``cdc run``: the fault
suite's ``poison_value`` (``tests/chaos/``)."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest

from cdc.events import dead_letter_topic
from sinks.search import search
from sinks.warehouse import WarehouseSink
from spark_jobs.apply import ledger_path
from tests.plugins.apply import Env, continuous_job, start_job, warehouse_ids
from tests.plugins.changes import ChangeWriter, make_reg
from tests.plugins.items import POISON_COLUMNS, good_row
from tests.plugins.postgres import wait_for

PLAIN_COLUMNS = [("id", "bigint"), ("name", "text")]


def dead_letters(env: Env, topic: str) -> list[dict[str, Any]]:
    dlq = dead_letter_topic(env.settings.topic_prefix)
    try:
        ends = env.store.end_offsets(dlq)
    except Exception:  # the topic does not exist yet
        return []
    out = []
    for p in ends:
        for r in env.store.iter_partition(dlq, p):
            body = orjson.loads(r.value)
            if body["source"]["topic"] == topic:
                out.append(body)
    return sorted(out, key=lambda b: b["source"]["offset"])


def search_ids(env: Env, reg: Any) -> set[int]:
    return {h.key["id"] for h in search(env.state, reg, "widget", limit=1000)}


@pytest.mark.parametrize("backend", ["embedded"])
def test_a_poison_record_never_stops_the_others(spark_clean: Any, env: Env) -> None:
    schema = f"p{uuid.uuid4().hex[:6]}"
    items = env.register(make_reg(schema, "items", POISON_COLUMNS, search=("name",)))
    plain = env.register(make_reg(schema, "plain", PLAIN_COLUMNS))
    wi, wp = ChangeWriter(env.store, items, partitions=2), ChangeWriter(env.store, plain)
    with wi.txn() as lsn_bc:  # one transaction: the poison rows share a micro-batch with good ones
        for i in range(1, 101):
            row = good_row(i)
            if i == 13:
                row["born"] = "0044-03-15 BC"  # a BC date
            if i == 42:
                row["amount"] = "NaN"  # a numeric NaN for a decimal column
            wi.insert(row)
    with wp.txn():
        for i in range(1, 51):
            wp.insert({"id": i, "name": f"plain {i}"})
    job = continuous_job(spark_clean, env)
    runner, errors = start_job(job)
    try:
        good = set(range(1, 101)) - {13, 42}
        wait_for(
            lambda: warehouse_ids(env, items) == good, timeout=180, what="every good row of the batch applied"
        )
        wait_for(
            lambda: warehouse_ids(env, plain) == set(range(1, 51)), timeout=60, what="the other table applied"
        )
        wait_for(lambda: search_ids(env, items) == good, timeout=60, what="the index holds the good rows")
        letters = dead_letters(env, items.topic)
        assert len(letters) == 2, letters
        by_key = {orjson.loads(d["key_json"])["id"]: d for d in letters}
        assert set(by_key) == {13, 42}
        bc, nan = by_key[13], by_key[42]
        assert "column born" in bc["reason"] and "1..9999" in bc["reason"], bc["reason"]
        assert "column amount" in nan["reason"] and "not finite" in nan["reason"], nan["reason"]
        for d in letters:
            assert d["table"] == items.qualified
            assert d["version"]["commit_lsn"] == lsn_bc and d["version"]["seq"] > 0
            assert d["source"]["topic"] == items.topic and d["source"]["offset"] >= 0
            assert orjson.loads(d["value"])["after"]["id"] == orjson.loads(d["key_json"])["id"]
        # later batches keep applying, for every table, while the job runs on
        with wi.txn():
            wi.update(good_row(1, 1))
            wi.insert(good_row(13, 1))  # the poison key, with a good value now
            wi.insert({**good_row(200), "seen": "12000-01-01 00:00:00+00"})  # a year past 9999
        with wp.txn():
            wp.insert({"id": 99, "name": "later"})
        wait_for(
            lambda: 13 in warehouse_ids(env, items) and 99 in warehouse_ids(env, plain),
            timeout=90,
            what="later batches",
        )
        assert 200 not in warehouse_ids(env, items)
        wait_for(lambda: len(dead_letters(env, items.topic)) == 3, timeout=30, what="the third dead letter")
        assert "column seen" in dead_letters(env, items.topic)[-1]["reason"]
        assert not errors, errors
    finally:
        job.stop()
        runner.join(60)
        job.close()
    assert not runner.is_alive() and not errors, errors
    rows = {r["id"]: r for r in WarehouseSink(env.state).current_rows(items, meta=False).to_pylist()}
    assert rows[1]["name"] == "widget 1 v1" and rows[13]["name"] == "widget 13 v1"
    assert orjson.loads(ledger_path(env.state).read_bytes())["dead_letters"] == 3
