"""The output-plugin allow-list of current Postgres minor releases (``output_plugin_libraries``, default
``'pgoutput, test_decoding'``): on a stock server ``cdc check`` reports wal2json refused, with the exact
statement that allows it; ``cdc run`` fails fast with the same error and fix, creating nothing; once the
DBA runs that statement, the whole capture path works. Runs on this machine's Postgres, which
``make setup`` keeps at Debian's current minor release."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from cdc.catalog import ServerInfo
from cdc.devcluster import PgCluster, knows_setting, start_cluster
from tests.plugins.capture import CaptureEnv, make_env
from tests.plugins.postgres import wait_for


@pytest.fixture(scope="module")
def stock_cluster() -> Iterator[PgCluster]:
    """A cluster whose output-plugin allow-list is the server's default."""
    base = Path(tempfile.mkdtemp(prefix="cdc-pg-stock-"))
    cluster = start_cluster(base, wal2json_allowed=False)
    try:
        yield cluster
    finally:
        cluster.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def env(stock_cluster: PgCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CaptureEnv]:
    db = stock_cluster.create_database()
    try:
        # the refusal is wal2json's: a suite-wide CDC_DECODER (make test-pgoutput) must not change it
        yield from make_env(stock_cluster, db, tmp_path, "embedded", request, decoder="wal2json")
    finally:
        stock_cluster.drop_database(db)


def _statement(fix: str) -> str:
    """The SQL of the fix: from the ``ALTER SYSTEM`` to before the ``--`` of the postgresql.conf form."""
    start = fix.index("ALTER SYSTEM")
    return fix[start : fix.index("  --", start)]


def test_stock_server_refuses_then_the_printed_fix_allows(env: CaptureEnv, stock_cluster: PgCluster) -> None:
    assert knows_setting(stock_cluster, "output_plugin_libraries"), (
        f"this Postgres ({stock_cluster.fetch('SHOW server_version')[0][0]}) predates the output-plugin "
        "allow-list: `make setup` installs Debian's current minor release"
    )
    assert stock_cluster.fetch("SHOW output_plugin_libraries") == [("pgoutput, test_decoding",)]
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t VALUES (1, 'before'), (2, 'quote '' and\nnewline')")
    env.add_table("public.t")

    # cdc check: an error finding with the exact statement, exit 2
    res = env.cdc("check", "--json")
    assert res.returncode == 2, res.stderr
    report = orjson.loads(res.stdout)
    (finding,) = [f for f in report["findings"] if f["check"] == "wal2json"]
    assert finding["severity"] == "error"
    assert (
        "output_plugin_libraries" in finding["message"] and "'pgoutput, test_decoding'" in finding["message"]
    )
    statement = _statement(finding["fix"])
    assert statement == (
        "ALTER SYSTEM SET output_plugin_libraries = 'pgoutput', 'test_decoding', 'wal2json'; "
        "SELECT pg_reload_conf();"
    )
    text = env.cdc("check")
    assert text.returncode == 2 and "ERROR wal2json" in text.stdout and "pg_reload_conf" in text.stdout

    # cdc run: fails fast with the same error and fix, no traceback, no slot, nothing written
    res = env.cdc("run", "--once")
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    assert "refuses the wal2json output plugin" in res.stderr and statement in res.stderr
    assert "lacks a privilege" not in res.stderr
    assert stock_cluster.fetch("SELECT count(*) FROM pg_replication_slots") == [(0,)]

    # the DBA runs the printed statement: check is clean on that point and capture works end to end
    for part in statement.split(";")[:-1]:  # as psql runs them: one statement at a time
        env.sql(part)
    assert stock_cluster.fetch("SHOW output_plugin_libraries") == [("pgoutput, test_decoding, wal2json",)]
    res = env.cdc("check", "--json")
    assert not [f for f in orjson.loads(res.stdout)["findings"] if f["check"] == "wal2json"], res.stdout
    env.run_once()
    env.sql("UPDATE t SET v = 'after' WHERE id = 1")
    env.run_once()
    rows = {
        orjson.loads(r.key)["id"]: orjson.loads(r.value)
        for r in env.records(env.reg("public", "t").topic)
        if r.value is not None
    }
    assert rows[1]["after"] == {"id": 1, "v": "after"} and rows[1]["op"] == "u"
    assert rows[2]["after"] == {"id": 2, "v": "quote ' and\nnewline"} and rows[2]["op"] == "r"


def test_pgoutput_needs_no_allow_list(env: CaptureEnv, stock_cluster: PgCluster) -> None:
    """The same stock server, decoder pgoutput: nothing to allow, capture works as it is."""
    env.decoder = "pgoutput"
    stock_cluster.execute("ALTER SYSTEM RESET output_plugin_libraries")  # as the DBA left it, or not
    stock_cluster.execute("SELECT pg_reload_conf()")
    wait_for(
        lambda: stock_cluster.fetch("SHOW output_plugin_libraries") == [("pgoutput, test_decoding",)],
        what="the stock allow-list",
    )
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t VALUES (1, 'before')")
    env.add_table("public.t")
    report = orjson.loads(env.cdc("check", "--json").stdout)
    assert not [f for f in report["findings"] if f["severity"] == "error"], report
    env.run_once()
    env.sql("UPDATE t SET v = %s WHERE id = 1", ["after \\ and\nnewline"])
    env.run_once()
    events = [orjson.loads(r.value) for r in env.records(env.reg("public", "t").topic) if r.value]
    assert [(e["op"], e["after"]) for e in events] == [
        ("r", {"id": 1, "v": "before"}),
        ("u", {"id": 1, "v": "after \\ and\nnewline"}),
    ]


@pytest.mark.parametrize(
    "setting,refused",
    [
        (None, False),  # a server without the allow-list loads any plugin
        ("pgoutput, test_decoding", True),
        ("", True),
        ("pgoutput, test_decoding, wal2json", False),
        ('pgoutput,"wal2json"', False),
        ("$libdir/wal2json.so", False),
        ("$libdir/wal2json_fork", True),
    ],
)
def test_output_plugin_rule(setting: str | None, refused: bool) -> None:
    info = ServerInfo(180006, "app", "logical", 10, 10, 0, 0, -1, "cdc", True, False, setting)
    refusal = info.output_plugin_refusal("wal2json")
    assert (refusal is not None) is refused
    if refusal is not None:
        message, fix = refusal
        assert repr(setting or "(empty)") in message
        assert "'wal2json'; SELECT pg_reload_conf();" in fix and "no restart" in fix
