"""A full re-snapshot of a table the warehouse already holds (``cdc snapshot TABLE``, read in chunks
by the real reader, ``cdc run``) opens no history version for a row it finds unchanged, and its
TRUNCATE marker closes none (issue 16, 2d): one version per unchanged row, ``cdc verify`` clean."""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import pytest

from sinks.warehouse import END_OP, IS_CURRENT, KEY, LSN, WarehouseSink
from tests.plugins.apply import apply_clean, cdc_cli
from tests.plugins.capture import CaptureEnv

pytestmark = pytest.mark.cdc_config("[snapshot]\nchunk_size = 40\n")


def _versions(env: CaptureEnv) -> tuple[Counter[int], list[dict[str, Any]]]:
    reg = env.reg("public", "t")
    history = WarehouseSink(env.state).history_rows(reg, meta=True).to_pylist()
    return Counter(orjson.loads(h[KEY])["id"] for h in history), history


def test_an_unchanged_resnapshot_opens_no_history_version(env: CaptureEnv, spark_clean: Any) -> None:
    env.sql(
        "CREATE TABLE t (id int PRIMARY KEY, name text, amount numeric(8,2), ratio double precision,"
        " tags text[], blob bytea, at timestamptz, big text)"
    )
    # ugly values: quotes, backslashes, newlines, NaN, nulls, arrays, bytes, one ~1 MB value
    env.sql(
        "INSERT INTO t SELECT g, 'say \"hi\" \\ ' || g || E'\\nnext line', g * 1.25,"
        " CASE WHEN g % 7 = 0 THEN 'NaN'::float8 ELSE g / 3.0 END,"
        " ARRAY['a,b', E'c\"d', NULL], decode(repeat('00ff5c22', g % 5), 'hex'),"
        " timestamptz '2026-01-01 00:00+00' + g * interval '1 minute',"
        " CASE WHEN g = 1 THEN repeat(E'x\"\\\\\\n', 250000) WHEN g % 3 = 0 THEN NULL ELSE 'b' || g END"
        " FROM generate_series(1, 150) g"
    )
    env.add_table("public.t")
    env.run_once()  # the initial snapshot
    env.sql("UPDATE t SET name = 'changed' WHERE id <= 5")
    env.run_once()  # the stream
    apply_clean(spark_clean, env.state)
    before, _ = _versions(env)
    assert before[1] == 2 and before[6] == 1 and sum(before.values()) == 155

    assert env.cdc("snapshot", "public.t").returncode == 0, env.last_stderr
    env.run_once()  # the full chunked re-read (40 rows a chunk) and its TRUNCATE marker
    ops = [orjson.loads(r.value)["op"] for r in env.records(env.reg("public", "t").topic) if r.value]
    assert ops.count("r") == 300, "every row read twice: the initial snapshot and the re-snapshot"
    apply_clean(spark_clean, env.state)

    after, history = _versions(env)
    assert after == before, "one version per unchanged row, no second one"
    assert not [h for h in history if h[END_OP] == "t"], "no row closed by the re-snapshot's marker"
    assert sum(1 for h in history if h[IS_CURRENT]) == 150
    # the open rows moved to the re-snapshot's versions: a later change closes them as usual
    current = WarehouseSink(env.state).current_rows(env.reg("public", "t"), meta=True).to_pylist()
    open_versions = {h[KEY]: h[LSN] for h in history if h[IS_CURRENT]}
    assert open_versions == {c[KEY]: c[LSN] for c in current}
    code, out = cdc_cli(env.dsn, env.state, "verify", "--json", "--wait", "30")
    report = {r["table"]: r for r in orjson.loads(out)}["public.t"]
    assert code == 0, report
    assert report["source_rows"] == report["warehouse_rows"] == 150, report
    assert not any(report[k] for k in ("missing", "extra", "different")), report


def test_a_resnapshot_read_after_a_change_in_the_same_batch_opens_no_version(
    env: CaptureEnv, spark_clean: Any
) -> None:
    """A change of a key and the re-snapshot's read of that key land in one apply batch: the read
    equals the row the change left, so it confirms that row (one version for the change, none for the
    read), whether the batch carries the full re-snapshot's marker (per-event form) or not (a --where
    re-snapshot)."""
    env.sql("CREATE TABLE t (id int PRIMARY KEY, name text, ratio double precision, tags text[])")
    env.sql(
        "INSERT INTO t SELECT g, 'n' || g, CASE WHEN g % 7 = 0 THEN 'NaN'::float8 ELSE g / 3.0 END,"
        " ARRAY['a,b', NULL] FROM generate_series(1, 60) g"
    )
    env.add_table("public.t")
    env.run_once()  # the initial snapshot
    apply_clean(spark_clean, env.state)
    assert _versions(env)[0] == Counter(range(1, 61))

    ugly = "'say \"hi\" \\ ' || id || E'\\nnext line'"
    env.sql(f"UPDATE t SET name = {ugly}, tags = ARRAY[E'c\"d'] WHERE id <= 5")  # older than the re-read
    assert env.cdc("snapshot", "public.t").returncode == 0, env.last_stderr
    env.run_once()  # the updates, then the full chunked re-read and its TRUNCATE marker
    assert apply_clean(spark_clean, env.state).batches == 1, "the changes and the reads in one batch"
    after, history = _versions(env)
    assert after == Counter({**dict.fromkeys(range(1, 61), 1), **dict.fromkeys(range(1, 6), 2)}), (
        "one version for each change, none for the re-snapshot's reads"
    )
    assert not [h for h in history if h[END_OP] == "t"], "no row closed by the re-snapshot's marker"

    env.sql("UPDATE t SET name = name || E'\\\\x' WHERE id BETWEEN 6 AND 8")
    assert env.cdc("snapshot", "public.t", "--where", "id <= 10").returncode == 0, env.last_stderr
    env.run_once()  # the updates, then the filtered re-read (no marker)
    assert apply_clean(spark_clean, env.state).batches == 1, "the changes and the reads in one batch"
    after, history = _versions(env)
    assert after == Counter({**dict.fromkeys(range(1, 61), 1), **dict.fromkeys(range(1, 9), 2)})
    current = WarehouseSink(env.state).current_rows(env.reg("public", "t"), meta=True).to_pylist()
    open_versions = {h[KEY]: h[LSN] for h in history if h[IS_CURRENT]}
    assert open_versions == {c[KEY]: c[LSN] for c in current}, "open rows at the reads' versions"
    code, out = cdc_cli(env.dsn, env.state, "verify", "--json", "--wait", "30")
    report = {r["table"]: r for r in orjson.loads(out)}["public.t"]
    assert code == 0, report
    assert not any(report[k] for k in ("missing", "extra", "different")), report
