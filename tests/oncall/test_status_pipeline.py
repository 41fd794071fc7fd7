"""`cdc status` over the whole pipeline: real Postgres, `cdc run`, the embedded log store and the real
Spark apply job (run once in this process)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.plugins.apply import apply_once
from tests.plugins.capture import CaptureEnv
from tests.plugins.postgres import wait_for
from tests.plugins.status import stage, status, status_config, status_until

DROP_AT_2MB = 'slot_policy = "drop"\nslot_drop_at_bytes = 2097152\n'
#: the status window (s): apply WARN (not running, not yet for a window) is judged within it of the
#: changes' append (a capture wait and a `cdc status` process: seconds on a loaded machine, so 12 s
#: leaves room on a CI machine), STOPPED once it passed
WINDOW_S = 12
pytestmark = pytest.mark.cdc_config(status_config(window=WINDOW_S, extra=DROP_AT_2MB))


def _tables(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE a (id int PRIMARY KEY, v text)")
    env.sql("CREATE TABLE b (id int PRIMARY KEY, body text)")
    env.sql("INSERT INTO a SELECT g, 'a' || g FROM generate_series(1, 20) g")
    env.sql("INSERT INTO b SELECT g, 'b' || g FROM generate_series(1, 5) g")
    env.add_table("public.a")
    env.add_table("public.b", "--search", "body")


def test_caught_up_ok_then_apply_stopped_warn_then_stopped(spark_clean: Any, env: CaptureEnv) -> None:
    _tables(env)
    proc = env.spawn("run")
    status_until(env, lambda r: r["processes"]["capture"]["running"], "capture running")
    status_until(env, lambda r: stage(r, "capture")["lag_bytes"] == 0, "snapshot captured")
    apply_once(spark_clean, env)

    code, report = status(env)
    assert code == 0 and report["verdict"] == "OK", [
        (s["name"], s["verdict"], s["reason"]) for s in report["stages"]
    ]
    for sink, table in (("warehouse", "public.a"), ("warehouse", "public.b"), ("search", "public.b")):
        st = stage(report, "apply", table, sink)
        assert st["lag_offsets"] == 0 and st["lag_seconds"] == 0 and st["verdict"] == "OK"
    assert stage(report, "capture")["lag_seconds"] == 0
    assert report["processes"]["apply"]["counters"]["events_applied"] == 25

    # capture keeps up, apply is stopped: per-table lag in offsets and seconds, WARN, then STOPPED
    env.sql("UPDATE a SET v = 'changed' WHERE id <= 10")
    env.sql("INSERT INTO b VALUES (100, 'new')")
    target = env.fetch("SELECT pg_current_wal_lsn()::text")[0][0]
    wait_for(
        lambda: (env.slot_confirmed() or 0) >= __import__("cdc.events").events.lsn_to_int(target),
        timeout=30,
        what="capture to pass the changes",
    )
    code, report = status(env)
    a = stage(report, "apply", "public.a", "warehouse")
    b = stage(report, "apply", "public.b", "search")
    assert a["lag_offsets"] == 10 and b["lag_offsets"] == 1
    assert a["lag_seconds"] > 0 and b["lag_seconds"] > 0
    assert a["verdict"] == "WARN" and code == 1, (a["reason"], report["processes"]["apply"], a["partitions"])
    assert sum(p["lag"] for p in a["partitions"].values()) == 10

    def stopped() -> bool:
        code, report = status(env)
        st = stage(report, "apply", "public.a", "warehouse")
        return code == 2 and st["verdict"] == "STOPPED" and "cdc apply" in st["fix"]

    wait_for(stopped, timeout=60, interval=1, what="apply STOPPED")
    assert proc.poll() is None


def test_drop_policy_end_to_end(spark_clean: Any, env: CaptureEnv) -> None:
    _tables(env)
    env.run_once()
    apply_once(spark_clean, env)
    code, report = status(env)
    assert code == 0, [(s["name"], s["verdict"], s["reason"]) for s in report["stages"]]
    # capture stays down while the source writes: the slot retains WAL past slot_drop_at_bytes
    env.sql("UPDATE a SET v = v || ' updated'")
    env.sql("INSERT INTO b SELECT g, 'late ' || g FROM generate_series(1000, 1999) g")
    env.sql("CREATE TABLE filler (id int, v text)")
    for _ in range(4):  # ~5 MiB of WAL
        env.sql(
            "INSERT INTO filler SELECT g, md5(g::text) || repeat('z', 500) FROM generate_series(1, 2500) g"
        )
    code, report = status(env)
    slot = stage(report, "slot")
    assert code == 2 and slot["verdict"] == "ERROR", slot
    assert (
        slot["dropped"]["tables"] == ["public.a", "public.b"]
        and "slot_drop_at_bytes" in slot["dropped"]["reason"]
    )
    assert "cdc run" in slot["fix"]
    assert not env.fetch("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", [env.slot])
    with env.registry() as reg:
        assert {t.snapshot_state for t in reg.list_tables()} == {"pending"}
    text = env.cdc("status")
    assert "dropped" in text.stdout and text.returncode == 2

    # the next `cdc run` re-snapshots the tables; apply; verify is clean; status is OK again
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.a": 20, "public.b": 1005}
    apply_once(spark_clean, env)
    res = env.cdc("verify", "--json", "--wait", "30")
    assert res.returncode == 0, res.stdout + res.stderr
    reports = {r["table"]: r for r in orjson.loads(res.stdout)}
    assert reports["public.b"]["warehouse_rows"] == reports["public.b"]["source_rows"] == 1005
    assert all(not r["missing"] and not r["different"] and not r["extra"] for r in reports.values())
    code, report = status(env)
    assert stage(report, "slot")["verdict"] == "OK" and report["slot_drop"]["slot"] == env.slot
    assert code == 0, [(s["name"], s["verdict"], s["reason"]) for s in report["stages"]]
