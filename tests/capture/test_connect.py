"""Connecting to the source: one helper, a connect timeout, errors classified (issue 9 item 3)."""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg2
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from cdc.cli import main
from cdc.connect import CONNECT_TIMEOUT_S, classify, connect, connect_replication, is_transient
from cdc.devcluster import PgCluster, free_port
from cdc.errors import (
    DsnError,
    SourceAuthError,
    SourceMissingError,
    SourcePrivilegeError,
    SourceUnavailableError,
)
from cdc.registry import Registry, TableReg
from tests.plugins.capture import CaptureEnv
from tests.plugins.postgres import wait_for

# most of these tests reach no cluster (a refused port, a DSN that does not parse, a stalling peer),
# but connect with the retry policy's timeouts: kept out of make check
pytestmark = pytest.mark.postgres


@pytest.fixture
def pw_role(pg: PgCluster) -> str:
    """A role that must log in with the password 'right-pw' (pg_hba: scram for cdc_password_auth)."""
    name = f"pw_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {name} LOGIN REPLICATION PASSWORD 'right-pw' IN ROLE cdc_password_auth")
    return name


def test_wrong_password_is_permanent_and_not_shown(pg: PgCluster, pg_db: str, pw_role: str) -> None:
    with pytest.raises(SourceAuthError) as err:
        connect(pg.dsn(pg_db, pw_role, "wr0ng-s3cret"))
    assert err.value.exit_code == 2
    assert "wr0ng-s3cret" not in str(err.value) and "wr0ng-s3cret" not in str(err.value.to_dict())
    with pytest.raises(SourceAuthError):
        connect_replication(pg.dsn(pg_db, pw_role, "wr0ng-s3cret"))
    connect(pg.dsn(pg_db, pw_role, "right-pw")).close()


def test_unknown_database_and_role_are_permanent(pg: PgCluster) -> None:
    with pytest.raises(SourceAuthError) as err:  # the server refused the session
        connect(pg.dsn("no_such_db_x"))
    assert not is_transient(err.value)
    with pytest.raises(SourceAuthError):
        connect(pg.dsn("postgres", "no_such_role_x"))


def test_refused_port_is_transient() -> None:
    with pytest.raises(SourceUnavailableError) as err:
        connect(f"host=127.0.0.1 port={free_port()} dbname=x user=u password=hunter22")
    assert is_transient(err.value)
    assert "hunter22" not in str(err.value)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgres:/user:hunter22@host/db",
        "host=h password=hunter22 port=notaport dbname",
        "postgresql://u:hunter22@h:5432/db?nonsense_option=1",
        "postgresql://u:hunter22@127.0.0.1:notaport/db",  # libpq checks the port only when connecting
    ],
)
def test_dsn_that_does_not_parse_is_a_config_error_without_the_password(dsn: str) -> None:
    with pytest.raises(DsnError) as err:
        connect(dsn)
    assert err.value.exit_code == 2
    assert "hunter22" not in str(err.value) and "hunter22" not in str(err.value.to_dict())


def test_sqlstates_after_connecting(pg: PgCluster, pg_db: str) -> None:
    weak = f"weak_{uuid.uuid4().hex[:8]}"
    pg.execute(f"CREATE ROLE {weak} LOGIN")
    pg.execute("CREATE TABLE secret_t (id int)", pg_db)
    with connect(pg.dsn(pg_db, weak)) as conn:
        with pytest.raises(Exception) as raw:
            conn.execute("SELECT * FROM secret_t")
        assert isinstance(classify(raw.value, pg.dsn(pg_db)), SourcePrivilegeError)
        with pytest.raises(Exception) as raw:
            conn.execute("SELECT * FROM no_such_table_x")
        assert isinstance(classify(raw.value, pg.dsn(pg_db)), SourceMissingError)


def test_replication_connection_has_a_connect_timeout(pg: PgCluster, pg_db: str) -> None:
    conn = connect_replication(pg.dsn(pg_db))
    try:
        assert conn.get_dsn_parameters()["connect_timeout"] == str(CONNECT_TIMEOUT_S)
        assert isinstance(conn, psycopg2.extras.LogicalReplicationConnection)
    finally:
        conn.close()


def _cli(tmp_path: Path, dsn: str, *args: str) -> int:
    return main(["--source", dsn, "--state", str(tmp_path / "state"), *args])


