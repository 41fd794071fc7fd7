"""Rows back from the dead (issue 11): a table registered on a running pipeline while its rows are
being deleted, the capture killed (-9) in the middle of the table's snapshot and started again. No
key the source deleted may come back in the topic."""

from __future__ import annotations

import random
import signal
from typing import Any

import psycopg
import pytest

from tests.plugins.capture import (
    CaptureEnv,
    SourceLoad,
    assert_versions_monotonic,
    materialize,
    progress,
    rows_of,
    wait_caught_up,
    wait_streaming,
)
from tests.plugins.postgres import wait_for

pytestmark = pytest.mark.cdc_config("[snapshot]\nchunk_size = 4096\n")

ROWS = 150_000


class _Deleter(SourceLoad):
    """Deletes of four rows of ``g`` at random (and updates of ``other``) on a thread."""

    def loop(self, conn: psycopg.Connection[Any]) -> None:
        rnd = random.Random(7)
        while not self.stop.is_set():
            lo = rnd.randint(1, ROWS)
            conn.execute("DELETE FROM g WHERE id BETWEEN %s AND %s", [lo, lo + 3])
            conn.execute("UPDATE other SET v = v + 1 WHERE id = 1")


def test_kill_9_during_a_late_snapshot_under_deletes_brings_no_deleted_row_back(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE other (id int PRIMARY KEY, v int)")
    env.sql("INSERT INTO other VALUES (1, 0)")
    env.sql("CREATE TABLE g (id int PRIMARY KEY, pad text)")
    env.sql(f"INSERT INTO g SELECT i, repeat(md5(i::text), 3) FROM generate_series(1, {ROWS}) i")
    env.add_table("public.other")
    proc = env.spawn("run")
    wait_streaming(env, proc)

    with _Deleter(env):
        env.add_table("public.g")
        topic = env.reg("public", "g").topic
        wait_for(
            lambda: (progress(env, "g").chunks if progress(env, "g") else 0) >= 3,
            timeout=120,
            interval=0.01,
            what="the snapshot of g to be under way",
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert env.reg("public", "g").snapshot_state != "done", "finished before the kill: make g bigger"
        # deletes go on while the capture is down, then it starts again and finishes
        wait_for(lambda: env.fetch("SELECT count(*) FROM g")[0][0] < ROWS - 2000, timeout=60, what="deletes")
        before = progress(env, "g")
        assert before is not None and not before.done
        proc = env.spawn("run")
        wait_for(lambda: env.reg("public", "g").snapshot_state == "done", timeout=180, what="g's snapshot")
        after = progress(env, "g")
        # resumed after the last done chunk, not started again
        assert after is not None and after.run == before.run and after.chunks > before.chunks
        assert "resuming after chunk" in env.proc_log()
    want = rows_of(env, "g")
    wait_caught_up(env)
    got = materialize(env.records(topic))
    ghosts = sorted(set(got) - set(want))
    assert not ghosts, f"{len(ghosts)} deleted keys came back, e.g. {ghosts[:5]}"
    assert got == want
    assert_versions_monotonic(env.records(topic))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, env.proc_log()
