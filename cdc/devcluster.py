"""A private PostgreSQL 15 cluster (wal_level=logical, wal2json) for tests, the demo and benchmarks.

initdb and postgres refuse to run as root, so when we run as root the cluster runs as the
``postgres`` OS user (``runuser``). The cluster lives in a directory of its own with its own port and
socket dir; it never touches a server someone else runs.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
WAL2JSON = Path("/usr/lib/postgresql/15/lib/wal2json.so")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_postgres_user() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@dataclass
class PgCluster:
    """A running private cluster. ``dsn(db)`` gives a superuser DSN over TCP on loopback."""

    datadir: Path
    sockdir: Path
    port: int
    user: str = "postgres"

    def dsn(self, dbname: str = "postgres", user: str | None = None, password: str | None = None) -> str:
        dsn = f"host=127.0.0.1 port={self.port} dbname={dbname} user={user or self.user}"
        return dsn + (f" password={password}" if password else "")

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [*_as_postgres_user(), str(PG_BIN / "pg_ctl"), "-D", str(self.datadir), "-w", "-t", "60", *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def start(self) -> None:
        self._ctl("-l", str(self.datadir / "server.log"), "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "stop")

    def restart(self) -> None:
        self._ctl("-m", "fast", "-l", str(self.datadir / "server.log"), "restart")

    def execute(self, query: str | sql.Composable, dbname: str = "postgres") -> None:
        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            conn.execute(query)  # type: ignore[arg-type]

    def fetch(self, query: str | sql.Composable, dbname: str = "postgres") -> list[tuple[object, ...]]:
        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            return conn.execute(query).fetchall()  # type: ignore[arg-type]

    def create_database(self, prefix: str = "t") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    def drop_database(self, name: str) -> None:
        """Drop a test database and any replication slot left in it."""
        for (slot,) in self.fetch(
            sql.SQL("SELECT slot_name FROM pg_replication_slots WHERE database = {}").format(
                sql.Literal(name)
            )
        ):
            self.execute(
                sql.SQL(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                    "WHERE slot_name = {} AND active_pid IS NOT NULL"
                ).format(sql.Literal(slot))
            )
            self.execute(sql.SQL("SELECT pg_drop_replication_slot({})").format(sql.Literal(slot)))
        self.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


#: the output plugins a cluster of ours allows (``output_plugin_libraries``, PostgreSQL 15.20+, 16.15+,
#: 17.11+, 18.6+; its default is ``'pgoutput, test_decoding'``, which refuses wal2json)
ALLOWED_OUTPUT_PLUGINS = ("pgoutput", "test_decoding", "wal2json")


def knows_setting(cluster: PgCluster, name: str) -> bool:
    """Whether the running server has the configuration parameter ``name``."""
    return bool(cluster.fetch(sql.SQL("SELECT 1 FROM pg_settings WHERE name = {}").format(sql.Literal(name))))


def allow_wal2json(cluster: PgCluster) -> bool:
    """Let the cluster load wal2json as an output plugin where the server has an allow-list of
    output plugins (``ALTER SYSTEM`` + reload, as a DBA would). False where the server has no such
    setting (every plugin is allowed there)."""
    if not knows_setting(cluster, "output_plugin_libraries"):
        return False
    cluster.execute(
        sql.SQL("ALTER SYSTEM SET output_plugin_libraries = {}").format(
            sql.SQL(", ").join(map(sql.Literal, ALLOWED_OUTPUT_PLUGINS))
        )
    )
    cluster.execute("SELECT pg_reload_conf()")
    return True


def start_cluster(base: Path, *, wal2json_allowed: bool = True) -> PgCluster:
    """initdb and start a private cluster under ``base``. ``wal2json_allowed=False`` leaves the
    server's output-plugin allow-list at its default (tests of what a stock server refuses)."""
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(f"{PG_BIN}/initdb not found: run `make setup` (apt-get install postgresql-15)")
    if not WAL2JSON.exists():
        raise RuntimeError(f"{WAL2JSON} not found: run `make setup` (apt-get install postgresql-15-wal2json)")
    datadir, sockdir = base / "data", base / "sock"
    sockdir.mkdir(parents=True)
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        for p in (base, sockdir):
            os.chown(p, pw.pw_uid, pw.pw_gid)
    subprocess.run(
        [
            *_as_postgres_user(),
            str(PG_BIN / "initdb"),
            "-D",
            str(datadir),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    port = free_port()
    conf = f"""
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = '{sockdir}'
wal_level = logical
max_replication_slots = 64
max_wal_senders = 64
max_connections = 200
fsync = off
full_page_writes = off
shared_buffers = 256MB
max_wal_size = 4GB
wal_sender_timeout = 60s
log_min_messages = warning
"""
    with open(datadir / "postgresql.conf", "a") as fh:
        fh.write(conf)
    with open(datadir / "pg_hba.conf", "w") as fh:
        fh.write(
            # members of the role cdc_password_auth log in with a password (tests of wrong passwords)
            "local all all trust\nlocal replication all trust\n"
            "host all +cdc_password_auth 127.0.0.1/32 scram-sha-256\n"
            "host replication +cdc_password_auth 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n"
        )
    cluster = PgCluster(datadir=datadir, sockdir=sockdir, port=port)
    cluster.start()
    cluster.execute("CREATE ROLE cdc_password_auth NOLOGIN")
    if wal2json_allowed:
        allow_wal2json(cluster)
    return cluster
