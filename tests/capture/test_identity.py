"""A table whose replica identity stops holding its key while it is captured (REPLICA IDENTITY
NOTHING, the primary key dropped): wal2json drops its UPDATEs and DELETEs with only a server
warning, so the reader refuses the table loudly, the others go on, and once the identity is back
the table is snapshotted again so the changes made meanwhile are not lost. With pgoutput the source
itself refuses such a table's UPDATEs and DELETEs (the table is in cdc's publication): nothing can be
lost, the other tables go on, and capture of the table goes on once the identity is back."""

from __future__ import annotations

import orjson
import psycopg
import pytest

from tests.plugins.capture import CaptureEnv, materialize
from tests.plugins.postgres import wait_for


def _rows(env: CaptureEnv, table: str) -> dict[str, dict[str, object]]:
    return {
        orjson.dumps({"id": i}).decode(): {"id": i, "v": v}
        for i, v in env.fetch(f"SELECT id, v FROM {table} ORDER BY id")
    }


BREAKS = pytest.mark.parametrize(
    "breaks,mends",
    [
        ("ALTER TABLE t REPLICA IDENTITY NOTHING", "ALTER TABLE t REPLICA IDENTITY DEFAULT"),
        ("ALTER TABLE t DROP CONSTRAINT t_pkey", "ALTER TABLE t ADD PRIMARY KEY (id)"),
    ],
    ids=["identity_nothing", "primary_key_dropped"],
)


def _two_tables(env: CaptureEnv) -> None:
    for t in ("t", "other"):
        env.sql(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
        env.sql(f"INSERT INTO {t} SELECT g, 'v' || g FROM generate_series(1, 5) g")
        env.add_table(f"public.{t}")
    env.run_once()


@pytest.mark.decoders("wal2json")
@BREAKS
def test_a_table_that_loses_its_replica_identity_is_refused_then_recovered(
    env: CaptureEnv, breaks: str, mends: str
) -> None:
    _two_tables(env)
    env.sql(breaks)
    env.sql("UPDATE t SET v = 'changed while unkeyable' WHERE id = 2")
    env.sql("DELETE FROM t WHERE id = 3")
    env.sql("UPDATE other SET v = 'other goes on' WHERE id = 1")
    res = env.cdc("run", "--once")
    assert res.returncode == 0, res.stderr
    assert "REFUSED public.t" in res.stderr and "wal2json drops them" in res.stderr, res.stderr
    refused = env.listed()["public.t"]["refused"]
    assert "REPLICA IDENTITY" in refused["reason"] and "REPLICA IDENTITY" in refused["fix"], refused
    assert materialize(env.records(env.reg("public", "other").topic)) == _rows(env, "other")

    env.sql(mends)
    res = env.cdc("run", "--once")
    assert res.returncode == 0, res.stderr
    assert "snapshotting it again" in res.stderr, res.stderr
    assert "refused" not in env.listed()["public.t"]
    # nothing lost: the update and the delete made while it was refused are in the topic now
    assert materialize(env.records(env.reg("public", "t").topic)) == _rows(env, "t")


@pytest.mark.decoders("pgoutput")
@BREAKS
def test_with_pgoutput_the_source_refuses_the_unkeyable_writes_and_nothing_is_lost(
    env: CaptureEnv, breaks: str, mends: str
) -> None:
    _two_tables(env)
    env.sql(breaks)
    for refused in ("UPDATE t SET v = 'changed while unkeyable' WHERE id = 2", "DELETE FROM t WHERE id = 3"):
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="replica identity"):
            env.sql(refused)
    env.sql("INSERT INTO t VALUES (6, 'an insert needs no identity')")
    env.sql("UPDATE other SET v = 'other goes on' WHERE id = 1")
    res = env.cdc("run", "--once")
    assert res.returncode == 0, res.stderr
    assert "REFUSED public.t" in res.stderr and "the source refuse them" in res.stderr, res.stderr
    assert materialize(env.records(env.reg("public", "other").topic)) == _rows(env, "other")

    env.sql(mends)
    env.sql("UPDATE t SET v = 'changed once keyed again' WHERE id = 2")
    env.sql("DELETE FROM t WHERE id = 3")
    res = env.cdc("run", "--once")
    assert res.returncode == 0, res.stderr
    assert "snapshotting it again" in res.stderr, res.stderr

    # the chunks of the snapshot again (the insert made while it was refused) follow once the
    # publication holds the table again: the next session
    def snapshotted() -> bool:
        env.run_once()
        return bool(env.listed()["public.t"]["snapshot"]["state"] == "done")

    wait_for(snapshotted, timeout=120, what="the snapshot again of public.t")
    assert "refused" not in env.listed()["public.t"]
    assert materialize(env.records(env.reg("public", "t").topic)) == _rows(env, "t")
