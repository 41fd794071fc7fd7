"""float4/float8 NaN, Infinity, -Infinity and numeric NaN/+-Infinity are never null in events
(issue 9 item 9), in the snapshot and in the stream. wal2json 2.5 (this machine's) sends them as
null; the non-finite recorder's triggers (cdc.recorders.nonfinite) carry them."""

from __future__ import annotations

from typing import Any

import orjson
import psycopg
import pytest

from tests.plugins.capture import CaptureEnv

#: the recorder exists for wal2json alone (pgoutput sends NaN and the infinities as they are)
pytestmark = pytest.mark.decoders("wal2json")

SPECIALS = ["NaN", "Infinity", "-Infinity"]


def _afters(env: CaptureEnv, table: str = "f") -> dict[tuple[str, int], dict[str, Any]]:
    return {
        (ev["op"], ev["after"]["id"]): ev["after"]
        for ev in env.values(env.reg("public", table).topic)
        if ev["after"]
    }


def _insert(env: CaptureEnv, i: int, v: str | None) -> None:
    env.sql(
        "INSERT INTO f VALUES (%s, %s::real, %s::float8, %s::numeric, ARRAY[%s, 1.5, NULL]::float8[], "
        "ARRAY[%s]::real[], ARRAY[%s, '1.000000000000000000001']::numeric[], 0.1)",
        [i, v, v, v, v, v, v],
    )


def _when_columns(env: CaptureEnv, table: str, trigger: str = "zzz_cdc_nonfinite") -> list[str] | str:
    """The columns the trigger's WHEN clause tests ("none": it has no WHEN; "row": the whole-row one)."""
    rows = env.fetch(
        "SELECT CASE WHEN tgqual IS NULL THEN 'none' WHEN position('NaN|Infinity' in "
        "pg_get_triggerdef(t.oid)) > 0 THEN 'row' END, "
        "ARRAY(SELECT a.attname::text FROM pg_depend d JOIN pg_attribute a ON a.attrelid = d.refobjid "
        "AND a.attnum = d.refobjsubid WHERE d.classid = 'pg_trigger'::regclass AND d.objid = t.oid "
        "AND d.refobjsubid > 0 ORDER BY 1) FROM pg_trigger t WHERE tgrelid = %s::regclass AND tgname = %s",
        [table, trigger],
    )
    assert len(rows) == 1, rows
    return str(rows[0][0]) if rows[0][0] else list(rows[0][1])


