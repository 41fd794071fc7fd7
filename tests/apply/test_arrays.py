"""Arrays of any number of dimensions, through the real path: Postgres -> `cdc run --once` -> the
embedded log store -> the Spark apply job -> Delta -> `cdc verify`. A 2-D (or 3-D) value is stored
(its elements in row-major order, docs/warehouse.md "Types"), never a dead letter, so the row's
other columns never go stale."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson

from cdc.config import Settings
from cdc.registry import Registry
from sinks.warehouse import WarehouseSink
from tests.plugins.apply import Env, cdc_cli, run_job
from tests.plugins.postgres import PgCluster


def test_a_multi_dimensional_array_is_stored_and_the_row_never_goes_stale(
    spark_clean: Any, pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    dsn = pg.dsn(pg_db)
    state = tmp_path / "state"
    pg.execute(
        "CREATE TABLE public.grid (id integer PRIMARY KEY, name text, m integer[], t text[], n numeric(6,2)[])",
        pg_db,
    )
    # snapshot rows: one already 2-D (read by the snapshot's COPY path)
    pg.execute(
        "INSERT INTO public.grid VALUES (1, 'one', '{1,2}', '{a}', '{1.50}'), "
        "(2, 'two', '{{1,2},{3,4}}', '{{\"a,b\",NULL},{\"q\\\"x\",\"\"}}', '{{1.25},{NULL}}'), "
        "(3, 'three', NULL, NULL, NULL)",
        pg_db,
    )
    assert cdc_cli(dsn, state, "tables", "add", "public.grid")[0] == 0
    code, out = cdc_cli(dsn, state, "run", "--once")
    assert code == 0, out
    # streamed: an UPDATE that sets a 2-D value with another column, a 3-D insert, back to 1-D
    for stmt in [
        "UPDATE public.grid SET name = 'one changed', m = '{{5,6},{7,8}}', n = '{{2.00,3.00}}' WHERE id = 1",
        "INSERT INTO public.grid VALUES (4, 'cube', '{{{1,2},{3,4}},{{5,6},{7,NULL}}}', '{{x}}', NULL)",
        "UPDATE public.grid SET name = 'two changed', m = '{9}' WHERE id = 2",
        "UPDATE public.grid SET m = '[0:1][1:2]={{10,20},{30,40}}' WHERE id = 3",
    ]:
        pg.execute(stmt, pg_db)
    code, out = cdc_cli(dsn, state, "run", "--once")
    assert code == 0, out

    settings = Settings(state_dir=state, source=None)
    with Registry(state) as reg_db:
        reg = reg_db.find("public.grid")
    summary = run_job(spark_clean, Env(settings, None, None), max_records=3)  # type: ignore[arg-type]
    assert summary.dead_letters == 0
    rows = {r["id"]: r for r in WarehouseSink(state).current_rows(reg, meta=False).to_pylist()}
    assert rows[1] == {
        "id": 1,
        "name": "one changed",
        "m": [5, 6, 7, 8],
        "t": ["a"],
        "n": [Decimal("2.00"), Decimal("3.00")],
    }
    assert rows[2] == {
        "id": 2,
        "name": "two changed",
        "m": [9],
        "t": ["a,b", None, 'q"x', ""],
        "n": [Decimal("1.25"), None],
    }
    assert rows[3]["m"] == [10, 20, 30, 40]
    assert rows[4]["m"] == [1, 2, 3, 4, 5, 6, 7, None] and rows[4]["t"] == ["x"]
    code, out = cdc_cli(dsn, state, "verify", "--json", "--wait", "30")
    reports = orjson.loads(out)
    assert code == 0, reports
    assert reports[0]["source_rows"] == 4 and reports[0]["warehouse_rows"] == 4
