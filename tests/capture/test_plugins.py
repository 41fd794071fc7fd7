"""The output plugins' facts (:mod:`cdc.codec.plugins`): each plugin's peek of an inactive slot counts
the changes it holds before a position and finds the oldest one's commit time, against a real
Postgres; no caller outside the module compares plugin names."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from cdc.catalog import create_logical_slot
from cdc.codec.plugins import PGOUTPUT, PLUGINS, WAL2JSON, OutputPlugin, plugin
from cdc.devcluster import PgCluster
from cdc.events import lsn_to_int
from cdc.registry import TableReg
from tests.plugins.postgres import fresh_database

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def db(pg: PgCluster) -> Iterator[str]:
    yield from fresh_database(pg)


def _reg(table: str) -> TableReg:
    return TableReg(schema="public", table=table, topic=f"cdc.public.{table}", key=("id",))


@pytest.mark.parametrize("which", [WAL2JSON, PGOUTPUT], ids=lambda p: p.name)
def test_peek_counts_what_the_slot_holds_and_the_oldest_commit(
    which: OutputPlugin, pg: PgCluster, db: str
) -> None:
    with psycopg.connect(pg.dsn(db), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        conn.execute("CREATE TABLE other (id int PRIMARY KEY)")
        conn.execute("CREATE PUBLICATION cdc_pub FOR TABLE t")
        create_logical_slot(conn, "cdc_peek", which.name)
        first = time.time()
        with conn.transaction():
            conn.execute("INSERT INTO t VALUES (1, 'it''s'), (2, 'new\nline')")
            conn.execute("UPDATE t SET v = 'x' WHERE id = 1")
        conn.execute("INSERT INTO other VALUES (1)")  # neither listed nor published
        conn.execute("DELETE FROM t WHERE id = 2")
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        upto = lsn_to_int(str(row[0]))
        pending = which.peek(conn, "cdc_peek", upto, [_reg("t")], "cdc_pub")
        assert pending.changes == 4
        assert pending.oldest_ms is not None and abs(pending.oldest_ms / 1000 - first) < 30
        again = which.peek(conn, "cdc_peek", upto, [_reg("t")], "cdc_pub")
        assert again == pending  # a peek consumes nothing
        conn.execute("SELECT pg_drop_replication_slot('cdc_peek')")


def test_each_plugin_is_known_by_its_name_and_unknown_names_are_refused() -> None:
    assert PLUGINS == {"wal2json": WAL2JSON, "pgoutput": PGOUTPUT}
    assert plugin("pgoutput") is PGOUTPUT
    assert PGOUTPUT.describe("pub") == "pgoutput (publication pub)" and WAL2JSON.describe("pub") == "wal2json"
    with pytest.raises(ValueError, match="test_decoding"):
        plugin("test_decoding")


def test_no_plugin_name_is_compared_outside_the_codec() -> None:
    """Every difference between the plugins is an attribute of :class:`OutputPlugin`."""
    found = subprocess.run(
        [
            "grep",
            "-rnE",
            "--include=*.py",
            r"""[=!]= *["'](wal2json|pgoutput)["']|["'](wal2json|pgoutput)["'] *[=!]=""",
            "cdc",
            "snapshot",
            "sinks",
            "spark_jobs",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    assert [line for line in found.splitlines() if not re.match(r"cdc/codec/", line)] == []


def test_wal2json_peek_finds_a_table_whose_name_holds_a_quote(pg: PgCluster, db: str) -> None:
    """wal2json's ``add-tables`` escaping (one helper, :func:`cdc.codec.wal2json.add_tables_option`)
    keeps a name with ``'``, space, comma and dot whole; no table listed peeks nothing."""
    with psycopg.connect(pg.dsn(db), autocommit=True) as conn:
        conn.execute("""CREATE SCHEMA "o'k" """)
        conn.execute("""CREATE TABLE "o'k"."it's, a.b" (id int PRIMARY KEY)""")
        conn.execute("CREATE TABLE it (id int PRIMARY KEY)")
        create_logical_slot(conn, "cdc_quote", WAL2JSON.name)
        conn.execute("""INSERT INTO "o'k"."it's, a.b" VALUES (1), (2)""")
        conn.execute("INSERT INTO it VALUES (1)")
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        upto = lsn_to_int(str(row[0]))
        quoted = TableReg(schema="o'k", table="it's, a.b", topic="cdc.ok.it", key=("id",))
        assert WAL2JSON.peek(conn, "cdc_quote", upto, [quoted], "").changes == 2
        assert WAL2JSON.peek(conn, "cdc_quote", upto, [], "").changes == 0
        conn.execute("SELECT pg_drop_replication_slot('cdc_quote')")
