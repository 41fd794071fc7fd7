"""The pgoutput decoder through the real reader (``cdc run``): cdc keeps its publication in step with
the registered tables, NaN/Infinity arrive exact with no trigger on the source, an unchanged TOAST
value is never null, a partitioned table's changes come under the parent, a TRUNCATE becomes an
event, a table registered while the reader streams is snapshotted in chunks (its watermarks come
through the publication), and `cdc check`, `cdc tables list`, `cdc status` say which decoder runs.
The differential test of the two decoders is ``test_pgoutput_differential.py``."""

from __future__ import annotations

from typing import Any

import orjson
import psycopg
import pytest

from tests.plugins.capture import CaptureEnv, materialize, wait_streaming
from tests.plugins.postgres import wait_for

pytestmark = pytest.mark.decoders("pgoutput", "pgoutput@pg18")

BIG = "x" * 50_000 + "\n'quote' \"dq\" \\back\\ ,comma\n" + "y" * 50_000


def _published(env: CaptureEnv) -> set[tuple[str, str]]:
    rows = env.fetch(
        "SELECT schemaname::text, tablename::text FROM pg_publication_tables WHERE pubname = %s",
        [env.slot],
    )
    return {(str(s), str(t)) for s, t in rows}


def _by_key(env: CaptureEnv, table: str) -> dict[str, dict[str, Any]]:
    """The topic as a versioned sink holds it (unchanged TOAST values merged from earlier rows)."""
    return materialize(env.records(env.reg("public", table).topic))


def test_pgoutput_capture_end_to_end(env: CaptureEnv) -> None:
    env.sql(
        "CREATE TABLE t (id int PRIMARY KEY, f float8, r real, n numeric, big text, tags text[], "
        "j jsonb, b bytea)"
    )
    env.sql("ALTER TABLE t ALTER big SET STORAGE EXTERNAL")  # out of line, uncompressed
    env.sql(
        "INSERT INTO t VALUES (1, 'NaN', '-Infinity', 'Infinity', %s, '{a,\"b c\",NULL,\"q\\\"x\"}', "
        "'{\"k\": [1, 2.50]}', '\\x00ff'), (2, 1.5, 0.25, 12345678901234567890.123456789, 'small', '{}', "
        "'null', NULL)",
        [BIG],
    )
    env.sql(
        "CREATE TABLE p (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)"
    )
    env.sql("CREATE TABLE p_eu PARTITION OF p FOR VALUES IN ('eu')")
    env.sql("CREATE TABLE p_us PARTITION OF p FOR VALUES IN ('us')")
    env.sql("INSERT INTO p VALUES (1, 'eu', 'a'), (2, 'us', 'b')")
    env.add_table("public.t")
    env.add_table("public.p")
    assert _published(env) == {("public", "t"), ("public", "p")}  # tables add created it
    assert env.fetch("SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal") == [(0,)]  # no recorder

    env.run_once()  # the initial snapshot
    # the same values again, streamed: each must encode exactly as the snapshot encoded it
    env.sql("INSERT INTO t SELECT id + 100, f, r, n, big, tags, j, b FROM t")
    env.sql("UPDATE t SET f = '-Infinity', n = 'NaN', r = 'NaN' WHERE id = 1")  # big: unchanged TOAST
    env.sql("UPDATE t SET id = 3 WHERE id = 2")  # a key change
    env.sql("DELETE FROM p WHERE id = 2")
    env.sql("INSERT INTO p VALUES (3, 'us', %s)", ["quote ' and\nnewline \\ back"])
    result = env.run_once()
    assert result["reason"] == "caught_up", result

    events = env.values(env.reg("public", "t").topic)
    snap = {ev["after"]["id"]: ev["after"] for ev in events if ev["op"] == "r"}
    streamed = {ev["after"]["id"]: ev["after"] for ev in events if ev["op"] == "c"}
    assert snap.keys() == {1, 2} and streamed.keys() == {101, 102, 3}  # 3: the key change's create
    for i in (1, 2):
        assert {**streamed[i + 100], "id": i} == snap[i]
    assert snap[1]["f"] == "NaN" and snap[1]["n"] == "Infinity" and snap[1]["r"] == "-Infinity"
    (upd,) = [ev for ev in events if ev["op"] == "u" and ev["after"]["id"] == 1]
    assert (upd["after"]["f"], upd["after"]["n"], upd["after"]["r"]) == ("-Infinity", "NaN", "NaN")
    # the unchanged TOAST value, marked unchanged by pgoutput: filled in by the reader
    assert upd["after"]["big"] == BIG and upd["unavailable"] == []
    assert _by_key(env, "t").keys() == {orjson.dumps({"id": i}).decode() for i in (1, 3, 101, 102)}
    assert _by_key(env, "t")['{"id":1}']["big"] == BIG  # merged from the snapshot's row
    assert _by_key(env, "p") == rows_of_p(env)

    # TRUNCATE: an event the topic carries; later rows follow it
    env.sql("TRUNCATE p")
    env.sql("INSERT INTO p VALUES (9, 'eu', 'after')")
    env.run_once()
    assert any(ev["op"] == "t" for ev in env.values(env.reg("public", "p").topic))
    assert _by_key(env, "p") == rows_of_p(env)

    listed = env.cdc("tables", "list")
    assert listed.returncode == 0 and f"decoder: pgoutput (publication {env.slot})" in listed.stdout
    assert {t["decoder"] for t in env.listed().values()} == {"pgoutput"}
    report = orjson.loads(env.cdc("check", "--json").stdout)
    (info,) = [f for f in report["findings"] if f["check"] == "decoder"]
    assert info["values"] == {"decoder": "pgoutput", "publication": env.slot}
    assert not [f for f in report["findings"] if f["severity"] == "error"], report
    assert "nonfinite_recorder" not in [f["check"] for f in report["findings"]]

    # a table removed from the publication behind cdc's back: an error with the SQL that fixes it
    env.sql(f"ALTER PUBLICATION {env.slot} DROP TABLE p")
    report = orjson.loads(env.cdc("check", "--json").stdout)
    (missing,) = [f for f in report["findings"] if f["check"] == "publication"]
    assert missing["severity"] == "error" and missing["values"]["missing"] == ["public.p"]
    assert f'ALTER PUBLICATION "{env.slot}" ADD TABLE "public"."p";' in missing["fix"]
    env.run_once()  # the reader puts it back
    assert ("public", "p") in _published(env)

    # tables remove drops it from the publication
    assert env.cdc("tables", "remove", "public.p").returncode == 0
    assert ("public", "p") not in _published(env)


