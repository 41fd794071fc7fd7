"""Connecting to the source: the one place that opens Postgres connections and classifies failures.

* :func:`connect`: an ordinary psycopg 3 connection (autocommit by default).
* :func:`connect_replication`: a psycopg2 ``LogicalReplicationConnection`` (psycopg 3 has no
  replication protocol).

Both use a connect timeout (:data:`CONNECT_TIMEOUT_S`), check the DSN parses first, and never
raise anything but a :class:`~cdc.errors.CdcError` whose message holds no password: a DSN that does
not parse is a :class:`~cdc.errors.DsnError` (psycopg's own text of that error quotes the whole DSN,
so it is never shown); any other failure goes through :func:`classify`.

:func:`classify` sorts an exception into *permanent* (:class:`~cdc.errors.SourcePermanentError`:
authentication, privilege, a missing database or table -- exit 2, fail fast) or *transient*
(:class:`~cdc.errors.SourceUnavailableError`: refused, unreachable, timed out, dropped, restarting --
the long-running reader retries those for ``retry_max_s``). After a connection is established the
server's SQLSTATE decides (``psycopg.errors`` / psycopg2 ``pgcode``). libpq reports a failure
*while connecting* without a SQLSTATE (psycopg 3 and psycopg2 alike), so there the failure
decides by what happened: a server that cannot be reached (TCP probe), a connect timeout
(``psycopg.errors.ConnectionTimeout``, libpq's "timeout expired") and a connection the peer dropped
before the session began (:data:`_TRANSIENT_TRANSPORT`: libpq's own text, which is not the server's
and is not translated unless the process sets ``LC_MESSAGES``) are transient, as are the server
states listed in :data:`_TRANSIENT_STARTUP` (starting up, shutting down, too many connections, a
standby taking no sessions) and a host that is not what the DSN's ``target_session_attrs`` asks for
(:data:`_WRONG_ROLE`: a standby not yet promoted during a failover), which libpq only reports as
text. Any other refusal -- the server answered with an error, such as a wrong password (28P01) or an
unknown role or database -- is permanent.

Two permanent SQLSTATEs get their own message and fix: 55000 naming ``wal_level`` (logical decoding
needs ``wal_level = logical``) and 58P01 naming the output plugin (wal2json is not installed).
"""

from __future__ import annotations

import re
import socket
import sys
from collections.abc import Mapping
from typing import Any

import psycopg

from cdc.config import parse_dsn, redact_dsn, redact_text
from cdc.errors import (
    CdcError,
    DsnError,
    SourceAuthError,
    SourceError,
    SourceMissingError,
    SourcePermanentError,
    SourcePrivilegeError,
    SourceUnavailableError,
)

CONNECT_TIMEOUT_S = 10

_CONNECT_FIX = (
    "check CDC_SOURCE / --source (host, port, database, user, password) and that the server "
    "accepts this client in pg_hba.conf"
)

#: SQLSTATE classes and codes that are worth retrying: connection exceptions, operator
#: intervention (admin/crash shutdown, cannot connect now), insufficient resources, the slot held
#: by a walsender that is still going away (55006 object_in_use), serialization failures.
_TRANSIENT_SQLSTATE_CLASSES = ("08", "57", "53")
_TRANSIENT_SQLSTATES = frozenset({"55006", "40001", "40P01"})
_AUTH_SQLSTATES = frozenset({"28P01", "28000"})
_MISSING_SQLSTATES = frozenset({"3D000", "3F000", "42P01", "42704"})

#: libpq's text for server states that refuse a session for now (it gives no SQLSTATE while
#: connecting): 57P03 cannot_connect_now, 53300 too_many_connections.
_TRANSIENT_STARTUP = (
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",
    "the database system is not accepting connections",  # a standby with hot_standby = off
    "too many connections",
    "remaining connection slots are reserved",
)

#: libpq's text for a host that answered but is not what the DSN's ``target_session_attrs`` asks for
#: (``primary``, ``read-write``; ``standby``, ``read-only``): a failover in progress -- the primary
#: gone, the standby not promoted yet -- refuses every host of a two-host DSN for a moment.
_WRONG_ROLE = (
    "server is in hot standby mode",
    "session is read-only",
    "server is not in hot standby mode",
    "session is not read-only",
)

#: libpq's text for a connection that broke or timed out before the session began: the peer (a
#: server under load, a proxy, a load balancer, a half-started server) accepted the TCP connection
#: and then closed it or said nothing. Nothing refused the login, so retrying may help.
_TRANSIENT_TRANSPORT = (
    "timeout expired",
    "server closed the connection unexpectedly",
    "could not receive data from server",
    "could not send data to server",
    "could not send startup packet",
    "could not send SSL negotiation packet",
    "SSL SYSCALL error",
    "SSL connection has been closed unexpectedly",
    "Connection reset by peer",
    "Broken pipe",
    "no connection to the server",
)