@pytest.mark.cdc_config('nonfinite_recorder_when = "columns"\n')
def test_special_float_and_numeric_values_in_snapshot_and_stream(env: CaptureEnv) -> None:
    env.sql(
        "CREATE TABLE f (id int PRIMARY KEY, r real, d double precision, n numeric, fa float8[], "
        "ra real[], na numeric[], plain double precision)"
    )
    env.sql("ALTER TABLE f REPLICA IDENTITY FULL")  # deletes carry the old row: its NaN too
    for i, v in enumerate(SPECIALS, start=1):
        _insert(env, i, v)  # snapshot rows 1..3
    res = env.cdc("tables", "add", "public.f")
    assert res.returncode == 0 and "installed the non-finite recorder's trigger" in res.stderr, res.stderr
    env.run_once()
    for i, v in enumerate(SPECIALS, start=11):
        _insert(env, i, v)  # streamed rows 11..13
    _insert(env, 14, None)  # real NULLs stay null
    env.sql("UPDATE f SET d = 'NaN', plain = 'Infinity', fa = '{-Infinity}' WHERE id = 11")
    env.sql("UPDATE f SET id = 22 WHERE id = 12")  # a key change keeps the row's values
    env.sql("DELETE FROM f WHERE id = 13")
    # several rows in one statement, in a savepoint rolled back, and through COPY
    env.sql(
        "INSERT INTO f (id, d, n) SELECT g, CASE WHEN g % 2 = 0 THEN 'NaN'::float8 END, g FROM generate_series(30, 39) g"
    )
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO f (id, d) VALUES (40, '-Infinity')")
            try:
                with conn.transaction():
                    conn.execute("UPDATE f SET d = 'NaN' WHERE id = 40")
                    raise RuntimeError("roll the savepoint back")
            except RuntimeError:
                pass
            conn.execute("UPDATE f SET n = 'NaN' WHERE id = 40")
        with conn.cursor().copy("COPY f (id, r, d) FROM STDIN") as copy:
            copy.write_row((50, "Infinity", None))
            copy.write_row((51, None, "NaN"))
        # a write the trigger saw but that never happened (ON CONFLICT DO NOTHING), then another
        # row of the table whose value is a real NULL: the skipped row's value must not reach it
        with conn.transaction():
            conn.execute("INSERT INTO f (id, d) VALUES (1, 'NaN') ON CONFLICT DO NOTHING")
            conn.execute("INSERT INTO f (id, d) VALUES (60, NULL)")
    summary = env.run_once()
    assert summary["reason"] == "caught_up"
    assert "non-finite recorder installed" not in env.last_stderr  # `cdc tables add` installed it
    got = _afters(env)
    for i, v in enumerate(SPECIALS, start=1):
        for op, row_id in (("r", i), ("c", i + 10)):
            after = got[(op, row_id)]
            assert (after["r"], after["d"], after["n"]) == (v, v, v), (op, after)
            # arrays are text in both paths: their elements keep the special values
            assert after["fa"] == [v, 1.5, None] and after["ra"] == [v]
            assert after["na"] == [v, "1.000000000000000000001"]
            assert after["plain"] == 0.1 and isinstance(after["plain"], float)
    nulls = got[("c", 14)]
    assert (nulls["r"], nulls["d"], nulls["n"], nulls["fa"]) == (None, None, None, [None, 1.5, None])
    update = got[("u", 11)]
    assert (update["d"], update["plain"], update["fa"], update["r"]) == (
        "NaN",
        "Infinity",
        ["-Infinity"],
        "NaN",
    )
    assert (got[("c", 22)]["r"], got[("c", 22)]["d"], got[("c", 22)]["n"]) == ("Infinity",) * 3
    deleted = [
        ev for ev in env.values(env.reg("public", "f").topic) if ev["op"] == "d" and ev["before"]["id"] == 13
    ]
    assert deleted and (deleted[0]["before"]["d"], deleted[0]["before"]["n"]) == ("-Infinity", "-Infinity")
    for g in range(30, 40):
        assert got[("c", g)]["d"] == ("NaN" if g % 2 == 0 else None) and got[("c", g)]["n"] == str(g)
    assert got[("c", 40)]["d"] == "-Infinity"
    assert (got[("u", 40)]["d"], got[("u", 40)]["n"]) == ("-Infinity", "NaN")  # not the rolled-back NaN
    assert (got[("c", 50)]["r"], got[("c", 50)]["d"]) == ("Infinity", None)
    assert (got[("c", 51)]["r"], got[("c", 51)]["d"]) == (None, "NaN")
    assert got[("c", 60)]["d"] is None
    assert "sends NaN/Infinity" not in env.last_stderr  # nothing to warn about
    assert _when_columns(env, "f") == ["d", "n", "plain", "r"]
    assert _when_columns(env, "f", "zzz_cdc_nonfinite_old") == ["d", "n", "plain", "r"]
    # the WHEN clause names the tracked columns: Postgres refuses to retype or drop one under it,
    # saying which trigger; the DBA drops the triggers in the same transaction, and the reader
    # puts them back over the columns the table has then
    with pytest.raises(psycopg.errors.FeatureNotSupported, match="trigger definition"):
        env.sql("ALTER TABLE f ALTER COLUMN r TYPE double precision")
    env.sql(
        "BEGIN; DROP TRIGGER zzz_cdc_nonfinite ON f; DROP TRIGGER zzz_cdc_nonfinite_old ON f; "
        "ALTER TABLE f ALTER COLUMN r TYPE double precision; ALTER TABLE f DROP COLUMN plain; "
        "ALTER TABLE f ADD COLUMN later real; COMMIT"
    )
    env.run_once()
    assert "non-finite recorder installed on public.f" in env.last_stderr
    assert _when_columns(env, "f") == ["d", "later", "n", "r"]
    env.sql("INSERT INTO f (id, r, n, later) VALUES (70, 'NaN', 'Infinity', '-Infinity')")
    env.run_once()
    got = _afters(env)
    assert (got[("c", 70)]["r"], got[("c", 70)]["n"], got[("c", 70)]["later"]) == (
        "NaN",
        "Infinity",
        "-Infinity",
    )


