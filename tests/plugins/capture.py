"""The capture environment of a test: its own database, state dir, unique slot and topic prefix and
log-store backend (:class:`CaptureEnv`, the ``env`` fixture); ``cdc`` as a subprocess (:data:`CDC`);
waiting for the reader; and a versioned "sink" that materialises a topic the way every sink must.

The ``env`` fixture is configured by the ``cdc_config`` marker (on the test, its class or its
module): ``pytest.mark.cdc_config("[snapshot]\nchunk_size = 7\n", backend="kafka")`` appends the
text to the test's ``cdc.toml`` and picks the log-store backend (``embedded`` by default). A test
parametrised indirectly on ``env`` (``parametrize("env", BACKENDS, indirect=True)``) runs on each
backend of the parameter.

The ``decoders`` marker runs a test once per output plugin it names
(``pytest.mark.decoders("wal2json", "pgoutput", "pgoutput@pg18")``): ``env``'s cdc.toml then sets
``decoder``, and the ``decoder`` fixture tells the test which one it runs with (None without the
marker: the default). ``@pg18``: ``env``'s database is in the PostgreSQL 18 cluster (the ``pg18``
fixture) instead of the session's PostgreSQL 15."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import orjson
import psycopg
import pytest

from cdc.config import Settings, load_settings
from cdc.devcluster import PgCluster
from cdc.events import TRUNCATE_KEY_FIELD, Version, lsn_to_int
from cdc.logstore import LogStore, StoredRecord
from cdc.logstore.factory import open_log_store
from cdc.registry import Registry, TableReg
from snapshot.chunk_state import ChunkProgress, load_progress
from tests.plugins.postgres import wait_for

#: the ``cdc`` command line, run from this interpreter (the worktree's code, not an installed script)
CDC = [sys.executable, "-c", "from cdc.cli import entry; entry()"]
#: the pause between two samples of a test polling a ``cdc`` verb (``cdc status``, ``cdc tables
#: list``): each is a process of its own (0.3 s of CPU or more), so a shorter pause would keep a core
#: busy for as long as the test waits
PROCESS_POLL_S = 0.5


@dataclass
class CaptureEnv:
    pg: PgCluster
    db: str
    state: Path
    slot: str
    prefix: str
    log_url: str | None
    config: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    last_stderr: str = ""  # of the last `cdc` run by :meth:`cdc`
    #: the source DSN when it is not ``pg``'s alone (a primary and its standby: tests/plugins/failover.py)
    source: str | None = None
    #: the output plugin the test asked for (the ``decoders`` marker): it wins over a suite-wide
    #: ``CDC_DECODER`` (``make test-pgoutput``); None: the suite's (the environment's, or the default)
    decoder: str | None = None

    @property
    def dsn(self) -> str:
        return self.source or self.pg.dsn(self.db)

    def environ(self) -> dict[str, str]:
        env = {
            **os.environ,
            "CDC_SOURCE": self.dsn,
            "CDC_STATE": str(self.state),
            "CDC_SLOT": self.slot,
            "CDC_TOPIC_PREFIX": self.prefix,
            "CDC_CONFIG": str(self.config),
        }
        env.pop("CDC_LOG", None)
        if self.decoder:
            env["CDC_DECODER"] = self.decoder
        if self.log_url:
            env["CDC_LOG"] = self.log_url
        return env

    def settings(self) -> Settings:
        return load_settings({}, self.environ(), self.state)

    def sql(self, query: str, params: Any = None) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(query, params)  # type: ignore[arg-type]

    def fetch(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(query, params).fetchall()  # type: ignore[arg-type]

    def cdc(
        self, *args: str, timeout: float = 300, extra_env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``cdc ARGS...`` in a process of its own (``extra_env``: more environment, e.g. a fault)."""
        res = subprocess.run(
            [*CDC, *args],
            env={**self.environ(), **(extra_env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.state.parent,
        )
        self.last_stderr = res.stderr
        return res

    def spawn(
        self, *args: str, extra_env: Mapping[str, str] | None = None, group: bool = False
    ) -> subprocess.Popen[bytes]:
        """``cdc ARGS...`` running in the background, its output in :meth:`proc_log`; ``group``: in a
        process group of its own, as a supervisor starts it (``os.killpg`` then reaches it all)."""
        log = open(self.state.parent / f"run-{len(self.procs)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [*CDC, *args],
            env={**self.environ(), **(extra_env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.state.parent,
            start_new_session=group,
        )
        self.procs.append(proc)
        return proc

    def proc_log(self, i: int = -1) -> str:
        n = i if i >= 0 else len(self.procs) + i
        return (self.state.parent / f"run-{n}.log").read_text(errors="replace")

    def verify(self, *extra: str, timeout: float = 600) -> tuple[int, list[dict[str, Any]]]:
        """``cdc verify --json EXTRA...`` in a process of its own: (exit code, the report)."""
        res = self.cdc("verify", "--json", *extra, timeout=timeout)
        assert res.stdout, res.stderr
        return res.returncode, orjson.loads(res.stdout)

    def add_table(self, name: str, *flags: str) -> None:
        res = self.cdc("tables", "add", name, *flags)
        assert res.returncode == 0, res.stderr + res.stdout

    def run_once(self, *extra: str) -> dict[str, Any]:
        res = self.cdc("run", "--once", "--json", *extra)
        assert res.returncode == 0, f"cdc run --once exited {res.returncode}:\n{res.stderr}\n{res.stdout}"
        return dict(orjson.loads(res.stdout.strip().splitlines()[-1]))

    def registry(self) -> Registry:
        return Registry(self.state)

    def reg(self, schema: str, table: str) -> TableReg:
        with self.registry() as r:
            return r.get(schema, table)

    def store(self) -> LogStore:
        return open_log_store(self.settings(), writer=False)

    def records(self, topic: str) -> list[StoredRecord]:
        with self.store() as store:
            out: list[StoredRecord] = []
            for p in sorted(store.end_offsets(topic)):
                out.extend(store.iter_partition(topic, p))
            return out

    def values(self, topic: str) -> list[dict[str, Any]]:
        """The events of ``topic`` decoded, in topic order per partition (tombstones left out)."""
        return [orjson.loads(r.value) for r in self.records(topic) if r.value]

    def listed(self) -> dict[str, dict[str, Any]]:
        """``cdc tables list --json`` by table name."""
        res = self.cdc("tables", "list", "--json")
        assert res.returncode == 0, res.stderr
        return {t["table"]: t for t in orjson.loads(res.stdout)}

    def slot_confirmed(self, pg: PgCluster | None = None) -> int | None:
        """The slot's confirmed position on ``pg`` (default: :attr:`pg`; a promoted standby after a
        failover)."""
        rows = (pg or self.pg).fetch(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{self.slot}'"
        )
        return lsn_to_int(str(rows[0][0])) if rows and rows[0][0] else None

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                if os.getpgid(proc.pid) == proc.pid:  # spawned with a group of its own: all of it
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=30)


class SourceLoad:
    """Changes made at the source on a thread of their own while the ``with`` block runs: a subclass's
    :meth:`loop` runs on one autocommit connection until :attr:`stop` is set; what it raises fails
    the test as the block ends."""

    def __init__(self, env: CaptureEnv) -> None:
        self.env = env
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run)

    def loop(self, conn: psycopg.Connection[Any]) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            with psycopg.connect(self.env.dsn, autocommit=True) as conn:
                self.loop(conn)
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        assert not self.errors, self.errors


def make_env(
    pg: PgCluster,
    db: str,
    tmp_path: Path,
    backend: str,
    request: pytest.FixtureRequest,
    options: str = "",
    decoder: str | None = None,
) -> Iterator[CaptureEnv]:
    tag = uuid.uuid4().hex[:8]
    log_url = None
    if backend == "kafka":
        broker = request.getfixturevalue("tansu_broker")
        log_url = f"kafka://{broker.bootstrap}"
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "cdc.toml"
    config.write_text(
        "heartbeat_interval_s = 1\npoll_s = 0.2\nbackoff_initial_s = 0.2\nbackoff_max_s = 2\n"
        + (f'decoder = "{decoder}"\n' if decoder else "")
        + options
    )
    env = CaptureEnv(pg, db, state, f"cdc_slot_{tag}", f"cdc{tag}", log_url, config, decoder=decoder)
    try:
        yield env
    finally:
        env.stop_all()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cdc_config(options, backend='embedded'): the cdc.toml lines and log store of ``env``"
    )
    config.addinivalue_line("markers", "decoders(*names): run the test once per output plugin (``env``)")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("decoders")
    if marker is not None and "capture_source" in metafunc.fixturenames:
        metafunc.parametrize("capture_source", list(marker.args), indirect=True)


@pytest.fixture
def capture_source(request: pytest.FixtureRequest) -> str:
    """``decoder[@server]`` of ``env`` (the ``decoders`` marker's parameter; "": the defaults)."""
    return str(getattr(request, "param", ""))


@pytest.fixture
def decoder(capture_source: str) -> str | None:
    """The output plugin of ``env`` (None: the default)."""
    return capture_source.partition("@")[0] or None


@pytest.fixture
def env(
    tmp_path: Path, request: pytest.FixtureRequest, capture_source: str, decoder: str | None
) -> Iterator[CaptureEnv]:
    """A :class:`CaptureEnv` on a fresh database of the session cluster, or of the PostgreSQL 18 one
    (see the module's doc for the ``cdc_config`` and ``decoders`` markers and the indirect backend
    parameter)."""
    marker = request.node.get_closest_marker("cdc_config")
    options = str(marker.args[0]) if marker and marker.args else ""
    backend = str(marker.kwargs.get("backend", "embedded")) if marker else "embedded"
    backend = str(getattr(request, "param", backend))
    server = capture_source.partition("@")[2]
    if server not in ("", "pg18"):
        raise ValueError(f"unknown server {server!r} in decoders marker (known: pg18)")
    cluster: PgCluster = request.getfixturevalue("pg18" if server else "pg")
    db = request.getfixturevalue("pg18_db" if server else "pg_db")
    yield from make_env(cluster, db, tmp_path, backend, request, options, decoder)


def current_lsn(env: CaptureEnv) -> int:
    """The source's WAL position now."""
    return lsn_to_int(str(env.fetch("SELECT pg_current_wal_lsn()::text")[0][0]))


def rows_of(env: CaptureEnv, table: str, key: str = "id") -> dict[str, dict[str, object]]:
    """The source's rows of ``table`` keyed like the topic (single key column ``key``)."""
    return {
        orjson.dumps({key: k}).decode(): orjson.loads(r)
        for k, r in env.fetch(f"SELECT {key}, row_to_json(t)::text FROM {table} t")
    }


def topic_size(env: CaptureEnv, topic: str) -> int:
    """Records written to ``topic`` so far (0 while it does not exist)."""
    try:
        with env.store() as store:
            return sum(store.end_offsets(topic).values())
    except Exception:  # the topic may not exist yet
        return 0


def wait_streaming(env: CaptureEnv, proc: subprocess.Popen[bytes]) -> None:
    """Until the reader streams: its initial snapshot is done and its slot is active (the slot is
    active during the initial snapshot too, while the connection that created it holds the exported
    snapshot)."""

    def active() -> bool:
        assert proc.poll() is None, env.proc_log()
        with env.registry() as registry:
            if registry.get_state("initial_snapshot") != "done":
                return False
        rows = env.pg.fetch(f"SELECT active FROM pg_replication_slots WHERE slot_name = '{env.slot}'")
        return bool(rows and rows[0][0])

    wait_for(active, timeout=60, what="the reader to stream")


def wait_caught_up(env: CaptureEnv, timeout: float = 90, pg: PgCluster | None = None) -> None:
    """Until the slot (on ``pg``, default ``env.pg``) confirmed the WAL position of now: every change
    committed before this call is durable in the topics."""
    target = current_lsn(env)
    wait_for(lambda: (env.slot_confirmed(pg) or 0) >= target, timeout=timeout, what="the reader to catch up")


def progress(env: CaptureEnv, table: str, schema: str = "public") -> ChunkProgress | None:
    """The chunked snapshot's progress of ``schema.table`` (None before it starts)."""
    with env.registry() as r:
        return load_progress(r, schema, table)


def materialize(records: list[StoredRecord]) -> dict[str, Any]:
    """What a versioned sink holds after applying ``records`` (any order within a partition is the
    topic's order): newest version per key wins, deletes remove, a truncate removes every row whose
    version is older. Keys are the key JSON text; values the ``after`` rows."""
    state: dict[str, tuple[Version, dict[str, Any] | None]] = {}
    truncates: list[Version] = []
    for rec in records:
        if rec.value is None:
            continue
        value = orjson.loads(rec.value)
        version = Version.of(value)
        key = rec.key.decode()
        if TRUNCATE_KEY_FIELD in orjson.loads(rec.key):
            truncates.append(version)
            continue
        current = state.get(key)
        if current is not None and current[0] >= version:
            continue
        after = value["after"]
        if after is not None and current is not None and current[1] is not None:
            merged = {c: current[1][c] for c in value.get("unavailable", []) if c in current[1]}
            after = {**after, **merged}
        state[key] = (version, after if value["op"] != "d" else None)
    newest_truncate = max(truncates) if truncates else None
    return {
        k: row
        for k, (v, row) in state.items()
        if row is not None and (newest_truncate is None or v > newest_truncate)
    }


def assert_versions_monotonic(records: list[StoredRecord]) -> None:
    """Per key, in topic order, versions never go down: no change was written before its snapshot
    row (or the snapshot row after a newer change)."""
    last: dict[bytes, Version] = {}
    for rec in records:
        if rec.value is None:
            continue
        version = Version.of(orjson.loads(rec.value))
        prev = last.get(rec.key)
        assert prev is None or version >= prev, (
            f"key {rec.key!r}: version {version} written after {prev} (partition {rec.partition} offset {rec.offset})"
        )
        last[rec.key] = version
