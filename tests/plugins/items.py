"""The workloads of the apply tests on a real source table: ``public.items`` (:data:`DDL`, edge
values in :func:`item_row`) changed through :func:`source`, registered and captured by the real
reader (:func:`register`, :func:`capture`) and checked with ``cdc verify`` (:func:`verify_json`); and
the poison workload's columns and good rows (:data:`POISON_COLUMNS`, :func:`good_row`)."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from cdc.config import Settings
from cdc.devcluster import PgCluster
from cdc.registry import Registry, TableReg
from tests.plugins.apply import cdc_cli

COLUMNS = [
    ("id", "bigint"),
    ("name", "text"),
    ("qty", "integer"),
    ("price", "numeric(20,6)"),
    ("big", "numeric"),
    ("ts", "timestamp with time zone"),
    ("doc", "jsonb"),
    ("flag", "boolean"),
    ("blob", "text"),
]
DDL = """CREATE TABLE public.items (id bigint PRIMARY KEY, name text, qty integer, price numeric(20,6),
 big numeric, ts timestamptz, doc jsonb, flag boolean, blob text)"""
# no NaN here: numeric(20,6) cannot hold one (tests/apply/test_poison.py dead-letters it)
PRICES = ["0.000001", "99999999999999.999999", "-99999999999999.999999", "0", "-0.000001", "12.5"]
BIGS = [
    "123456789012345678901234567890.123456789012345678901234567890",
    "Infinity",
    "-Infinity",
    "1e-30",
    "NaN",
]
TS = [
    "2024-02-29 23:59:59.999999+00",
    "1970-01-01 00:00:00+00",
    "infinity",
    "-infinity",
    "2026-11-22 03:00:00.5+05:30",
]


def _toast(i: int) -> str:
    """A value stored out of line (24 kB, incompressible): an UPDATE that leaves it unchanged does
    not send it."""
    return random.Random(i).randbytes(12_000).hex()


def item_row(i: int, gen: int = 0) -> dict[str, Any]:
    """Row ``i`` of the workload: numeric, timestamp and jsonb edge values; every ninth row from
    row 2 holds a value stored out of line, every fourth none."""
    return {
        "id": i,
        "name": f"widget {i} generation {gen}",
        "qty": i * 7 + gen,
        "price": PRICES[(i + gen) % len(PRICES)],
        "big": BIGS[(i + gen) % len(BIGS)],
        "ts": TS[(i + gen) % len(TS)],
        "doc": Jsonb({"i": i, "tags": ["a", "b"], "n": 1.5, "gen": gen}),
        "flag": (i + gen) % 2 == 0,
        "blob": None if i % 4 == 0 else f"blob-{i}-" + (_toast(i) if i % 9 == 2 else "x" * (i % 5)),
    }


class Source:
    """Changes made to a table of the source database (``cdc run`` captures them)."""

    def __init__(self, dsn: str, table: str = "items") -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.ident = sql.Identifier("public", table)

    def close(self) -> None:
        self.conn.close()

    def insert(self, *rows: dict[str, Any]) -> None:
        """One transaction per row."""
        for row in rows:
            self.conn.execute(
                sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                    self.ident,
                    sql.SQL(", ").join(map(sql.Identifier, row)),
                    sql.SQL(", ").join(sql.Placeholder() * len(row)),
                ),
                list(row.values()),
            )

    def update(self, key: int, changes: dict[str, Any]) -> None:
        sets = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in changes)
        self.conn.execute(
            sql.SQL("UPDATE {} SET {} WHERE id = %s").format(self.ident, sets), [*changes.values(), key]
        )

    def delete(self, key: int) -> None:
        self.conn.execute(sql.SQL("DELETE FROM {} WHERE id = %s").format(self.ident), [key])

    def change_key(self, old: int, new: int) -> None:
        self.conn.execute(sql.SQL("UPDATE {} SET id = %s WHERE id = %s").format(self.ident), [new, old])

    def truncate(self) -> None:
        self.conn.execute(sql.SQL("TRUNCATE {}").format(self.ident))


@contextlib.contextmanager
def source(dsn: str, table: str = "items") -> Iterator[Source]:
    src = Source(dsn, table)
    try:
        yield src
    finally:
        src.close()


def register(dsn: str, state: Path, table: str = "public.items") -> TableReg:
    """``cdc tables add TABLE --search name``: its registration."""
    code, out = cdc_cli(dsn, state, "tables", "add", table, "--search", "name")
    assert code == 0, out
    with Registry(state) as r:
        return r.find(table)


def items_table(pg: PgCluster, db: str, state: Path) -> tuple[str, TableReg]:
    """``public.items`` created in ``db`` and registered in ``state``: (the DSN, its registration)."""
    pg.execute(DDL, db)
    dsn = pg.dsn(db)
    return dsn, register(dsn, state)


def capture(dsn: str, state: Path) -> None:
    """``cdc run --once``: the real reader snapshots new tables, then streams the changes so far
    into the log store."""
    code, out = cdc_cli(dsn, state, "run", "--once")
    assert code == 0, out


def verify_json(settings: Settings, dsn: str, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    """``cdc verify --json EXTRA...`` in this process: (exit code, the report)."""
    code, out = cdc_cli(dsn, Path(settings.state_dir), "verify", "--json", *extra)
    return code, orjson.loads(out)


POISON_COLUMNS = [
    ("id", "bigint"),
    ("name", "text"),
    ("born", "date"),
    ("seen", "timestamp with time zone"),
    ("amount", "numeric(10,2)"),
]


def good_row(i: int, gen: int = 0) -> dict[str, Any]:
    return {
        "id": i,
        "name": f"widget {i} v{gen}",
        "born": "2020-02-29",
        "seen": "2026-01-01 10:00:00+00",
        "amount": f"{i}.{gen:02d}",
    }
