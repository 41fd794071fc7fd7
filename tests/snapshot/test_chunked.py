"""Chunked snapshots while streaming (issue 11): a late table under a concurrent insert/update/delete
load ends identical in the topic, the warehouse and the search index (`cdc verify` clean) while the
other tables keep streaming; composite text keys with parallel chunks resume after kill -9 from the
last done chunk; `cdc snapshot --where` re-reads only the matching rows and refuses hostile text."""

from __future__ import annotations

import random
import signal
from typing import Any

import orjson
import psycopg
import pytest

from tests.plugins.apply import cdc_cli, reader_env
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

pytestmark = [
    pytest.mark.cdc_config("[snapshot]\nchunk_size = 2048\n"),
    pytest.mark.decoders("wal2json", "pgoutput"),
]


class Load(SourceLoad):
    """Inserts, updates and deletes on ``big`` (and updates of ``other``) on a thread."""

    def __init__(self, env: CaptureEnv, first_new: int, seed: int = 5) -> None:
        super().__init__(env)
        self.next_id = first_new
        self.rnd = random.Random(seed)

    def loop(self, conn: psycopg.Connection[Any]) -> None:
        rnd = self.rnd
        while not self.stop.is_set():
            with conn.transaction():
                k = rnd.randint(1, self.next_id)
                conn.execute(
                    "UPDATE big SET qty = qty + 1, name = name || '+', price = price * 2 WHERE id = %s",
                    [k],
                )
                conn.execute(
                    "INSERT INTO big VALUES (%s, %s, 0, 1.000001, now())",
                    [self.next_id, f"new row {self.next_id}"],
                )
                self.next_id += 1
                lo = rnd.randint(1, self.next_id)
                conn.execute("DELETE FROM big WHERE id BETWEEN %s AND %s", [lo, lo + 1])
            conn.execute("UPDATE other SET v = v + 1 WHERE id = 1")


# ~98 chunks of 512 rows: as many chunks (and chunk bounds under the load) as 200,000 rows in chunks
# of 2,048, at a quarter of the rows to read, write, apply, index and verify
@pytest.mark.cdc_config("[snapshot]\nchunk_size = 512\n")
def test_late_table_under_load_ends_identical_in_warehouse_and_index_while_others_stream(
    env: CaptureEnv, spark_clean: Any
) -> None:
    rows = 50_000
    env.sql("CREATE TABLE other (id int PRIMARY KEY, v int)")
    env.sql("INSERT INTO other VALUES (1, 0)")
    env.sql(
        "CREATE TABLE big (id bigint PRIMARY KEY, name text, qty int, price numeric(20,6), ts timestamptz)"
    )
    env.sql(
        "INSERT INTO big SELECT g, 'item ' || g, g % 100, g / 7.0, '2026-01-01'::timestamptz + g * interval '1 s' "
        f"FROM generate_series(1, {rows}) g"
    )
    env.sql("ANALYZE big")
    env.add_table("public.other")
    proc = env.spawn("run")
    wait_streaming(env, proc)
    topic_other = env.reg("public", "other").topic
    with Load(env, rows + 1) as load:
        env.add_table("public.big", "--search", "name")
        wait_for(
            lambda: (p := progress(env, "big")) is not None and p.chunks >= 2, timeout=120, what="chunks"
        )
        # the other table streams meanwhile: a marked change reaches its topic before the snapshot ends
        env.sql("UPDATE other SET v = -1000000 WHERE id = 1")

        def other_marked() -> bool:
            got = materialize(env.records(topic_other))
            return any(r["v"] <= -1000000 + 10_000 and r["v"] < 0 for r in got.values())

        wait_for(other_marked, timeout=30, what="the other table's change during the snapshot")
        p = progress(env, "big")
        assert p is not None and not p.done, (
            "the snapshot ended before the other table's change: make big bigger"
        )
        assert 0 < p.chunks < 98
        wait_for(
            lambda: env.reg("public", "big").snapshot_state == "done", timeout=300, what="big's snapshot"
        )
    wait_caught_up(env)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, env.proc_log()

    topic = env.reg("public", "big").topic
    want = rows_of(env, "big")
    got = materialize(env.records(topic))
    assert set(got) == set(want)
    records = env.records(topic)
    assert_versions_monotonic(records)
    ops = [orjson.loads(r.value)["op"] for r in records if r.value]
    assert ops.count("r") > rows * 0.9 and ops.count("d") > 0 and ops.count("u") > 0

    # tables list shows the finished chunked snapshot
    code, out = cdc_cli(env.dsn, env.state, "tables", "list", "--json")
    listed = {t["table"]: t for t in orjson.loads(out)}
    prog = listed["public.big"]["snapshot"]["progress"]
    # chunks of chunk_size rows in key order: 50k rows, 512 a chunk, less the load's deletes ahead of
    # the snapshot (2 rows a transaction at most) and more its inserts behind the last key (1 each);
    # how many transactions ran depends on the machine's speed (105 chunks seen on a slow one)
    txns = load.next_id - (rows + 1)
    fewest, most = (rows - 2 * txns) // 512, -(-(rows + txns) // 512) + 1
    assert code == 0 and prog["done"] and prog["chunks_left"] == 0, prog
    assert max(fewest, 1) <= prog["chunks_done"] <= most, (prog, txns)

    # the Spark apply job, then verify against the source: clean
    from tests.plugins.apply import run_job

    summary = run_job(spark_clean, reader_env(env.state))
    assert summary.dead_letters == 0
    code, out = cdc_cli(env.dsn, env.state, "verify", "--json", "--wait", "30")
    reports = {r["table"]: r for r in orjson.loads(out)}
    big = reports["public.big"]
    assert code == 0, big
    assert big["source_rows"] == big["warehouse_rows"] == big["search_docs"] == len(want)
    assert not any(big[k] for k in ("missing", "extra", "different")), big


