"""Schema changes end to end (issue 11): the real reader streams a table while its columns change at
the source, the Spark job applies across the change, and ``cdc verify`` ends clean. Events carry
``source.schema_version``; a dropped column stays in the warehouse, null from then on, listed in the
Delta table's ``cdc.dropped_columns``, and leaves the search columns."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from deltalake import DeltaTable

from cdc.config import Settings
from cdc.events import dead_letter_topic
from sinks.warehouse import DROPPED_CONF, WarehouseSink
from tests.plugins.apply import apply_clean, cdc_cli, reader_env, run_job, warehouse_rows
from tests.plugins.capture import CaptureEnv, progress, wait_caught_up, wait_streaming
from tests.plugins.postgres import wait_for
from tests.schema.helpers import install_recorder, rename_two_columns_then_write

pytestmark = pytest.mark.decoders("wal2json", "pgoutput")


def _verify_clean(env: CaptureEnv, table: str) -> dict[str, Any]:
    code, out = cdc_cli(env.dsn, env.state, "verify", "--json", "--wait", "30")
    report = {r["table"]: r for r in orjson.loads(out)}[table]
    assert code == 0, report
    assert not any(report[k] for k in ("missing", "extra", "different")), report
    return report


@contextlib.contextmanager
def _running(env: CaptureEnv, spark: Any) -> Iterator[None]:
    """`cdc run` streaming ``items``: a first change (qty + 100 on ids 1-5) captured and applied
    before the body; stopped by SIGTERM after it, and it must exit 0."""
    proc = env.spawn("run")
    try:
        wait_streaming(env, proc)
        env.sql("UPDATE items SET qty = qty + 100 WHERE id <= 5")
        wait_caught_up(env)
        apply_clean(spark, env.state)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, env.proc_log()


def test_drop_column_is_followed_kept_null_in_the_warehouse_and_left_out_of_search(
    env: CaptureEnv, spark_clean: Any
) -> None:
    env.sql("CREATE TABLE items (id int PRIMARY KEY, name text, note text, qty int)")
    env.sql("INSERT INTO items SELECT g, 'item ' || g, 'note ' || g, g FROM generate_series(1, 20) g")
    env.add_table("public.items", "--search", "name,note")
    with _running(env, spark_clean):
        reg = env.reg("public", "items")
        assert reg.schema_version == 1
        env.sql("ALTER TABLE items DROP COLUMN note")
        env.sql("UPDATE items SET qty = -1 WHERE id = 1")  # an UPDATE first: the catalog tells
        env.sql("INSERT INTO items VALUES (21, 'item 21', 21)")
        env.sql("UPDATE items SET name = 'renamed 2' WHERE id = 2")
        env.sql("DELETE FROM items WHERE id = 3")
        wait_caught_up(env)

    reg = env.reg("public", "items")
    assert [c.name for c in reg.columns] == ["id", "name", "qty"]
    assert reg.schema_version == 2 and reg.dropped_columns == ("note",)
    assert reg.search == ("name",)
    values = env.values(reg.topic)
    first = values[0]["source"]
    assert first["schema_version"] == 1 and "note" in values[0]["after"]
    after_drop = [v for v in values if v["after"] and v["after"].get("qty") == -1]
    (ev,) = after_drop
    assert ev["source"]["schema_version"] == 2 and "note" not in ev["after"] and ev["unavailable"] == []
    later = [v for v in values if v["source"]["commit_lsn"] >= ev["source"]["commit_lsn"]]
    assert len(later) >= 4 and all(v["source"]["schema_version"] == 2 for v in later if v)
    assert all("note" not in (v["after"] or v["before"]) for v in later if v)

    apply_clean(spark_clean, env.state)
    sink = WarehouseSink(env.state)
    current = {r["id"]: r for r in sink.current_rows(reg, meta=False).to_pylist()}
    assert current[1]["note"] is None and current[1]["qty"] == -1  # null from then on
    assert current[21]["note"] is None and current[2]["note"] is None
    assert current[4]["note"] == "note 4"  # rows not changed since keep their last value
    assert 3 not in current
    cur_path, hist_path, _ = sink.paths(reg)
    for path in (cur_path, hist_path):
        assert DeltaTable(str(path)).metadata().configuration[DROPPED_CONF] == "note"
    code, out = cdc_cli(env.dsn, env.state, "search", "public.items", "renamed", "--json")
    assert code == 0, out
    code, out = cdc_cli(env.dsn, env.state, "tables", "list", "--json")
    (listed,) = orjson.loads(out)
    assert listed["schema_version"] == 2 and listed["dropped_columns"] == ["note"]
    _verify_clean(env, "public.items")


def _dead_letters(env: CaptureEnv, topic: str) -> list[dict[str, Any]]:
    dlq = dead_letter_topic(Settings(state_dir=env.state).topic_prefix)  # the apply job's
    return [
        body
        for r in env.records(dlq)
        if r.value and (body := orjson.loads(r.value))["source"]["topic"] == topic
    ]


def test_type_changes_widen_safely_and_refuse_the_unsafe_one_per_record(
    env: CaptureEnv, spark_clean: Any
) -> None:
    env.sql(
        "CREATE TABLE items (id int PRIMARY KEY, qty int, price numeric(10,2), name varchar(10), code text)"
    )
    env.sql("INSERT INTO items SELECT g, g, g + 0.25, 'n' || g, (g * 10)::text FROM generate_series(1, 20) g")
    env.add_table("public.items")
    with _running(env, spark_clean):
        # safe: int -> bigint, numeric(10,2) -> numeric(20,4), varchar(10) -> text
        env.sql("ALTER TABLE items ALTER COLUMN qty TYPE bigint")
        env.sql("ALTER TABLE items ALTER COLUMN price TYPE numeric(20,4)")
        env.sql("ALTER TABLE items ALTER COLUMN name TYPE text")
        env.sql(
            "UPDATE items SET qty = 5000000000 + id, price = 1234567890123.4567, "
            "name = 'a name longer than ten' WHERE id <= 3"
        )
        env.sql("INSERT INTO items VALUES (21, -9000000000, 0.0001, 'new', '210')")
        wait_caught_up(env)
        reg = env.reg("public", "items")
        assert {c.name: c.type for c in reg.columns}["qty"] == "bigint" and reg.schema_version >= 2
        apply_clean(spark_clean, env.state)
        sink = WarehouseSink(env.state)
        current = {r["id"]: r for r in sink.current_rows(reg, meta=False).to_pylist()}
        assert current[1]["qty"] == 5000000001 and current[21]["qty"] == -9000000000
        assert str(current[2]["price"]) == "1234567890123.4567" and str(current[7]["price"]) == "7.2500"
        assert current[3]["name"] == "a name longer than ten"
        _verify_clean(env, "public.items")

        # unsafe: text -> int (the stored column holds text): refused per record, the others apply
        env.sql("ALTER TABLE items ALTER COLUMN code TYPE int USING code::int")
        env.sql("UPDATE items SET code = 77, qty = 1 WHERE id = 7")
        env.sql("UPDATE items SET code = NULL, qty = 2 WHERE id = 8")
        wait_caught_up(env)
    reg = env.reg("public", "items")
    summary = run_job(spark_clean, reader_env(env.state))
    assert summary.dead_letters == 1
    (letter,) = _dead_letters(env, reg.topic)
    assert "column code" in letter["reason"] and "re-snapshot" in letter["reason"], letter
    current = warehouse_rows(env, reg)
    assert current[7]["qty"] == 7 and current[7]["code"] == "70"  # the refused change did not apply
    assert current[8]["qty"] == 2 and current[8]["code"] is None  # a null value still applies
    # a second run does not loop on it
    again = run_job(spark_clean, reader_env(env.state))
    assert again.dead_letters == 0


def test_rename_column_is_followed_as_a_new_column_and_in_the_search_columns(
    env: CaptureEnv, spark_clean: Any
) -> None:
    env.sql("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)")
    env.sql("INSERT INTO items SELECT g, 'item ' || g, g FROM generate_series(1, 30) g")
    env.add_table("public.items", "--search", "name")
    with _running(env, spark_clean):
        env.sql("ALTER TABLE items RENAME COLUMN name TO title")
        env.sql("UPDATE items SET qty = -1 WHERE id = 1")  # an UPDATE first
        env.sql("INSERT INTO items VALUES (31, 'gadget 31', 31)")
        # the initial snapshot is not chunked: a chunked run that is done is the re-snapshot's
        wait_for(
            lambda: (p := progress(env, "items")) is not None and p.done,
            timeout=120,
            what="the rename followed and the table snapshotted again",
        )
        env.sql("UPDATE items SET title = 'renamed widget' WHERE id = 2")
        wait_caught_up(env)

    reg = env.reg("public", "items")
    assert [c.name for c in reg.columns] == ["id", "title", "qty"]
    assert reg.dropped_columns == ("name",) and reg.search == ("title",)
    assert reg.search_field("title") == "name"  # the index keeps its field
    assert "renamed at the source" in env.proc_log()

    apply_clean(spark_clean, env.state)
    current = warehouse_rows(env, reg)
    assert current[2]["title"] == "renamed widget" and current[1]["qty"] == -1
    assert current[20]["title"] == "item 20"  # the re-snapshot brought every row's value
    assert current[31]["title"] == "gadget 31"
    code, out = cdc_cli(env.dsn, env.state, "search", "public.items", "renamed", "--json")
    assert code == 0 and [h["key"] for h in orjson.loads(out)] == [{"id": 2}], out
    _verify_clean(env, "public.items")


def test_renames_told_by_the_ddl_recorder_end_to_end(env: CaptureEnv, spark_clean: Any) -> None:
    """The trigger variant of the rename test: two columns renamed before any row (the rows alone
    show two drops and two adds) are followed as renames, the warehouse gets every row's values
    under the new names, and `cdc verify` is clean."""
    env.sql("CREATE TABLE items (id int PRIMARY KEY, name text, note text, qty int)")
    env.sql("INSERT INTO items SELECT g, 'item ' || g, 'note ' || g, g FROM generate_series(1, 30) g")
    install_recorder(env)
    env.add_table("public.items", "--search", "name")
    with _running(env, spark_clean):
        rename_two_columns_then_write(env)

    reg = env.reg("public", "items")
    assert [c.name for c in reg.columns] == ["id", "title", "memo", "qty"]
    assert reg.dropped_columns == ("name", "note") and reg.search == ("title",)
    assert "told by the DDL recorder" in env.proc_log()

    apply_clean(spark_clean, env.state)
    current = warehouse_rows(env, reg)
    assert current[2]["title"] == "renamed widget" and current[1]["qty"] == -1
    assert current[20]["title"] == "item 20" and current[20]["memo"] == "note 20"
    assert current[31]["memo"] == "memo 31"
    code, out = cdc_cli(env.dsn, env.state, "search", "public.items", "renamed", "--json")
    assert code == 0 and [h["key"] for h in orjson.loads(out)] == [{"id": 2}], out
    _verify_clean(env, "public.items")
