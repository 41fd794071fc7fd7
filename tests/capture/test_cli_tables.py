"""`cdc tables add|list|remove` against the real Postgres cluster."""

import json
from pathlib import Path

import pytest

from cdc.registry import Alignment, Registry
from tests.plugins.cli import Run
from tests.plugins.postgres import PgCluster


@pytest.fixture
def cdc(pg: PgCluster, pg_db: str, cdc_main: Run) -> Run:
    """``cdc ARGS`` in-process, by default on the test's database."""
    return lambda *argv, source=None: cdc_main(*argv, source=source or pg.dsn(pg_db))


def sql(pg: PgCluster, db: str, *statements: str) -> None:
    for s in statements:
        pg.execute(s, db)


def test_add_list_remove_round_trip_with_quoted_names(
    cdc: Run, pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    sql(
        pg,
        pg_db,
        'CREATE SCHEMA "Mixed Case"',
        'CREATE TABLE "Mixed Case"."tab le" ("Id" int PRIMARY KEY, body text, secret text, n numeric(10,2) NOT NULL)',
        "CREATE TABLE public.orders (id bigint PRIMARY KEY, note text)",
    )
    code, out, err = cdc("tables", "add", '"Mixed Case"."tab le"', "--search", "body", "--exclude", "secret")
    assert code == 0, err
    assert "cdc.Mixed_Case.tab_le" in out
    code, out, err = cdc("tables", "add", "ORDERS", "--json")  # unquoted folds to lower case
    assert code == 0, err
    assert json.loads(out)["table"] == "public.orders"

    code, out, _ = cdc("tables", "list", "--json")
    assert code == 0
    listed = json.loads(out)
    assert [t["table"] for t in listed] == ["Mixed Case.tab le", "public.orders"]
    mixed = listed[0]
    state = tmp_path / "state"
    assert mixed == {
        "table": "Mixed Case.tab le",
        "schema": "Mixed Case",
        "name": "tab le",
        "topic": "cdc.Mixed_Case.tab_le",
        "key": ["Id"],
        "search": ["body"],
        "exclude": ["secret"],
        "columns": [
            {"name": "Id", "type": "integer", "nullable": False},
            {"name": "body", "type": "text", "nullable": True},
            {"name": "secret", "type": "text", "nullable": True},
            {"name": "n", "type": "numeric(10,2)", "nullable": False},
        ],
        "schema_version": 1,
        "dropped_columns": [],
        "snapshot": {"state": "pending", "consistent_lsn": None, "end_offsets": None},
        "warehouse": {
            "current": str(state / "warehouse" / "Mixed_Case" / "tab_le"),
            "history": str(state / "warehouse" / "Mixed_Case" / "tab_le__history"),
        },
        "search_index": str(state / "search" / "cdc.Mixed_Case.tab_le"),
        "search_shards": None,  # the index is created (with its shards) by its first apply
        "decoder": "wal2json",  # the configured one until a slot records its own
    }
    assert listed[1]["search_index"] is None and listed[1]["search_shards"] is None
    assert listed[1]["key"] == ["id"]

    with Registry(state) as r:  # the snapshot side records its alignment; list shows it
        r.set_snapshot_state("public", "orders", "done", Alignment(0x1_0000_00A0, {0: 3, 1: 0}))
    code, out, _ = cdc("tables", "list", "--json")
    assert json.loads(out)[1]["snapshot"] == {
        "state": "done",
        "consistent_lsn": "1/A0",
        "end_offsets": {"0": 3, "1": 0},
    }
    code, out, _ = cdc("tables", "list")
    assert code == 0 and "1/A0" in out and '"Mixed Case"."tab le"' in out and "pending" in out

    code, out, err = cdc("tables", "add", '"Mixed Case"."tab le"')
    assert code == 1 and "already registered" in err and "cdc tables remove" in err

    code, out, err = cdc("tables", "remove", '"Mixed Case"."tab le"')
    assert code == 0, err
    assert "topic cdc.Mixed_Case.tab_le" in out and "kept" in out
    code, out, _ = cdc("tables", "list", "--json")
    assert [t["table"] for t in json.loads(out)] == ["public.orders"]
    code, out, err = cdc("tables", "remove", '"Mixed Case"."tab le"', "--json")
    assert code == 1 and json.loads(err)["error"] == "RegistryError"
    # the source table is untouched
    assert pg.fetch('SELECT count(*) FROM "Mixed Case"."tab le"', pg_db) == [(0,)]


@pytest.mark.parametrize(
    "setup,argv,message,fix",
    [
        ([], ["public.nope"], "does not exist", "quote"),
        (
            ["CREATE TABLE t (id int PRIMARY KEY)", "CREATE VIEW v AS SELECT * FROM t"],
            ["v"],
            "is a view",
            "table",
        ),
        (
            ["CREATE TABLE t (id int PRIMARY KEY)", "CREATE MATERIALIZED VIEW mv AS SELECT * FROM t"],
            ["mv"],
            "materialized view",
            "table",
        ),
        (["CREATE TABLE nopk (a int, b text)"], ["nopk"], "no primary key", "REPLICA IDENTITY FULL"),
        (
            ["CREATE TABLE nopk (a int, b text)"],
            ["nopk", "--key", "a"],
            "not carried by the replica identity",
            "ALTER TABLE public.nopk REPLICA IDENTITY FULL",
        ),
        (
            ["CREATE TABLE pk (id int PRIMARY KEY, email text)"],
            ["pk", "--key", "email"],
            "not carried by the replica identity",
            "without --key",
        ),
        (
            ["CREATE TABLE t (id int PRIMARY KEY, b text)"],
            ["t", "--key", "nocol"],
            "has no column 'nocol'",
            "id, b",
        ),
        (
            ["CREATE TABLE t (id int PRIMARY KEY, b text)"],
            ["t", "--search", "zz"],
            "has no column 'zz'",
            "id, b",
        ),
        (
            ['CREATE TABLE t (id int PRIMARY KEY, "Body" text)'],
            ["t", "--exclude", "body"],
            "has no column 'body'",
            'write it as "Body"',
        ),
        (
            ["CREATE TABLE t (id int PRIMARY KEY, b text)"],
            ["t", "--exclude", "id"],
            "key column",
            "--exclude",
        ),
        (
            ["CREATE TABLE t (id int PRIMARY KEY, b text)"],
            ["t", "--search", "b", "--exclude", "b"],
            "both name",
            "--search",
        ),
        (['CREATE TABLE "Orders" (id int PRIMARY KEY)'], ["orders"], "does not exist", "'public.\"Orders\"'"),
        ([], ["Mixed Case.t"], "not valid", "double quotes"),
        (
            [
                "CREATE FOREIGN DATA WRAPPER w",
                "CREATE SERVER s FOREIGN DATA WRAPPER w",
                "CREATE FOREIGN TABLE ft (id int) SERVER s",
            ],
            ["ft"],
            "is a foreign table",
            "table",
        ),
    ],
)
def test_add_refusals(
    cdc: Run,
    pg: PgCluster,
    pg_db: str,
    tmp_path: Path,
    setup: list[str],
    argv: list[str],
    message: str,
    fix: str,
) -> None:
    sql(pg, pg_db, *setup)
    code, out, err = cdc("tables", "add", *argv, "--json")
    assert code != 0 and out == ""
    body = json.loads(err)
    assert body["error"] == "RegistryError"
    assert message in body["message"], body
    assert fix in body["fix"], body
    assert (
        not (tmp_path / "state" / "registry.db").exists() or Registry(tmp_path / "state").list_tables() == []
    )


def test_key_on_table_without_pk_is_accepted_with_replica_identity(
    cdc: Run, pg: PgCluster, pg_db: str
) -> None:
    sql(
        pg,
        pg_db,
        "CREATE TABLE full_t (a int, b text)",
        "ALTER TABLE full_t REPLICA IDENTITY FULL",
        "CREATE TABLE idx_t (a int NOT NULL, b text)",
        "CREATE UNIQUE INDEX ux ON idx_t (a)",
        "ALTER TABLE idx_t REPLICA IDENTITY USING INDEX ux",
    )
    code, out, err = cdc("tables", "add", "full_t", "--key", "a,b", "--json")
    assert code == 0, err
    added = json.loads(out)
    assert added["key"] == ["a", "b"]
    # accepted, but a key nothing guarantees unique is shown, with the fix
    (warning,) = added["warnings"]
    assert "not guaranteed unique" in warning and 'CREATE UNIQUE INDEX ON public.full_t ("a", "b")' in warning
    code, out, err = cdc("tables", "add", "idx_t", "--key", "a", "--json")
    assert code == 0, err
    assert json.loads(out)["warnings"] == []
    code, out, err = cdc("tables", "list", "--json")
    assert [t["table"] for t in json.loads(out)] == ["public.full_t", "public.idx_t"]


def test_missing_select_privilege_is_refused(cdc: Run, pg: PgCluster, pg_db: str) -> None:
    sql(pg, pg_db, "CREATE TABLE secret (id int PRIMARY KEY)")
    pg.execute("DO $$ BEGIN CREATE ROLE cdc_nosel LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
    code, _, err = cdc("tables", "add", "secret", source=pg.dsn(pg_db, user="cdc_nosel"))
    assert code == 1
    assert "cannot SELECT" in err and 'GRANT SELECT ON public.secret TO "cdc_nosel"' in err


def test_connection_failure_hides_the_password(cdc: Run) -> None:
    code, _, err = cdc("tables", "add", "t", source="postgresql://u:hunter2@127.0.0.1:1/db")
    assert code == 1
    assert "cannot connect" in err and "hunter2" not in err and "***" in err


def test_list_and_remove_without_registry(cdc: Run, tmp_path: Path) -> None:
    code, out, _ = cdc("tables", "list", "--json")
    assert code == 0 and json.loads(out) == []
    code, _, err = cdc("tables", "remove", "public.x")
    assert code == 1 and "not registered" in err
    assert not (tmp_path / "state").exists()
