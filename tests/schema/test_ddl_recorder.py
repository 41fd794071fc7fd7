"""The DDL recorder end to end (issue 11): with the event trigger installed (`cdc check --fix`), the
real reader takes schema changes from the recorder's messages in the stream -- renames exactly, a
table dropped or renamed at once -- and DDL on tables it does not capture leaves it undisturbed."""

from __future__ import annotations

import signal
from typing import Any

import orjson

from tests.plugins.capture import CaptureEnv, wait_caught_up, wait_streaming
from tests.plugins.postgres import wait_for
from tests.schema.helpers import install_recorder, rename_two_columns_then_write


def test_renames_are_told_exactly_and_ddl_elsewhere_does_not_disturb_capture(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE items (id int PRIMARY KEY, name text, note text, qty int)")
    env.sql("INSERT INTO items SELECT g, 'item ' || g, 'note ' || g, g FROM generate_series(1, 30) g")
    env.sql("CREATE TABLE bystander (id int PRIMARY KEY, v text)")
    install_recorder(env)
    env.add_table("public.items", "--search", "name,note")
    proc = env.spawn("run")
    try:
        wait_streaming(env, proc)
        # DDL on a table the service does not capture: recorded, ignored
        env.sql("ALTER TABLE bystander ADD COLUMN w int")
        env.sql("ALTER TABLE bystander RENAME COLUMN v TO vv")
        env.sql("ALTER TABLE bystander RENAME TO bystander2")
        env.sql("DROP TABLE bystander2")
        env.sql("UPDATE items SET qty = qty + 100 WHERE id <= 3")
        wait_caught_up(env)
        assert proc.poll() is None, env.proc_log()
        assert env.reg("public", "items").schema_version == 1

        # two renames before any row: the rows alone show two columns gone and two new ones (a drop
        # and an add each); the recorder says they are renames
        rename_two_columns_then_write(env)
        assert proc.poll() is None, env.proc_log()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, env.proc_log()

    log = env.proc_log()
    assert "told by the DDL recorder" in log and "(DDL recorder)" in log, log
    assert "bystander" not in log, log
    reg = env.reg("public", "items")
    assert [c.name for c in reg.columns] == ["id", "title", "memo", "qty"]
    assert reg.dropped_columns == ("name", "note") and reg.search == ("title", "memo")
    assert reg.search_field("title") == "name" and reg.search_field("memo") == "note"
    values = env.values(reg.topic)
    (upd,) = [v for v in values if v["op"] == "u" and v["after"]["qty"] == -1]
    # the first rename and the second each bump the version before the row
    assert upd["source"]["schema_version"] == 3 and set(upd["after"]) == {"id", "title", "memo", "qty"}
    assert upd["unavailable"] == []
    snap = [v for v in values if v["op"] == "r" and v["source"]["commit_lsn"] > upd["source"]["commit_lsn"]]
    assert {v["after"]["id"] for v in snap} >= set(range(2, 31))  # every row again, new names
    assert all("title" in v["after"] and "name" not in v["after"] for v in snap)


def test_a_dropped_and_a_renamed_table_are_told_at_once(env: CaptureEnv) -> None:
    for t in ("keep", "gone", "moved"):
        env.sql(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
        env.sql(f"INSERT INTO {t} VALUES (1, 'a')")
    install_recorder(env)
    for t in ("keep", "gone", "moved"):
        env.add_table(f"public.{t}")
    proc = env.spawn("run")
    try:
        wait_streaming(env, proc)
        env.sql("DROP TABLE gone")
        env.sql("ALTER TABLE moved RENAME TO moved2")

        def told() -> dict[str, dict[str, Any]] | None:
            rows = env.listed()
            ok = all("source_missing_ddl" in rows[t] for t in ("public.gone", "public.moved"))
            return rows if ok else None

        rows = wait_for(told, timeout=60, what="the drop and the rename in cdc tables list")
        assert rows["public.gone"]["source_missing_ddl"] == {
            "what": "dropped",
            "to": None,
            "tag": "DROP TABLE",
        }
        assert rows["public.moved"]["source_missing_ddl"]["to"] == "public.moved2"
        assert "source_missing_since" not in rows["public.keep"]
        text = env.cdc("tables", "list").stdout
        assert "MISSING at the source: dropped (DROP TABLE)" in text, text
        assert "MISSING at the source: renamed to public.moved2" in text, text
        status = orjson.loads(env.cdc("status", "--json", timeout=120).stdout)
        stages = {s["table"]: s for s in status["stages"] if s["stage"] == "source_table"}
        assert "renamed to public.moved2" in stages["public.moved"]["reason"]
        assert "`cdc tables add public.moved2`" in stages["public.moved"]["fix"]
        assert "dropped by DROP TABLE" in stages["public.gone"]["reason"]

        env.sql("INSERT INTO keep VALUES (2, 'b')")  # the others go on
        wait_caught_up(env)
        assert proc.poll() is None, env.proc_log()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, env.proc_log()
    assert "told by the DDL recorder" in env.proc_log()
    assert {v["after"]["id"] for v in env.values(env.reg("public", "keep").topic)} == {1, 2}
