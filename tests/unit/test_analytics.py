"""`cdc sql`'s DuckDB connection prints nothing of its own on stdout."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from cdc.cli.output import print_json
from cdc.cli.query.analytics import Warehouse, rows_of


def test_a_slow_query_prints_no_progress_bar_after_the_json(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # DuckDB draws its bar after 2 s on stdout, pipe or not; 1 ms makes a quarter-second query slow
    with Warehouse(tmp_path, []) as wh:
        wh.con.execute("SET progress_bar_time = 1")  # also turns the bar back on
        result = wh.query("SELECT sum(hash(a)) AS s FROM range(30000000) t(a)")
    print_json(rows_of(result))
    out = capfd.readouterr().out
    assert len(orjson.loads(out)) == 1, out[:200]
