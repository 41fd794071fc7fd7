"""Slot creation (cdc.catalog.create_logical_slot, snapshot.create_exported_slot): a persistent slot
is a failover slot where the server has them (PostgreSQL 17+), never where it has not (15), and a
temporary one never is (the server refuses a temporary failover slot)."""

from __future__ import annotations

import psycopg2
import psycopg2.extras
import pytest

from cdc.catalog import create_logical_slot, create_slot_command, slot_info
from cdc.codec.plugins import PGOUTPUT, WAL2JSON
from cdc.connect import connect
from cdc.events import int_to_lsn
from snapshot import create_exported_slot
from tests.plugins.postgres import PgCluster


def _failover(cluster: PgCluster, slot: str) -> list[tuple[object, ...]]:
    return cluster.fetch(
        f"SELECT failover, temporary, plugin FROM pg_replication_slots WHERE slot_name = '{slot}'"
    )


def test_command_names_failover_only_for_a_persistent_slot_on_17_and_later() -> None:
    cmd = create_slot_command("s", "pgoutput", temporary=False, server_version=180006)
    assert cmd == 'CREATE_REPLICATION_SLOT "s" LOGICAL "pgoutput" (FAILOVER true, SNAPSHOT \'export\')'
    assert "FAILOVER" not in create_slot_command("s", "pgoutput", temporary=True, server_version=180006)
    assert create_slot_command("s", "wal2json", temporary=False, server_version=150020) == (
        'CREATE_REPLICATION_SLOT "s" LOGICAL "wal2json" EXPORT_SNAPSHOT'
    )


@pytest.mark.parametrize("temporary", [False, True])
def test_exported_slot_on_18_is_a_failover_slot_unless_temporary(
    pg18: PgCluster, pg18_db: str, temporary: bool
) -> None:
    repl = psycopg2.connect(
        pg18.dsn(pg18_db), connection_factory=psycopg2.extras.LogicalReplicationConnection
    )
    try:
        snap = create_exported_slot(repl.cursor(), "exp18", temporary=temporary, plugin=PGOUTPUT)
        assert snap.name and snap.consistent_lsn > 0
        assert _failover(pg18, "exp18") == [(not temporary, temporary, "pgoutput")]
    finally:
        repl.close()
    if not temporary:
        pg18.execute("SELECT pg_drop_replication_slot('exp18')")


def test_exported_slot_on_15_has_no_failover(pg: PgCluster, pg_db: str) -> None:
    repl = psycopg2.connect(pg.dsn(pg_db), connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        snap = create_exported_slot(repl.cursor(), "exp15", temporary=False, plugin=WAL2JSON)
    finally:
        repl.close()
    assert snap.consistent_lsn > 0
    assert pg.fetch("SELECT plugin, temporary FROM pg_replication_slots WHERE slot_name = 'exp15'") == [
        ("wal2json", False)
    ]


def test_sql_slot_is_failover_on_18_and_plain_on_15(
    pg: PgCluster, pg_db: str, pg18: PgCluster, pg18_db: str
) -> None:
    with connect(pg18.dsn(pg18_db)) as conn:
        lsn = create_logical_slot(conn, "sql18", "pgoutput")
        assert slot_info(conn, "sql18").exists
    assert lsn > 0
    assert _failover(pg18, "sql18") == [(True, False, "pgoutput")]
    with connect(pg.dsn(pg_db)) as conn:
        lsn = create_logical_slot(conn, "sql15", "wal2json")
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'sql15'"
        )
        assert row.fetchone() == (int_to_lsn(lsn),)
    with connect(pg18.dsn(pg18_db)) as conn:
        create_logical_slot(conn, "sql18_plain", "pgoutput", failover=False)
    assert _failover(pg18, "sql18_plain") == [(False, False, "pgoutput")]
