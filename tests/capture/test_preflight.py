"""`cdc check`: the finding logic on given facts (unit) and the checks against the real cluster."""

import json
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc.catalog import ServerInfo, SlotInfo, TableDescription
from cdc.cli import main
from cdc.codec.compiled import native_status
from cdc.codec.plugins import PGOUTPUT, WAL2JSON
from cdc.devcluster import knows_setting
from cdc.preflight import (
    CHECKS,
    FAILOVER_CHECKS,
    Finding,
    check_capacity,
    check_role,
    check_slot,
    check_tables,
    check_wal_keep,
    check_wal_level,
    probe_plugin,
    verdict_exit_code,
)
from cdc.registry import Column, Registry, TableReg
from tests.plugins.cli import Run
from tests.plugins.postgres import PgCluster

INFO = ServerInfo(
    server_version_num=150000,
    database="app",
    wal_level="logical",
    max_replication_slots=10,
    max_wal_senders=10,
    slots_in_use=2,
    senders_in_use=1,
    max_slot_wal_keep_size=1 << 30,
    role="cdc",
    role_replication=True,
    role_superuser=False,
)
NO_SLOT = SlotInfo(name="cdc_slot", exists=False)
OUR_SLOT = SlotInfo(
    name="cdc_slot",
    exists=True,
    plugin="wal2json",
    slot_type="logical",
    database="app",
    active=True,
    wal_status="reserved",
    retained_bytes=1000,
)


# --- pure logic ------------------------------------------------------------------------------------
def test_clean_facts_give_no_findings() -> None:
    found = [
        *check_wal_level(INFO),
        *check_role(INFO),
        *check_capacity(INFO, NO_SLOT),
        *check_wal_keep(INFO),
        *check_slot(OUR_SLOT, "app", WAL2JSON),
        *check_slot(NO_SLOT, "app", WAL2JSON),
    ]
    assert found == []
    assert verdict_exit_code(found) == 0


def test_verdict() -> None:
    warn = Finding("x", "warning", "m", "f")
    err = Finding("x", "error", "m", "f")
    assert verdict_exit_code([warn]) == 1
    assert verdict_exit_code([warn, err]) == 2


@pytest.mark.parametrize("level", ["replica", "minimal"])
def test_wal_level_not_logical(level: str) -> None:
    (f,) = check_wal_level(replace(INFO, wal_level=level))
    assert f.severity == "error" and level in f.message and "wal_level = 'logical'" in f.fix


def test_role_without_replication() -> None:
    (f,) = check_role(replace(INFO, role_replication=False))
    assert f.check == "replication_role" and "WITH REPLICATION" in f.fix
    assert check_role(replace(INFO, role_replication=False, role_superuser=True)) == []


def test_slots_exhausted_only_matters_when_our_slot_is_missing() -> None:
    full = replace(INFO, slots_in_use=10)
    (f,) = check_capacity(full, NO_SLOT)
    assert f.check == "replication_slots" and f.severity == "error" and "max_replication_slots" in f.fix
    assert f.values == {"max_replication_slots": 10, "slots_in_use": 10}
    assert check_capacity(full, OUR_SLOT) == []


def test_wal_senders_exhausted() -> None:
    busy = replace(INFO, senders_in_use=10)
    (f,) = check_capacity(busy, NO_SLOT)
    assert f.check == "wal_senders" and "max_wal_senders" in f.fix
    assert check_capacity(busy, OUR_SLOT) == []  # our own reader holds one of them


def test_wal_keep_unset_is_a_warning() -> None:
    (f,) = check_wal_keep(replace(INFO, max_slot_wal_keep_size=-1))
    assert f.severity == "warning" and "max_slot_wal_keep_size" in f.fix


def test_slot_states() -> None:
    (lost,) = check_slot(replace(OUR_SLOT, active=False, wal_status="lost"), "app", WAL2JSON)
    assert (
        lost.severity == "error"
        and "cdc snapshot" in lost.fix
        and "pg_drop_replication_slot('cdc_slot')" in lost.fix
    )
    (unres,) = check_slot(replace(OUR_SLOT, wal_status="unreserved"), "app", WAL2JSON)
    assert unres.severity == "error"
    (idle,) = check_slot(replace(OUR_SLOT, active=False, retained_bytes=5 << 20), "app", WAL2JSON)
    assert (
        idle.severity == "warning" and "5.0 MB" in idle.message and idle.values["retained_bytes"] == 5 << 20
    )
    assert check_slot(replace(OUR_SLOT, plugin="pgoutput"), "app", PGOUTPUT) == []
    (foreign,) = check_slot(replace(OUR_SLOT, plugin="pgoutput"), "app", WAL2JSON)  # not the decoder in use
    assert foreign.severity == "error" and "CDC_SLOT" in foreign.fix
    (other_db,) = check_slot(OUR_SLOT, "other", WAL2JSON)
    assert other_db.severity == "error"


