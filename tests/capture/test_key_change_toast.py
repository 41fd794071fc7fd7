"""A primary-key change of a row with an out-of-line TOAST column (issue 16, 2b), through the real
reader (``cdc run --once``, on each decoder: wal2json leaves the unchanged column out, pgoutput marks
it unchanged) and the real apply job (Spark): the reader fills the new key's event in from the old
key's values (issue 31), and the apply holds the row -- within one batch, across batches, after a
restart of the apply, and when the old key's insert itself was a dead letter.

The apply runs once in this process on the session's Spark (the same job `cdc apply --once` runs),
except the one killed after a sink wrote: that is ``cdc apply --once`` in a process of its own, and
the next apply in this process restarts from its checkpoint. A JVM of its own for each of the five
applies cost 25-30 s apiece."""

from __future__ import annotations

import secrets
from typing import Any

import orjson
import pytest

from tests.plugins.apply import apply_once, warehouse_rows
from tests.plugins.capture import CaptureEnv

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.decoders("wal2json", "pgoutput"),
]


def body(i: int) -> str:
    """~12 kB, incompressible, with quotes, a newline and backslashes."""
    return f"row {i} 'q' \"dq\" back\\slash\\\\ new\nline " + secrets.token_hex(6000)


def warehouse(env: CaptureEnv, table: str) -> dict[Any, dict[str, Any]]:
    return warehouse_rows(env, env.reg("public", table))


def source(env: CaptureEnv, table: str) -> dict[int, dict[str, Any]]:
    cols = "id, v, body" if table == "d" else "id, v"
    rows = env.fetch(f"SELECT {cols} FROM {table}")
    return {r[0]: dict(zip(cols.split(", "), r, strict=True)) for r in rows}


def body_of(env: CaptureEnv, key: int) -> str:
    return str(env.fetch("SELECT body FROM d WHERE id = %s", (key,))[0][0])


def same(env: CaptureEnv, table: str) -> None:
    w, s = warehouse(env, table), source(env, table)
    assert set(w) == set(s)
    for k, row in s.items():
        assert {c: w[k][c] for c in row} == row, f"{table} key {k} differs"


@pytest.mark.timeout(1800)  # a Spark start for the killed apply: minutes on a loaded 2-core box
def test_key_change_keeps_the_unchanged_toast_value(env: CaptureEnv, spark: Any) -> None:
    env.sql("CREATE TABLE d (id int PRIMARY KEY, v text, born date, body text)")
    env.sql("ALTER TABLE d ALTER COLUMN body SET STORAGE EXTERNAL")
    env.sql("CREATE TABLE other (id int PRIMARY KEY, v text)")
    for i in (1, 2, 3):
        env.sql("INSERT INTO d VALUES (%s, 'a', '2001-02-03', %s)", (i, body(i)))
    env.sql("INSERT INTO other VALUES (1, 'a')")
    env.add_table("public.d", "--search", "v,body")
    env.add_table("public.other")
    env.run_once()
    apply_once(spark, env)
    same(env, "d")

    # the reproduction: the old key's row was applied by an earlier batch; and within one
    # batch: an insert and its key change together
    env.sql("INSERT INTO d VALUES (4, 'a', '2001-02-03', %s)", (body(4),))
    env.sql("UPDATE d SET id = 40 WHERE id = 4")
    env.sql("UPDATE d SET id = 100 WHERE id = 1; UPDATE other SET v = 'b' WHERE id = 1")
    env.run_once()
    recs = [orjson.loads(r.value) for r in env.records(env.reg("public", "d").topic) if r.value]
    moved = sorted((r["after"]["id"], r["before"]) for r in recs if r["op"] == "c" and r["before"])
    assert moved == [(40, {"id": 4}), (100, {"id": 1})]
    # the reader filled the unchanged body in from the old key's
    assert all(r["unavailable"] == [] and "body" in r["after"] for r in recs if r["after"])
    out = apply_once(spark, env)
    assert out.dead_letters == 0
    same(env, "d")
    same(env, "other")

    # after a restart: the apply is killed after the first sink applied the key change's batch; the
    # restarted job replays it
    env.sql("UPDATE d SET id = 200 WHERE id = 2")
    env.run_once()
    arm = env.state.parent / "arm"
    arm.touch()
    crashed = env.cdc(
        "apply", "--once", "--json", timeout=900, extra_env={"CDC_FAULTS": f"apply.after_sink:@{arm}"}
    )
    assert crashed.returncode != 0 and "cdc-fault: apply.after_sink" in crashed.stderr, crashed.stderr[-3000:]
    apply_once(spark, env)
    same(env, "d")
    code, report = env.verify()
    assert code == 0, report
    assert [(t["table"], t["status"]) for t in report] == [("public.d", "ok"), ("public.other", "ok")], report

    # the old key's insert was a dead letter (a BC date): its key change's new row is whole all the
    # same (the reader filled body in from the old key's), so it is applied; only the insert is not
    env.sql("INSERT INTO d VALUES (7, 'a', '0044-03-15 BC', %s)", (body(7),))
    env.sql("UPDATE d SET id = 70, born = '2000-01-01' WHERE id = 7; UPDATE other SET v = 'c' WHERE id = 1")
    env.run_once()
    out = apply_once(spark, env)
    assert out.dead_letters == 1
    assert warehouse(env, "other")[1]["v"] == "c"
    assert 7 not in warehouse(env, "d")
    assert warehouse(env, "d")[70]["body"] == body_of(env, 70)
    res = env.cdc("deadletters", "list", "--table", "public.d", "--json")
    listed = {d["key"]: d["reason"] for d in orjson.loads(res.stdout)}
    assert set(listed) == {'{"id":7}'} and "born" in listed['{"id":7}']
