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


def test_pg18_cluster_is_logical_decodes_pgoutput_and_has_no_wal2json(pg18: PgCluster, pg18_db: str) -> None:
    assert pg18.fetch("SHOW server_version_num")[0][0].startswith("18")
    assert pg18.fetch("SHOW wal_level", pg18_db) == [("logical",)]
    assert pg18.fetch("SHOW output_plugin_libraries") == [("pgoutput, test_decoding",)]
    pg18.execute("CREATE TABLE t (id int PRIMARY KEY, v text)", pg18_db)
    pg18.execute("CREATE PUBLICATION p FOR TABLE t", pg18_db)
    pg18.execute("SELECT pg_create_logical_replication_slot('fixture_probe18', 'pgoutput')", pg18_db)
    pg18.execute("INSERT INTO t VALUES (2, 'quote '' and\nnewline')", pg18_db)
    rows = pg18.fetch(
        "SELECT data FROM pg_logical_slot_get_binary_changes('fixture_probe18', NULL, NULL, "
        "'proto_version', '1', 'publication_names', 'p')",
        pg18_db,
    )
    # B(egin), R(elation), I(nsert), C(ommit); the insert carries the text value
    kinds = [bytes(r[0])[:1] for r in rows]
    assert kinds == [b"B", b"R", b"I", b"C"], kinds
    assert b"quote ' and\nnewline" in bytes(rows[2][0])