class _Writer(SourceLoad):
    """Updates, deletes and inserts on ``c`` across its text key's regions, on a thread."""

    def loop(self, conn: psycopg.Connection[Any]) -> None:
        rnd = random.Random(3)
        regions = ["eu", "us", "Ünïcode", "a b", "x'y"]
        while not self.stop.is_set():
            r, n = rnd.choice(regions), rnd.randint(1, 12000)
            conn.execute("UPDATE c SET label = 'changed ' || n WHERE region = %s AND n = %s", [r, n])
            conn.execute("DELETE FROM c WHERE region = %s AND n = %s", [rnd.choice(regions), n + 1])
            conn.execute(
                "INSERT INTO c VALUES (%s, %s, 'inserted') ON CONFLICT DO NOTHING",
                [rnd.choice(regions), rnd.randint(12001, 20000)],
            )


@pytest.mark.cdc_config("[snapshot]\nchunk_size = 1000\nparallel_chunks = 3\n")
def test_composite_text_key_parallel_chunks_resume_after_kill_9(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE c (region text, n int, label text, PRIMARY KEY (region, n))")
    env.sql(
        "INSERT INTO c SELECT r, g, md5(r || g) FROM unnest(ARRAY['eu', 'us', 'Ünïcode', 'a b', 'x''y']) r, "
        "generate_series(1, 12000) g"
    )
    env.sql("CREATE TABLE other (id int PRIMARY KEY, v int)")
    env.sql("INSERT INTO other VALUES (1, 0)")
    env.add_table("public.other")
    proc = env.spawn("run")
    wait_streaming(env, proc)
    with _Writer(env):
        env.add_table("public.c")
        wait_for(lambda: (p := progress(env, "c")) is not None and p.chunks >= 6, timeout=120, what="chunks")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        before = progress(env, "c")
        assert before is not None and not before.done, "finished before the kill: make c bigger"
        proc = env.spawn("run")
        wait_for(lambda: env.reg("public", "c").snapshot_state == "done", timeout=180, what="c's snapshot")
    after = progress(env, "c")
    assert after is not None and after.run == before.run and after.chunks > before.chunks
    assert 60 <= after.chunks <= 70, after  # 60k rows (plus inserts) in chunks of 1000
    wait_caught_up(env)
    want = {
        orjson.dumps({"region": r, "n": n}).decode(): {"region": r, "n": n, "label": lab}
        for r, n, lab in env.fetch("SELECT region, n, label FROM c")
    }
    got = materialize(env.records(env.reg("public", "c").topic))
    assert got == want
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, env.proc_log()


def test_where_resnapshots_only_matching_rows_and_refuses_hostile_text(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, kind text)")
    env.sql(
        "INSERT INTO t SELECT g, CASE WHEN g % 2 = 0 THEN 'even' ELSE 'odd' END FROM generate_series(1, 100) g"
    )
    env.add_table("public.t")
    env.run_once()
    topic = env.reg("public", "t").topic

    def snapshot_rows() -> int:
        return sum(1 for r in env.records(topic) if r.value and orjson.loads(r.value)["op"] == "r")

    first = snapshot_rows()
    assert first == 100
    for hostile in [
        "id > 0; DROP TABLE t",
        "id > 0 OR 1=1",
        "id > (SELECT 1)",
        "pg_sleep(1) IS NULL",
        "nope = 1",
        "kind = 'unterminated",
        "id > 0 -- comment",
    ]:
        res = env.cdc("snapshot", "public.t", "--where", hostile)
        assert res.returncode == 2, (hostile, res.stderr)
        assert "--where" in res.stderr and "fix" in res.stderr.lower(), res.stderr
    assert env.reg("public", "t").snapshot_state == "done"
    res = env.cdc("snapshot", "public.t", "--where", "kind = 'even' AND id <= 40", "--json")
    assert res.returncode == 0, res.stderr
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.t": 20}
    assert snapshot_rows() == first + 20
    assert len(materialize(env.records(topic))) == 100  # a partial snapshot removes nothing
    assert env.fetch("SELECT count(*) FROM t")[0][0] == 100


@pytest.mark.parametrize(
    "policy",
    [
        "fail",
        pytest.param(
            "resnapshot",
            marks=pytest.mark.cdc_config('slot_lost = "resnapshot"\n[snapshot]\nchunk_size = 2048\n'),
        ),
    ],
)
def test_recovery_after_a_lost_slot_is_chunked_and_removes_rows_deleted_meanwhile(
    env: CaptureEnv, policy: str
) -> None:
    """A gone slot (here dropped by hand; after a failover to a server without it, the same): with
    ``slot_lost = "fail"`` (the default) ``cdc run`` exits 3 and ``cdc snapshot --all`` is the fix;
    with ``"resnapshot"`` ``cdc run`` recovers by itself and ``cdc status`` says so. Either way a new
    slot, every table snapshotted again in chunks with its TRUNCATE marker, so rows deleted while no
    slot existed do not survive."""
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v int)")
    env.sql("INSERT INTO t SELECT g, 0 FROM generate_series(1, 5000) g")
    env.add_table("public.t")
    env.run_once()
    env.pg.execute(f"SELECT pg_drop_replication_slot('{env.slot}')")
    env.sql("DELETE FROM t WHERE id % 10 = 0")  # lost with the slot
    env.sql("UPDATE t SET v = 1 WHERE id % 10 = 1")
    if policy == "fail":
        assert env.cdc("run", "--once").returncode == 3
        assert env.cdc("snapshot", "--all").returncode == 0
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.t": 4500}
    p = progress(env, "t")
    assert p is not None and p.done and p.full and p.chunks == 3  # 2048 a chunk
    got = materialize(env.records(env.reg("public", "t").topic))
    assert got == rows_of(env, "t")  # no deleted row left behind
    if policy == "resnapshot":
        assert "the slot does not exist on the source any more" in env.last_stderr
        status = orjson.loads(env.cdc("status", "--json").stdout)
        (slot,) = [s for s in status["stages"] if s["stage"] == "slot"]
        assert slot["dropped"]["tables"] == ["public.t"] and "resnapshot" in slot["dropped"]["reason"]
        assert slot["dropped"]["reread"] == {"public.t": 4500}


