"""``cdc verify`` on a table with ``char(n)`` columns (issue 9 item 8): the real pipeline (reader,
Spark apply) then verify must be clean (it reported every row different: the source side was read
without the blank padding the events and the warehouse carry). The apply runs once in this process on
the session's Spark (a JVM of its own for 21 rows cost 30-50 s); `cdc verify` is its own process."""

from __future__ import annotations

from typing import Any

import pytest

from tests.plugins.apply import apply_once
from tests.plugins.capture import CaptureEnv

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow]


def test_verify_is_clean_on_char_columns(env: CaptureEnv, spark: Any) -> None:
    env.sql("CREATE TABLE c (id char(4) PRIMARY KEY, code char(8), one character, arr char(3)[], v text)")
    env.sql(
        "INSERT INTO c SELECT lpad(g::text, 2), 'ab', 'x', ARRAY['a', 'bb', NULL]::char(3)[], 'row ' || g "
        "FROM generate_series(1, 20) g"
    )
    env.sql("INSERT INTO c VALUES ('n', NULL, NULL, NULL, NULL)")
    env.add_table("public.c")
    env.run_once()
    env.sql("UPDATE c SET code = 'zz' WHERE id = ' 3'")
    env.run_once()
    assert apply_once(spark, env).records > 0
    code, (report,) = env.verify(timeout=300)
    assert code == 0, report
    assert report["different"] == [] and report["source_rows"] == 21 and report["warehouse_rows"] == 21
