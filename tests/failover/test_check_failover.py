"""`cdc check` on PostgreSQL 18: wal2json missing (pgoutput is what works there), what the version
brings, and the failover-slot setup of a primary and its standby (tests/plugins/failover.py) with
each fix; the judging functions on given facts too."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from cdc.catalog import FailoverInfo, ServerInfo, SlotInfo, SyncedSlot, create_logical_slot
from cdc.codec.plugins import PGOUTPUT, WAL2JSON
from cdc.connect import connect
from cdc.preflight import (
    FAILOVER_CHECKS,
    check_failover_primary,
    check_failover_ready,
    check_failover_standby,
    check_output_plugin,
    check_server_version,
    run_preflight,
)
from tests.plugins.capture import CaptureEnv
from tests.plugins.cli import Run
from tests.plugins.failover import STANDBY_SLOT, FailoverPair, pair_env
from tests.plugins.postgres import PgCluster, free_port, wait_for

STANDBY = FailoverInfo(
    in_recovery=True,
    synchronized_standby_slots="",
    physical_slots=(),
    standbys=0,
    sync_replication_slots=True,
    hot_standby_feedback=True,
    primary_slot_name="sb1",
    conninfo_has_dbname=True,
    slot=SyncedSlot(
        "cdc", synced=True, temporary=False, failover=True, confirmed_flush_lsn=1, invalidation_reason=None
    ),
)
PRIMARY = replace(
    STANDBY,
    in_recovery=False,
    synchronized_standby_slots="sb1",
    physical_slots=("sb1",),
    standbys=1,
    sync_replication_slots=False,
    hot_standby_feedback=False,
    primary_slot_name="",
    slot=replace(STANDBY.slot, synced=False),  # type: ignore[arg-type]
)
SLOT = SlotInfo(name="cdc", exists=True, plugin="pgoutput", slot_type="logical", database="app")
INFO = ServerInfo(180006, "app", "logical", 10, 10, 1, 1, -1, "cdc", True, False, "pgoutput, test_decoding")


# --- judging (pure) -----------------------------------------------------------------------------
def test_versions_say_streaming_level_and_failover() -> None:
    (f18,) = check_server_version(INFO)
    assert (
        f18.severity == "info" and "streaming = parallel" in f18.message and "failover slots:" in f18.message
    )
    assert f18.values == {
        "server_version_num": 180006,
        "proto_version": 4,
        "streaming": "parallel",
        "failover_slots": True,
    }
    (f15,) = check_server_version(replace(INFO, server_version_num=150020))
    assert (
        "streaming = on" in f15.message
        and "no failover slots" in f15.message
        and f15.values["proto_version"] == 3
    )
    (f13,) = check_server_version(replace(INFO, server_version_num=130000))
    assert "no streaming" in f13.message and f13.values["proto_version"] == 1


def test_missing_wal2json_points_to_pgoutput() -> None:
    (refused,) = check_output_plugin(INFO, WAL2JSON)  # unknown whether installed: allow it, or use pgoutput
    assert "ALTER SYSTEM SET output_plugin_libraries" in refused.fix and 'decoder = "pgoutput"' in refused.fix
    (missing,) = check_output_plugin(INFO, WAL2JSON, installed=False)
    assert "not installed" in missing.message and missing.fix.startswith("capture with pgoutput")
    assert "CDC_DECODER=pgoutput" in missing.fix


@pytest.mark.parametrize(
    ("change", "setting", "fix"),
    [
        (
            {"sync_replication_slots": False},
            "sync_replication_slots",
            "ALTER SYSTEM SET sync_replication_slots = on",
        ),
        (
            {"hot_standby_feedback": False},
            "hot_standby_feedback",
            "ALTER SYSTEM SET hot_standby_feedback = on",
        ),
        ({"primary_slot_name": ""}, "primary_slot_name", "pg_create_physical_replication_slot"),
        ({"conninfo_has_dbname": False}, "primary_conninfo", "dbname="),
    ],
)
def test_standby_setting_missing_is_named_with_its_fix(
    change: dict[str, Any], setting: str, fix: str
) -> None:
    assert check_failover_standby("b:5433", 180006, STANDBY) == []
    (found,) = check_failover_standby("b:5433", 180006, replace(STANDBY, **change))
    assert found.check == "failover_standby" and found.severity == "warning"
    assert (
        found.values == {"standby": "b:5433", "setting": setting}
        and fix in found.fix
        and "b:5433" in found.fix
    )
    # a role that may not read primary_conninfo: unknown, not a finding
    assert check_failover_standby("b:5433", 180006, replace(STANDBY, conninfo_has_dbname=None)) == []
    (old,) = check_failover_standby("b:5433", 160004, None)
    assert "cannot sync slots" in old.message


def test_primary_needs_synchronized_standby_slots_and_a_failover_slot() -> None:
    assert check_failover_primary(PRIMARY, SLOT, []) == []
    (unset,) = check_failover_primary(replace(PRIMARY, synchronized_standby_slots=""), SLOT, [])
    assert unset.check == "synchronized_standby_slots" and "synchronized_standby_slots = 'sb1'" in unset.fix
    # no standby anywhere: nothing to synchronize with
    assert (
        check_failover_primary(
            replace(PRIMARY, synchronized_standby_slots="", physical_slots=(), standbys=0), SLOT, []
        )
        == []
    )
    plain = replace(PRIMARY, slot=replace(PRIMARY.slot, failover=False))  # type: ignore[arg-type]
    (no_failover,) = check_failover_primary(plain, SLOT, [])
    assert (
        no_failover.check == "failover_slot"
        and 'ALTER_REPLICATION_SLOT "cdc" (FAILOVER true)' in no_failover.fix
    )


def test_readiness_is_synced_and_not_temporary() -> None:
    (ready,) = check_failover_ready("b:5433", SLOT, STANDBY)
    assert ready.severity == "info" and ready.values["ready"] is True
    for copy, why in [
        (None, "no copy"),
        (replace(STANDBY.slot, temporary=True), "temporary"),  # type: ignore[arg-type]
        (replace(STANDBY.slot, invalidation_reason="wal_removed"), "invalidated"),  # type: ignore[arg-type]
    ]:
        (found,) = check_failover_ready("b:5433", SLOT, replace(STANDBY, slot=copy))
        assert found.severity == "warning" and why in found.message and found.values["ready"] is False
    assert check_failover_ready("b:5433", replace(SLOT, exists=False), STANDBY) == []


# --- against PostgreSQL 18 ----------------------------------------------------------------------
def _check(cdc_main: Run, source: str) -> dict[str, Any]:
    _, out, _ = cdc_main("check", "--json", source=source)
    return dict(json.loads(out))


def _failover(report: dict[str, Any]) -> list[tuple[str, str, Any]]:
    return [
        (f["check"], f["severity"], f["values"].get("setting"))
        for f in report["findings"]
        if f["check"] in FAILOVER_CHECKS
    ]


def test_pg18_without_wal2json_says_use_pgoutput(
    pg18: PgCluster, pg18_db: str, cdc_main: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_SLOT", "cdc_pg18_check")
    report = _check(cdc_main, pg18.dsn(pg18_db))
    (found,) = [f for f in report["findings"] if f["check"] == "wal2json"]
    # a superuser can look in the library directory: not installed, allowing it would not help
    assert found["severity"] == "error" and "not installed" in found["message"]
    assert found["values"]["installed"] is False and 'decoder = "pgoutput"' in found["fix"]
    (version,) = [f for f in report["findings"] if f["check"] == "server_version"]
    assert "PostgreSQL 18.6" in version["message"] and version["values"]["streaming"] == "parallel"
    # a REPLICATION role cannot look: the allow-list refusal, with both ways out
    pg18.execute(
        "DO $$BEGIN CREATE ROLE cdc_repl18 LOGIN REPLICATION; EXCEPTION WHEN duplicate_object THEN END$$"
    )
    report = _check(cdc_main, pg18.dsn(pg18_db, user="cdc_repl18"))
    (found,) = [f for f in report["findings"] if f["check"] == "wal2json"]
    assert found["values"].get("installed") is None and "output_plugin_libraries" in found["fix"]
    assert 'decoder = "pgoutput"' in found["fix"]
    # capturing with pgoutput: wal2json is not looked for
    with connect(pg18.dsn(pg18_db)) as conn:
        pgout = run_preflight(conn, "cdc_pg18_check", [], plugin=PGOUTPUT)
    assert "wal2json" not in pgout.checked and "pgoutput" in pgout.skipped["wal2json"] and not pgout.errors


def test_standby_without_sync_replication_slots_gets_the_finding_and_its_fix_works(
    pg18_pair: Callable[..., FailoverPair], cdc_main: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = pg18_pair(standby_settings={"sync_replication_slots": "off"})
    monkeypatch.setenv("CDC_SLOT", "cdc_fo_check")
    report = _check(cdc_main, pair.dsn())
    assert _failover(report) == [("failover_standby", "warning", "sync_replication_slots")]
    (found,) = [f for f in report["findings"] if f["check"] == "failover_standby"]
    where = f"127.0.0.1:{pair.standby.port}"
    assert (
        where in found["message"]
        and f"on the standby {where}: ALTER SYSTEM SET sync_replication_slots = on" in found["fix"]
    )
    fix = found["fix"].split(": ", 1)[1]
    for statement in filter(None, (s.strip() for s in fix.split(";"))):
        pair.standby.execute(statement)
    assert _failover(_check(cdc_main, pair.dsn())) == []


def _slot_sync(pair: FailoverPair, *, on: bool) -> None:
    """The standby's ``sync_replication_slots`` set and reloaded; off: until its slot-sync worker has
    exited (it does on the reload that turns the setting off; the postmaster starts it again once it
    is back on)."""
    pair.standby.execute(f"ALTER SYSTEM SET sync_replication_slots = {'on' if on else 'off'}")
    pair.standby.execute("SELECT pg_reload_conf()")
    if not on:
        wait_for(
            lambda: (
                not pair.standby.fetch(
                    "SELECT 1 FROM pg_stat_activity WHERE backend_type = 'slotsync worker'"
                )
            ),
            what="the standby's slot-sync worker to exit",
        )


def test_configured_pair_has_no_failover_finding_and_readiness_follows_the_sync(
    pg18_pair: Callable[..., FailoverPair], cdc_main: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = pg18_pair()
    slot = "cdc_fo_ready"
    monkeypatch.setenv("CDC_SLOT", slot)
    assert _failover(_check(cdc_main, pair.dsn())) == []  # no slot yet: nothing to be ready
    # the standby's slot-sync worker could copy a new slot and make it ready before the check ends
    # (CI once saw it ready by then): it is held off (sync_replication_slots off: the worker exits on
    # the reload) while the slot is made and checked, so the check sees a copy that is surely not ready
    _slot_sync(pair, on=False)
    with connect(pair.primary.dsn()) as conn:
        create_logical_slot(conn, slot, "pgoutput")
    # the check says what holding the sync off did, and that the standby's copy is not ready
    assert _failover(_check(cdc_main, pair.dsn())) == [
        ("failover_standby", "warning", "sync_replication_slots"),
        ("failover_ready", "warning", None),
    ]
    assert pair.standby_slot(slot) is None  # no worker copied it meanwhile
    # synced by hand while the worker is off (it would start again only 10 s after it last started),
    # then the setting back on: the check says the copy is ready
    pair.wait_synced(slot, by_hand=True)
    _slot_sync(pair, on=True)
    assert _failover(_check(cdc_main, pair.dsn())) == [("failover_ready", "info", None)]


def test_primary_without_synchronized_standby_slots_gets_the_finding(
    pg18_pair: Callable[..., FailoverPair], cdc_main: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = pg18_pair(synchronized=False)
    monkeypatch.setenv("CDC_SLOT", "cdc_fo_sync")
    # the DSN names the primary only: the primary's own standbys are what it judges by
    report = _check(cdc_main, pair.primary.dsn())
    (found,) = [f for f in report["findings"] if f["check"] == "synchronized_standby_slots"]
    assert found["values"]["physical_slots"] == [STANDBY_SLOT]
    assert f"ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'" in found["fix"]
    pair.primary.execute(found["fix"].split(": ", 1)[1].split(";")[0])
    pair.primary.execute("SELECT pg_reload_conf()")
    assert _failover(_check(cdc_main, pair.primary.dsn())) == []


def _failover_stage(env: CaptureEnv) -> Any:
    res = env.cdc("status", "--json")
    (stage,) = [s for s in json.loads(res.stdout)["stages"] if s["stage"] == "slot"]
    return stage["failover"]


def test_status_shows_failover_readiness(
    pg18_pair: Callable[..., FailoverPair], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pair = pg18_pair()
    for env in pair_env(pair, tmp_path, request):
        failover = partial(_failover_stage, env)
        assert failover() is None  # no slot yet
        with connect(pair.primary.dsn(env.db)) as conn:
            create_logical_slot(conn, env.slot, "pgoutput")
        where = f"127.0.0.1:{pair.standby.port}"
        before = failover()
        assert before["failover"] is True and before["unreachable"] == {}
        assert [(s["standby"], s["ready"]) for s in before["standbys"]] == [(where, False)]
        pair.wait_synced(env.slot)
        assert failover()["standbys"] == [
            {"standby": where, "ready": True, "synced": True, "temporary": False}
        ]


def test_a_host_of_the_dsn_that_cannot_be_reached_is_skipped_with_why(pg18: PgCluster, pg18_db: str) -> None:
    down = free_port()
    dsn = f"host=127.0.0.1,127.0.0.1 port={pg18.port},{down} dbname={pg18_db} user=postgres target_session_attrs=primary"
    with connect(dsn) as conn:
        report = run_preflight(conn, "cdc_unreached", [], plugin=PGOUTPUT, dsn=dsn)
    assert report.skipped[f"failover_standby@127.0.0.1:{down}"].startswith("cannot connect")
    assert not [f for f in report.findings if f.check in FAILOVER_CHECKS]
    assert set(FAILOVER_CHECKS) <= set(report.checked)