def test_cli_wrong_password_fails_fast_with_exit_2(
    pg: PgCluster, pg_db: str, pw_role: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for verb in (["check"], ["tables", "add", "public.t"]):
        assert _cli(tmp_path, pg.dsn(pg_db, pw_role, "wr0ng-s3cret"), *verb) == 2
        err = capsys.readouterr().err
        assert "refused" in err and "fix:" in err and "wr0ng-s3cret" not in err


def test_run_permanent_error_is_not_retried(
    pg: PgCluster, pg_db: str, pw_role: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Registry(tmp_path / "state") as reg:
        reg.add(TableReg("public", "t", "cdc.public.t", ("id",)))
    assert _cli(tmp_path, pg.dsn(pg_db, pw_role, "wr0ng-s3cret"), "run", "--once") == 2
    err = capsys.readouterr().err
    assert "retry" not in err and "wr0ng-s3cret" not in err


def test_run_transient_error_retried_for_retry_max_s_each_retry_logged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a refused port fails each attempt at once: 3 s holds about six at backoffs of 0.2-0.5 s, and
    # two retries is all this asks, even with each attempt taking a second on a loaded machine
    (tmp_path / "cdc.toml").write_text("retry_max_s = 3\nbackoff_initial_s = 0.2\nbackoff_max_s = 0.5\n")
    with Registry(tmp_path / "state") as reg:
        reg.add(TableReg("public", "t", "cdc.public.t", ("id",)))
    monkeypatch.chdir(tmp_path)  # cdc.toml is read from the working directory
    dsn = f"host=127.0.0.1 port={free_port()} dbname=x user=u password=hunter22"
    code = _cli(tmp_path, dsn, "run", "--once")
    err = capsys.readouterr().err
    assert code == 1
    retries = [line for line in err.splitlines() if "retry" in line]
    assert len(retries) >= 2, err
    assert "could not restore it" in err and "hunter22" not in err


class _Listener:
    """A loopback TCP listener on a thread that accepts every connection and then either holds it
    open without a word (``stall``) or closes it at once (``close``): a peer that answers on TCP
    but never starts a Postgres session."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = int(self.sock.getsockname()[1])
        self.held: list[socket.socket] = []
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # shut down by stop()
                return
            self.accepted += 1
            if self.mode == "close":
                conn.close()
            else:
                self.held.append(conn)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.sock.close()
        self.thread.join(5)
        for conn in self.held:
            conn.close()


@pytest.fixture
def listener(request: pytest.FixtureRequest) -> Iterator[_Listener]:
    lst = _Listener(request.param)
    try:
        yield lst
    finally:
        lst.stop()


# libpq's smallest connect_timeout is 2 s
def _listener_dsn(lst: _Listener) -> str:
    return f"host=127.0.0.1 port={lst.port} dbname=x user=u password=hunter22 connect_timeout=2"


@pytest.mark.parametrize("listener", ["stall", "close"], indirect=True)
def test_peer_that_times_out_or_closes_while_connecting_is_transient(listener: _Listener) -> None:
    """Nothing refused the login: the peer accepted and then said nothing for connect_timeout
    (psycopg 3 "connection timeout expired", libpq "timeout expired") or closed the connection
    ("server closed the connection unexpectedly"). Transient, from both connect helpers, and
    bounded by the connect timeout: the stalled peer never answers, so only libpq's timeout ends the
    attempt ("timeout expired" is its word), not a clock in this test (pytest's timeout would end a
    hang)."""
    for helper in (connect, connect_replication):
        with pytest.raises(SourceUnavailableError) as err:
            helper(_listener_dsn(listener))
        assert is_transient(err.value) and err.value.exit_code == 1
        words = "timeout expired" if listener.mode == "stall" else "closed the connection unexpectedly"
        assert words in err.value.message and "hunter22" not in str(err.value.to_dict())
        assert err.value.fix and "connect_timeout" in err.value.fix
    assert listener.accepted >= 2


@pytest.mark.parametrize("listener", ["close"], indirect=True)
def test_run_retries_a_peer_that_closes_while_connecting(
    listener: _Listener, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cdc run` retries it with backoff, logs each retry, and gives up after retry_max_s (exit 1),
    instead of failing fast as for a refused login. The peer closes every attempt at once, so
    retry_max_s (3 s) holds about six attempts at backoffs of 0.2-0.5 s; two is all this asks, even
    with each one taking a second on a loaded machine."""
    (tmp_path / "cdc.toml").write_text("retry_max_s = 3\nbackoff_initial_s = 0.2\nbackoff_max_s = 0.5\n")
    with Registry(tmp_path / "state") as reg:
        reg.add(TableReg("public", "t", "cdc.public.t", ("id",)))
    monkeypatch.chdir(tmp_path)
    code = _cli(tmp_path, _listener_dsn(listener), "run", "--once")
    err = capsys.readouterr().err
    assert code == 1, err  # it gave up (a failure that is not retried exits 2 at once, see above)
    retries = [line for line in err.splitlines() if "retry" in line]
    assert len(retries) >= 2, err
    assert "closed the connection unexpectedly" in err and "could not restore it" in err
    assert "hunter22" not in err
    assert listener.accepted >= len(retries)


def test_run_waits_until_a_host_is_what_target_session_attrs_asks_for(env: CaptureEnv) -> None:
    """A failover's moment on one server: no host of the DSN is what its ``target_session_attrs``
    asks for (in a failover: the primary gone, the standby not promoted yet; here a database whose
    sessions are read-only and ``read-write``). libpq's own refusal reaches both connect helpers as a
    transient error, and ``cdc run`` retries it until the server is what the DSN asks for, then
    captures: it does not exit as for a refused login."""
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t VALUES (1, 'before'), (2, 'before')")
    env.add_table("public.t")
    database = sql.Identifier(env.db)
    env.pg.execute(sql.SQL("ALTER DATABASE {} SET default_transaction_read_only = on").format(database))
    dsn = make_conninfo(env.dsn, target_session_attrs="read-write")
    for helper in (connect, connect_replication):
        with pytest.raises(SourceUnavailableError) as err:
            helper(dsn)
        assert is_transient(err.value) and err.value.exit_code == 1
        assert "session is read-only" in err.value.message and "failover" in err.value.message
    proc = env.spawn("run", "--once", extra_env={"CDC_SOURCE": dsn})
    wait_for(lambda: "a failover in progress" in env.proc_log(), what="cdc run retrying the read-only server")
    assert proc.poll() is None, env.proc_log()
    env.pg.execute(sql.SQL("ALTER DATABASE {} RESET default_transaction_read_only").format(database))
    assert proc.wait(timeout=120) == 0, env.proc_log()
    assert "retry" in env.proc_log()
    assert sorted(v["after"]["id"] for v in env.values(env.reg("public", "t").topic)) == [1, 2]
