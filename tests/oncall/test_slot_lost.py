"""A slot Postgres invalidated (wal_status = lost): the reader stops with SlotLostError, status says
ERROR with the fix, and under slot_policy = "drop" status drops the dead slot and marks the tables, so
the next `cdc run` re-snapshots them. Changes the session cluster's max_slot_wal_keep_size for the
duration of the test (reset after)."""

from __future__ import annotations

import pytest

from cdc.devcluster import PgCluster
from tests.plugins.capture import PROCESS_POLL_S, CaptureEnv
from tests.plugins.postgres import wait_for
from tests.plugins.status import stage, status, status_config

DROP_WHEN_LOST = (
    'slot_policy = "drop"\nslot_drop_at_bytes = 1099511627776\n'  # 1 TiB: only "lost" triggers it
)
pytestmark = pytest.mark.cdc_config(status_config(window=3, extra=DROP_WHEN_LOST))


def test_invalidated_slot_is_dropped_marked_and_resnapshotted(pg: PgCluster, env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 10) g")
    env.add_table("public.t")
    env.run_once()
    pg.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
    pg.execute("SELECT pg_reload_conf()")
    try:
        env.sql("INSERT INTO t SELECT g, 'y' FROM generate_series(11, 20) g")

        def lost() -> bool:
            env.sql("SELECT pg_switch_wal()")
            env.sql("INSERT INTO t VALUES (1000, 'z') ON CONFLICT (id) DO UPDATE SET v = t.v || 'z'")
            env.sql("CHECKPOINT")
            rows = env.fetch("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", [env.slot])
            return bool(rows) and rows[0][0] == "lost"

        wait_for(lost, timeout=60, interval=0.2, what="Postgres to invalidate the slot")
    finally:
        pg.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
        pg.execute("SELECT pg_reload_conf()")
    res = env.cdc("run", "--once")
    assert res.returncode == 3, res.stderr  # the reader's own answer: SlotLostError
    code, report = status(env)  # the policy drops the dead slot and marks the table
    assert code == 2
    cap, slot = stage(report, "capture"), stage(report, "slot")
    assert cap["verdict"] == "ERROR" and "SlotLostError" in cap["reason"]
    assert slot["verdict"] == "ERROR" and "wal_status = lost" in slot["dropped"]["reason"]
    assert slot["dropped"]["tables"] == ["public.t"]
    assert not env.fetch("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", [env.slot])
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.t": 21}

    def both_ok() -> bool:
        _, report = status(env)
        return bool(stage(report, "slot")["verdict"] == "OK" and stage(report, "capture")["verdict"] == "OK")

    # each sample is a `cdc status` process, judged over a 3 s window: polled, not one sample
    wait_for(both_ok, timeout=60, interval=PROCESS_POLL_S, what="slot and capture OK after the re-snapshot")
