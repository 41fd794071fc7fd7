"""The fault suite (`make chaos`): a mixed workload against the private Postgres while faults are
injected at random moments into every process of the pipeline; after each fault the pipeline must
catch up with `cdc verify` clean for every table.

The pipeline runs as it does in production: `cdc run` and `cdc apply` as separate processes, which
this harness supervises the way systemd or Kubernetes would (a process that exits is started again,
from its checkpoint). Everything is driven through the CLI, so the suite tests what users run. No
crash is hidden by a restart: every exit is recorded, and one that no fault explains (``EXITS``: a
fault that hit, a signal's one exit, an outage's while it lasts) fails the run, with its log's end.
A fault counts only if it hit (a process signalled while it ran, a walsender terminated, Postgres
restarted, the disk full, the broker stopped); one that hit nothing is reported as a miss.

What it prints at the end: the faults injected per kind, the changes made, lost and duplicated
(counted from the workload's own ledger of what it committed against the warehouse's current tables
and history, apart from `cdc verify`: see ledger.py; both must be 0) and the time to recover per kind
of fault (from the fault to a clean `cdc verify`, with the writes stopped after the fault), and the
exits of each process (explained by faults, stopped by the harness, unexplained). A kind
that was asked for but could not be injected (a tmpfs that would not mount) is reported as not
injected and fails the run; a kind that belongs to the other backend is reported as not applicable.

Two kinds belong to one backend each: ``disk_full`` fills the embedded log store's disk (a tmpfs of its
own); ``broker_freeze`` is the Kafka equivalent, the broker unavailable. The test broker (Tansu) keeps
everything in memory, so it cannot be stopped and started again without losing every record it
acknowledged (a loss no real broker with durable storage would cause); it is frozen instead (SIGSTOP,
then SIGCONT after a few seconds to longer than a client's request timeout): it answers nothing, every
request times out, connections are dropped and retried, and its records are kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg

from cdc.devcluster import PgCluster
from tests.chaos.disk import Disk, Sampler
from tests.chaos.disk import live as live_bytes
from tests.chaos.ledger import Count, Ledger, Recording, committed, count
from tests.plugins.apply import descendants
from tests.plugins.capture import CDC

DDL = """
CREATE TABLE chaos_accounts (
    id bigint PRIMARY KEY, name text NOT NULL, balance numeric(30, 6), ratio float8,
    born date, updated_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE chaos_events (
    tenant int, seq bigint, payload text, amount numeric, PRIMARY KEY (tenant, seq));
CREATE TABLE chaos_docs (slug text PRIMARY KEY, title text, body text);
ALTER TABLE chaos_docs ALTER COLUMN body SET STORAGE EXTERNAL;
"""
TABLES = ("public.chaos_accounts", "public.chaos_events", "public.chaos_docs")
NUMERIC_EDGES = (
    "0",
    "-0.000001",
    "99999999999999999999999.999999",
    "-99999999999999999999999.999999",
    "1e-6",
    "123456789012345678.123456",
)
#: chaos_events.amount is an unbounded numeric: it also takes NaN and the infinities, which the
#: stream carries past wal2json 2.5 through the non-finite recorder (cdc/recorders/nonfinite.py)
AMOUNTS = (*NUMERIC_EDGES, "NaN", "Infinity", "-Infinity")
#: chaos_accounts.ratio (float8): one row in 20 holds NaN or an infinity
SPECIAL_RATIOS = (float("nan"), float("inf"), float("-inf"))

FAULT_KINDS = (
    "reader_kill9",
    "reader_term",
    "apply_kill9",
    "apply_kill9_after_sink",
    "apply_term",
    "walsender_terminate",
    "pg_restart_fast",
    "pg_restart_immediate",
    "disk_full",
    "broker_freeze",
    "corrupt_record",
    "poison_value",
)


@dataclass(frozen=True)
class Explains:
    """Which exits of a process a fault that hit explains, from the fault until the pipeline recovered:
    ``codes`` (None: any), ``one`` (a signal's: exactly one exit, which must happen; else any number,
    each restart during an outage too), ``says`` (the exit's log holds this error)."""

    codes: tuple[int, ...] | None = None
    one: bool = False
    says: str | None = None


#: the error `cdc run` and `cdc apply` stop on when the log store's disk is full (cdc/logstore)
DISK_FULL = "the disk holding the log store is full"
#: the one infrastructure error an exit of `cdc apply` is allowed for, by its exact message: Spark's,
#: when a Python worker it started did not connect back in time (a loaded machine's, not cdc's);
#: such an exit is counted and reported apart, never taken for a fault's
INFRA_ERROR = "Python worker failed to connect back."
#: per kind, the exits of `cdc run` and `cdc apply` a fault of that kind that hit explains. A signal
#: explains one exit with its code: -9 for SIGKILL, 0 for the graceful stop SIGTERM asks for. A kind
#: not listed for a process explains none of its exits: the reader retries a dropped connection and a
#: restarting source itself (cdc/reader, Failures), so walsender_terminate and the restarts of
#: Postgres explain no exit; corrupt_record's stop of the reader is the harness's own
#: (``Proc.held_down``). A frozen broker explains any exit (its clients' errors take many forms).
EXITS: dict[str, dict[str, Explains]] = {
    "reader_kill9": {"cdc run": Explains((-signal.SIGKILL,), one=True)},
    "reader_term": {"cdc run": Explains((0,), one=True)},
    "apply_kill9": {"cdc apply": Explains((-signal.SIGKILL,), one=True)},
    "apply_kill9_after_sink": {"cdc apply": Explains((-signal.SIGKILL,), one=True)},
    "apply_term": {"cdc apply": Explains((0,), one=True)},
    "disk_full": {"cdc run": Explains(says=DISK_FULL), "cdc apply": Explains(says=DISK_FULL)},
    "broker_freeze": {"cdc run": Explains(), "cdc apply": Explains()},
}


@dataclass(frozen=True)
class Size:
    """How much to run: cycles (one fault each), the longest transaction, seconds of writes a cycle,
    how long a recovery may take, the size of the embedded log store's filesystem (``disk_full``
    fills it: the smaller, the sooner; a CI run's log store stays under 150 MB) and the warehouse's
    ``vacuum_min_retention_s`` (None: the default; a CI run lasts less than the default's 5 minutes,
    so it takes 30 s, above its longest read, to bound its disk as a longer run is bounded), and the
    apply's ``--stall-timeout``: the CI size's 150 s restarts a batch that hangs (a frozen broker)
    within its recovery budget, yet spares its catch-up batch after an apply fault (130,000 records
    whose Spark tasks took 78-118 s at load 4: 60 s killed it three times running, 2026-11-26); the
    full size takes the default 300 s, since its batches (transactions of up to 100,000 rows, rows
    of ~9 KB) run their Spark tasks longer than that on a loaded machine, where 60 s killed every
    attempt of the first batch (2026-11-26, load 20-25 on 2 cores). A watchdog that restarts a batch
    that is slow but progressing, the same batch each time, is a livelock (``docs/robustness.md``)."""

    cycles: int
    max_tx: int
    write_s: tuple[float, float]
    verify_wait_s: float
    log_fs_mb: int = 2048
    vacuum_min_retention_s: float | None = None
    stall_timeout_s: int = 60
    #: no fault is injected after this many seconds from the baseline (None: no limit); the run then
    #: ends as usual (final verify, ledger count, disk), with fewer faults than planned
    budget_s: float | None = None

    @staticmethod
    def named(name: str) -> Size:
        if name == "ci":
            return Size(
                cycles=len(FAULT_KINDS) - 1,
                max_tx=500,
                write_s=(0.2, 0.6),
                verify_wait_s=360,
                log_fs_mb=512,
                vacuum_min_retention_s=30,
                stall_timeout_s=150,
            )
        if name == "full":
            # every kind four times: disk_full and broker_freeze belong to one backend each
            return Size(
                cycles=4 * (len(FAULT_KINDS) - 1),
                max_tx=100_000,
                write_s=(2.0, 8.0),
                verify_wait_s=900,
                stall_timeout_s=300,
            )
        raise ValueError(f"unknown size {name!r}: ci or full")


@dataclass
class Report:
    backend: str
    decoder: str = "wal2json"
    #: faults that hit (a process signalled, a walsender terminated, ...), per kind
    faults: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: faults injected that hit nothing (the process was between restarts, no walsender was
    #: active, ...), per kind: not counted in :attr:`faults`, and they explain no exit
    misses: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recover_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    changes: int = 0
    transactions: int = 0
    lost: int = 0
    duplicated: int = 0
    dead_letters_expected: int = 0
    dead_letters_seen: int = 0
    #: asked for but not injected (why): fails the run
    skipped: dict[str, str] = field(default_factory=dict)
    #: the other backend's kind (why)
    not_applicable: dict[str, str] = field(default_factory=dict)
    #: the ledger against the warehouse (None until counted)
    ledger: Count | None = None
    #: faults planned (``Size.cycles``); fewer are injected when the time budget runs out, or the run
    #: stops at a failure
    planned: int = 0
    #: why the run injected fewer faults than planned ("" if it did not stop early)
    stopped_early: str = ""
    #: the state dir's peak and live bytes (tests/chaos/disk.py)
    disk: Disk = field(default_factory=Disk)
    #: per process (``cdc run``, ``cdc apply``): its starts, its exits, and of those the ones a
    #: fault that hit explains, the harness's own stops, and the rest (unexplained)
    exits: dict[str, dict[str, int]] = field(default_factory=dict)
    #: each exit no fault explains, with the end of its log: fails the run
    unexplained: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [f"chaos on the {self.backend} log store, decoder {self.decoder}"]
        out.append(f"  changes made: {self.changes:,} in {self.transactions:,} transactions")
        done, missed = sum(self.faults.values()), sum(self.misses.values())
        short = (
            f" of {self.planned} planned"
            + (f" ({missed} hit nothing)" if missed else "")
            + (f" ({self.stopped_early})" if self.stopped_early else "")
            if done < self.planned
            else ""
        )
        out.append(f"  faults injected: {done}{short}")
        for kind in FAULT_KINDS:
            if kind in self.skipped:
                out.append(f"    {kind:24} NOT INJECTED: {self.skipped[kind]}")
            elif kind in self.not_applicable:
                out.append(f"    {kind:24} not applicable: {self.not_applicable[kind]}")
            elif self.faults.get(kind):
                times = sorted(self.recover_s[kind])
                took = (
                    f"p50 {times[len(times) // 2]:.1f} s, max {times[-1]:.1f} s" if times else "NOT RECOVERED"
                )
                out.append(f"    {kind:24} x{self.faults[kind]:<3} recovered in {took}")
            if self.misses.get(kind):
                out.append(f"    {kind:24} MISSED x{self.misses[kind]} (injected, hit nothing: not counted)")
        for name, n in self.exits.items():
            rest = f"{n['unexplained']} UNEXPLAINED" if n["unexplained"] else "none unexplained"
            infra = f"{n['infrastructure']} on {INFRA_ERROR!r}, " if n.get("infrastructure") else ""
            out.append(
                f"  {name} exits: {n['exits']} in {n['starts']} starts: {n['by faults']} explained by faults "
                f"that hit, {n['by the harness']} stopped by the harness, {infra}{rest}"
            )
        if self.ledger is None:
            out.append("  lost, duplicated: NOT COUNTED (the run stopped before the ledger's count)")
        else:
            out.append(f"  lost: {self.lost} ({self.ledger.line()})")
            out.append(f"  duplicated in effect: {self.duplicated} (history versions beyond those written)")
            out.extend(f"    e.g. {e}" for e in self.ledger.examples)
        out.append(f"  dead letters: {self.dead_letters_seen} (expected {self.dead_letters_expected})")
        out.extend(self.disk.lines())
        out.extend(f"  UNEXPLAINED EXIT: {u}" for u in self.unexplained)
        out.extend(f"  FAILURE: {f}" for f in self.failures)
        return out

    @property
    def ok(self) -> bool:
        return (
            not self.failures
            and not self.unexplained
            and not self.disk.errors
            and not self.skipped
            and self.ledger is not None
            and self.lost == 0
            and self.duplicated == 0
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "decoder": self.decoder,
            "changes": self.changes,
            "transactions": self.transactions,
            "faults": dict(self.faults),
            "misses": dict(self.misses),
            "exits": self.exits,
            "unexplained": self.unexplained,
            "planned": self.planned,
            "stopped_early": self.stopped_early,
            "recover_s": {k: sorted(v) for k, v in self.recover_s.items()},
            "lost": self.lost,
            "duplicated": self.duplicated,
            "dead_letters": self.dead_letters_seen,
            "skipped": self.skipped,
            "not_applicable": self.not_applicable,
            "disk": self.disk.to_dict(),
            "ledger": dataclasses.asdict(self.ledger) if self.ledger else None,
            "failures": self.failures,
        }


@dataclass(frozen=True)
class Exit:
    """One exit of a supervised process: the start it ended (``#N`` in its log), its exit code, when it
    was seen (``time.monotonic()``; the supervisor looks every ``Supervisor.interval``), and whether the
    harness stopped it (a fault that holds it down, the end of the run)."""

    start: int
    code: int | None
    at: float
    by_harness: bool


class Proc:
    """One supervised `cdc` process in a process group of its own, signalled as a supervisor does: to
    the whole group. `cdc apply`'s Spark JVM runs in a group of its own (a group SIGTERM must not
    reach it); a SIGKILL also goes to every descendant, as systemd's SIGKILL of the unit's cgroup
    does. Every exit is recorded in :attr:`exits` before the process is started again: none goes
    unseen."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.args, self.env, self.log = name, args, env, log
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.exits: list[Exit] = []
        self._reaped = True  # the current popen's exit is in exits (True: none started yet)
        #: held by whoever starts or stops the process (the supervisor, a fault)
        self.lock = threading.RLock()
        #: True while a fault keeps the process down on purpose (the supervisor leaves it alone)
        self.held = False
        #: True once the harness has asked the current process to stop: its exit is the harness's
        self._stopping = False

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        with self.lock:
            self.reap()
            with self.log.open("ab") as out:
                out.write(f"\n=== start {self.name} #{self.starts} at {time.time():.3f}\n".encode())
                self.popen = subprocess.Popen(
                    self.args,
                    env={**self.env, **(extra_env or {})},
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self._reaped = False
            self._stopping = False
            self.starts += 1

    def reap(self, by_harness: bool = False) -> Exit | None:
        """Record the exit of the current process once it has exited (``by_harness``: the harness
        stopped it); the new :class:`Exit`, or None (still running, or recorded already)."""
        with self.lock:
            if self._reaped or self.popen is None or self.popen.poll() is None:
                return None
            self._reaped = True
            out = Exit(self.starts - 1, self.popen.returncode, time.monotonic(), by_harness or self._stopping)
            self.exits.append(out)
            return out

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> bool:
        """``sig`` to the running process's group (SIGKILL: also to each descendant); whether it
        reached a running process (False: none runs, e.g. between its exit and its restart)."""
        with self.lock:  # the supervisor starts no process meanwhile
            if not self.alive():
                return False
            assert self.popen is not None
            kids = descendants(self.popen.pid) if sig == signal.SIGKILL else []
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return False
            for kid in kids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(kid, sig)
            return True

    def wait(self, timeout: float) -> int | None:
        if self.popen is None:
            return None
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def ask_stop(self) -> None:
        """SIGTERM of the harness's own, without waiting: the exit that follows, whenever it is seen,
        is the harness's (one before it, of the process's own, is recorded as such first)."""
        with self.lock:
            self.reap()
            if self.alive() and not self._stopping:
                self._stopping = True
                self.signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM (unless :meth:`ask_stop` sent it), then SIGKILL after 60 s: an exit of the
        harness's own."""
        self.ask_stop()
        if self.wait(60) is None:
            self.signal(signal.SIGKILL)
            self.wait(30)
        self.reap(by_harness=True)

    def section(self, start: int, tail: int | None = 2500) -> str:
        """The end of the log of start ``#start`` (the text after its ``=== start`` line; ``tail``:
        its last characters, None: all of it)."""
        text = self.log.read_text(errors="replace")
        head = f"=== start {self.name} #{start} at "
        at = text.find(head)
        if at < 0:
            return f"(no {head!r} in {self.log})"
        end = text.find(f"=== start {self.name} #{start + 1} at ", at)
        out = text[at : end if end >= 0 else len(text)]
        return out if tail is None else out[-tail:]

    @contextlib.contextmanager
    def held_down(self) -> Iterator[None]:
        """Stop the process and keep the supervisor from starting it again until the block ends."""
        with self.lock:
            self.held = True
        try:
            self.stop()
            yield
        finally:
            with self.lock:
                self.held = False


class Supervisor:
    """Starts a process again as soon as it has exited, the way systemd (``Restart=always``) or
    Kubernetes would: polled every ``interval`` seconds on a thread of its own, so a restart does not
    wait for whatever the harness is doing (a `cdc verify` can take a minute). Each exit is recorded
    (``Proc.exits``) before the restart: the harness then tells which of them its faults explain."""

    def __init__(self, procs: list[Proc], interval: float = 0.2) -> None:
        self.procs = procs
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            for proc in self.procs:
                if proc.lock.acquire(blocking=False):  # busy: a fault is stopping or starting it
                    try:
                        if not proc.held and not proc.alive():
                            proc.start()  # which records the exit first
                    finally:
                        proc.lock.release()


class Workload:
    """Random transactions of 1..max_tx changes over the three tables, on a thread, until paused.
    The only writer, so it knows which keys exist; after a lost connection it re-reads them. Every
    write goes through :class:`Recording` into :attr:`ledger` once the source has committed it."""

    def __init__(self, dsn: str, rng: random.Random, max_tx: int) -> None:
        self.dsn, self.rng, self.max_tx = dsn, rng, max_tx
        self.accounts: list[int] = []
        self.events: list[tuple[int, int]] = []
        self.docs: list[str] = []
        self.next_id = 1
        self.next_seq = 1
        self.changes = 0
        self.transactions = 0
        self.errors = 0
        self._run = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._conn: psycopg.Connection[Any] | None = None
        self.ledger = Ledger()
        #: a transaction whose commit a fault cut off: (its id, its writes), until the source says
        self._uncertain: tuple[int | None, list[Any]] | None = None
        self._tx_no = 0  # each transaction's row in chaos_ledger_tx (see _settle)
        self._backend_pid: int | None = None

    # -- control
    def start(self) -> None:
        self._run.set()
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="workload", daemon=True)
            self._thread.start()

    def pause(self) -> None:
        self._run.clear()
        deadline = time.monotonic() + 300
        while not self._idle.wait(0.2):
            if time.monotonic() > deadline:
                raise RuntimeError("the workload did not pause within 300 s")

    def close(self) -> None:
        self.pause()
        if self._conn is not None:
            self._conn.close()

    # -- the loop
    def _connect(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self.dsn, connect_timeout=5)
            self._settle()
            self._reload()
        return self._conn

    def _settle(self) -> None:
        """The cut-off transaction into the ledger if the source committed it, before any later one
        (the ledger applies transactions in their order). Every transaction also inserts its number
        into ``chaos_ledger_tx`` (a table nobody captures), so its row says whether it committed, once
        the backend that ran it is gone. (Not ``pg_xact_status``: after a crash an id that never
        reached the WAL is "in the future", and can be given again to another transaction.)"""
        if self._uncertain is None:
            return
        assert self._conn is not None
        conn, (tx_no, ops) = self._conn, self._uncertain
        old_pid = self._backend_pid

        def status(tx_no: int) -> str | None:
            running = conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (old_pid,)).fetchone()
            row = conn.execute("SELECT 1 FROM chaos_ledger_tx WHERE id = %s", (tx_no,)).fetchone()
            conn.rollback()
            if running is not None:
                return None  # it may still commit
            return "committed" if row is not None else "aborted"

        deadline = time.monotonic() + 120
        while (done := committed(ops, tx_no, status)) is None:
            if time.monotonic() > deadline:
                self.ledger.errors.append(f"transaction {tx_no} still in progress 120 s after its fault")
                break
            time.sleep(0.2)
        if done:
            self.ledger.apply(ops)
            self.ledger.uncertain_committed += 1
        else:
            self.ledger.uncertain_aborted += 1
        self._uncertain = None

    def _reload(self) -> None:
        assert self._conn is not None
        with self._conn.transaction():
            self.accounts = [r[0] for r in self._conn.execute("SELECT id FROM chaos_accounts")]
            self.events = [(r[0], r[1]) for r in self._conn.execute("SELECT tenant, seq FROM chaos_events")]
            self.docs = [r[0] for r in self._conn.execute("SELECT slug FROM chaos_docs")]
            self.next_id = max([self.next_id, *[a + 1 for a in self.accounts]])
            self.next_seq = max([self.next_seq, *[s + 1 for _, s in self.events]])

    def _loop(self) -> None:
        while True:
            if not self._run.is_set():
                self._idle.set()
                self._run.wait()
                continue
            try:
                conn = self._connect()
                size = self._tx_size()
                recording, tx_no = Recording(conn, self.ledger), None
                try:
                    with conn.transaction():
                        self._tx_no += 1
                        self._backend_pid = conn.info.backend_pid
                        conn.execute("INSERT INTO chaos_ledger_tx (id) VALUES (%s)", (self._tx_no,))
                        tx_no = self._tx_no
                        for _ in range(size):
                            self._change(recording)  # type: ignore[arg-type]
                except psycopg.OperationalError:
                    self._uncertain = (tx_no, recording.pending)
                    raise
                self.ledger.apply(recording.pending)
                self.changes += size
                self.transactions += 1
            except psycopg.OperationalError:
                # the source restarted or our backend was terminated: the transaction's outcome is
                # unknown, so the key sets are read again after reconnecting
                self.errors += 1
                if self._conn is not None:
                    self._conn.close()
                self._conn = None
                time.sleep(0.2)  # a source restart takes a moment; retried until paused

    def _tx_size(self) -> int:
        r = self.rng.random()
        if r < 0.7:
            return self.rng.randint(1, 10)
        if r < 0.95:
            return self.rng.randint(10, max(10, self.max_tx // 20))
        return self.rng.randint(1, self.max_tx)

    def _change(self, conn: psycopg.Connection[Any]) -> None:
        r = self.rng.random()
        rng = self.rng
        if r < 0.35 or len(self.accounts) < 20:
            i = self.next_id
            self.next_id += 1
            conn.execute(
                "INSERT INTO chaos_accounts (id, name, balance, ratio, born) VALUES (%s, %s, %s, %s, %s)",
                (
                    i,
                    f"account {i} {secrets.token_hex(3)}",
                    rng.choice(NUMERIC_EDGES),
                    rng.choice(SPECIAL_RATIOS) if rng.random() < 0.05 else rng.random() * 1e6,
                    f"{rng.randint(1900, 2020)}-0{rng.randint(1, 9)}-1{rng.randint(0, 9)}",
                ),
            )
            self.accounts.append(i)
        elif r < 0.55:
            i = rng.choice(self.accounts)
            conn.execute(
                "UPDATE chaos_accounts SET balance = %s, name = %s, updated_at = now() WHERE id = %s",
                (rng.choice(NUMERIC_EDGES), f"renamed {i} {secrets.token_hex(2)}", i),
            )
        elif r < 0.62:
            i = self.accounts.pop(rng.randrange(len(self.accounts)))
            conn.execute("DELETE FROM chaos_accounts WHERE id = %s", (i,))
        elif r < 0.65:
            old = self.accounts.pop(rng.randrange(len(self.accounts)))
            new = self.next_id
            self.next_id += 1
            conn.execute("UPDATE chaos_accounts SET id = %s WHERE id = %s", (new, old))
            self.accounts.append(new)
        elif r < 0.80:
            t, s = rng.randint(1, 5), self.next_seq
            self.next_seq += 1
            conn.execute(
                "INSERT INTO chaos_events (tenant, seq, payload, amount) VALUES (%s, %s, %s, %s)",
                (t, s, secrets.token_hex(16), rng.choice(AMOUNTS)),
            )
            self.events.append((t, s))
        elif r < 0.85 and self.events:
            t, s = self.events.pop(rng.randrange(len(self.events)))
            conn.execute("DELETE FROM chaos_events WHERE tenant = %s AND seq = %s", (t, s))
        elif r < 0.9 or len(self.docs) < 5:
            slug = f"doc-{secrets.token_hex(6)}"
            # incompressible and over the TOAST threshold, stored out of line (STORAGE EXTERNAL)
            conn.execute(
                "INSERT INTO chaos_docs (slug, title, body) VALUES (%s, %s, %s)",
                (slug, "draft", secrets.token_hex(3000)),
            )
            self.docs.append(slug)
        elif r < 0.96:
            # a TOAST update: body unchanged, so wal2json leaves it out of the change
            conn.execute(
                "UPDATE chaos_docs SET title = %s WHERE slug = %s",
                (f"title {secrets.token_hex(4)}", rng.choice(self.docs)),
            )
        elif r < 0.98:
            # a primary-key change, body unchanged: the new key's event lacks it (the old key's row
            # holds it)
            old = self.docs.pop(rng.randrange(len(self.docs)))
            new = f"doc-{secrets.token_hex(6)}"
            conn.execute("UPDATE chaos_docs SET slug = %s WHERE slug = %s", (new, old))
            self.docs.append(new)
        elif r < 0.999:
            slug = self.docs.pop(rng.randrange(len(self.docs)))
            conn.execute("DELETE FROM chaos_docs WHERE slug = %s", (slug,))
        else:
            conn.execute("TRUNCATE chaos_events")
            self.events.clear()


class Chaos:
    """One run of the suite on one backend."""

    def __init__(
        self,
        pg: PgCluster,
        db: str,
        workdir: Path,
        backend: str,
        size: Size,
        seed: int,
        kafka_bootstrap: str | None = None,
        say: Callable[[str], None] = print,
        kinds: tuple[str, ...] | None = None,
        kafka_pid: int | None = None,
        decoder: str = "wal2json",
    ) -> None:
        unknown = set(kinds or ()) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown kinds of fault {sorted(unknown)}; known: {', '.join(FAULT_KINDS)}")
        self.kinds = kinds or FAULT_KINDS
        self.pg, self.db, self.workdir, self.backend, self.size = pg, db, workdir, backend, size
        self.rng = random.Random(seed)
        self.say = say
        self.report = Report(backend, decoder=decoder)
        self.dsn = pg.dsn(db)
        self.state = workdir / "state"
        self.mounted = False
        self.kafka_bootstrap = kafka_bootstrap
        self.kafka_pid = kafka_pid
        self.prefix = f"chaos{seed}"
        workdir.mkdir(parents=True, exist_ok=True)
        # heartbeats every second: an idle source's slot confirms quickly, so verify need not wait
        toml = f'heartbeat_interval_s = 1\ndecoder = "{decoder}"\n'
        if size.vacuum_min_retention_s is not None:
            toml += f"[warehouse]\nvacuum_min_retention_s = {size.vacuum_min_retention_s:.1f}\n"
        (workdir / "cdc.toml").write_text(toml)
        self.env = {
            "CDC_CONFIG": str(workdir / "cdc.toml"),
            **os.environ,
            "CDC_SOURCE": self.dsn,
            "CDC_STATE": str(self.state),
            "CDC_TOPIC_PREFIX": self.prefix,
            "CDC_SLOT": f"chaos_{seed}_{backend}",
        }
        if kafka_bootstrap:
            self.env["CDC_LOG"] = f"kafka://{kafka_bootstrap}"
        else:
            self.env.pop("CDC_LOG", None)
        logs = workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.notes = logs / "harness.log"
        self.reader = Proc("cdc run", [*CDC, "run"], self.env, logs / "run.log")
        # apply_kill9_after_sink arms the running job through this file (cdc.faults): no restart needed
        self.arm_after_sink = workdir / "arm-apply-after-sink"
        apply_env = dict(self.env)
        if "apply_kill9_after_sink" in self.kinds:
            apply_env["CDC_FAULTS"] = f"apply.after_sink:@{self.arm_after_sink}"
        self.apply = Proc(
            "cdc apply",
            [*CDC, "apply", "--stall-timeout", str(size.stall_timeout_s)],
            apply_env,
            logs / "apply.log",
        )
        self.supervisor = Supervisor([self.reader, self.apply])
        self._poisoned: int | None = None
        self._poison_rows = 0
        self._thaw: threading.Timer | None = None
        #: per process: how many of its exits :meth:`account` has told apart; the run's start
        self._accounted = {p.name: 0 for p in (self.reader, self.apply)}
        self._t0 = time.monotonic()
        self.workload = Workload(self.dsn, self.rng, size.max_tx)
        self.sampler = Sampler(
            self.state, self.report.disk, skip=self.state / "log" / "filler", note=self.note
        )

    def note(self, line: str) -> None:
        """A line in logs/harness.log (faults, restarts and each verify, timestamped like the other logs)."""
        with self.notes.open("a") as f:
            f.write(f"{time.time():.3f} {line}\n")

    # -- set-up
    def _cdc(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CDC, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def _skip(self, kind: str, why: str) -> None:
        """``kind`` was asked for and cannot be injected here: the run fails, saying why."""
        if kind in self.kinds:
            self.report.skipped[kind] = why
            self.say(f"  {kind}: NOT INJECTED: {why}")

    def _not_applicable(self, kind: str, why: str) -> None:
        if kind in self.kinds:
            self.report.not_applicable[kind] = why

    def _mount_log(self) -> None:
        """The embedded log store on a size-limited filesystem of its own, so its disk can really fill
        up (``disk_full``). The Kafka backend's disk is the broker's: its fault is ``broker_freeze``."""
        self.log_dir = self.state / "log"
        self.log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # as private as cdc makes it
        if self.kafka_bootstrap:
            self._not_applicable("disk_full", "the Kafka log store's disk is the broker's: see broker_freeze")
            if self.kafka_pid is None:
                self._skip("broker_freeze", "the broker's process is not ours to freeze")
            return
        self._not_applicable("broker_freeze", "no broker: the embedded log store's equivalent is disk_full")
        if "disk_full" not in self.kinds:
            return
        if os.geteuid() != 0:
            self._skip("disk_full", "not root: no size-limited filesystem can be mounted")
            return
        proc = subprocess.run(
            [
                "mount",
                "-t",
                "tmpfs",
                "-o",
                f"size={self.size.log_fs_mb}m,mode=0700",
                "tmpfs",
                str(self.log_dir),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            self._skip("disk_full", f"mount of a size-limited tmpfs failed: {proc.stderr.strip()}")
            return
        self.mounted = True

    def setup(self) -> None:
        self._mount_log()
        self.sampler.start()
        self.pg.execute(DDL, self.db)
        # the workload's record of its own commits (tests/chaos/ledger.py), never registered
        self.pg.execute("CREATE TABLE chaos_ledger_tx (id bigint PRIMARY KEY)", self.db)
        for table in TABLES:
            extra = ["--search", "name"] if table.endswith("accounts") else []
            proc = self._cdc("tables", "add", table, *extra)
            if proc.returncode != 0:
                raise RuntimeError(f"cdc tables add {table} failed: {proc.stderr}")
        self.reader.start()
        self.apply.start()
        self.supervisor.start()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.workload.close()
        if self._thaw is not None:  # never leave the broker frozen
            self._thaw.cancel()
            self._thaw_broker()
        self.supervisor.stop()
        for proc in (self.reader, self.apply):  # an exit since the last fault's recovery: its own
            proc.reap()
        # both asked to stop at once (the apply job finishes its batch and stops Spark: seconds);
        # each exit that follows is the harness's, however long the other's stop takes
        for proc in (self.reader, self.apply):
            proc.ask_stop()
        self.reader.stop()
        self.apply.stop()
        self.account(None, time.monotonic(), time.monotonic())
        with contextlib.suppress(Exception):
            self.pg.execute(f"SELECT pg_drop_replication_slot('{self.env['CDC_SLOT']}')", self.db)
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.log_dir)], check=False)

    # -- faults
    def inject(self, kind: str) -> bool:
        """Inject a fault of ``kind``; whether it hit (signalled a running process, terminated a
        walsender, restarted Postgres, filled the disk, froze the broker, wrote its record or row)."""
        hit = getattr(self, f"_fault_{kind}")()
        assert isinstance(hit, bool), (kind, hit)
        return hit

    def _fault_reader_kill9(self) -> bool:
        return self.reader.signal(signal.SIGKILL)

    def _fault_reader_term(self) -> bool:
        return self.reader.signal(signal.SIGTERM)

    def _fault_apply_kill9(self) -> bool:
        return self.apply.signal(signal.SIGKILL)

    def _fault_apply_term(self) -> bool:
        return self.apply.signal(signal.SIGTERM)

    def _fault_apply_kill9_after_sink(self) -> bool:
        """kill -9 of the Spark job between a sink's write and Spark's checkpoint of that batch: the
        running job's fault point ``apply.after_sink`` is armed (a file, see :mod:`cdc.faults`) and
        fires at the next batch it applies, removing the file; the workload goes on writing until it
        has (the supervisor then starts the job again, unarmed). Arming the running job, rather than
        restarting it with the point on, spares a Spark start (30-40 s on a loaded machine). It hit
        once the job removed the file."""
        self.arm_after_sink.touch()
        deadline = time.monotonic() + self.size.verify_wait_s
        while self.arm_after_sink.exists():  # polled: the fault fires at the job's next batch
            if time.monotonic() > deadline:
                self.arm_after_sink.unlink(missing_ok=True)
                self.report.failures.append(
                    f"apply.after_sink did not fire within {self.size.verify_wait_s:.0f} s of arming"
                )
                return False
            time.sleep(0.1)
        return True

    def _fault_walsender_terminate(self) -> bool:
        """The reader's walsender terminated; it hit if one was (none is active while the reader is
        between restarts)."""
        rows = self.pg.fetch(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            f"WHERE slot_name = '{self.env['CDC_SLOT']}' AND active_pid IS NOT NULL",
            self.db,
        )
        return any(terminated for (terminated,) in rows)

    def _pg_restart(self, mode: str) -> bool:
        """Postgres stopped (``mode``) and started again: it hit if the server that answers after it
        started after the one before (``pg_postmaster_start_time``)."""
        query = "SELECT pg_postmaster_start_time()"
        before = self.pg.fetch(query)[0][0]
        self.pg.stop(mode)
        self.pg.start()
        return bool(self.pg.fetch(query)[0][0] > before)  # type: ignore[operator]

    def _fault_pg_restart_fast(self) -> bool:
        return self._pg_restart("fast")

    def _fault_pg_restart_immediate(self) -> bool:
        return self._pg_restart("immediate")

    def _fault_disk_full(self) -> bool:
        """The log store's filesystem filled up, for 1-3 s: it hit if a write was refused for want of
        space (ENOSPC)."""
        if not self.mounted:
            return False
        filler = self.log_dir / "filler"
        full = False
        # unbuffered: a buffered file keeps what the full disk refused and raises ENOSPC again at close
        with filler.open("wb", buffering=0) as f:
            chunk = b"\0" * (1 << 20)
            try:
                while True:
                    f.write(chunk)
            except OSError as exc:
                full = exc.errno == errno.ENOSPC
                if not full:
                    self.note(f"disk_full: the filler stopped on {exc!r}, not a full disk")
        # keep writing into the full disk for a while: the processes must fail loudly, not lose data
        time.sleep(self.rng.uniform(1.0, 3.0))  # the fault's duration, not a synchronisation
        filler.unlink()
        return full

    def _fault_broker_freeze(self) -> bool:
        """The Kafka broker stops answering (SIGSTOP) for 3 to 15 s, then goes on (SIGCONT, from a
        timer: the harness goes on with the fault's usual course meanwhile, so the recovery time counts
        from the freeze and includes it). Requests time out (the request timeout is 10 s), connections
        are dropped, the producer retries its batches unchanged, the apply job's reads fail and it is
        restarted; nothing acknowledged is lost. A freeze, not a restart: the test broker keeps its
        records in memory only. It hit once the broker is seen stopped (state T in /proc)."""
        assert self.kafka_pid is not None
        try:
            os.kill(self.kafka_pid, signal.SIGSTOP)
        except ProcessLookupError:
            return False
        self._thaw = threading.Timer(self.rng.uniform(3.0, 15.0), self._thaw_broker)
        self._thaw.start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{self.kafka_pid}/stat").read_text()
                if stat.rsplit(")", 1)[1].split()[0] == "T":
                    return True
            time.sleep(0.05)
        return False

    def _thaw_broker(self) -> None:
        if self.kafka_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.kafka_pid, signal.SIGCONT)

    def _fault_corrupt_record(self) -> bool:
        """A record that is not an event, appended to a table's topic (the reader is paused for it:
        the embedded store admits one writer per topic)."""
        topic = f"{self.prefix}.public.chaos_accounts"
        code = (
            "import sys\n"
            "from cdc.config import load_settings\n"
            "from cdc.logstore import Record\n"
            "from cdc.logstore.factory import open_log_store\n"
            "import os\n"
            "from pathlib import Path\n"
            "s = load_settings({}, dict(os.environ), Path.cwd())\n"
            "store = open_log_store(s, writer=True)\n"
            f"store.append({topic!r}, [Record(key=b'{{\"id\": -1}}', value=b'{{not json')])\n"
            "store.close()\n"
        )
        with self.reader.held_down():
            proc = subprocess.run(
                [sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=120
            )
        if proc.returncode != 0:
            self.report.failures.append(f"could not append a corrupt record: {proc.stderr[-500:]}")
            return False
        self.report.dead_letters_expected += 1
        return True

    def _fault_poison_value(self) -> bool:
        """A row holding a value the warehouse cannot store (a BC date): it must go to the dead-letter
        topic while everything else applies; the row is then corrected at the source. Its id is
        negative: the workload's ids only grow, from the largest id it reloads after a reconnect, so
        ids of a positive range reserved for poison rows were taken by the workload once a poison row
        held the largest id (the full size failed so: duplicate key). -1 is corrupt_record's key."""
        self._poison_rows += 1
        i = -1 - self._poison_rows
        self.pg.execute(
            f"INSERT INTO chaos_accounts (id, name, balance, born) VALUES ({i}, 'poison', 1, '0044-03-15 BC')",
            self.db,
        )
        self.report.dead_letters_expected += 1
        self._poisoned = i
        return True

    # -- checks
    def dead_letters(self) -> int:
        proc = self._cdc("topic", "dump", f"{self.prefix}.__dead_letter", "--json")
        if proc.returncode != 0:
            return 0  # no dead-letter topic yet
        return sum(1 for line in proc.stdout.splitlines() if line.strip())

    def verify(self) -> list[dict[str, Any]] | None:
        """``cdc verify --json`` once the pipeline caught up; None until it is clean."""
        t0 = time.monotonic()
        # verify answers as soon as the tables are equal; a longer wait only spares process starts.
        # It reads every row of both sides: at full size (~1 million rows and ~1 GB of TOAST text
        # after 30 faults) one clean verify takes 70-220 s on 2 cores, so it gets the recovery's budget.
        # --full: the suite hunts changes lost before the topics, which an incremental verify (the
        # ranges the topics say changed) cannot see
        proc = self._cdc(
            "verify", "--json", "--full", "--wait", "60", "--limit", "5", timeout=self.size.verify_wait_s
        )
        took = time.monotonic() - t0
        try:
            reports = orjson.loads(proc.stdout)
        except orjson.JSONDecodeError:
            self._last_verify = [{"exit": proc.returncode, "stderr": proc.stderr[-1000:]}]
            self.note(f"verify ({took:.1f} s): exit {proc.returncode}, {proc.stderr[-300:]!r}")
            return None
        if proc.returncode == 0 and all(r.get("status") == "ok" for r in reports):
            self.note(f"verify ({took:.1f} s): clean")
            return list(reports)
        self._last_verify = reports
        self.note(f"verify ({took:.1f} s): not clean: {orjson.dumps(reports).decode()[:600]}")
        return None

    def count(self) -> None:
        """Lost and duplicated from the workload's ledger against the warehouse (tests/chaos/ledger.py),
        apart from `cdc verify`."""
        ledger = self.workload.ledger

        def sql(query: str) -> list[dict[str, Any]]:
            proc = self._cdc("sql", query, "--json", timeout=self.size.verify_wait_s)
            if proc.returncode != 0:
                raise RuntimeError(f"`cdc sql {query}` failed: {proc.stderr[-500:]}")
            try:
                return list(orjson.loads(proc.stdout))
            except orjson.JSONDecodeError as exc:
                raise RuntimeError(
                    f"`cdc sql {query}` printed no JSON ({exc}): {proc.stdout[-300:]!r}"
                ) from exc

        try:
            counted = count(ledger, sql)
        except RuntimeError as exc:
            self.report.failures.append(f"the ledger could not be counted: {exc}")
            return
        self.report.ledger = counted
        self.report.lost, self.report.duplicated = counted.lost, counted.duplicated
        self.note(
            f"ledger: {ledger.changes} changes in {ledger.transactions} transactions "
            f"({ledger.uncertain_committed} cut off by a fault and committed, {ledger.uncertain_aborted} "
            f"not); lost {counted.lost}, duplicated {counted.duplicated}: {counted.line()}"
        )
        self.report.failures.extend(f"ledger: {e}" for e in ledger.errors)
        if counted.unexpected or counted.open_history_mismatch:
            self.report.failures.append(f"the warehouse is not what the workload wrote: {counted.line()}")

    def baseline(self) -> None:
        """Before the first fault: the initial snapshot is applied and `cdc verify` is clean (so every
        topic exists and recovery times measure the faults, not the start-up). The workload starts
        once every table's initial snapshot is taken: a change before it reaches the warehouse only
        as part of a snapshot row, not as the version the ledger counts."""
        deadline = time.monotonic() + self.size.verify_wait_s
        while True:
            proc = self._cdc("tables", "list", "--json")
            states = {t["table"]: t["snapshot"]["state"] for t in orjson.loads(proc.stdout or "[]")}
            if proc.returncode == 0 and set(states) == set(TABLES) and set(states.values()) == {"done"}:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the initial snapshots were not taken within {self.size.verify_wait_s:.0f} s: {states}"
                )
            time.sleep(0.5)
        self.workload.start()
        time.sleep(self.rng.uniform(*self.size.write_s))  # some writes on top of the snapshot
        self.workload.pause()
        deadline = time.monotonic() + self.size.verify_wait_s
        while self.verify() is None:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the pipeline did not come up clean within {self.size.verify_wait_s:.0f} s: "
                    f"{orjson.dumps(getattr(self, '_last_verify', None)).decode()[:1500]}"
                )

    def recover(self, kind: str, t_fault: float, hit: bool = True) -> None:
        """Until `cdc verify` is clean after the fault and, of a signal that hit, its process has
        exited (:meth:`_signalled_exited`): its recovery time, of a fault that hit, in the report; or
        until the recovery's budget is spent (a failure)."""
        deadline = time.monotonic() + self.size.verify_wait_s
        poisoned = self._poisoned
        while True:
            if poisoned is not None and self.dead_letters() >= self.report.dead_letters_expected:
                # the poison row is in the dead-letter topic: correct it at the source
                self.pg.execute(
                    f"UPDATE chaos_accounts SET born = '2001-01-01' WHERE id = {poisoned}", self.db
                )
                # its insert is a dead letter; the corrected row is its one version in the warehouse
                self.workload.ledger.insert("public.chaos_accounts", {"id": poisoned, "name": "poison"})
                poisoned = self._poisoned = None
            exited = not hit or self._signalled_exited(kind, t_fault)
            if poisoned is None and exited and self.verify() is not None:
                if hit:
                    self.report.recover_s[kind].append(time.monotonic() - t_fault)
                return
            if not exited:
                time.sleep(0.2)  # polled: the supervisor sees the exit within its interval
            if time.monotonic() > deadline:
                last = getattr(self, "_last_verify", None)
                self.report.failures.append(
                    f"after {kind}: not recovered within {self.size.verify_wait_s:.0f} s; last verify: "
                    f"{orjson.dumps(last).decode()[:1500] if last else 'no answer'}"
                )
                return

    def _signalled_exited(self, kind: str, t_fault: float) -> bool:
        """Every process a signal of ``kind`` stops (:data:`EXITS`, ``one``) has exited since
        ``t_fault``: a graceful stop first finishes the micro-batch in progress, which may be the one
        that makes `cdc verify` clean, so a clean verify alone does not end that fault's recovery."""
        for proc in (self.reader, self.apply):
            rule = EXITS.get(kind, {}).get(proc.name)
            seen = proc.exits[self._accounted[proc.name] :]
            if rule is not None and rule.one and not any(e.at >= t_fault for e in seen):
                return False
        return True

    def run(self) -> Report:
        self.setup()
        self.baseline()
        kinds = [
            k for k in self.kinds if k not in self.report.skipped and k not in self.report.not_applicable
        ]
        plan = [kinds[i % len(kinds)] for i in range(self.size.cycles)]
        self.rng.shuffle(plan)
        self.report.planned = len(plan)
        deadline = None if self.size.budget_s is None else time.monotonic() + self.size.budget_s
        try:
            for n, kind in enumerate(plan, 1):
                if deadline is not None and time.monotonic() > deadline:
                    self.say(
                        f"  time budget of {self.size.budget_s:.0f} s spent: {n - 1} faults, then the end"
                    )
                    self.report.stopped_early = "the time budget ran out"
                    break
                if not self.cycle(f"{n}/{len(plan)}", kind):
                    if n < len(plan):
                        self.report.stopped_early = "the run stopped at a failure"
                    break
            self.report.changes = self.workload.ledger.changes
            self.report.transactions = self.workload.ledger.transactions
            # the last recovery's clean verify stands if nothing was written since (writes are paused)
            final = self.verify() if self.report.failures or not plan else True
            if final is None:
                self.report.failures.append("the final verify is not clean")
            self.count()
            self.measure_disk()
            self.report.dead_letters_seen = self.dead_letters()
            if self.report.dead_letters_seen != self.report.dead_letters_expected:
                self.report.failures.append(
                    f"{self.report.dead_letters_expected} dead letters expected, "
                    f"{self.report.dead_letters_seen} in the dead-letter topic"
                )
        finally:
            self.sampler.stop()
            self.close()
        return self.report

    def cycle(self, n: str, kind: str) -> bool:
        """Writes, a fault of ``kind`` (counted if it hit, else a miss), more writes, the recovery, then
        the exits since the last fault told apart (:meth:`account`); whether the run goes on (no
        failure, no unexplained exit)."""
        self.workload.start()
        time.sleep(self.rng.uniform(*self.size.write_s))  # writes before the fault
        t_fault = time.monotonic()
        self.account(None, t_fault, t_fault)  # exits since the last recovery: no fault explains them
        self.note(f"fault {n}: {kind}")
        hit = self.inject(kind)
        self.note(f"fault {n}: {kind} {'injected' if hit else 'injected, HIT NOTHING (not counted)'}")
        (self.report.faults if hit else self.report.misses)[kind] += 1
        time.sleep(self.rng.uniform(0, self.size.write_s[0]))  # writes after the fault
        self.workload.pause()
        recovered = len(self.report.recover_s[kind])
        self.recover(kind, t_fault, hit)
        self.account(kind if hit else None, t_fault, time.monotonic())
        ok = not self.report.failures and not self.report.unexplained
        if not hit:
            self.say(f"  [{n}] {kind}: HIT NOTHING (not counted)" + ("" if ok else "; FAILED"))
        elif ok and len(self.report.recover_s[kind]) > recovered:
            self.say(f"  [{n}] {kind}: recovered in {self.report.recover_s[kind][-1]:.1f} s")
        else:
            self.say(f"  [{n}] {kind}: FAILED")
        return ok

    def account(self, kind: str | None, t_fault: float, t_end: float) -> None:
        """Tell apart every exit of `cdc run` and `cdc apply` seen since the last call, up to ``t_end``:
        a stop of the harness's own; one the fault ``kind`` explains (it hit: None is no fault, or one
        that hit nothing), seen from ``t_fault`` on, as :data:`EXITS` says; or unexplained, in the
        report with the end of its log (it fails the run). A signal that hit a process that did not
        exit by ``t_end`` is a failure."""
        explains = EXITS.get(kind, {}) if kind is not None else {}
        for proc in (self.reader, self.apply):
            counts = self.report.exits.setdefault(
                proc.name,
                dict.fromkeys(
                    ("starts", "exits", "by faults", "by the harness", "infrastructure", "unexplained"), 0
                ),
            )
            seen = [e for e in proc.exits[self._accounted[proc.name] :] if e.at <= t_end]
            self._accounted[proc.name] += len(seen)
            rule = explains.get(proc.name)
            left = 1  # the exits a signal explains
            for e in seen:
                counts["exits"] += 1
                if e.by_harness:
                    counts["by the harness"] += 1
                    self.note(f"exit of {proc.name} #{e.start} (code {e.code}): stopped by the harness")
                elif rule is not None and e.at >= t_fault and self._explained(rule, proc, e, left):
                    counts["by faults"] += 1
                    left -= 1
                    self.note(f"exit of {proc.name} #{e.start} (code {e.code}): explained by {kind}")
                elif proc is self.apply and e.code == 1 and INFRA_ERROR in proc.section(e.start, tail=None):
                    counts["infrastructure"] += 1
                    self.note(f"exit of {proc.name} #{e.start} (code 1): Spark's {INFRA_ERROR!r}, restarted")
                else:
                    counts["unexplained"] += 1
                    why = (
                        f"{kind}, which hit, explains no such exit of it"
                        + (f" (only: {rule})" if rule else "")
                        if kind is not None and e.at >= t_fault
                        else "no fault was under way"
                    )
                    self.report.unexplained.append(
                        f"{proc.name} #{e.start} exited (code {e.code}) {e.at - self._t0:.1f} s into the run: "
                        f"{why}; the end of its log:\n{proc.section(e.start)}"
                    )
                    self.note(f"UNEXPLAINED exit of {proc.name} #{e.start} (code {e.code}): {why}")
            if rule is not None and rule.one and left > 0:
                self.report.failures.append(
                    f"{kind} signalled {proc.name}, which did not exit by its recovery"
                )
            counts["starts"] = proc.starts

    @staticmethod
    def _explained(rule: Explains, proc: Proc, e: Exit, left: int) -> bool:
        """Whether ``rule`` explains the exit ``e`` of ``proc`` (``left``: the exits a signal still explains)."""
        return (
            (not rule.one or left > 0)
            and (rule.codes is None or e.code in rule.codes)
            and (rule.says is None or rule.says in proc.section(e.start, tail=None))
        )

    def measure_disk(self) -> None:
        """The last sample of the state dir, then its live size (after the final verify and count)."""
        self.sampler.stop()
        try:
            self.sampler.sample()
            self.report.disk.live = live_bytes(self.state, self.sampler.skip)
        except Exception as exc:  # the run's other figures are still reported
            self.report.disk.errors.append(f"the live size could not be measured: {exc!r}")
        self.note(f"disk: peak {self.report.disk.peak}, live {self.report.disk.live}")


@contextlib.contextmanager
def tansu() -> Iterator[tuple[str, int]]:
    """A private Tansu broker: (its bootstrap address, its process id for ``broker_freeze``)."""
    from tests.plugins.tansu import TansuBroker

    broker = TansuBroker.start()
    try:
        yield broker.bootstrap, broker.proc.pid
    finally:
        broker.stop()
