"""Snapshots: the initial one under concurrent writes, a crash in the middle, re-snapshot requests,
progress output, and a lost slot."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import psycopg
import pytest

from tests.plugins.capture import CaptureEnv, assert_versions_monotonic, materialize, rows_of, topic_size
from tests.plugins.postgres import wait_for


def test_changes_during_the_initial_snapshot_are_neither_lost_nor_applied_before_their_row(
    env: CaptureEnv,
) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v int, pad text)")
    env.sql("INSERT INTO t SELECT g, 0, repeat('p', 100) FROM generate_series(1, 100000) g")
    env.add_table("public.t")
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        rnd = random.Random(11)
        n = 100001
        try:
            with psycopg.connect(env.dsn, autocommit=True) as conn:
                while not stop.is_set():
                    with conn.transaction():
                        conn.execute("UPDATE t SET v = v + 1 WHERE id = %s", [rnd.randint(1, n)])
                        conn.execute("INSERT INTO t VALUES (%s, -1, 'new')", [n])
                        conn.execute("DELETE FROM t WHERE id = %s", [rnd.randint(1, n)])
                        n += 1
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    proc = env.spawn("run")
    try:
        wait_for(lambda: env.reg("public", "t").snapshot_state == "done", timeout=120, what="the snapshot")
        time.sleep(1.0)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not errors, errors
    topic = env.reg("public", "t").topic
    want = rows_of(env, "t")
    wait_for(
        lambda: materialize(env.records(topic)) == want, timeout=60, what="the topic to match the source"
    )
    records = env.records(topic)
    assert_versions_monotonic(records)
    ops = [orjson.loads(r.value)["op"] for r in records if r.value]
    assert ops.count("r") > 90000 and ops.count("u") > 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, env.proc_log()


def test_kill_9_during_the_snapshot_then_restart_completes_it(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE big (id int PRIMARY KEY, pad text)")
    env.sql("INSERT INTO big SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, 300000) g")
    env.add_table("public.big")
    topic = env.reg("public", "big").topic
    proc = env.spawn("run")
    wait_for(
        lambda: env.reg("public", "big").snapshot_state == "running" and topic_size(env, topic) > 0,
        timeout=60,
        interval=0.01,
        what="the snapshot to be running",
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    written = topic_size(env, topic)
    assert env.reg("public", "big").snapshot_state == "running"
    assert written < 300000, "the snapshot finished before the kill; make the table bigger"
    env.sql("UPDATE big SET pad = 'changed' WHERE id <= 10")
    env.run_once()
    reg = env.reg("public", "big")
    assert reg.snapshot_state == "done" and reg.alignment is not None
    got = materialize(env.records(topic))
    assert len(got) == 300000
    assert got['{"id":5}']["pad"] == "changed" and got['{"id":11}']["pad"] != "changed"


def test_snapshot_request_resnapshots_only_that_table(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE a (id int PRIMARY KEY)")
    env.sql("CREATE TABLE b (id int PRIMARY KEY)")
    env.sql("INSERT INTO a SELECT generate_series(1, 10)")
    env.sql("INSERT INTO b SELECT generate_series(1, 20)")
    env.add_table("public.a")
    env.add_table("public.b")
    first = env.run_once()
    assert first["snapshot_rows"] == {"public.a": 10, "public.b": 20}
    lsn_a = env.reg("public", "a").alignment.consistent_lsn  # type: ignore[union-attr]
    env.sql("DELETE FROM a WHERE id > 5")
    res = env.cdc("snapshot", "public.a", "--json")
    assert res.returncode == 0, res.stderr
    assert orjson.loads(res.stdout) == {"requested": ["public.a"], "where": None}
    assert env.reg("public", "a").snapshot_state == "pending"
    second = env.run_once()
    assert second["snapshot_rows"] == {"public.a": 5}
    reg_a = env.reg("public", "a")
    assert (
        reg_a.snapshot_state == "done"
        and reg_a.alignment is not None
        and reg_a.alignment.consistent_lsn > lsn_a
    )
    assert len(materialize(env.records(reg_a.topic))) == 5
    bad = env.cdc("snapshot")
    assert bad.returncode == 2 and "--all" in bad.stderr


def test_json_progress_lines(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.sql("INSERT INTO t SELECT generate_series(1, 12345)")
    env.sql("ANALYZE t")
    env.add_table("public.t")
    res = env.cdc("run", "--once", "--json")
    assert res.returncode == 0, res.stderr
    lines = [orjson.loads(line) for line in res.stderr.splitlines() if line.startswith("{")]
    progress = [p for p in lines if p.get("event") == "snapshot_progress"]
    assert progress and progress[-1]["done"] is True and progress[-1]["rows"] == 12345
    assert progress[-1]["estimate"] == 12345 and progress[-1]["table"] == "public.t"


def test_missing_slot_after_snapshot_needs_a_resnapshot(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.sql("INSERT INTO t SELECT generate_series(1, 3)")
    env.add_table("public.t")
    env.run_once()
    env.pg.execute(f"SELECT pg_drop_replication_slot('{env.slot}')")
    env.sql("INSERT INTO t VALUES (4)")
    res = env.cdc("run", "--once")
    assert res.returncode == 3, res.stderr
    assert "cdc snapshot --all" in res.stderr
    assert env.cdc("snapshot", "--all").returncode == 0
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.t": 4}
    assert len(materialize(env.records(env.reg("public", "t").topic))) == 4


def test_slot_left_by_an_unfinished_initial_snapshot_is_recreated(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.sql("INSERT INTO t SELECT generate_series(1, 3)")
    env.add_table("public.t")
    env.pg.execute(
        f"SELECT pg_create_logical_replication_slot('{env.slot}', '{env.settings().decoder}')", env.db
    )
    with env.registry() as r:
        r.set_snapshot_state("public", "t", "running")
        r.set_state("initial_snapshot", "running")
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.t": 3}
    assert env.reg("public", "t").snapshot_state == "done"


@pytest.mark.postgres  # no cluster used; kept out of make check as before
def test_run_without_source_is_a_config_error(tmp_path: Path) -> None:
    res = subprocess.run(
        [
            "env",
            "-u",
            "CDC_SOURCE",
            sys.executable,
            "-c",
            "from cdc.cli import entry; entry()",
            "--state",
            str(tmp_path),
            "run",
            "--once",
        ],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert res.returncode == 2 and "CDC_SOURCE" in res.stderr


def test_foreign_slot_of_the_same_name_is_not_dropped(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.add_table("public.t")
    env.pg.execute(
        f"SELECT pg_create_logical_replication_slot('{env.slot}', '{env.settings().decoder}')", env.db
    )
    res = env.cdc("run", "--once")
    assert res.returncode == 1 and "already exists" in res.stderr and "CDC_SLOT" in res.stderr
    assert env.pg.fetch(f"SELECT 1 FROM pg_replication_slots WHERE slot_name = '{env.slot}'")
