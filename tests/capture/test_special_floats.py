"""float4/float8 NaN, Infinity, -Infinity and numeric NaN/+-Infinity are never null in events
(issue 9 item 9, capture side) -- within what the installed wal2json sends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.devcluster import PgCluster
from tests.capture.test_reader_support import CaptureEnv, make_env

pytestmark = [pytest.mark.postgres]

SPECIALS = ["NaN", "Infinity", "-Infinity"]


@pytest.fixture
def env(pg: PgCluster, pg_db: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CaptureEnv]:
    yield from make_env(pg, pg_db, tmp_path, "embedded", request)


def _afters(env: CaptureEnv) -> dict[tuple[str, int], dict[str, Any]]:
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for r in env.records(env.reg("public", "f").topic):
        if r.value:
            ev = orjson.loads(r.value)
            out[(ev["op"], ev["after"]["id"])] = ev["after"]
    return out


def test_special_float_and_numeric_values_in_snapshot_and_stream(env: CaptureEnv) -> None:
    env.sql(
        "CREATE TABLE f (id int PRIMARY KEY, r real, d double precision, n numeric, fa float8[], "
        "ra real[], na numeric[], plain double precision)"
    )
    insert = (
        "INSERT INTO f VALUES (%s, %s::real, %s::float8, %s::numeric, ARRAY[%s, 1.5, NULL]::float8[], "
        "ARRAY[%s]::real[], ARRAY[%s, '1.000000000000000000001']::numeric[], 0.1)"
    )
    for i, v in enumerate(SPECIALS, start=1):
        env.sql(insert, [i, v, v, v, v, v, v])  # snapshot rows 1..3
    env.add_table("public.f")
    env.run_once()
    for i, v in enumerate(SPECIALS, start=11):
        env.sql(insert, [i, v, v, v, v, v, v])  # streamed rows 11..13
    env.sql("UPDATE f SET d = 'NaN', plain = 'Infinity', fa = '{-Infinity}' WHERE id = 11")
    env.run_once()
    old_wal2json = "this wal2json (< 2.6) sends NaN/Infinity" in env.last_stderr
    got = _afters(env)
    for i, v in enumerate(SPECIALS, start=1):
        for op, row_id in (("r", i), ("c", i + 10)):
            after = got[(op, row_id)]
            # arrays are text in both paths: their elements keep the special values
            assert after["fa"] == [v, 1.5, None] and after["ra"] == [v]
            assert after["na"] == [v, "1.000000000000000000001"]
            assert after["plain"] == 0.1 and isinstance(after["plain"], float)
            if op == "c" and old_wal2json:
                assert after["r"] is None and after["d"] is None and after["n"] is None
            else:
                assert (after["r"], after["d"], after["n"]) == (v, v, v), (op, after)
    update = got[("u", 11)]
    assert update["fa"] == ["-Infinity"]
    if not old_wal2json:
        assert update["d"] == "NaN" and update["plain"] == "Infinity"
    else:  # wal2json 2.5 (Debian bookworm's): the loss is said, per table and column
        assert "public.f (r, d, n, plain)" in env.last_stderr
