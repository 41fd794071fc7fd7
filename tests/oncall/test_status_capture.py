"""`cdc status` against a real Postgres and the embedded log store: the capture and slot stages."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.plugins.capture import PROCESS_POLL_S, CaptureEnv
from tests.plugins.postgres import wait_for
from tests.plugins.status import stage, status, status_config, status_until

RETAINED_WAL = "retained_wal_warn_bytes = 1048576\nretained_wal_critical_bytes = 4194304\n"
#: the status window (s): twice the reader's heartbeat interval (1 s in the tests' cdc.toml)
WINDOW_S = 2
pytestmark = [
    pytest.mark.cdc_config(status_config(window=WINDOW_S, extra=RETAINED_WAL)),
    pytest.mark.decoders("wal2json", "pgoutput"),
]


def _setup(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 10) g")
    env.add_table("public.t")


def test_idle_source_longer_than_window_is_zero_seconds_and_ok(env: CaptureEnv) -> None:
    _setup(env)
    proc = env.spawn("run")
    status_until(env, lambda r: r["processes"]["capture"]["running"], "capture running")
    env.sql("INSERT INTO t VALUES (100, 'y')")
    status_until(env, lambda r: stage(r, "capture")["lag_bytes"] == 0, "caught up")
    # the source now stays idle for longer than the window
    deadline = time.monotonic() + WINDOW_S + 1
    wait_for(lambda: time.monotonic() > deadline, timeout=10, what="the window to pass")

    def idle_and_ok() -> dict[str, Any] | None:
        """One sample; itself if it says 0 s and OK. A sample taken while a heartbeat is between its
        emit and its confirm (slow on a loaded machine) may not: the next one is taken then. A lag
        that grows with the idle time (heartbeats not moving the slot) never comes back to 0."""
        _, report = status(env)
        cap = stage(report, "capture")
        ok = cap["lag_seconds"] == 0 and cap["verdict"] == "OK" and stage(report, "slot")["verdict"] == "OK"
        return report if ok and report["processes"]["capture"]["running"] is True else None

    for _ in range(3):  # heartbeats move the slot: the idle source keeps saying 0 s, not a growing lag
        report = wait_for(
            idle_and_ok, timeout=60, interval=PROCESS_POLL_S, what="an idle sample at 0 s and OK"
        )
        assert proc.poll() is None, env.proc_log()
    counters = report["processes"]["capture"]["counters"]
    assert counters["events_written"] >= 11


def test_writes_while_capture_stopped_grow_lag_then_stopped_critical(env: CaptureEnv) -> None:
    _setup(env)
    env.run_once()
    status_until(env, lambda r: stage(r, "capture")["verdict"] == "OK", "capture OK")
    env.sql("INSERT INTO t SELECT g, repeat('w', 100) FROM generate_series(1000, 2000) g")
    _, first = status(env)
    env.sql("UPDATE t SET v = 'again'")
    _, second = status(env)
    lag1, lag2 = stage(first, "capture")["lag_bytes"], stage(second, "capture")["lag_bytes"]
    assert 0 < lag1 < lag2
    assert stage(second, "capture")["lag_seconds"] > 0

    def stopped() -> bool:
        code, report = status(env)
        cap = stage(report, "capture")
        return code == 2 and cap["verdict"] == "STOPPED" and "cdc run" in cap["fix"]

    # each sample is a `cdc status` process: seconds apiece on a loaded machine
    wait_for(stopped, timeout=120, interval=PROCESS_POLL_S, what="capture STOPPED, exit 2")


def test_retained_wal_past_threshold_exits_2_with_the_fix(env: CaptureEnv) -> None:
    _setup(env)
    env.run_once()
    env.sql("CREATE TABLE filler (id int, v text)")
    for _ in range(4):  # ~5 MiB of WAL the stopped slot must retain
        env.sql(
            "INSERT INTO filler SELECT g, md5(g::text) || repeat('z', 500) FROM generate_series(1, 2500) g"
        )
    code, report = status(env)
    slot = stage(report, "slot")
    assert code == 2 and report["severity"] == "critical"
    assert slot["severity"] == "critical" and slot["retained_wal_bytes"] > 4194304
    assert "pg_drop_replication_slot" in slot["fix"] and "cdc run" in slot["fix"]
    text = env.cdc("status")
    assert text.returncode == 2 and "what to do:" in text.stdout and "retained WAL" in text.stdout
