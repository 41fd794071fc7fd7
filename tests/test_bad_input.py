"""Bad input (issue 9): every case gets a clear error (what is wrong and how to fix it), a non-zero
exit, and loses nothing. Real Postgres where a source is involved."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc.devcluster import PgCluster, free_port, start_cluster
from cdc.registry import Registry
from tests.plugins.capture import CDC, CaptureEnv
from tests.plugins.cli import Run


def _clear(err: str) -> None:
    """A clear error: an 'error:' line and a 'fix:' line, no traceback."""
    assert "Traceback" not in err
    assert err.startswith("error:") and "fix:" in err, err


def _clear_after_progress(err: str) -> str:
    """:func:`_clear` for a verb that logs progress lines before it fails; returns the fix."""
    start = err.find("error:")
    assert start == 0 or err[start - 1 : start] == "\n", err
    _clear(err[start:])
    return err.split("fix:", 1)[1]


# --- cdc.toml and environment --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "toml,words",
    [
        ("sorce = 'host=x'\n", "unknown key 'sorce'"),
        ("[warehouse]\nbucket = 4\n", "unknown key '[warehouse] bucket'"),
        ("[warehous]\nbuckets = 4\n", "unknown key 'warehous'"),
        ('[warehouse]\nbuckets = "16"\n', "'[warehouse] buckets' must be an integer"),
        ("[kafka]\nssl_check_hostname = 1\n", "must be true or false"),
        ("[kafka]\nsecurity_protocol = 'TLS'\n", "security_protocol"),
        ("[status]\nslot_policy = 'drop'\n", "slot_drop_at_bytes"),
        ("partitions = 0\n", "partitions"),
        ("this is = not toml [\n", "is not valid TOML"),
        ("[serve]\nport = 'http'\n", "'[serve] port' must be an integer"),
    ],
)
def test_bad_cdc_toml(cdc_main: Run, tmp_path: Path, toml: str, words: str) -> None:
    (tmp_path / "cdc.toml").write_text(toml)
    code, out, err = cdc_main("tables", "list")
    assert code == 2 and out == ""
    _clear(err)
    assert words in err
    assert not (tmp_path / "state").exists()  # nothing was created


@pytest.mark.parametrize(
    "var,value,words",
    [
        ("CDC_SOURCES", "host=x", "unknown environment variable CDC_SOURCES"),
        ("CDC_PARTITIONS", "four", "partitions must be a positive integer"),
        ("CDC_LOG", "redis://x", "not a log store"),
        ("CDC_SLOT", "Bad-Slot", "not a valid replication slot name"),
        ("CDC_CONFIG", "/nonexistent/cdc.toml", "does not exist"),
        ("CDC_SOURCE", "postgres:/user:pw-leak@host/db", "does not parse"),
        ("CDC_SOURCE", "host=h port=1 no_such_option=1 password=pw-leak", "does not parse"),
    ],
)
def test_bad_environment(
    cdc_main: Run, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, var: str, value: str, words: str
) -> None:
    monkeypatch.setenv(var, value)
    code, _, err = cdc_main("tables", "list")
    assert code == 2
    _clear(err)
    assert words in err and "pw-leak" not in err


def test_no_source_configured(cdc_main: Run) -> None:
    code, _, err = cdc_main("check")
    assert code == 2
    _clear(err)
    assert "CDC_SOURCE" in err


def test_unreachable_host(cdc_main: Run) -> None:
    code, _, err = cdc_main("check", source=f"postgresql://u:pw-leak@127.0.0.1:{free_port()}/db")
    assert code == 1
    _clear(err)
    assert "cannot be reached" in err and "pw-leak" not in err


def test_wrong_password(cdc_main: Run, pg: PgCluster, pg_db: str) -> None:
    role = f"pw_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'right' IN ROLE cdc_password_auth")
    code, _, err = cdc_main("tables", "add", "t", source=pg.dsn(pg_db, role, "pw-leak"))
    assert code == 2
    _clear(err)
    assert "password authentication failed" in err and "pw-leak" not in err


def test_unknown_database(cdc_main: Run, pg: PgCluster) -> None:
    code, _, err = cdc_main("check", source=pg.dsn("no_such_database"))
    assert code == 2
    _clear(err)
    assert 'database "no_such_database" does not exist' in err


# --- registration --------------------------------------------------------------------------------------
@pytest.fixture
def db(pg: PgCluster, pg_db: str) -> str:
    for stmt in (
        "CREATE TABLE victim (id int PRIMARY KEY, v text)",
        "CREATE TABLE nopk (id int, v text)",
        "CREATE TABLE keyed (id int PRIMARY KEY, v text, n int)",
        "CREATE VIEW a_view AS SELECT * FROM keyed",
        "CREATE MATERIALIZED VIEW a_matview AS SELECT * FROM keyed",
    ):
        pg.execute(stmt, pg_db)
    return pg_db


def _registered(tmp_path: Path) -> list[str]:
    if not (tmp_path / "state" / "registry.db").exists():
        return []
    with Registry(tmp_path / "state") as reg:
        return [r.qualified for r in reg.list_tables()]


REFUSALS = [
    (["no_such_table"], "does not exist"),
    (["a_view"], "is a view"),
    (["a_matview"], "is a materialized view"),
    (["nopk"], "has no primary key"),
    (["keyed", "--key", "v"], "is not carried by the replica identity"),
    (["keyed", "--search", "nope"], "nope"),
    (["keyed", "--exclude", "id"], "--exclude names key column"),
    (["keyed", "--search", "v", "--exclude", "v"], "--search and --exclude both name"),
    (['"Keyed"'], "does not exist"),
    # hostile identifiers: nothing is executed, nothing registered, the victim table stays
    (["victim; DROP TABLE victim"], "not valid"),
    (["'victim'"], "not valid"),
    (['"victim'], "never closed"),
    (['public."victim"; --'], "not valid"),
    (
        [
            "..",
        ],
        "not valid",
    ),
    (["public..victim"], "a name is missing"),
    (["a.b.c"], "3 dotted parts"),
    (["x" * 64], "63-byte identifier limit"),
    (['"' + "é" * 40 + '"'], "63-byte identifier limit"),
    ([""], "it is empty"),
    (['""'], "empty name"),
    (['"a\x00b"'], "NUL"),
]


@pytest.mark.parametrize("argv,words", REFUSALS, ids=[repr(a)[:40] for a, _ in REFUSALS])
def test_registration_refused(
    cdc_main: Run, pg: PgCluster, db: str, tmp_path: Path, argv: list[str], words: str
) -> None:
    code, out, err = cdc_main("tables", "add", *argv, source=pg.dsn(db))
    assert code != 0 and out == ""
    _clear(err)
    assert words in err
    assert _registered(tmp_path) == []
    assert pg.fetch("SELECT count(*) FROM victim", db) == [(0,)]  # still there


def test_registration_twice_refused_keeps_the_first(
    cdc_main: Run, pg: PgCluster, db: str, tmp_path: Path
) -> None:
    assert cdc_main("tables", "add", "keyed", "--search", "v", source=pg.dsn(db))[0] == 0
    code, _, err = cdc_main("tables", "add", "keyed", source=pg.dsn(db))
    assert code == 1
    _clear(err)
    assert "already registered" in err
    with Registry(tmp_path / "state") as reg:
        assert reg.get("public", "keyed").search == ("v",)


def test_registration_without_select_privilege(cdc_main: Run, pg: PgCluster, db: str, tmp_path: Path) -> None:
    role = f"nosel_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {role} LOGIN")
    code, _, err = cdc_main("tables", "add", "keyed", source=pg.dsn(db, role))
    assert code == 1
    _clear(err)
    assert "cannot SELECT" in err and _registered(tmp_path) == []


def test_remove_unregistered(cdc_main: Run) -> None:
    code, _, err = cdc_main("tables", "remove", "public.nothing")
    assert code == 1
    _clear(err)
    assert "not registered" in err


def test_non_utf8_table_name(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDC_")}
    res = subprocess.run(
        [
            *CDC,
            "--state",
            str(tmp_path / "s"),
            "--source",
            "host=127.0.0.1 port=1",
            "tables",
            "add",
            b"t\xff\xfe",
        ],
        capture_output=True,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 1
    err = res.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err and "not valid UTF-8" in err


def test_corrupt_registry(cdc_main: Run, tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "registry.db").write_bytes(b"this is not a database" * 100)
    code, _, err = cdc_main("tables", "list")
    assert code == 1
    _clear(err)
    assert "cannot be read" in err
    assert (tmp_path / "state" / "registry.db").read_bytes().startswith(b"this is not")  # kept as it was


# --- the CLI --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,words",
    [
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["tables", "list", "--jsn"], "unrecognized arguments: --jsn"),
        (["tables", "add"], "the following arguments are required"),
        (["--statee", "x", "tables", "list"], "invalid choice: 'x'"),
        (["tables", "frob"], "invalid choice: 'frob'"),
    ],
)
def test_cli_unknown_verbs_and_flags(cdc_main: Run, argv: list[str], words: str) -> None:
    code, _, err = cdc_main(*argv)
    assert code == 2 and words in err


def test_dump_of_an_unknown_topic(cdc_main: Run) -> None:
    code, _, err = cdc_main("topic", "dump", "cdc.public.nothing")
    assert code != 0
    _clear(err)
    assert "cdc.public.nothing" in err


def test_snapshot_needs_names_or_all(cdc_main: Run) -> None:
    code, _, err = cdc_main("snapshot")
    assert code == 2
    _clear(err)


# --- the source ---------------------------------------------------------------------------------------
def test_slot_dropped_underneath(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.sql("INSERT INTO t VALUES (1)")
    env.add_table("public.t")
    env.run_once()
    env.pg.execute(f"SELECT pg_drop_replication_slot('{env.slot}')")
    res = env.cdc("run", "--once")
    assert res.returncode == 3
    assert "does not exist any more" in res.stderr and "cdc snapshot --all" in res.stderr
    assert len(env.records(env.reg("public", "t").topic)) == 1  # the topic is kept


def test_table_dropped_before_its_snapshot(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.add_table("public.t")
    env.sql("DROP TABLE t")
    res = env.cdc("run", "--once")
    assert res.returncode == 1, res.stderr
    assert (
        "Traceback" not in res.stderr and "does not exist" in res.stderr and "cdc tables remove" in res.stderr
    )
    assert env.reg("public", "t").snapshot_state != "done"  # registration kept, nothing marked done


def test_table_renamed_while_registered(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.add_table("public.t")
    env.sql("ALTER TABLE t RENAME TO t2")
    res = env.cdc("run", "--once")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and "does not exist" in res.stderr and "fix:" in res.stderr


def test_replica_identity_changed_is_a_check_finding(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.add_table("public.t")
    env.sql("ALTER TABLE t REPLICA IDENTITY NOTHING")
    res = env.cdc("check")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "REPLICA IDENTITY" in res.stdout


def test_permission_revoked_before_the_snapshot(env: CaptureEnv) -> None:
    role = f"cap_{uuid.uuid4().hex[:8]}"
    env.pg.execute(f"CREATE ROLE {role} LOGIN REPLICATION")
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.sql(f"GRANT SELECT ON t TO {role}")
    dsn = env.pg.dsn(env.db, role)
    assert env.cdc("--source", dsn, "tables", "add", "public.t").returncode == 0
    env.sql(f"REVOKE SELECT ON t FROM {role}")
    res = env.cdc("--source", dsn, "run", "--once")
    assert res.returncode == 2, res.stderr
    assert "lacks a privilege" in res.stderr and "retry" not in res.stderr


@pytest.fixture(scope="module")
def replica_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgCluster]:
    """A second tiny cluster with wal_level = replica (logical decoding impossible)."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="cdc-pg-replica-"))
    cluster = start_cluster(base)
    try:
        cluster.execute("ALTER SYSTEM SET wal_level = 'replica'")
        cluster.restart()
        yield cluster
    finally:
        cluster.stop("immediate")
        import shutil

        shutil.rmtree(base, ignore_errors=True)