def rows_of_p(env: CaptureEnv) -> dict[str, dict[str, Any]]:
    return {
        orjson.dumps({"id": i, "region": r}).decode(): {"id": i, "region": r, "v": v}
        for i, r, v in env.fetch("SELECT id, region, v FROM p")
    }


def test_table_added_while_streaming_is_snapshotted_through_the_publication(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE a (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO a SELECT g, 'a' || g FROM generate_series(1, 10) g")
    env.sql("CREATE TABLE late (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO late SELECT g, 'l' || g FROM generate_series(1, 500) g")
    env.add_table("public.a")
    proc = env.spawn("run")
    wait_streaming(env, proc)
    env.add_table("public.late")  # while the reader streams: chunked, between watermarks
    env.sql("UPDATE late SET v = 'changed' WHERE id <= 5")
    env.sql("DELETE FROM late WHERE id > 490")
    wait_for(
        lambda: env.reg("public", "late").snapshot_state == "done",
        timeout=60,
        what="the chunked snapshot of the late table",
    )
    env.sql("INSERT INTO late VALUES (1000, 'after the snapshot')")
    want = {
        orjson.dumps({"id": i}).decode(): {"id": i, "v": v} for i, v in env.fetch("SELECT id, v FROM late")
    }
    wait_for(lambda: _by_key(env, "late") == want, timeout=60, what="the late table's topic = the source")
    assert proc.poll() is None, env.proc_log()
    assert _published(env) == {("public", "a"), ("public", "late"), ("public", "cdc_watermark")}


@pytest.mark.decoders("pgoutput")  # PostgreSQL 18 of the wheel has no wal2json to create the first slot
def test_a_slot_of_the_other_decoder_is_refused_with_the_way_to_switch(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.add_table("public.t")
    res = env.cdc("run", "--once", extra_env={"CDC_DECODER": "wal2json"})
    assert res.returncode == 0, res.stderr  # the slot is created with wal2json
    res = env.cdc("run", "--once")  # cdc.toml: pgoutput
    assert res.returncode == 2, res.stderr
    assert "was created with 'wal2json'" in res.stderr and "pg_drop_replication_slot" in res.stderr
    assert "Traceback" not in res.stderr


def test_a_big_transaction_streams_in_blocks_and_only_committed_rows_arrive(env: CaptureEnv) -> None:
    """With ``streaming`` on, a transaction bigger than ``logical_decoding_work_mem`` reaches the reader
    in blocks before its commit; the reader spools them and emits the transaction at its commit,
    leaving out the rows of a subtransaction rolled back in the middle; a transaction that commits
    meanwhile is not held up."""
    env.sql(f"ALTER DATABASE \"{env.db}\" SET logical_decoding_work_mem = '64kB'")
    env.sql("CREATE TABLE big (id int PRIMARY KEY, v text)")
    env.sql("CREATE TABLE small (id int PRIMARY KEY)")
    env.add_table("public.big")
    env.add_table("public.small")
    env.run_once()
    proc = env.spawn("run")
    wait_streaming(env, proc)
    with psycopg.connect(env.dsn) as conn:  # one transaction
        conn.execute("INSERT INTO big SELECT g, 'row ' || g FROM generate_series(1, 40000) g")
        conn.execute("SAVEPOINT s")
        conn.execute("INSERT INTO big SELECT g, 'rolled back' FROM generate_series(40001, 50000) g")
        conn.execute("ROLLBACK TO SAVEPOINT s")
        env.sql("INSERT INTO small VALUES (1)")  # commits while the big one is open
        wait_for(lambda: _by_key(env, "small") == {'{"id":1}': {"id": 1}}, timeout=60, what="small's row")
        conn.execute(
            "INSERT INTO big SELECT g, e'quote '' \\\\ and\\nnewline ' || g FROM generate_series(50001, 60000) g"
        )
    want = {i for i in range(1, 40001)} | {i for i in range(50001, 60001)}
    wait_for(
        lambda: {int(k[6:-1]) for k in _by_key(env, "big")} == want,
        timeout=120,
        what="the big transaction's committed rows in the topic",
    )
    streamed = env.fetch(
        "SELECT stream_txns, stream_count FROM pg_stat_replication_slots WHERE slot_name = %s", [env.slot]
    )
    assert streamed and streamed[0][0] >= 1 and streamed[0][1] > 1, streamed  # sent in blocks
    assert _by_key(env, "big")['{"id":50001}']["v"] == "quote ' \\ and\nnewline 50001"
    assert proc.poll() is None, env.proc_log()


def test_stored_generated_columns(env: CaptureEnv, capture_source: str) -> None:
    """PostgreSQL 18 publishes stored generated columns (the publication asks for them); before 18
    pgoutput never sends them, so ``tables add`` leaves them out of the capture with a warning, and
    the snapshot and the stream agree."""
    env.sql("CREATE TABLE g (id int PRIMARY KEY, a int, b int GENERATED ALWAYS AS (a * 2) STORED)")
    env.sql("INSERT INTO g (id, a) VALUES (1, 1)")
    res = env.cdc("tables", "add", "public.g")
    assert res.returncode == 0, res.stderr
    on_18 = capture_source.endswith("@pg18")
    assert ("stored generated column" in res.stderr) is not on_18, res.stderr
    env.run_once()
    env.sql("INSERT INTO g (id, a) VALUES (2, 2)")
    env.sql("UPDATE g SET a = 5 WHERE id = 1")
    env.run_once()
    events = [(ev["op"], ev["after"]) for ev in env.values(env.reg("public", "g").topic)]
    if on_18:
        assert events == [
            ("r", {"id": 1, "a": 1, "b": 2}),
            ("c", {"id": 2, "a": 2, "b": 4}),
            ("u", {"id": 1, "a": 5, "b": 10}),
        ]
    else:
        assert events == [("r", {"id": 1, "a": 1}), ("c", {"id": 2, "a": 2}), ("u", {"id": 1, "a": 5})]
        assert env.reg("public", "g").exclude == ("b",)
    assert [c.name for c in env.reg("public", "g").columns] == (["id", "a", "b"] if on_18 else ["id", "a"])
