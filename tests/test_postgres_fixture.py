"""The private cluster is what every capture test relies on: logical WAL and wal2json."""

from tests.plugins.postgres import PgCluster


def test_cluster_is_logical_and_has_wal2json(pg: PgCluster, pg_db: str) -> None:
    assert pg.fetch("SHOW wal_level", pg_db) == [("logical",)]
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)", pg_db)
    pg.execute("SELECT pg_create_logical_replication_slot('fixture_probe', 'wal2json')", pg_db)
    pg.execute("INSERT INTO t VALUES (2, 'y')", pg_db)
    rows = pg.fetch(
        "SELECT data FROM pg_logical_slot_get_changes('fixture_probe', NULL, NULL, 'format-version', '2')",
        pg_db,
    )
    assert any('"action":"I"' in str(r[0]) and '"value":2' in str(r[0]) for r in rows), rows