def test_a_role_that_may_not_install_the_recorder_is_told_the_fix(env: CaptureEnv) -> None:
    role = f"cdc_nf_{env.slot[-8:]}"
    env.sql(f"CREATE ROLE {role} LOGIN REPLICATION")
    env.sql("CREATE TABLE f (id int PRIMARY KEY, d double precision, n numeric(10,2), t text)")
    env.sql(f"GRANT SELECT ON f TO {role}")
    env.sql(f"GRANT CREATE ON SCHEMA public TO {role}")  # the function, not the trigger on f
    low = env.pg.dsn(env.db, user=role)
    res = env.cdc("--source", low, "tables", "add", "public.f")
    assert res.returncode == 0, res.stderr
    assert "non-finite recorder" in res.stderr and "cdc check --nonfinite-recorder-sql" in res.stderr
    res = env.cdc("--source", low, "run", "--once")
    assert res.returncode == 0, res.stderr
    env.sql("INSERT INTO f VALUES (1, 'NaN', 1.5, 'x')")
    res = env.cdc("--source", low, "run", "--once")
    assert res.returncode == 0, res.stderr
    assert "sends NaN/Infinity in public.f (d, n) as null" in res.stderr and "fix:" in res.stderr
    assert _afters(env)[("c", 1)]["d"] is None  # the loss this warning is about

    res = env.cdc("--source", low, "check", "--json")
    found = [f for f in orjson.loads(res.stdout)["findings"] if f["check"] == "nonfinite_recorder"]
    assert res.returncode == 1 and found and found[0]["severity"] == "warning", res.stdout
    assert "public.f (d, n)" in found[0]["message"] and "--nonfinite-recorder-sql" in found[0]["fix"]
    script = env.cdc("--source", low, "check", "--nonfinite-recorder-sql")
    assert script.returncode == 0 and "CREATE OR REPLACE TRIGGER" in script.stdout
    with psycopg.connect(env.dsn, autocommit=True) as owner:  # the owner runs what it printed
        owner.execute(script.stdout.encode())
    res = env.cdc("--source", low, "check", "--json")
    assert not [f for f in orjson.loads(res.stdout)["findings"] if f["check"] == "nonfinite_recorder"]
    env.sql("INSERT INTO f VALUES (2, '-Infinity', 'NaN', 'y')")
    res = env.cdc("--source", low, "run", "--once")
    assert res.returncode == 0 and "sends NaN/Infinity" not in res.stderr, res.stderr
    after = _afters(env)[("c", 2)]
    assert (after["d"], after["n"], after["t"]) == ("-Infinity", "NaN", "y")


