"""Error classification by class and SQLSTATE (no message parsing once a SQLSTATE exists)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import psycopg
import psycopg.errors as pe
import psycopg2
import pytest

from cdc.connect import classify, is_transient
from cdc.errors import (
    ConfigError,
    SourceAuthError,
    SourceMissingError,
    SourcePermanentError,
    SourcePrivilegeError,
    SourceUnavailableError,
)

DSN = "postgresql://u:hunter22@127.0.0.1:1/db"


@pytest.mark.parametrize(
    "exc,cls",
    [
        (pe.InvalidPassword("x"), SourceAuthError),  # 28P01
        (pe.InvalidAuthorizationSpecification("x"), SourceAuthError),  # 28000
        (pe.InsufficientPrivilege("x"), SourcePrivilegeError),  # 42501
        (pe.InvalidCatalogName("x"), SourceMissingError),  # 3D000
        (pe.UndefinedTable("x"), SourceMissingError),  # 42P01
        (pe.InvalidSchemaName("x"), SourceMissingError),  # 3F000
        (pe.AdminShutdown("x"), SourceUnavailableError),  # 57P01: pg_terminate_backend, fast shutdown
        (pe.CannotConnectNow("x"), SourceUnavailableError),  # 57P03
        (pe.ConnectionFailure("x"), SourceUnavailableError),  # 08006
        (pe.TooManyConnections("x"), SourceUnavailableError),  # 53300
        (pe.ObjectInUse("x"), SourceUnavailableError),  # 55006: slot still held by the old walsender
        (pe.SyntaxError("x"), SourcePermanentError),  # 42601: a bug, not retried
        (psycopg.OperationalError("server closed the connection unexpectedly"), SourceUnavailableError),
        (psycopg2.OperationalError("SSL SYSCALL error: EOF detected"), SourceUnavailableError),
        (psycopg2.InterfaceError("connection already closed"), SourceUnavailableError),
    ],
)
def test_classify(exc: Exception, cls: type[Exception]) -> None:
    err = classify(exc, DSN)
    assert type(err) is cls
    assert is_transient(err) == (cls is SourceUnavailableError)
    assert err.exit_code == (1 if cls is SourceUnavailableError else 2)
    assert "hunter22" not in str(err.to_dict())


def test_driver_text_with_the_dsn_is_scrubbed() -> None:
    err = classify(psycopg.ProgrammingError(f'missing "=" after "{DSN}" in connection info string'), DSN)
    assert "hunter22" not in err.message and "u:***@127.0.0.1" in err.message


def test_config_errors_are_not_transient() -> None:
    assert not is_transient(ConfigError("x"))


@pytest.mark.parametrize(
    "exc,words,fix",
    [
        (
            pe.ObjectNotInPrerequisiteState("logical decoding requires wal_level >= logical"),
            "wal_level",
            "restart",
        ),
        (
            pe.UndefinedFile('could not access file "wal2json": No such file or directory'),
            "wal2json",
            "apt-get",
        ),
    ],
)
def test_permanent_source_settings_have_a_fix(exc: Exception, words: str, fix: str) -> None:
    err = classify(exc, DSN)
    assert type(err) is SourcePermanentError and not is_transient(err)
    assert words in err.message and err.fix is not None and fix in err.fix


@pytest.fixture
def listening() -> Iterator[int]:
    """A loopback port that accepts TCP connections (so the host counts as reachable)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)  # never accepted: the backlog holds every probe of a test
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize(
    "text",
    [
        "server is in hot standby mode",  # target_session_attrs=primary: a standby not promoted yet
        "session is read-only",  # read-write
        "server is not in hot standby mode",  # standby
        "session is not read-only",  # read-only
    ],
)
def test_a_reachable_host_of_the_wrong_role_is_transient_while_connecting(listening: int, text: str) -> None:
    """libpq refuses a host that is not what ``target_session_attrs`` asks for with text alone (no
    SQLSTATE); during a failover that is every host for a moment, so it is retried, not an exit 2
    as for a refused login. The host is reachable here: only the text can decide."""
    dsn = f"host=127.0.0.1 port={listening} dbname=db user=u password=hunter22 target_session_attrs=primary"
    raw = psycopg.OperationalError(f'connection to server at "127.0.0.1", port {listening} failed: {text}')
    err = classify(raw, dsn, connecting=True)
    assert type(err) is SourceUnavailableError and is_transient(err) and err.exit_code == 1
    assert "failover" in err.message and text in err.message
    assert err.fix is not None and "retries" in err.fix and "hunter22" not in str(err.to_dict())
    # a standby with hot_standby = off refuses every session until it is promoted: transient as well
    off = psycopg.OperationalError("FATAL:  the database system is not accepting connections")
    assert type(classify(off, dsn, connecting=True)) is SourceUnavailableError
    other = classify(psycopg.OperationalError("FATAL: no pg_hba.conf entry for host"), dsn, connecting=True)
    assert type(other) is SourceAuthError  # any other refusal by a reachable server stays permanent