def _desc(**kw: object) -> TableDescription:
    base = TableDescription(
        schema="public",
        table="t",
        relkind="r",
        columns=(Column("id", "integer", False), Column("b", "text")),
        primary_key=("id",),
        replica_identity="d",
        replica_identity_columns=("id",),
        estimated_rows=0,
        has_select_privilege=True,
        sql_name="public.t",
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_table_findings() -> None:
    reg = TableReg(schema="public", table="t", topic="cdc.public.t", key=("id",))
    assert check_tables([reg], {("public", "t"): _desc()}, "cdc") == []
    (gone,) = check_tables([reg], {("public", "t"): None}, "cdc")
    assert gone.check == "registered_tables" and "cdc tables remove public.t" in gone.fix
    (nopk,) = check_tables(
        [reg], {("public", "t"): _desc(primary_key=(), replica_identity_columns=())}, "cdc"
    )
    assert nopk.check == "replica_identity" and "no primary key" in nopk.message
    assert nopk.fix.startswith("ALTER TABLE public.t REPLICA IDENTITY FULL")
    full = _desc(primary_key=(), replica_identity="f", replica_identity_columns=("id", "b"))
    assert check_tables([reg], {("public", "t"): full}, "cdc") == []
    (nosel,) = check_tables([reg], {("public", "t"): _desc(has_select_privilege=False)}, "cdc")
    assert nosel.check == "select_privilege" and 'GRANT SELECT ON public.t TO "cdc"' in nosel.fix
    (view,) = check_tables([reg], {("public", "t"): _desc(relkind="v")}, "cdc")
    assert "is a view" in view.message
    # a partitioned parent is capturable (its leaves' changes go to its topic); each leaf's replica
    # identity must carry the key
    leaves = (("public", "t_2026_01", "d", ("id",)), ("public", "t_2026_02", "d", ("id",)))
    parent = _desc(relkind="p", leaf_identities=leaves)
    assert check_tables([reg], {("public", "t"): parent}, "cdc") == []
    bad_leaf = _desc(relkind="p", leaf_identities=(leaves[0], ("public", "t_2026_02", "n", ())))
    (leaf,) = check_tables([reg], {("public", "t"): bad_leaf}, "cdc")
    assert leaf.check == "replica_identity" and "(partition t_2026_02)" in leaf.message
    assert leaf.fix.startswith('ALTER TABLE "public"."t_2026_02" REPLICA IDENTITY FULL')


# --- against the real cluster ----------------------------------------------------------------------


@pytest.fixture
def slot(monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"chk_{uuid.uuid4().hex[:10]}"  # slots are cluster-wide: never share one between tests
    monkeypatch.setenv("CDC_SLOT", name)
    return name


@pytest.fixture
def cdc(pg: PgCluster, pg_db: str, cdc_main: Run, monkeypatch: pytest.MonkeyPatch, slot: str) -> Run:
    """``cdc ARGS`` in-process on the test's database, as ``user`` (default: the superuser)."""
    monkeypatch.setenv("CDC_SLOT", slot)  # cdc_main cleared it if the slot fixture ran first
    return lambda *argv, user=None: cdc_main(*argv, source=pg.dsn(pg_db, user=user))


def _register(tmp_path: Path, table: str, key: tuple[str, ...] = ("id",)) -> None:
    with Registry(tmp_path / "state") as r:
        r.add(TableReg(schema="public", table=table, topic=f"cdc.public.{table}", key=key))


def test_check_on_a_clean_source(cdc: Run, pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE good (id int PRIMARY KEY, b text)", pg_db)
    _register(tmp_path, "good")
    code, out, _ = cdc("check", "--json")
    report = json.loads(out)
    # every check ran, wal2json included, but pgoutput's (the decoder is wal2json); those of
    # failover slots need PostgreSQL 17+
    assert report["checked"] == [
        c for c in CHECKS if c not in FAILOVER_CHECKS and c not in ("pgoutput", "publication")
    ]
    assert report["skipped"] == {}
    # the test cluster leaves max_slot_wal_keep_size unlimited (shared cluster: not changed here),
    # so that warning is the one warning; the optional DDL recorder is not installed (info), and
    # what PostgreSQL 15 brings is said (info)
    assert [(f["check"], f["severity"]) for f in report["findings"]] == [
        ("decoder", "info"),
        ("per_change_path", "info" if native_status()[0] else "warning"),
        ("server_version", "info"),
        ("max_slot_wal_keep_size", "warning"),
        ("ddl_recorder", "info"),
    ]
    assert report["findings"][0]["values"] == {"decoder": "wal2json", "publication": None}
    assert report["ok"] is True and code == 1 == report["exit_code"]
    # the probe slot is gone again
    assert pg.fetch("SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'cdc_check_%'") == [(0,)]

    code, out, _ = cdc("check")
    assert code == 1
    assert "OK    wal_level" in out and "OK    wal2json" in out
    assert "WARN  max_slot_wal_keep_size:" in out and "— fix: ALTER SYSTEM SET max_slot_wal_keep_size" in out
    assert "ready, with warnings" in out
    assert "INFO  ddl_recorder: the DDL recorder is not installed" in out and "cdc check --fix" in out


def test_check_finds_table_without_key_identity_and_dropped_table(
    cdc: Run, pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    pg.execute("CREATE TABLE nokey (id int, b text)", pg_db)  # tables add refuses it: register directly
    pg.execute("CREATE TABLE dropme (id int PRIMARY KEY)", pg_db)
    _register(tmp_path, "nokey")
    _register(tmp_path, "dropme")
    pg.execute("DROP TABLE dropme", pg_db)
    code, out, _ = cdc("check", "--json")
    report = json.loads(out)
    assert code == 2 and report["ok"] is False
    errors = {f["check"]: f for f in report["findings"] if f["severity"] == "error"}
    assert set(errors) == {"replica_identity", "registered_tables"}
    assert "public.nokey" in errors["replica_identity"]["message"]
    assert errors["replica_identity"]["fix"].startswith("ALTER TABLE public.nokey REPLICA IDENTITY FULL")
    assert "public.dropme" in errors["registered_tables"]["message"]
    # the fix works: after it, the finding is gone
    pg.execute("ALTER TABLE nokey REPLICA IDENTITY FULL", pg_db)
    pg.execute("CREATE TABLE dropme (id int PRIMARY KEY)", pg_db)
    code, out, _ = cdc("check", "--json")
    assert [f["check"] for f in json.loads(out)["findings"]] == [
        "decoder",
        "per_change_path",
        "server_version",
        "max_slot_wal_keep_size",
        "ddl_recorder",
    ]


def test_a_partitioned_parent_is_capturable_and_add_and_check_say_the_same(
    cdc: Run, pg: PgCluster, pg_db: str
) -> None:
    pg.execute(
        "CREATE TABLE payment (payment_id int, payment_date date, amount numeric(5,2), "
        "PRIMARY KEY (payment_id, payment_date)) PARTITION BY RANGE (payment_date)",
        pg_db,
    )
    for m in (1, 2, 3):
        pg.execute(
            f"CREATE TABLE payment_2026_0{m} PARTITION OF payment "
            f"FOR VALUES FROM ('2026-0{m}-01') TO ('2026-0{m + 1}-01')",
            pg_db,
        )
    code, _, err = cdc("tables", "add", "payment", "--json")
    assert code == 0, err
    code, out, _ = cdc("check", "--json")
    report = json.loads(out)
    assert [f for f in report["findings"] if f["severity"] == "error"] == [], report
    assert code == 1  # the unlimited max_slot_wal_keep_size warning only
    # one leaf whose replica identity cannot carry the key: found, named, with the fix
    pg.execute("ALTER TABLE payment_2026_02 REPLICA IDENTITY NOTHING", pg_db)
    code, out, _ = cdc("check", "--json")
    (leaf,) = [f for f in json.loads(out)["findings"] if f["severity"] == "error"]
    assert code == 2 and leaf["check"] == "replica_identity"
    assert "(partition payment_2026_02)" in leaf["message"], leaf
    # `cdc tables add` refuses by the same rule, in the same words
    assert cdc("tables", "remove", "payment")[0] == 0
    code, _, err = cdc("tables", "add", "payment", "--json")
    body = json.loads(err)
    assert code == 1 and (body["message"], body["fix"]) == (leaf["message"], leaf["fix"])


def test_check_as_role_without_replication_or_select(
    cdc: Run, pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    role = f"r_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {role} LOGIN")
    pg.execute("CREATE TABLE private (id int PRIMARY KEY)", pg_db)
    pg.execute("CREATE TABLE shared (id int PRIMARY KEY)", pg_db)
    pg.execute(f"GRANT SELECT ON shared TO {role}", pg_db)
    _register(tmp_path, "private")
    _register(tmp_path, "shared")
    code, out, _ = cdc("check", "--json", user=role)
    report = json.loads(out)
    assert code == 2
    errors = [(f["check"], f["values"]) for f in report["findings"] if f["severity"] == "error"]
    assert errors == [
        ("replication_role", {"role": role}),
        ("select_privilege", {"table": "public.private", "role": role}),
    ]
    assert "wal2json" in report["skipped"] and "wal2json" not in report["checked"]
    code, out, _ = cdc("check", user=role)
    assert f"ERROR replication_role: role '{role}' has neither REPLICATION" in out
    assert "SKIP  wal2json" in out and "NOT ready" in out


def test_check_reports_the_ddl_recorder_and_fix_installs_it_when_the_role_may(
    cdc: Run, pg: PgCluster, pg_db: str
) -> None:
    def recorder(*argv: str, user: str | None = None) -> tuple[int, dict[str, Any] | None, str]:
        code, out, err = cdc("check", "--json", *argv, user=user)
        found = [f for f in json.loads(out)["findings"] if f["check"] == "ddl_recorder"]
        return code, found[0] if found else None, err

    code, found, _ = recorder()
    assert code == 1  # the max_slot_wal_keep_size warning only: info does not count
    assert found is not None and found["severity"] == "info" and "not installed" in found["message"]
    assert found["fix"].startswith("run `cdc check --fix`") and "cdc_record_ddl" in found["fix"]

    # a role that may not: --fix says what a superuser must run, the finding stays
    role = f"r_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {role} LOGIN REPLICATION")
    pg.execute(f"GRANT CREATE ON SCHEMA public TO {role}", pg_db)  # it may create the function, not a trigger
    _, found, err = recorder("--fix", user=role)
    assert "did not install the DDL recorder" in err and "superuser" in err, err
    assert (
        found is not None
        and "need a superuser" in found["fix"]
        and "--ddl-recorder-sql | psql" in found["fix"]
    )
    assert pg.fetch("SELECT count(*) FROM pg_event_trigger", pg_db) == [(0,)]
    assert pg.fetch("SELECT to_regproc('public.cdc_record_ddl')", pg_db) == [(None,)]  # all or nothing

    _, found, err = recorder("--fix")
    assert "installed the DDL recorder" in err and found is None
    triggers = pg.fetch("SELECT evtname, evtevent FROM pg_event_trigger ORDER BY 1", pg_db)
    assert triggers == [("cdc_ddl_command_end", "ddl_command_end"), ("cdc_ddl_sql_drop", "sql_drop")]
    _, found, err = recorder("--fix")  # again: nothing to do
    assert "installed" not in err and found is None

    # half removed, or disabled: a warning with the same fix
    pg.execute("ALTER EVENT TRIGGER cdc_ddl_sql_drop DISABLE", pg_db)
    code, found, _ = recorder()
    assert found is not None and found["severity"] == "warning" and "cdc_ddl_sql_drop" in found["message"]
    # the SQL a superuser can run by hand installs it too
    code, out, _ = cdc("check", "--ddl-recorder-sql")
    assert code == 0 and out.startswith("BEGIN;") and "CREATE EVENT TRIGGER" in out
    pg.execute(out, pg_db)
    assert recorder()[1] is None


def test_check_warns_about_our_inactive_slot_retaining_wal(
    cdc: Run, pg: PgCluster, pg_db: str, slot: str
) -> None:
    pg.execute(f"SELECT pg_create_logical_replication_slot('{slot}', 'wal2json')", pg_db)
    pg.execute(
        "CREATE TABLE churn AS SELECT g AS id, md5(g::text) AS t FROM generate_series(1, 20000) g", pg_db
    )
    code, out, _ = cdc("check", "--json")
    report = json.loads(out)
    (finding,) = [f for f in report["findings"] if f["check"] == "slot"]
    assert finding["severity"] == "warning" and slot in finding["message"]
    assert finding["values"]["retained_bytes"] > 1_000_000 and finding["values"]["active"] is False
    assert f"pg_drop_replication_slot('{slot}')" in finding["fix"]
    assert code == 1


def test_probe_reports_a_missing_output_plugin(pg: PgCluster, pg_db: str) -> None:
    with psycopg.connect(pg.dsn(pg_db), autocommit=True) as conn:
        assert probe_plugin(conn, WAL2JSON) is None
        if knows_setting(pg, "output_plugin_libraries"):  # allowed, so that the lookup itself fails
            conn.execute("SET output_plugin_libraries = 'no_such_plugin'")
        finding = probe_plugin(conn, replace(WAL2JSON, name="no_such_plugin"))
    assert finding is not None and finding.severity == "error" and "not installed" in finding.message


def test_connection_failure_is_an_error_not_a_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "--source",
            "host=127.0.0.1 port=1 user=x password=sekret",
            "--state",
            str(tmp_path),
            "check",
            "--json",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    body = json.loads(err)
    assert body["error"] == "SourceUnavailableError" and "cannot connect" in body["message"]
    assert "sekret" not in err