@pytest.mark.cdc_config('nonfinite_recorder_when = "columns"\n')
def test_a_float_column_added_later_is_covered_once_the_reader_sees_it(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE f (id int PRIMARY KEY, t text)")
    env.add_table("public.f")
    env.run_once()
    assert not env.fetch("SELECT 1 FROM pg_trigger WHERE tgrelid = 'f'::regclass")  # nothing to track
    env.sql("ALTER TABLE f ADD COLUMN d double precision")
    env.sql("INSERT INTO f VALUES (1, 'a', 1.5)")  # the reader learns the column from this row
    env.run_once()
    assert "non-finite recorder installed on public.f (d)" in env.last_stderr
    env.sql("INSERT INTO f VALUES (2, 'b', 'Infinity')")
    env.run_once()
    assert _afters(env)[("c", 2)]["d"] == "Infinity"
    # a second one: the WHEN clause, which names the columns, gets it when the reader starts or
    # sees the column
    assert _when_columns(env, "f") == ["d"]
    env.sql("ALTER TABLE f ADD COLUMN e real")
    env.sql("INSERT INTO f VALUES (3, 'c', 2.5, 1.5)")
    env.run_once()
    assert "non-finite recorder installed on public.f" in env.last_stderr
    assert _when_columns(env, "f") == ["d", "e"]
    env.sql("INSERT INTO f VALUES (4, 'd', 1.5, '-Infinity')")
    env.run_once()
    assert (_afters(env)[("c", 4)]["d"], _afters(env)[("c", 4)]["e"]) == (1.5, "-Infinity")


# --- table shapes that restrict triggers (issue 16, 2c) -----------------------------------------
def _recorder_findings(env: CaptureEnv, *source: str) -> list[dict[str, Any]]:
    res = env.cdc(*source, "check", "--json")
    # a report, never an abort (a partitioned parent is still an error finding: issue 16, 2d)
    assert res.stdout.startswith("{") and "Traceback" not in res.stderr, res.stderr
    return [f for f in orjson.loads(res.stdout)["findings"] if f["check"] == "nonfinite_recorder"]


@pytest.mark.cdc_config('nonfinite_recorder_when = "columns"\n')
def test_a_table_with_generated_columns_registers_and_captures_its_nan(env: CaptureEnv) -> None:
    """Postgres refuses a BEFORE trigger's WHEN that reads a stored generated column in NEW (or
    NEW whole): the WHEN tests the table's other float and numeric columns, and no table stops."""
    env.sql("CREATE TABLE other (id int PRIMARY KEY, d double precision)")
    env.add_table("public.other")
    env.sql(
        "CREATE TABLE film (id int PRIMARY KEY, title text, rate numeric(4,2), score double precision, "
        "body text, fulltext tsvector GENERATED ALWAYS AS (to_tsvector('english', title)) STORED)"
    )
    env.sql("ALTER TABLE film ALTER COLUMN body SET STORAGE EXTERNAL")
    env.sql("INSERT INTO film VALUES (1, 'It''s a \"film\"\\n', 'NaN', '-Infinity', 'b')")  # snapshot row
    res = env.cdc("tables", "add", "public.film")
    assert res.returncode == 0, res.stderr
    assert "installed the non-finite recorder's trigger" in res.stderr and "Traceback" not in res.stderr
    assert _when_columns(env, "film") == ["rate", "score"] and _when_columns(env, "other") == ["d"]
    assert _recorder_findings(env) == []  # installed and up to date: nothing to report
    env.sql("DROP TRIGGER zzz_cdc_nonfinite ON film")  # `cdc check --fix` puts it back
    found = _recorder_findings(env)
    assert len(found) == 1 and "public.film (rate, score)" in found[0]["message"], found
    res = env.cdc("check", "--fix")
    assert "installed the non-finite recorder on public.film" in res.stderr and "Traceback" not in res.stderr
    assert _recorder_findings(env) == [] and _when_columns(env, "film") == ["rate", "score"]
    env.run_once()
    env.sql("INSERT INTO film VALUES (2, 'Alien', 'NaN', 'Infinity', repeat('x', 5000))")
    env.sql("INSERT INTO film VALUES (3, 'Heat', 7.5, NULL, 'c')")
    env.sql("INSERT INTO other VALUES (1, 'Infinity'), (2, 'NaN')")
    env.sql("UPDATE film SET score = 'NaN' WHERE id = 3")
    env.run_once()
    got = _afters(env, "film")
    assert (got[("r", 1)]["rate"], got[("r", 1)]["score"]) == ("NaN", "-Infinity")
    assert (got[("c", 2)]["rate"], got[("c", 2)]["score"], got[("c", 2)]["fulltext"]) == (
        "NaN",
        "Infinity",
        "'alien':1",
    )
    assert (got[("c", 3)]["rate"], got[("c", 3)]["score"]) == ("7.50", None)
    assert (got[("u", 3)]["rate"], got[("u", 3)]["score"]) == ("7.50", "NaN")
    assert (_afters(env, "other")[("c", 1)]["d"], _afters(env, "other")[("c", 2)]["d"]) == ("Infinity", "NaN")
    assert "sends NaN/Infinity" not in env.last_stderr
    # a column the WHEN clause does not test stays the DBA's to drop; a tested one is refused
    env.sql("ALTER TABLE film DROP COLUMN body")
    with pytest.raises(psycopg.errors.FeatureNotSupported, match="trigger definition"):
        env.sql("ALTER TABLE film ALTER COLUMN score TYPE real")
    env.sql("INSERT INTO film (id, title, rate, score) VALUES (4, 'Ran', 'NaN', '-Infinity')")
    env.run_once()
    got = _afters(env, "film")
    assert (got[("c", 4)]["rate"], got[("c", 4)]["score"]) == ("NaN", "-Infinity")


@pytest.mark.cdc_config('nonfinite_recorder_when = "columns"\n')
def test_a_generated_column_added_later_leaves_the_when_on_the_other_columns(env: CaptureEnv) -> None:
    """A generated column added under the trigger (a float one too) is not in its WHEN: the table
    still restores from a dump, and the other columns stay covered."""
    env.sql("CREATE TABLE f (id int PRIMARY KEY, d double precision)")
    env.add_table("public.f")
    env.run_once()
    assert _when_columns(env, "f") == ["d"]
    env.sql(
        "ALTER TABLE f ADD COLUMN t text, ADD COLUMN up text GENERATED ALWAYS AS (upper(t)) STORED, "
        "ADD COLUMN half float8 GENERATED ALWAYS AS (d / 2) STORED"
    )
    env.sql("INSERT INTO f VALUES (1, 'NaN', 'a')")  # the reader learns the new columns from this row
    env.run_once()
    assert _when_columns(env, "f") == ["d"]
    env.sql("INSERT INTO f VALUES (2, '-Infinity', 'b')")
    env.run_once()
    got = _afters(env)
    assert (got[("c", 1)]["d"], got[("c", 2)]["d"], got[("c", 2)]["up"]) == ("NaN", "-Infinity", "B")


def test_a_generated_float_column_is_reported_as_not_covered(env: CaptureEnv) -> None:
    """A BEFORE trigger sees a generated column before Postgres computes it: its NaN is not
    recorded, and `tables add`, `run`, `check` and `tables list` say so, with the fix."""
    env.sql(
        "CREATE TABLE m (id int PRIMARY KEY, a double precision, "
        "half double precision GENERATED ALWAYS AS (a / 2) STORED)"
    )
    res = env.cdc("tables", "add", "public.m")
    assert res.returncode == 0, res.stderr
    assert "half" in res.stderr and "generated" in res.stderr and "wal2json to 2.6+" in res.stderr
    found = _recorder_findings(env)
    assert len(found) == 1 and "public.m (half: generated" in found[0]["message"], found
    assert "--exclude" in found[0]["fix"]
    assert env.listed()["public.m"]["nonfinite_recorder"]["state"] == "partial"
    env.run_once()
    env.sql("INSERT INTO m VALUES (1, 'NaN')")
    env.run_once()
    after = _afters(env, "m")[("c", 1)]
    assert after["a"] == "NaN" and after["half"] is None  # the loss the warning is about
    assert "does not cover half" in env.last_stderr


@pytest.mark.cdc_config('nonfinite_recorder_when = "columns"\n')
def test_a_partitioned_table_gets_the_recorder_on_every_partition(env: CaptureEnv) -> None:
    """BEFORE ROW triggers on a partitioned parent are cloned to its partitions (PG13+), also one
    attached later; with a generated column too."""
    env.sql(
        "CREATE TABLE pay (id int, month int, amount numeric, cents bigint GENERATED ALWAYS AS (id * 100) STORED, "
        "PRIMARY KEY (id, month)) PARTITION BY RANGE (month)"
    )
    env.sql("CREATE TABLE pay_1 PARTITION OF pay FOR VALUES FROM (1) TO (2)")
    env.sql(
        "CREATE TABLE log (id int, month int, v real, PRIMARY KEY (id, month)) PARTITION BY RANGE (month)"
    )
    env.sql("CREATE TABLE log_1 PARTITION OF log FOR VALUES FROM (1) TO (2)")
    for t in ("public.pay", "public.log"):
        res = env.cdc("tables", "add", t)
        assert res.returncode == 0 and "installed the non-finite recorder's trigger" in res.stderr, res.stderr
    assert _when_columns(env, "pay") == ["amount"] and _when_columns(env, "log") == ["v"]
    assert _recorder_findings(env) == []
    env.run_once()
    env.sql("CREATE TABLE pay_2 PARTITION OF pay FOR VALUES FROM (2) TO (3)")
    env.sql("CREATE TABLE log_2 PARTITION OF log FOR VALUES FROM (2) TO (3)")
    env.sql("INSERT INTO pay (id, month, amount) VALUES (1, 1, 'NaN'), (2, 2, '-Infinity')")
    env.sql("INSERT INTO log VALUES (1, 1, 'Infinity'), (2, 2, 'NaN')")
    env.run_once()
    assert "sends NaN/Infinity" not in env.last_stderr
    pay = {k[1]: v for k, v in _afters(env, "pay").items()}
    assert (pay[1]["amount"], pay[2]["amount"], pay[2]["cents"]) == ("NaN", "-Infinity", 200)
    log = {k[1]: v["v"] for k, v in _afters(env, "log").items()}
    assert log == {1: "Infinity", 2: "NaN"}
    assert _recorder_findings(env) == []


def test_a_table_of_another_owner_is_reported_and_the_others_go_on(env: CaptureEnv) -> None:
    """The capture role lacks TRIGGER on a table another role owns: that table is reported (with
    the SQL for its owner) in `tables add`, `run`, `check` and `tables list`; its own tables get
    the recorder and carry their NaN."""
    role, owner = f"cdc_ow_{env.slot[-8:]}", f"own_{env.slot[-8:]}"
    env.sql(f"CREATE ROLE {role} LOGIN REPLICATION")
    env.sql(f"CREATE ROLE {owner} NOLOGIN")
    env.sql(f"GRANT CREATE ON SCHEMA public TO {role}")
    env.sql("CREATE TABLE theirs (id int PRIMARY KEY, d double precision)")
    env.sql("CREATE TABLE mine (id int PRIMARY KEY, n numeric, g text GENERATED ALWAYS AS (n::text) STORED)")
    env.sql(f"ALTER TABLE theirs OWNER TO {owner}")
    env.sql(f"GRANT SELECT ON theirs TO {role}")
    env.sql(f"ALTER TABLE mine OWNER TO {role}")
    low = env.pg.dsn(env.db, user=role)
    res = env.cdc("--source", low, "tables", "add", "public.theirs")
    assert res.returncode == 0, res.stderr
    assert "reaches the topic as null" in res.stderr and "cdc check --nonfinite-recorder-sql" in res.stderr
    res = env.cdc("--source", low, "tables", "add", "public.mine")
    assert res.returncode == 0 and "installed the non-finite recorder's trigger" in res.stderr, res.stderr
    listed = env.listed()
    assert listed["public.theirs"]["nonfinite_recorder"]["state"] == "failed"
    assert "nonfinite_recorder" not in listed["public.mine"]
    found = _recorder_findings(env, "--source", low)
    assert (
        len(found) == 1
        and "public.theirs (d)" in found[0]["message"]
        and "public.mine" not in found[0]["message"]
    )
    res = env.cdc("--source", low, "run", "--once")
    assert res.returncode == 0, res.stderr
    env.sql("INSERT INTO theirs VALUES (1, 'NaN')")
    env.sql("INSERT INTO mine (id, n) VALUES (1, 'NaN')")
    res = env.cdc("--source", low, "run", "--once")
    assert res.returncode == 0, res.stderr
    assert "sends NaN/Infinity in public.theirs (d) as null" in res.stderr and "public.mine" not in res.stderr
    assert _afters(env, "mine")[("c", 1)]["n"] == "NaN"
    assert _afters(env, "theirs")[("c", 1)]["d"] is None  # the loss the warnings are about
    script = env.cdc("--source", low, "check", "--nonfinite-recorder-sql")
    assert script.returncode == 0 and '"theirs"' in script.stdout, script.stderr
    with psycopg.connect(env.dsn, autocommit=True) as su:  # the owner (here: a superuser) runs it
        su.execute(script.stdout.encode())
    assert _recorder_findings(env, "--source", low) == []
    env.sql("INSERT INTO theirs VALUES (2, '-Infinity')")
    res = env.cdc("--source", low, "run", "--once")
    assert res.returncode == 0 and "sends NaN/Infinity" not in res.stderr, res.stderr
    assert _afters(env, "theirs")[("c", 2)]["d"] == "-Infinity"
    assert "nonfinite_recorder" not in env.listed()["public.theirs"]


#: the triggers of earlier versions: the whole row printed and matched; none on a generated table
_OLD_FORM = (
    "CREATE OR REPLACE TRIGGER zzz_cdc_nonfinite BEFORE INSERT OR UPDATE ON {t} FOR EACH ROW {when}"
    "EXECUTE FUNCTION public.cdc_record_nonfinite('new', 'id')"
)


@pytest.mark.cdc_config('nonfinite_recorder_when = "columns"\n')
def test_the_whole_row_triggers_of_earlier_versions_are_replaced(env: CaptureEnv) -> None:
    """An installation from before: `cdc check` calls its triggers outdated and `cdc run` replaces
    them by the per-column WHEN; values of every tracked shape (real, float8, numeric, a domain
    over float8, on a table with a generated column too) still arrive exact."""
    env.sql("CREATE DOMAIN ratio AS double precision")
    env.sql("CREATE TABLE p (id int PRIMARY KEY, r real, d float8, n numeric, q ratio, t text)")
    env.sql(
        "CREATE TABLE g (id int PRIMARY KEY, d float8, q ratio, t text, "
        "up text GENERATED ALWAYS AS (upper(t)) STORED)"
    )
    for t in ("public.p", "public.g"):
        env.add_table(t)
    env.run_once()
    assert _when_columns(env, "p") == ["d", "n", "q", "r"] and _when_columns(env, "g") == ["d", "q"]
    env.sql(_OLD_FORM.format(t="p", when="WHEN (NEW::text ~ 'NaN|Infinity') "))
    env.sql(_OLD_FORM.format(t="g", when=""))
    assert _when_columns(env, "p") == "row" and _when_columns(env, "g") == "none"
    found = _recorder_findings(env)
    assert (
        len(found) == 1
        and "missing or outdated for public.g (d, q); public.p (r, d, n, q)" in (found[0]["message"])
    ), found
    env.run_once()
    assert "non-finite recorder installed on public.p" in env.last_stderr
    assert "non-finite recorder installed on public.g" in env.last_stderr
    assert _when_columns(env, "p") == ["d", "n", "q", "r"] and _when_columns(env, "g") == ["d", "q"]
    assert _recorder_findings(env) == []
    for i, v in enumerate(SPECIALS, start=1):
        env.sql("INSERT INTO p VALUES (%s, %s, %s, %s, %s, 'x')", [i, v, v, v, v])
        env.sql("INSERT INTO g VALUES (%s, %s, %s, 'a\\\"b''c\\n')", [i, v, v])
    env.sql("INSERT INTO p VALUES (9, 1.5, NULL, 2.25, NULL, 'NaN')")  # finite, null, a text word
    env.sql("UPDATE g SET d = 'NaN', t = repeat('y', 9000) WHERE id = 3")
    env.run_once()
    p, g = _afters(env, "p"), _afters(env, "g")
    for i, v in enumerate(SPECIALS, start=1):
        assert (p[("c", i)]["r"], p[("c", i)]["d"], p[("c", i)]["n"], p[("c", i)]["q"]) == (v,) * 4
        assert (g[("c", i)]["d"], g[("c", i)]["q"], g[("c", i)]["up"]) == (v, v, "A\\\"B'C\\N")
    assert (p[("c", 9)]["r"], p[("c", 9)]["d"], p[("c", 9)]["n"], p[("c", 9)]["q"]) == (
        1.5,
        None,
        "2.25",
        None,
    )
    assert (g[("u", 3)]["d"], g[("u", 3)]["q"], g[("u", 3)]["up"]) == ("NaN", "-Infinity", "Y" * 9000)
    assert "sends NaN/Infinity" not in env.last_stderr


@pytest.mark.cdc_config('nonfinite_recorder_when = "row"\n')
def test_the_row_form_never_blocks_ddl_and_covers_a_column_added_later_at_once(env: CaptureEnv) -> None:
    """nonfinite_recorder_when = "row": the WHEN prints the row (none with generated columns):
    the DBA's ALTER COLUMN TYPE / DROP COLUMN go through, a float column added is covered before
    the reader sees it."""
    env.sql("CREATE TABLE f (id int PRIMARY KEY, r real, n numeric, plain float8)")
    env.sql(
        "CREATE TABLE g (id int PRIMARY KEY, d float8, t text, up text GENERATED ALWAYS AS (upper(t)) STORED)"
    )
    for t in ("public.f", "public.g"):
        env.add_table(t)
    env.run_once()
    assert _when_columns(env, "f") == "row" and _when_columns(env, "g") == "none"
    assert _recorder_findings(env) == []
    env.sql("ALTER TABLE f ALTER COLUMN r TYPE double precision")
    env.sql("ALTER TABLE f DROP COLUMN plain")
    env.sql("ALTER TABLE f ADD COLUMN later real")
    env.sql("INSERT INTO f (id, r, n, later) VALUES (1, 'NaN', 'Infinity', '-Infinity')")
    env.sql("INSERT INTO g (id, d, t) VALUES (1, '-Infinity', 'x')")
    env.run_once()
    f, g = _afters(env, "f")[("c", 1)], _afters(env, "g")[("c", 1)]
    assert (f["r"], f["n"], f["later"]) == ("NaN", "Infinity", "-Infinity")
    assert (g["d"], g["up"]) == ("-Infinity", "X")
    assert _when_columns(env, "f") == "row" and _recorder_findings(env) == []
