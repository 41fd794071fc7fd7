"""The real path: Postgres -> `cdc run --once` (each decoder: wal2json, pgoutput) -> embedded log store -> the Spark apply
job -> Delta + tantivy -> `cdc verify` clean. Covers snapshot rows, inserts, updates, deletes, a primary-key
change, TRUNCATE, an unchanged out-of-line TOAST value and numeric edge values."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.registry import Registry
from sinks.warehouse import WarehouseSink
from tests.plugins.apply import cdc_cli, reader_env, run_job
from tests.plugins.postgres import PgCluster


@pytest.mark.parametrize("plugin", ["wal2json", "pgoutput"])
def test_captured_changes_applied_by_spark_verify_clean(
    plugin: str, spark_clean: Any, pg: PgCluster, pg_db: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_DECODER", plugin)
    dsn = pg.dsn(pg_db)
    state = tmp_path / "state"
    pg.execute(
        "CREATE TABLE public.items (id bigint PRIMARY KEY, name text, qty integer, price numeric(20,6),"
        " big numeric, ts timestamptz, doc jsonb, blob text)",
        pg_db,
    )
    pg.execute(
        "INSERT INTO public.items SELECT g, 'snapshot item ' || g, g, g * 1.5, g::numeric / 7, "
        "'2026-01-01 00:00:00+00'::timestamptz + g * interval '1 second', jsonb_build_object('g', g), NULL "
        "FROM generate_series(1, 50) g",
        pg_db,
    )
    code, out = cdc_cli(dsn, state, "tables", "add", "public.items", "--search", "name")
    assert code == 0, out
    code, out = cdc_cli(dsn, state, "run", "--once")
    assert code == 0, out

    # changes after the snapshot
    toast = os.urandom(12_000).hex()  # incompressible: stored out of line
    for stmt in [
        "INSERT INTO public.items VALUES (101, 'streamed', 1, 0.000001, 'NaN', '2024-02-29 23:59:59.999999+00', "
        "'{\"a\": [1, 2]}', NULL)",
        "INSERT INTO public.items VALUES (102, 'edge', 2, 99999999999999.999999, "
        "123456789012345678901234567890.123456789012345678901234567890, 'infinity', '{}', NULL)",
        f"UPDATE public.items SET blob = '{toast}' WHERE id = 7",
        "UPDATE public.items SET qty = qty + 1000 WHERE id = 7",  # blob unchanged: not sent
        "UPDATE public.items SET name = 'renamed ' || id, price = -price WHERE id % 5 = 0",
        "DELETE FROM public.items WHERE id IN (3, 4)",
        "UPDATE public.items SET id = 1001 WHERE id = 9",
        "BEGIN; TRUNCATE public.items; INSERT INTO public.items SELECT * FROM (VALUES (1, 'after truncate', 1, "
        "1.000001, 2::numeric, now(), '[1]'::jsonb, NULL)) v; COMMIT",
    ]:
        pg.execute(stmt, pg_db)
    # the rows before the truncate were captured too; bring some back so the tables are not trivial
    pg.execute(
        "INSERT INTO public.items SELECT g, 'again ' || g, g, g / 3.0, g, now(), '{}', NULL "
        "FROM generate_series(2, 40) g",
        pg_db,
    )
    pg.execute(f"UPDATE public.items SET blob = '{toast}' WHERE id = 8", pg_db)
    pg.execute("UPDATE public.items SET name = 'toast kept' WHERE id = 8", pg_db)
    code, out = cdc_cli(dsn, state, "run", "--once")
    assert code == 0, out

    with Registry(state) as reg_db:
        reg = reg_db.find("public.items")
    summary = run_job(spark_clean, reader_env(state), max_records=60)
    assert summary.dead_letters == 0
    assert summary.batches >= 2

    # WAL after the last capture that does not concern the table: the reader is not running, so the slot
    # stays behind pg_current_wal_lsn(); verify must see that nothing of public.items is pending
    pg.execute("CREATE TABLE public.unrelated (x int); INSERT INTO public.unrelated VALUES (1)", pg_db)
    code, out = cdc_cli(dsn, state, "verify", "--json", "--wait", "30")
    reports = orjson.loads(out)
    assert code == 0, (reports[0]["lag"], reports[0]["consistent_lsn"])
    assert (
        reports[0]["source_rows"] == 40
        and reports[0]["warehouse_rows"] == 40
        and reports[0]["search_docs"] == 40
    )
    rows = {r["id"]: r for r in WarehouseSink(state).current_rows(reg, meta=False).to_pylist()}
    assert rows[8]["blob"] == toast and rows[8]["name"] == "toast kept"

    # a change the reader has not captured yet: "not caught up" (exit 3), not "different"
    pg.execute("UPDATE public.items SET qty = 0 WHERE id = 2", pg_db)
    code, out = cdc_cli(dsn, state, "verify", "--json", "--wait", "0.5")  # no reader runs
    reports = orjson.loads(out)
    assert code == 3 and reports[0]["status"] == "not_caught_up"
    assert reports[0]["lag"]["slot"]["pending_changes"] == 1
