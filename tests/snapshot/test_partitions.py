"""Partitioned tables registered as the parent (issue 11): every leaf partition is captured into the
parent's topic; rows moving between partitions end as the right row; partitions created, attached
(with rows) and detached while streaming are picked up without a restart. And a registered table
dropped at the source: recorded and shown, while the other tables keep streaming."""

from __future__ import annotations

import signal

import orjson
import pytest

from tests.plugins.capture import PROCESS_POLL_S, CaptureEnv, materialize, wait_caught_up, wait_streaming
from tests.plugins.postgres import wait_for

pytestmark = pytest.mark.cdc_config("[snapshot]\nchunk_size = 500\n")


def source_rows(env: CaptureEnv) -> dict[str, dict[str, object]]:
    return {
        orjson.dumps({"region": r, "id": i}).decode(): {"id": i, "region": r, "v": v}
        for i, r, v in env.fetch("SELECT id, region, v FROM p")
    }


def test_parent_captures_every_partition_row_movement_attach_create_detach(env: CaptureEnv) -> None:
    env.sql(
        "CREATE TABLE p (id int, region text, v int, PRIMARY KEY (region, id)) PARTITION BY LIST (region)"
    )
    env.sql("CREATE TABLE p_eu PARTITION OF p FOR VALUES IN ('eu')")
    env.sql("CREATE TABLE p_us PARTITION OF p FOR VALUES IN ('us')")
    env.sql(
        "INSERT INTO p SELECT g, CASE WHEN g % 2 = 0 THEN 'eu' ELSE 'us' END, 0 FROM generate_series(1, 2000) g"
    )
    res = env.cdc("tables", "add", "public.p", "--json")
    assert res.returncode == 0, res.stderr
    proc = env.spawn("run")
    wait_streaming(env, proc)
    topic = env.reg("public", "p").topic
    # the slot is active from its creation on, while the initial snapshot still reads: wait for it
    wait_for(lambda: env.reg("public", "p").snapshot_state == "done", timeout=120, what="p's snapshot")

    # changes in every leaf, and rows moving between partitions
    env.sql("UPDATE p SET v = 1 WHERE id <= 10")
    env.sql("UPDATE p SET region = 'us' WHERE id IN (2, 4, 6)")  # eu -> us: a delete and an insert
    env.sql("DELETE FROM p WHERE id = 1")
    wait_caught_up(env)
    assert materialize(env.records(topic)) == source_rows(env)

    # a partition created while streaming, and one attached with rows the stream never carried
    env.sql("CREATE TABLE p_asia PARTITION OF p FOR VALUES IN ('asia')")
    env.sql("INSERT INTO p VALUES (5001, 'asia', 7)")
    env.sql("CREATE TABLE p_sa (id int, region text, v int, PRIMARY KEY (region, id))")
    env.sql("INSERT INTO p_sa SELECT g, 'sa', 3 FROM generate_series(3001, 3700) g")
    env.sql("ALTER TABLE p ATTACH PARTITION p_sa FOR VALUES IN ('sa')")
    wait_for(
        lambda: len(materialize(env.records(topic))) == 2000 - 1 + 1 + 700, timeout=60, what="new partitions"
    )
    env.sql("UPDATE p SET v = 9 WHERE id IN (3001, 5001)")
    env.sql("UPDATE p SET region = 'sa' WHERE id = 3")  # us -> sa (the attached one)
    wait_caught_up(env)
    wait_for(
        lambda: materialize(env.records(topic)) == source_rows(env), timeout=60, what="the topic to match"
    )

    # a partition detached: its rows leave the parent, and the topic
    env.sql("ALTER TABLE p DETACH PARTITION p_eu")
    wait_for(
        lambda: materialize(env.records(topic)) == source_rows(env),
        timeout=60,
        what="the detached rows to go",
    )
    assert not any('"eu"' in k for k in materialize(env.records(topic)))
    env.sql("INSERT INTO p_eu VALUES (9999, 'eu', 1)")  # no longer part of p: not captured
    env.sql("UPDATE p SET v = 11 WHERE id = 5001")
    wait_caught_up(env)
    assert materialize(env.records(topic)) == source_rows(env)
    assert proc.poll() is None, env.proc_log()
    log = env.proc_log()
    assert "partitions of public.p changed" in log
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, env.proc_log()


def test_a_registered_table_dropped_at_the_source_is_shown_and_the_others_go_on(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE keep (id int PRIMARY KEY, v int)")
    env.sql("CREATE TABLE gone (id int PRIMARY KEY)")
    env.sql("INSERT INTO keep VALUES (1, 0)")
    env.add_table("public.keep")
    env.add_table("public.gone")
    proc = env.spawn("run")
    wait_streaming(env, proc)
    env.sql("DROP TABLE gone")
    env.sql("UPDATE keep SET v = 5")

    def listed() -> dict[str, dict[str, object]]:
        res = env.cdc("tables", "list", "--json")
        assert res.returncode == 0, res.stderr
        return {t["table"]: t for t in orjson.loads(res.stdout)}

    wait_for(
        lambda: "source_missing_since" in listed()["public.gone"],
        timeout=30,
        interval=PROCESS_POLL_S,
        what="the drop to be noticed",
    )
    assert "source_missing_since" not in listed()["public.keep"]
    text = env.cdc("tables", "list").stdout
    assert "MISSING at the source" in text
    wait_caught_up(env)
    env.sql("UPDATE keep SET v = 6")
    wait_caught_up(env)
    assert materialize(env.records(env.reg("public", "keep").topic)) == {'{"id":1}': {"id": 1, "v": 6}}
    # a re-snapshot of the dropped table waits, and does not stop the others
    assert env.cdc("snapshot", "public.gone").returncode == 0
    env.sql("UPDATE keep SET v = 7")
    wait_caught_up(env)
    assert materialize(env.records(env.reg("public", "keep").topic)) == {'{"id":1}': {"id": 1, "v": 7}}
    assert proc.poll() is None, env.proc_log()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, env.proc_log()


def test_a_renamed_key_column_is_refused_loudly_and_the_others_go_on(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE keep (id int PRIMARY KEY, v int)")
    env.sql("CREATE TABLE k (id int PRIMARY KEY, v int)")
    env.sql("INSERT INTO keep VALUES (1, 0)")
    env.sql("INSERT INTO k VALUES (1, 0)")
    env.add_table("public.keep")
    env.add_table("public.k")
    proc = env.spawn("run")
    wait_streaming(env, proc)
    env.sql("ALTER TABLE k RENAME COLUMN id TO kid")

    def refused() -> dict[str, str] | None:
        res = env.cdc("tables", "list", "--json")
        assert res.returncode == 0, res.stderr
        return {t["table"]: t for t in orjson.loads(res.stdout)}["public.k"].get("refused")

    found = wait_for(refused, timeout=30, interval=PROCESS_POLL_S, what="the renamed key to be refused")
    assert "kid" not in found["reason"] and "id" in found["reason"] and "cdc tables remove" in found["fix"]
    text = env.cdc("tables", "list").stdout
    assert "REFUSED" in text and "cdc tables add public.k" in text
    env.sql("INSERT INTO k VALUES (2, 0)")  # would lack its key: not captured any more
    env.sql("UPDATE keep SET v = 3")
    wait_caught_up(env)
    assert materialize(env.records(env.reg("public", "keep").topic)) == {'{"id":1}': {"id": 1, "v": 3}}
    assert "REFUSED public.k" in env.proc_log()
    assert proc.poll() is None, env.proc_log()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, env.proc_log()
