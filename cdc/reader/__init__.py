"""The reader stage: Postgres logical replication (wal2json v2) -> change events in the log store.

Interface: :class:`Reader` (``Reader(settings, store, registry).run(once=..., stop=...)``), tuned by
:class:`ReaderOptions`. Modules beside it: :mod:`~cdc.reader.wal2json` (plugin options, decoding,
value encoding), :mod:`~cdc.reader.envelope` (the event), :mod:`~cdc.reader.replication` (the
psycopg2 loop); the snapshot stage is the top-level :mod:`snapshot` package.

Guarantees
----------
* **At least once into the log store.** A position is confirmed to the slot only after every event
  before it is durable (see :mod:`cdc.reader.replication`). After a crash (kill -9 at any moment)
  the next run resumes from the slot's confirmed position: no committed change of a registered
  table is missing from its topic; some may be repeated (their versions make that harmless).
* **Snapshot alignment.** A table is streamed only after its snapshot is complete. A table new to
  the stream (registered after the initial snapshot) drops its stream changes whose commit LSN is
  below its snapshot's consistent point (the snapshot holds them): no change is lost and none is
  written before its snapshot row. A *re-snapshot* of a table the stream already carried keeps those
  changes (they follow the snapshot rows with older versions, which sinks ignore; dropping them would
  lose deletes of rows the new snapshot no longer has). The drop position is kept in the registry
  state (``drop_before:[schema, table]``) so it survives restarts.
* **Resume state** is the slot's ``confirmed_flush_lsn`` plus the registry: ``snapshot_state`` per
  table and the ``initial_snapshot`` state. A slot whose initial snapshot never completed is dropped
  and the initial snapshot is done again from scratch; a table left ``running`` or ``pending`` is
  snapshotted again.
* **Failures.** A dropped connection or a restarted source is retried with exponential backoff
  (``max_attempts`` consecutive failures, then SourceError). A dropped or invalidated slot raises
  SlotLostError (re-snapshot needed), never a silent skip. Any other error propagates: the process
  exits and restarts from the slot.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import orjson
import psycopg
import psycopg2

from cdc.catalog import slot_info
from cdc.config import Settings, redact_dsn
from cdc.errors import ConfigError, SlotLostError, SourceError
from cdc.events import int_to_lsn, lsn_to_int
from cdc.logstore import LogStore, TopicConfig
from cdc.reader.envelope import EventBuilder, TableCodec
from cdc.reader.replication import (
    HEARTBEAT_PREFIX,
    SESSION_OPTIONS,
    Batch,
    StreamControl,
    open_replication,
    stream,
)
from cdc.registry import Column, Registry, TableReg

INITIAL_SNAPSHOT_KEY = "initial_snapshot"
#: registry state: the tables the last stream session read (JSON list of [schema, table])
STREAMED_TABLES_KEY = "streamed_tables"


def drop_before_key(schema: str, table: str) -> str:
    """Registry state key: stream changes of the table with a commit LSN below this value are
    dropped (they are contained in its snapshot and were never streamed before)."""
    return "drop_before:" + orjson.dumps([schema, table]).decode()


__all__ = ["Reader", "ReaderOptions", "RunResult"]


@dataclass(frozen=True)
class ReaderOptions:
    """Tuning of the reader, from ``cdc.toml`` (keys as the field names)."""

    batch_max_events: int = 5000
    batch_max_ms: int = 100
    heartbeat_interval_s: float = 10.0  # 0: no heartbeat messages
    max_attempts: int = 10
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    snapshot_workers: int = 2
    poll_s: float = 1.0

    @classmethod
    def from_settings(cls, settings: Settings) -> ReaderOptions:
        return cls.from_mapping(settings.extra)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ReaderOptions:
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in values:
                continue
            raw = values[f.name]
            try:
                value = int(raw) if f.type in ("int", int) else float(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(
                    f"{f.name} must be a number, got {raw!r}", fix=f"set {f.name} in cdc.toml to a number"
                ) from exc
            if value < 0 or (value == 0 and f.name not in ("heartbeat_interval_s",)):
                raise ConfigError(
                    f"{f.name} must be positive, got {raw!r}", fix=f"set {f.name} > 0 in cdc.toml"
                )
            kwargs[f.name] = value
        return cls(**kwargs)


@dataclass
class RunResult:
    """How :meth:`Reader.run` ended: ``stopped`` (SIGTERM) or ``caught_up`` (``--once``)."""

    reason: str
    confirmed_lsn: int
    changes: int = 0
    events: int = 0
    snapshots: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "confirmed_lsn": int_to_lsn(self.confirmed_lsn),
            "changes": self.changes,
            "events": self.events,
            "snapshot_rows": self.snapshots,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def _retryable(exc: BaseException) -> bool:
    """Connection-level failures (dropped connection, restarting source, slot still held by the
    previous walsender) -- by class, never by message."""
    if isinstance(exc, psycopg2.OperationalError | psycopg2.InterfaceError | psycopg.OperationalError):
        return True
    return type(exc) is psycopg2.DatabaseError


def _signature(regs: list[TableReg]) -> tuple[Any, ...]:
    """What the running stream depends on (columns excluded: the stream tracks those itself)."""
    return tuple(
        sorted(
            (
                r.schema,
                r.table,
                r.topic,
                r.key,
                r.exclude,
                r.snapshot_state,
                r.alignment.consistent_lsn if r.alignment else None,
            )
            for r in regs
        )
    )


class Reader:
    """Snapshot, then stream, the registered tables into the log store (see the module docstring).

    One reader per slot and state directory. ``run`` blocks until stopped (``stop`` set, e.g. by
    SIGTERM: the current batch is made durable and confirmed first) or, with ``once=True``, until
    the slot's confirmed position reaches the WAL position at the start of the run.
    """

    def __init__(
        self,
        settings: Settings,
        store: LogStore,
        registry: Registry,
        *,
        options: ReaderOptions | None = None,
        progress: Callable[[], Any] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings
        self.dsn = settings.require_source()
        self.store = store
        self.registry = registry
        self.options = options or ReaderOptions.from_settings(settings)
        self.progress_factory = progress
        self.log = log or (lambda _msg: None)
        self.confirmed = 0
        self.stats: dict[str, int] = {"changes": 0}
        self.events = 0
        self.snapshots: dict[str, int] = {}
        self.store_lock = threading.Lock()
        self._topics: set[str] = set()

    # -- entry point ------------------------------------------------------------------------------
    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> RunResult:
        stop = stop or threading.Event()
        started = time.monotonic()
        target: int | None = None
        attempt = 0
        while True:
            progressed_before = self.stats["changes"], self.confirmed
            try:
                if once and target is None:
                    target = self._wal_position_now()
                    self.log(f"catching up to {int_to_lsn(target)}")
                reason = self._session(stop, target)
                if reason in ("stopped", "caught_up"):
                    return RunResult(
                        reason,
                        self.confirmed,
                        self.stats["changes"],
                        self.events,
                        self.snapshots,
                        time.monotonic() - started,
                    )
                attempt = 0
            except SlotLostError:
                raise
            except Exception as exc:
                if not _retryable(exc):
                    raise
                if (self.stats["changes"], self.confirmed) != progressed_before:
                    attempt = 0
                attempt += 1
                if attempt >= self.options.max_attempts:
                    raise SourceError(
                        f"lost the connection to the source {redact_dsn(self.dsn)} and could not restore it "
                        f"after {attempt} attempts: {str(exc).strip()}",
                        fix="check that the source is up and reachable; `cdc run` resumes from the slot",
                        attempts=attempt,
                    ) from exc
                delay = min(self.options.backoff_max_s, self.options.backoff_initial_s * 2 ** (attempt - 1))
                self.log(
                    f"source connection failed ({type(exc).__name__}: {str(exc).strip()[:200]}); "
                    f"retry {attempt}/{self.options.max_attempts - 1} in {delay:.1f} s"
                )
                if stop.wait(delay):
                    return RunResult(
                        "stopped",
                        self.confirmed,
                        self.stats["changes"],
                        self.events,
                        self.snapshots,
                        time.monotonic() - started,
                    )

    # -- plumbing -----------------------------------------------------------------------------------
    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn,
            autocommit=True,
            options=SESSION_OPTIONS,
            application_name="cdc-reader",
            connect_timeout=15,
        )

    def _wal_position_now(self) -> int:
        """Emit a heartbeat message and return its LSN: every commit before it precedes it in WAL."""
        with self._connect() as conn:
            return self._heartbeat(conn)

    @staticmethod
    def _heartbeat(conn: psycopg.Connection[Any]) -> int:
        row = conn.execute(
            "SELECT pg_logical_emit_message(false, %s, '')::text", [HEARTBEAT_PREFIX]
        ).fetchone()
        assert row is not None
        return lsn_to_int(str(row[0]))

    def _ensure_topics(self, regs: list[TableReg]) -> None:
        for reg in regs:
            if reg.topic not in self._topics:
                with self.store_lock:
                    self.store.create_topic(
                        reg.topic, TopicConfig(partitions=self.settings.partitions, compacted=True)
                    )
                self._topics.add(reg.topic)

    def _codec(self, reg: TableReg, db: str) -> TableCodec:
        codec = TableCodec(reg, prefix=self.settings.topic_prefix, db=db, partitions=self.settings.partitions)
        drop_before = self.registry.get_state(drop_before_key(reg.schema, reg.table))
        if drop_before is not None:
            codec.snapshot_lsn = int(drop_before)
        return codec

    def _slot_lost(self, why: str) -> SlotLostError:
        return SlotLostError(
            f"replication slot {self.settings.slot_name!r} {why}; changes since the last confirmed position "
            "cannot be read any more, so the topics may miss changes",
            fix="re-snapshot every table: `cdc snapshot --all`, then `cdc run` (it creates a new slot)",
            slot=self.settings.slot_name,
        )

    # -- one session: snapshots, then stream until a registration change / stop / target ---------
    def _session(self, stop: threading.Event, target: int | None) -> str:
        slot = self.settings.slot_name
        with self._connect() as conn:
            db = str(conn.info.dbname)
            regs = self.registry.list_tables()
            info = slot_info(conn, slot)
            initial_state = self.registry.get_state(INITIAL_SNAPSHOT_KEY)
            initial_done = initial_state == "done"
            if info.exists and initial_state is None:
                raise SourceError(
                    f"replication slot {slot!r} already exists, but this state directory "
                    f"({self.settings.state_dir}) never created it: it may belong to another cdc deployment",
                    fix=f"use another slot name (CDC_SLOT), or, if the slot is a leftover, drop it: "
                    f"SELECT pg_drop_replication_slot('{slot}')",
                    slot=slot,
                )
            if info.exists and info.wal_status == "lost":
                raise self._slot_lost("was invalidated (wal_status = 'lost')")
            if not info.exists and initial_done and any(r.snapshot_state == "done" for r in regs):
                raise self._slot_lost("does not exist any more")
            self._ensure_topics(regs)
            if not info.exists or not initial_done:
                if info.exists:
                    # we created it (state "running"), but the snapshot it exported is gone
                    self.log(f"slot {slot} exists but its initial snapshot never completed: recreating it")
                    conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])
                start_lsn = self._snapshot(regs, db, slot, temporary=False)
                self.registry.set_state(INITIAL_SNAPSHOT_KEY, "done")
            else:
                start_lsn = max(self.confirmed, info.confirmed_flush_lsn or 0)
                todo = [r for r in regs if r.snapshot_state != "done"]
                if todo:
                    tmp = f"{slot}_snap{os.getpid()}"[:63]
                    self._snapshot(todo, db, tmp, temporary=True)
            self.confirmed = max(self.confirmed, start_lsn)
            regs = self.registry.list_tables()
            if any(r.snapshot_state != "done" for r in regs):
                return "restart"  # registered while we were snapshotting
            self._ensure_topics(regs)
            signature = _signature(regs)
            generation = [self.registry.generation()]

            def should_restart() -> bool:
                gen = self.registry.generation()
                if gen == generation[0]:
                    return False
                generation[0] = gen
                return _signature(self.registry.list_tables()) != signature

            def columns_changed(reg: TableReg, cols: tuple[Column, ...]) -> None:
                self.log(f"columns of {reg.qualified} changed at the source: {[c.name for c in cols]}")
                self.registry.set_columns(reg.schema, reg.table, cols)

            codecs = {(r.schema, r.table): self._codec(r, db) for r in regs}
            self.registry.set_state(STREAMED_TABLES_KEY, orjson.dumps(sorted(codecs)).decode())
            builder = EventBuilder(codecs, columns_changed)
            batch = Batch(self.store, self.store_lock)
            ctl = StreamControl(
                stop=stop,
                should_restart=should_restart,
                heartbeat=lambda: self._heartbeat(conn),
                heartbeat_interval_s=self.options.heartbeat_interval_s,
                target=target,
                poll_s=self.options.poll_s,
                batch_max_events=self.options.batch_max_events,
                batch_max_ms=self.options.batch_max_ms,
                stats=self.stats,
            )

            def on_confirm(pos: int) -> None:
                self.confirmed = pos

            ctl.on_confirm = on_confirm
            self.log(f"streaming {len(regs)} table(s) from {int_to_lsn(self.confirmed)}")
            try:
                reason, pos = stream(
                    self.dsn, slot, [(r.schema, r.table) for r in regs], self.confirmed, builder, batch, ctl
                )
            finally:
                batch.close()
                self.events += batch.written
            self.confirmed = max(self.confirmed, pos)
            return reason

    def _snapshot(self, regs: list[TableReg], db: str, slot: str, *, temporary: bool) -> int:
        """Snapshot ``regs`` from a new slot's exported snapshot; record each table's alignment.
        Returns the consistent point."""
        from snapshot import create_exported_slot
        from snapshot.exported import read_tables
        from snapshot.progress import NullProgress

        streamed_raw = self.registry.get_state(STREAMED_TABLES_KEY)
        streamed = {tuple(x) for x in orjson.loads(streamed_raw)} if streamed_raw and temporary else set()
        if not temporary:
            self.registry.set_state(INITIAL_SNAPSHOT_KEY, "running")
        for reg in regs:
            self.registry.set_snapshot_state(reg.schema, reg.table, "running")
        repl = open_replication(self.dsn)
        try:
            snap = create_exported_slot(repl.cursor(), slot, temporary=temporary)
            self.log(
                f"{'initial' if not temporary else 'table'} snapshot of {len(regs)} table(s) at "
                f"{int_to_lsn(snap.consistent_lsn)}"
            )
            progress = self.progress_factory() if self.progress_factory else NullProgress()
            try:
                results = (
                    read_tables(
                        self.dsn,
                        snap,
                        regs,
                        self.store,
                        prefix=self.settings.topic_prefix,
                        db=db,
                        partitions=self.settings.partitions,
                        progress=progress,
                        workers=self.options.snapshot_workers,
                        store_lock=self.store_lock,
                    )
                    if regs
                    else []
                )
            finally:
                progress.close()
        finally:
            repl.close()  # a temporary slot is dropped with its connection
        for res in results:
            # A table the stream already carried up to the restart position keeps its changes
            # between that position and the snapshot (dropping them would lose its deletes); a
            # table new to the stream drops them: the snapshot holds them.
            drop_before = 0 if (res.reg.schema, res.reg.table) in streamed else snap.consistent_lsn
            self.registry.set_state(drop_before_key(res.reg.schema, res.reg.table), str(drop_before))
            self.registry.set_columns(res.reg.schema, res.reg.table, res.columns)
            self.registry.set_snapshot_state(res.reg.schema, res.reg.table, "done", res.alignment)
            self.snapshots[res.reg.qualified] = res.rows
            self.events += res.rows
            self.log(f"snapshot of {res.reg.qualified}: {res.rows} rows")
        return snap.consistent_lsn
