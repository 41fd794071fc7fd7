"""Rows that real tables have: values of 1, 5 and 20 MB next to short ones, holding quotes, commas,
newlines, carriage returns, tabs and backslashes, in columns of many types. The initial snapshot and
a chunked one (through ``cdc run --once``) carry every value exactly."""

from __future__ import annotations

import random
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg.types.json import Jsonb

from cdc.devcluster import PgCluster
from tests.capture.test_reader_support import CaptureEnv, make_env, materialize

pytestmark = [pytest.mark.postgres]

MB = 1 << 20
UGLY = 'a"b,c\n\\d\r\te""\\\\,\n\r\n{}NULL é😀'

DDL = """
CREATE TYPE mood3 AS ENUM ('ok', 'a "quoted", label');
CREATE TABLE big (
  id integer PRIMARY KEY, e mood3, j jsonb, x xml, ta text[], b bytea, iv interval, ip inet,
  f double precision, n numeric, t text
)"""
COLUMNS = "id, e, j, x, ta, b, iv, ip, f, n, t"


@pytest.fixture
def env(pg: PgCluster, pg_db: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CaptureEnv]:
    yield from make_env(pg, pg_db, tmp_path, "embedded", request, "[snapshot]\nchunk_size = 7\n")


def _text(rnd: random.Random, size: int) -> str:
    """``size`` characters, mostly the awkward ones, never the same twice (a cut or a swap shows)."""
    pieces = []
    n = 0
    while n < size:
        piece = UGLY[rnd.randrange(len(UGLY)) :] + str(rnd.random())
        pieces.append(piece)
        n += len(piece)
    return "".join(pieces)[:size]


def _rows() -> list[tuple[Any, ...]]:
    rnd = random.Random(16)
    out: list[tuple[Any, ...]] = []
    big = {5: 1 * MB, 12: 20 * MB, 20: 5 * MB, 21: 1 * MB, 33: 5 * MB}
    for i in range(1, 41):
        size = big.get(i, rnd.choice([0, 1, 10, 200]))
        t = _text(rnd, size)
        small = _text(rnd, 12)
        out.append(
            (
                i,
                "ok" if i % 2 else 'a "quoted", label',
                Jsonb({"k": small, "n": [1, 2.5, None], "big": _text(rnd, MB) if i == 21 else ""}),
                "<a>" + small.replace("<", "").replace("&", "") + "</a>",
                [small, None, "", "NULL", '"', "a,b", "{x}"] + ([t[: MB // 2]] if i == 33 else []),
                rnd.randbytes(5 * MB if i == 20 else 20),
                f"{i} days {i % 24}:00:01.5",
                f"10.0.{i}.1/24",
                rnd.uniform(-1e300, 1e300) if i % 3 else 0.1,
                Decimal(f"{rnd.randrange(10**30)}.{i:09d}"),
                t if size or i % 4 else None,
            )
        )
    return out


def _source(env: CaptureEnv) -> dict[str, dict[str, Any]]:
    """Every row as the events encode it, read back from the source."""
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id, e::text, j::text, x::text, ta, b, iv::text, ip::text, f, n::text, t FROM big"
        ).fetchall()
    out = {}
    for id_, e, j, x, ta, b, iv, ip, f, n, t in rows:
        out[orjson.dumps({"id": id_}).decode()] = {
            "id": id_,
            "e": e,
            "j": j,
            "x": x,
            "ta": ta,
            "b": b.hex(),
            "iv": iv,
            "ip": ip,
            "f": f,
            "n": n,
            "t": t,
        }
    return out


def _check(env: CaptureEnv, want: dict[str, dict[str, Any]]) -> int:
    """The topic's rows equal the source's, value for value; returns the number of ``op=r`` events."""
    records = env.records(env.reg("public", "big").topic)
    got = materialize(records)
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        for col, value in row.items():
            assert got[key][col] == value, (key, col, str(got[key][col])[:80], str(value)[:80])
    return sum(1 for r in records if r.value and orjson.loads(r.value)["op"] == "r")


def test_rows_of_1_5_and_20_mb_snapshot_exactly_initial_and_chunked(env: CaptureEnv) -> None:
    env.sql(DDL)
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        for row in _rows():  # one by one, in id order: the COPY returns them in this order
            conn.execute(f"INSERT INTO big ({COLUMNS}) VALUES ({', '.join(['%s'] * 11)})", row)
    want = _source(env)
    assert max(len(r["t"] or "") for r in want.values()) == 20 * MB
    env.add_table("public.big")
    out = env.run_once()  # the initial snapshot
    assert out["snapshot_rows"].get("public.big") == len(want), out
    assert _check(env, want) == len(want)
    res = env.cdc("snapshot", "public.big")
    assert res.returncode == 0, res.stderr
    env.run_once()  # a chunked snapshot (7 rows a chunk) while streaming
    assert _check(env, want) == 2 * len(want)
