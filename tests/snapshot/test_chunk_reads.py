"""How a chunked snapshot reads the source (issue 16, section 3): one ``COPY ... ORDER BY key LIMIT n``
per chunk, the next chunk starting after the last key read, as Postgres printed it. Ugly keys
(composite, text with quotes, backslashes, commas, newlines, empty strings, trailing spaces) must
survive that round trip at every chunk bound, next to big values; a ``--where`` filter and resume
still hold; a NULL key is refused with a fix."""

from __future__ import annotations

import orjson
import psycopg
import pytest

from tests.plugins.capture import CaptureEnv, materialize, progress
from tests.plugins.postgres import wait_for

pytestmark = pytest.mark.cdc_config("[snapshot]\nchunk_size = 3\n")

#: text key values that a chunk bound may land on
UGLY = [
    "",
    " ",
    "a",
    "a ",
    "O'Brien",
    "''",
    '"quoted"',
    'a,b,"c"',
    "back\\slash",
    "\\x41",
    "new\nline",
    "tab\there",
    "cr\rhere",
    "Ünïcödé ✓",
    "NULL",
    "\\N",
    "(1,2)",
    "zz" * 40,
]


def _streaming_first(env: CaptureEnv) -> None:
    """The initial snapshot of a one-row table, so that tables registered next are chunked."""
    env.sql("CREATE TABLE tiny (id int PRIMARY KEY)")
    env.sql("INSERT INTO tiny VALUES (1)")
    env.add_table("public.tiny")
    env.run_once()


def _source(env: CaptureEnv, table: str, key: list[str]) -> dict[str, dict[str, object]]:
    out = {}
    for (row,) in env.fetch(f"SELECT row_to_json(t)::text FROM {table} t"):
        value = orjson.loads(str(row))
        out[orjson.dumps({k: value[k] for k in key}).decode()] = value
    return out


def _scans(env: CaptureEnv, table: str) -> int:
    rows = env.fetch(
        f"SELECT coalesce(idx_scan, 0) + coalesce(seq_scan, 0) FROM pg_stat_user_tables WHERE relname = '{table}'"
    )
    return int(rows[0][0])  # type: ignore[call-overload]


@pytest.mark.cdc_config("[snapshot]\nchunk_size = 100\n")
def test_each_chunk_is_one_scan_of_the_table(env: CaptureEnv) -> None:
    """No upper-bound query before each chunk, and no chunk read on a stream session the server
    refuses (wal2json 2.5 refuses the first session of every `cdc run` process): the table is scanned
    exactly once per chunk."""
    _streaming_first(env)
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        # no statistics on t: with them, planning the last chunk (key > 1000, the histogram's upper
        # bound) probes the primary key for its actual maximum, which pg_stat_user_tables counts as an
        # index scan of t; autovacuum's analyze of the new rows would land mid-snapshot in some runs
        conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text) WITH (autovacuum_enabled = off)")
        conn.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 1000) g")
        # the index build of the CREATE scanned t: flushed now (blocking), not when this backend exits
        conn.execute("SELECT pg_stat_force_next_flush()")
    before = _scans(env, "t")
    env.add_table("public.t")
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.t": 1000}
    p = progress(env, "t")
    # 10 full chunks, then one that finds no row after the last key
    assert p is not None and p.done and p.chunks == 11 and p.read == 1000, p

    def scans() -> int:
        n = _scans(env, "t") - before
        assert n <= p.chunks, f"{n} scans of t for {p.chunks} chunks"
        return n

    # the backends flush their statistics when they exit, soon after `cdc run` does
    wait_for(lambda: scans() == p.chunks, timeout=30, what="the scan counts of t")
    assert _source(env, "t", ["id"]) == materialize(env.records(env.reg("public", "t").topic))


def test_ugly_composite_and_text_keys_at_every_chunk_bound_with_big_values(env: CaptureEnv) -> None:
    _streaming_first(env)
    env.sql("CREATE TABLE c (region text, n int, note text, PRIMARY KEY (region, n))")
    env.sql("CREATE TABLE k (name text PRIMARY KEY, big text)")
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        for i, r in enumerate(UGLY):
            for n in (1, 2):
                conn.execute("INSERT INTO c VALUES (%s, %s, %s)", [r, n, f"{r}|{n}"])
            # big values (600 kB, with quotes, commas, newlines and backslashes) next to short ones
            big = ('x"y,z\n\\' * 100_000)[: 600_000 + i] if i % 5 == 0 else r
            conn.execute("INSERT INTO k VALUES (%s, %s)", [r, big])
    env.add_table("public.c")
    env.add_table("public.k")
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.c": 2 * len(UGLY), "public.k": len(UGLY)}
    pc, pk = progress(env, "c"), progress(env, "k")
    # chunks of 3: every third key is a bound read back as a literal (and one empty chunk at the end)
    assert pc is not None and pc.chunks == 2 * len(UGLY) // 3 + 1, pc
    assert pk is not None and pk.chunks == len(UGLY) // 3 + 1, pk
    assert materialize(env.records(env.reg("public", "c").topic)) == _source(env, "c", ["region", "n"])
    assert materialize(env.records(env.reg("public", "k").topic)) == _source(env, "k", ["name"])

    # a --where snapshot on a text with a quote pages through its matching rows only
    res = env.cdc("snapshot", "public.c", "--where", "note >= 'O''Brien'")
    assert res.returncode == 0, res.stderr
    want = env.fetch("SELECT count(*) FROM c WHERE note >= 'O''Brien'")[0][0]
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.c": want} and 0 < want < 2 * len(UGLY)  # type: ignore[operator]
    assert materialize(env.records(env.reg("public", "c").topic)) == _source(env, "c", ["region", "n"])


def test_a_null_key_is_refused_with_a_fix(env: CaptureEnv) -> None:
    _streaming_first(env)
    env.sql("CREATE TABLE nk (code text, v int)")
    env.sql("CREATE UNIQUE INDEX ON nk (code)")
    env.sql("ALTER TABLE nk REPLICA IDENTITY FULL")
    env.sql("INSERT INTO nk SELECT 'c' || g, g FROM generate_series(1, 10) g")
    env.sql("INSERT INTO nk VALUES (NULL, 0)")
    env.add_table("public.nk", "--key", "code")
    res = env.cdc("run", "--once")
    assert res.returncode != 0
    assert "public.nk" in res.stderr and "'code' is NULL" in res.stderr and "NOT NULL" in res.stderr, (
        res.stderr
    )
    # filled and keyed: the snapshot goes through
    env.sql("UPDATE nk SET code = 'none' WHERE code IS NULL")
    env.sql("ALTER TABLE nk ALTER code SET NOT NULL")
    summary = env.run_once()
    assert summary["snapshot_rows"] == {"public.nk": 11}
    assert materialize(env.records(env.reg("public", "nk").topic)) == _source(env, "nk", ["code"])