#: the server's message when a library (an output plugin that is not built in) is not installed:
#: it names the plugin, so no plugin is named here
_MISSING_LIBRARY = re.compile(r'could not access file "(?:\$libdir/)?([^"/]+)"')

#: session options for every source connection, so text output (timestamps, floats) is the same in
#: the stream and in the snapshot's COPY
SESSION_OPTIONS = "-c TimeZone=UTC -c DateStyle=ISO,MDY -c IntervalStyle=postgres -c extra_float_digits=1"


def _connect_kwargs(dsn: str, application_name: str, options: str | None) -> dict[str, Any]:
    """libpq parameters added to ``dsn``: the application name, the connect timeout (unless the DSN
    sets one), the session options."""
    kwargs: dict[str, Any] = {"application_name": application_name}
    if "connect_timeout" not in parse_dsn(dsn):
        kwargs["connect_timeout"] = CONNECT_TIMEOUT_S
    if options is not None:
        kwargs["options"] = options
    return kwargs


def connect(
    dsn: str,
    *,
    application_name: str = "cdc",
    options: str | None = None,
    autocommit: bool = True,
) -> psycopg.Connection[Any]:
    """A psycopg 3 connection to the source, or a classified :class:`SourceError` (see
    :func:`classify`) that does not show the password."""
    kwargs = _connect_kwargs(dsn, application_name, options)
    try:
        return psycopg.connect(dsn, autocommit=autocommit, **kwargs)
    except psycopg.Error as exc:
        raise classify(exc, dsn, connecting=True) from None


