"""A mixed workload made in a real Postgres table and captured by the real reader (`cdc run --once`),
applied by the Spark job to Delta and tantivy, then ``cdc verify`` against the source: clean; then
differences and a lagging pipeline are reported."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.cli import main as cdc_main
from cdc.logstore.factory import open_log_store
from sinks.warehouse import WarehouseSink
from tests.plugins.apply import Env, reader_env, run_job
from tests.plugins.changes import ChangeWriter, make_reg
from tests.plugins.items import (
    COLUMNS,
    DDL,
    PRICES,
    TS,
    capture,
    item_row,
    items_table,
    register,
    source,
    verify_json,
)
from tests.plugins.postgres import PgCluster


def test_mixed_workload_verifies_clean_then_differences_are_found(
    spark_clean: Any, pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    dsn, reg = items_table(pg, pg_db, state)
    env = reader_env(state)
    capture(dsn, state)  # the initial snapshot (empty): every change below is streamed
    with source(dsn) as src:
        src.insert(*(item_row(i) for i in range(1, 31)))
        src.truncate()  # everything above is gone
        src.insert(*(item_row(i) for i in range(1, 61)))
        capture(dsn, state)
        first = run_job(spark_clean, env, max_records=40)  # a first pass; the rest arrives later
        assert first.batches >= 2
        for i in range(1, 61, 4):
            src.update(i, {"name": f"widget {i} renamed", "price": PRICES[i % 3], "ts": TS[i % 5]})
        for i in range(2, 61, 9):
            # an unchanged TOASTed column: not sent, must keep the stored value
            src.update(i, {"qty": 1000 + i})
        for i in (3, 13, 23):
            src.delete(i)
        src.change_key(5, 505)
        src.change_key(6, 606)
        src.update(505, {"name": "moved key"})
        capture(dsn, state)

    summary = run_job(spark_clean, env, max_records=100)
    assert summary.dead_letters == 0 and summary.events > 0
    with open_log_store(env.settings, writer=False) as store:
        events = [
            orjson.loads(r.value)
            for p in sorted(store.end_offsets(reg.topic))
            for r in store.iter_partition(reg.topic, p)
            if r.value is not None
        ]
    # the updates of qty left the unchanged out-of-line blob out: the reader filled it in
    assert all(e["unavailable"] == [] for e in events)
    long_blob = [
        e
        for e in events
        if e["op"] == "u"
        and e["after"]["qty"] >= 1000
        and len(item_row(e["after"]["id"])["blob"] or "") > 2000
    ]
    assert long_blob and all(e["after"]["blob"] == item_row(e["after"]["id"])["blob"] for e in long_blob)

    code, reports = verify_json(env.settings, dsn)
    assert code == 0, reports
    (report,) = reports
    assert report["source_rows"] == 57 and report["warehouse_rows"] == 57 and report["search_docs"] == 57
    assert report["mode"] == "full" and report["ranges_checked"] == report["ranges"] > 1  # all, not 0
    assert report["missing"] == [] and report["extra"] == [] and report["different"] == []
    # numeric exactness survives the trip
    current = {r["id"]: r for r in WarehouseSink(state).current_rows(reg, meta=False).to_pylist()}
    assert str(current[1]["price"]) in {p for p in PRICES}
    assert current[2]["blob"] == item_row(2)["blob"] and current[2]["qty"] == 1002
    filled = {e["after"]["id"] for e in long_blob}
    assert all(current[i]["blob"] == item_row(i)["blob"] for i in filled), "a TOAST value was lost"

    # now make the source differ behind the pipeline's back: changes the slot skips (lost)
    pg.execute("UPDATE public.items SET price = price + 0.000001 WHERE id = 10", pg_db)
    pg.execute("UPDATE public.items SET name = 'tampered' WHERE id = 12", pg_db)
    pg.execute("DELETE FROM public.items WHERE id = 11", pg_db)
    pg.execute("INSERT INTO public.items (id, name) VALUES (999, 'never captured')", pg_db)
    pg.execute(f"SELECT pg_replication_slot_advance('{env.settings.slot_name}', pg_current_wal_lsn())", pg_db)
    # lost before the topic, with the row count unchanged: no topic names their ranges, so only the
    # scrub (off here) or a full verify reads those rows
    code, reports = verify_json(env.settings, dsn, "--scrub", "0")
    assert code == 0 and reports[0]["mode"] == "incremental" and reports[0]["ranges_checked"] == 0, reports
    assert reports[0]["checked_ranges"] == []
    code, reports = verify_json(env.settings, dsn, "--full")
    assert code == 1
    (report,) = reports
    assert report["status"] == "different"
    assert [d["key"] for d in report["different"]] == [{"id": 10}, {"id": 12}]
    assert set(report["different"][0]["columns"]) == {"price"}
    assert set(report["different"][1]["columns"]) == {"name"}
    assert report["different_count"] == 2
    assert [d["key"] for d in report["search"]["different"]] == [{"id": 12}]
    assert report["search"]["different"][0]["source"] == {"name": "tampered"}
    assert report["missing"] == [{"id": 999}] and report["extra"] == [{"id": 11}]
    assert report["search"]["missing"] == [{"id": 999}] and report["search"]["extra"] == [{"id": 11}]
    assert 0 < report["ranges_differing"] <= report["ranges"]


def test_verify_reports_not_caught_up_distinctly(
    spark_clean: Any, pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    dsn, reg = items_table(pg, pg_db, state)
    env = reader_env(state)
    with source(dsn) as src:
        src.insert(*(item_row(i) for i in range(1, 6)))
        capture(dsn, state)
        run_job(spark_clean, env)
        src.insert(item_row(6))
        capture(dsn, state)  # captured, not applied
    # no apply runs: nothing moves, so how long verify waits does not change its answer
    code, reports = verify_json(env.settings, dsn, "--wait", "0.5")
    assert code == 3
    assert reports[0]["status"] == "not_caught_up" and reports[0]["lag"]["apply"][reg.topic]
    out = io.StringIO()  # the same for people
    with contextlib.redirect_stdout(out):
        code = cdc_main(["--source", dsn, "--state", str(env.settings.state_dir), "verify", "--wait", "0.5"])
    assert code == 3
    assert "not caught up" in out.getvalue() and "public.items" in out.getvalue()


@pytest.mark.parametrize("backend", ["embedded"])
def test_toast_unavailable_in_the_same_batch_as_the_full_row(spark_clean: Any, env: Env) -> None:
    """Sink mechanics on synthetic events: an update without its unchanged TOAST value, in the same
    micro-batch as the insert that carried it, keeps the value."""
    reg = env.register(make_reg("s_toast", "items", COLUMNS, search=("name",)))
    w = ChangeWriter(env.store, reg)
    row = {
        "id": 1,
        "name": "first",
        "qty": 1,
        "price": "1.000000",
        "big": "2",
        "ts": TS[0],
        "doc": "{}",
        "flag": True,
        "blob": "big value",
    }
    with w.txn():
        w.insert(row)
    with w.txn():
        w.update(dict(row, qty=2), unavailable=("blob",))
    run_job(spark_clean, env)  # one micro-batch holds both
    (stored,) = WarehouseSink(env.state).current_rows(reg, meta=False).to_pylist()
    assert stored["blob"] == "big value" and stored["qty"] == 2


@contextlib.contextmanager
def _slot_held_behind(dsn: str, slot: str) -> Any:
    """A logical slot streamed by a connection that never confirms: active (so verify cannot peek it)
    and behind every later WAL position, as while the reader's feedback is still on its way."""
    import psycopg2
    import psycopg2.extras

    conn = psycopg2.connect(dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        cur = conn.cursor()  # the reader's slot (`cdc run` made it)
        cur.start_replication(slot_name=slot, decode=False, options={"format-version": "2"})
        yield
    finally:
        conn.close()


def test_verify_of_equal_tables_does_not_wait_for_the_pipeline(
    spark_clean: Any, pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    """Equal tables are the source's state at the consistent point whatever the positions say, so
    verify answers at once, even with the slot behind that point and active (verify used to wait for
    the slot, per table, for as long as --wait: 10 s a table on an idle pipeline). A difference is
    still judged against the positions: with the slot behind, it is "not caught up"."""
    import time

    pg.execute(DDL, pg_db)
    pg.execute("CREATE TABLE public.others (LIKE public.items INCLUDING ALL)", pg_db)
    dsn = pg.dsn(pg_db)
    state = tmp_path / "state"
    env = reader_env(state)
    for table in ("items", "others"):
        register(dsn, state, f"public.{table}")
        with source(dsn, table) as src:
            src.insert(*(item_row(i) for i in range(1, 21)))
    capture(dsn, state)
    run_job(spark_clean, env)
    with _slot_held_behind(dsn, env.settings.slot_name):
        pg.execute("CREATE TABLE public.unrelated (x int); INSERT INTO public.unrelated VALUES (1)", pg_db)
        # the slot never moves while held: a verify that waited for it would answer only once its
        # --wait ran out, so answering before then is the proof (not a speed bound: 300 s is far
        # from the few seconds verify takes, however loaded the machine)
        t0 = time.monotonic()
        code, reports = verify_json(env.settings, dsn, "--wait", "300")
        took = time.monotonic() - t0
        assert code == 0, reports
        assert [(r["table"], r["status"], r["source_rows"]) for r in reports] == [
            ("public.items", "ok", 20),
            ("public.others", "ok", 20),
        ]
        assert took < 300, (
            f"verify of equal tables took {took:.1f} s, its whole --wait: it waited for the slot"
        )
        assert len({r["consistent_lsn"] for r in reports}) == 1  # one point for every table

        pg.execute("UPDATE public.others SET qty = -1 WHERE id = 3", pg_db)  # behind the pipeline's back
        code, reports = verify_json(env.settings, dsn, "--wait", "0.5")  # the slot is held
        assert code == 3, reports
        by_table = {r["table"]: r for r in reports}
        assert by_table["public.items"]["status"] == "ok"
        assert by_table["public.others"]["status"] == "not_caught_up"
        assert by_table["public.others"]["lag"]["slot"]["slot"] == env.settings.slot_name
