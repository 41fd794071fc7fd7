"""What `cdc run --once` and `cdc apply --once` print, as a new user sees it (issue #35): cdc's own
lines only, each once; Spark's start-up output (the JVM's incubator-module warning, log4j's notes
and WARN lines, pyspark's warnings) and a log line repeated by a restarted reader session only with
``--verbose``. Real Postgres, the real reader, the embedded log store and `cdc apply` (Spark) in
processes of their own."""

from __future__ import annotations

import re

import orjson

from cdc.registry import State
from tests.plugins.capture import CaptureEnv

#: every line `cdc apply --once` prints of its own (stdout without --json; nothing on stderr)
APPLY_LINE = re.compile(r"apply: state .*, starting Spark\.\.\.|batch \d+: .*|applied \d+ events from .*")
#: Spark start-up lines that are there whatever the machine (the launcher always adds the incubating
#: vector module; log4j without a configuration loads Spark's default profile and says so)
SPARK_NOISE = (
    "WARNING: Using incubator modules: jdk.incubator.vector",
    "Using Spark's default log4j profile",
)


def _streaming(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("cdc run: streaming ")]


def test_run_and_apply_print_their_own_lines_once_unless_verbose(env: CaptureEnv, jvm: None) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, name text)")
    env.sql("INSERT INTO t SELECT g, 'name ' || g FROM generate_series(1, 20) g")
    env.add_table("public.t", "--search", "name")

    run = env.cdc("run", "--once")
    assert run.returncode == 0, run.stderr
    assert all(line.startswith("cdc run: ") for line in run.stderr.splitlines()), run.stderr
    assert len(_streaming(run.stderr)) == 1, run.stderr  # each line once
    assert len(set(run.stderr.splitlines())) == len(run.stderr.splitlines()), run.stderr

    apply = env.cdc("apply", "--once")
    assert apply.returncode == 0, apply.stderr
    assert apply.stderr == "", apply.stderr  # no Spark start-up noise, no warning
    lines = apply.stdout.splitlines()
    assert [line for line in lines if not APPLY_LINE.fullmatch(line)] == [], apply.stdout
    assert lines[-1].startswith("applied 20 events"), apply.stdout

    env.sql("UPDATE t SET name = 'renamed' WHERE id <= 3")
    run = env.cdc("run", "--once", "--verbose")
    assert run.returncode == 0, run.stderr
    # the reader streams in a second session at once when wal2json (< 2.6) refused its first
    # session's numeric-data-types-as-string; --verbose shows the repeated line, as the reader says it
    with env.registry() as registry:
        refused = registry.get_state(State.WAL2JSON_NUMERIC_AS_STRING) == "0"
    assert len(_streaming(run.stderr)) == (2 if refused else 1), run.stderr

    apply = env.cdc("apply", "--once", "--verbose")
    assert apply.returncode == 0, apply.stderr
    for noise in SPARK_NOISE:
        assert noise in apply.stderr, apply.stderr
    assert apply.stdout.splitlines()[-1].startswith("applied 3 events"), apply.stdout
    res = env.cdc("sql", "--json", "SELECT count(*) AS n FROM public.t WHERE name = 'renamed'")
    assert res.returncode == 0 and orjson.loads(res.stdout) == [{"n": 3}], res.stdout