def test_wal_level_not_logical(replica_cluster: PgCluster, cdc_main: Run, tmp_path: Path) -> None:
    replica_cluster.execute("CREATE TABLE IF NOT EXISTS t (id int PRIMARY KEY)")
    dsn = replica_cluster.dsn()
    code, out, err = cdc_main("check", source=dsn)
    assert code == 2
    assert "wal_level" in out
    assert cdc_main("tables", "add", "t", source=dsn)[0] == 0
    code, out, err = cdc_main("run", "--once", source=dsn)
    assert code == 2, err
    fix = _clear_after_progress(err)
    assert "its wal_level is not 'logical'" in err
    assert "set wal_level = logical in postgresql.conf" in fix and "restart the server" in fix
    assert replica_cluster.fetch("SELECT count(*) FROM pg_replication_slots") == [(0,)]


def test_wal2json_missing(cdc_main: Run, pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    """The server cannot load wal2json (here: the database's dynamic_library_path names a directory
    that does not exist, so the plugin is not found, as on a server without the package): exit 2, the message
    names the plugin, the fix names the package for the server's version; no slot is left behind and
    nothing is written to the topic."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)", pg_db)
    pg.execute("INSERT INTO t VALUES (1)", pg_db)
    pg.execute(f"ALTER DATABASE {pg_db} SET dynamic_library_path = '/nonexistent/cdc-no-plugins'")
    dsn = pg.dsn(pg_db)
    assert cdc_main("tables", "add", "t", source=dsn)[0] == 0
    code, out, err = cdc_main("run", "--once", source=dsn)
    assert code == 2, err
    fix = _clear_after_progress(err)
    assert "the wal2json output plugin is not installed on the source server" in err
    major = pg.fetch("SHOW server_version_num")[0][0]
    assert f"apt-get install postgresql-{int(str(major)) // 10000}-wal2json" in fix
    assert pg.fetch(f"SELECT count(*) FROM pg_replication_slots WHERE database = '{pg_db}'") == [(0,)]
    with Registry(tmp_path / "state") as reg:
        assert reg.get("public", "t").snapshot_state != "done"
    code, out, err = cdc_main("topic", "dump", "cdc.public.t")
    assert (code, out.strip()) == (0, ""), (code, out, err)


def test_replication_privilege_revoked_while_running(env: CaptureEnv) -> None:
    """The running reader loses its connection (transient: retried), then the source refuses the
    role (permanent): it stops with exit 2 and the fix, instead of retrying for retry_max_s."""
    from tests.plugins.capture import wait_streaming

    role = f"cap_{uuid.uuid4().hex[:8]}"
    env.pg.execute(f"CREATE ROLE {role} LOGIN REPLICATION")
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.sql(f"GRANT SELECT ON t TO {role}")
    dsn = env.pg.dsn(env.db, role)
    assert env.cdc("--source", dsn, "tables", "add", "public.t").returncode == 0
    proc = subprocess.Popen(
        [*CDC, "--source", dsn, "run"],
        env=env.environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=env.state.parent,
    )
    env.procs.append(proc)  # type: ignore[arg-type]
    wait_streaming(env, proc)  # type: ignore[arg-type]
    env.pg.execute(f"ALTER ROLE {role} NOREPLICATION")
    env.pg.execute(
        f"SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = '{env.slot}'"
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "refused" in out and "fix:" in out
    assert out.count("retry") <= 2  # the dropped connection is retried, the refusal is not
