"""``cdc rebuild`` between runs of the real apply job (Spark): the live tables are the job's, a
corrupted current table is rebuilt from the topic, and the job goes on over the rebuilt table (its
history kept, its next changes applied to the current table, the history and the search index)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import orjson
from deltalake import DeltaTable

from cdc import paths
from cdc.cli import main as cdc_main
from sinks.warehouse import WarehouseSink
from tests.plugins.apply import reader_env, run_job
from tests.plugins.items import capture, item_row, items_table, source, verify_json
from tests.plugins.postgres import PgCluster


def test_the_apply_goes_on_over_a_rebuilt_table(
    spark_clean: Any, pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    dsn, reg = items_table(pg, pg_db, state)
    env = reader_env(state)
    capture(dsn, state)
    with source(dsn) as src:
        src.insert(*(item_row(i) for i in range(1, 31)))
        for i in range(1, 31, 4):
            src.update(i, {"name": f"renamed {i}"})
        src.delete(3)
    capture(dsn, state)
    assert run_job(spark_clean, env).dead_letters == 0
    current = paths.warehouse_tables(state, "public", "items")[0]
    DeltaTable(str(current)).delete("id = 5")
    assert verify_json(env.settings, dsn, "--wait", "0")[0] != 0
    history_path = paths.warehouse_tables(state, "public", "items")[1]
    history_before = (history_path.stat().st_ino, WarehouseSink(state).history_rows(reg).num_rows)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cdc_main(
            ["--source", dsn, "--state", str(state), "rebuild", "public.items", "--yes", "--json"]
        )
    report = orjson.loads(out.getvalue())
    assert code == 0 and report["status"] == "rebuilt", report
    assert verify_json(env.settings, dsn)[0] == 0
    assert (history_path.stat().st_ino, WarehouseSink(state).history_rows(reg).num_rows) == history_before

    with source(dsn) as src:
        src.update(5, {"name": "after the rebuild"})
        src.insert(item_row(40))
        src.delete(6)
    capture(dsn, state)
    assert run_job(spark_clean, env).dead_letters == 0
    code, reports = verify_json(env.settings, dsn)
    assert code == 0, reports
    history = WarehouseSink(state).history_rows(reg, meta=False).to_pylist()
    assert any(r["id"] == 5 and r["name"] == "after the rebuild" for r in history)
    assert any(r["id"] == 40 for r in history)