def test_check_explains_the_watermark_table_and_fix_creates_it(env: CaptureEnv) -> None:
    role = f"cdc_low_{env.slot[-8:]}"
    env.sql(f"CREATE ROLE {role} LOGIN REPLICATION PASSWORD 'pw'")
    env.sql("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    low = env.pg.dsn(env.db, user=role, password="pw")

    def check(dsn: str, *extra: str) -> dict[str, Any]:
        res = env.cdc("--source", dsn, "check", "--json", *extra)
        assert res.returncode in (0, 1, 2), res.stderr
        return dict(orjson.loads(res.stdout))

    report = check(low)
    found = [f for f in report["findings"] if f["check"] == "watermark_table"]
    assert found and found[0]["severity"] == "warning" and "CREATE TABLE" in found[0]["fix"], found
    report = check(env.dsn)
    assert "watermark_table" in report["checked"]
    assert not [f for f in report["findings"] if f["check"] == "watermark_table"]  # creatable: cdc run will
    check(env.dsn, "--fix")
    assert env.fetch("SELECT to_regclass('public.cdc_watermark') IS NOT NULL")[0][0]
    report = check(low)
    found = [f for f in report["findings"] if f["check"] == "watermark_table"]
    assert found and found[0]["severity"] == "error" and "GRANT" in found[0]["fix"], found