def connect_replication(dsn: str, *, application_name: str = "cdc-reader", options: str | None = None) -> Any:
    """A psycopg2 ``LogicalReplicationConnection`` with a connect timeout, or a classified
    :class:`SourceError`."""
    import psycopg2.extras  # here: ~10 ms of imports that only the reader's connection needs

    kwargs = _connect_kwargs(dsn, application_name, options)
    try:
        return psycopg2.connect(
            dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection, **kwargs
        )
    except psycopg2.Error as exc:
        raise classify(exc, dsn, connecting=True) from None


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a psycopg 3 or psycopg2 error, if the server sent one."""
    if isinstance(exc, psycopg.Error):
        return exc.sqlstate
    pg2 = _psycopg2()
    if pg2 is not None and isinstance(exc, pg2.Error):
        code: str | None = exc.pgcode
        return code
    return None


def _psycopg2() -> Any:
    """psycopg2 if this process imported it (:func:`connect_replication`), else None: an error of
    it cannot have been raised then, and the other verbs do without its import."""
    return sys.modules.get("psycopg2")


def is_transient(exc: BaseException) -> bool:
    """Whether retrying ``exc`` may help (see the module docstring). CdcErrors say it by class."""
    if isinstance(exc, SourceUnavailableError):
        return True
    if isinstance(exc, CdcError):
        return False
    code = sqlstate(exc)
    if code:
        return code.startswith(_TRANSIENT_SQLSTATE_CLASSES) or code in _TRANSIENT_SQLSTATES
    # no SQLSTATE: the link broke (server closed the connection, SSL SYSCALL, timeout, a closed
    # connection used) -- psycopg 3 OperationalError, psycopg2 OperationalError/InterfaceError, and
    # the bare psycopg2 DatabaseError that replication commands raise when the walsender goes away
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        return True
    pg2 = _psycopg2()
    if pg2 is None:
        return False
    if isinstance(exc, pg2.OperationalError | pg2.InterfaceError):
        return True
    return type(exc) is pg2.DatabaseError


def classify(exc: BaseException, dsn: str, *, connecting: bool = False) -> SourceError:
    """A :class:`SourceError` for a psycopg 3 / psycopg2 error: permanent or transient, with the
    server's text redacted (never the password, never the raw DSN)."""
    shown = redact_dsn(dsn)
    detail = redact_text(str(exc).strip(), dsn)
    code = sqlstate(exc)
    values: dict[str, Any] = {"source": shown, "sqlstate": code}
    if code in _AUTH_SQLSTATES:
        return SourceAuthError(
            f"cannot connect to the source {shown}: the server refused the login: {detail}",
            fix=_CONNECT_FIX,
            **values,
        )
    if code == "42501" and "output plugin" in detail:
        # no SQLSTATE of its own: output_plugin_libraries (current minor releases) refused the plugin;
        # the reader checks the setting before it creates a slot, this catches a race with a reload
        return SourcePermanentError(
            f"the source server {shown} refuses the output plugin: {detail}",
            fix="as a superuser on the source, add the plugin to output_plugin_libraries and reload "
            "(`cdc check` prints the exact ALTER SYSTEM statement)",
            **values,
        )
    if code == "42501":
        return SourcePrivilegeError(
            f"the source role lacks a privilege: {detail}",
            fix="grant the role what `cdc check` lists (SELECT on the registered tables, REPLICATION)",
            **values,
        )
    if code in _MISSING_SQLSTATES:
        return SourceMissingError(
            f"the source has no such object: {detail}",
            fix="check the database name in the DSN and the registered tables (`cdc tables list`)",
            **values,
        )
    if code == "55000" and "wal_level" in detail:
        return SourcePermanentError(
            f"the source {shown} cannot do logical decoding: its wal_level is not 'logical': {detail}",
            fix="set wal_level = logical in postgresql.conf (or ALTER SYSTEM SET wal_level = logical) "
            "and restart the server; `cdc check` shows the server's settings",
            **values,
        )
    if code == "58P01" and (library := _MISSING_LIBRARY.search(detail)) is not None:
        plugin = library.group(1)
        package = f"postgresql-{_server_major(exc) or '<major version>'}-{plugin}"
        return SourcePermanentError(
            f"the {plugin} output plugin is not installed on the source server {shown}: {detail}",
            fix=f"install it on the database server (Debian/Ubuntu: apt-get install {package}, the "
            "package for the server's major version; RDS, Aurora and Cloud SQL ship wal2json), then "
            "run `cdc check` again",
            **values,
        )
    if connecting and code is None:
        if not _reachable(dsn) or any(s in detail for s in _TRANSIENT_STARTUP):
            return SourceUnavailableError(
                f"cannot connect to the source {shown} (it cannot be reached): {detail}",
                fix="check that the server is up and reachable from here (host, port, firewall)",
                **values,
            )
        if any(s in detail for s in _WRONG_ROLE):
            return SourceUnavailableError(
                f"cannot connect to the source {shown}: no host is what target_session_attrs asks "
                f"for (a failover in progress?): {detail}",
                fix="cdc run retries while a standby is promoted (retry_max_s bounds it); if no host of "
                "the DSN can become what target_session_attrs asks for, add the primary's host to it",
                **values,
            )
        if isinstance(exc, psycopg.errors.ConnectionTimeout) or any(
            s in detail for s in _TRANSIENT_TRANSPORT
        ):
            return SourceUnavailableError(
                f"cannot connect to the source {shown} (it accepted the connection, then timed out or "
                f"closed it before the session began): {detail}",
                fix="check that the server is up and not overloaded, and that nothing between here and "
                "it (a proxy, a load balancer, a firewall) drops the connection; raise connect_timeout "
                "in the DSN for a slow link",
                **values,
            )
        return SourceAuthError(
            f"cannot connect to the source {shown}: the server refused the connection: {detail}",
            fix=_CONNECT_FIX + "; the database and the role must exist",
            **values,
        )
    if is_transient(exc):
        return SourceUnavailableError(
            f"lost the connection to the source {shown}: {detail}",
            fix="check that the source is up and reachable",
            **values,
        )
    return SourcePermanentError(f"the source refused an operation: {detail}", fix=None, **values)


def _server_major(exc: BaseException) -> int | None:
    """The major version of the server behind the connection ``exc`` came from, if it says."""
    version = 0
    if isinstance(exc, psycopg.Error) and exc.pgconn is not None:
        version = exc.pgconn.server_version
    elif (pg2 := _psycopg2()) is not None and isinstance(exc, pg2.Error) and exc.cursor is not None:
        version = exc.cursor.connection.server_version
    return version // 10000 if version else None


def _reachable(dsn: str, timeout: float = 3.0) -> bool:
    """Whether some host of the DSN accepts a TCP (or Unix-socket) connection on its port."""
    try:
        params: Mapping[str, str] = parse_dsn(dsn)
    except DsnError:
        return False
    hosts = (params.get("host") or params.get("hostaddr") or "localhost").split(",")
    ports = (params.get("port") or "5432").split(",")
    for i, host in enumerate(hosts):
        try:
            port = int(ports[i] if i < len(ports) else ports[-1] or 5432)
            if host.startswith("/"):
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(timeout)
                    s.connect(f"{host}/.s.PGSQL.{port}")
            else:
                socket.create_connection((host, port), timeout=timeout).close()
        except (OSError, ValueError):
            continue
        return True
    return False
