"""The reader stage: Postgres logical replication (wal2json v2 or pgoutput) -> change events in the log store.

Interface: :class:`Reader` (``Reader(settings, store, registry).run(once=..., stop=...)``), tuned by
:class:`ReaderOptions`. Modules beside it: :mod:`~cdc.reader.slot` (the slot decision: create,
recover, resume), :mod:`~cdc.reader.watch` (the watcher of source changes while streaming),
:mod:`~cdc.reader.replication` (the psycopg2 loop), :mod:`~cdc.reader.schema` (a table's columns
changed: the one place that settles it), :mod:`~cdc.reader.ddl` (the DDL recorder's stream side).
The recorders' triggers on the source are :mod:`cdc.recorders`. Decoding is :mod:`cdc.codec` (the
decoder, the event); the snapshot stage is the top-level :mod:`snapshot` package, which the reader imports (never the
other way round).

Guarantees
----------
* **At least once into the log store.** A position is confirmed to the slot only after every event
  before it is durable (see :mod:`cdc.reader.replication`). After a crash (kill -9 at any moment)
  the next run resumes from the slot's confirmed position: no committed change of a registered
  table is missing from its topic; some may be repeated (their versions make that harmless).
* **Snapshot alignment.** The initial snapshot's rows are versioned at the slot's consistent point
  and streaming starts there. A table snapshotted later (registered on a running pipeline, a
  re-snapshot request, the recovery after a lost slot) is streamed from the moment its snapshot
  starts and read in chunks between watermarks (:mod:`snapshot.chunked`, ``docs/snapshots.md``):
  no stream change is dropped, and each chunk row's version orders it against them.
* **Resume state** is the slot's ``confirmed_flush_lsn`` plus the registry: ``snapshot_state`` per
  table, the ``initial_snapshot`` state and each chunked snapshot's progress. A slot whose initial
  snapshot never completed is dropped and the initial snapshot is done again from scratch; a table
  left ``running`` resumes its chunked snapshot after its last done chunk.
* **Failures** are classified (:mod:`cdc.connect`). Transient ones (a dropped connection, a
  restarting or unreachable source, a timeout) are retried with exponential backoff, each retry
  logged, for at most ``retry_max_s`` seconds and ``max_attempts`` consecutive failures without
  progress, then SourceUnavailableError. Permanent ones (authentication, privilege, a missing
  database or table) fail at once with a SourcePermanentError (exit 2). A dropped or invalidated slot raises
  SlotLostError (re-snapshot needed), never a silent skip. Any other error propagates: the process
  exits and restarts from the slot.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
import psycopg2
import psycopg2.errors
from psycopg import sql

from cdc.catalog import (
    CaptureProblem,
    TableDescription,
    capture_digests,
    capture_problems,
    create_logical_slot,
    describe_table,
    is_table,
    key_columns_gone,
    server_info,
    slot_info,
    source_tables,
    table_oids,
)
from cdc.codec import HEARTBEAT_PREFIX, Decoder
from cdc.codec.compiled import native_status
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.codec.plugins import plugin as output_plugin
from cdc.codec.wal2json import DECODER as WAL2JSON
from cdc.config import ReaderConfig, Settings, redact_dsn, redact_text, section_options
from cdc.connect import SESSION_OPTIONS, classify, connect, is_transient
from cdc.errors import (
    RegistryError,
    SlotLostError,
    SourceError,
    SourcePermanentError,
    SourceUnavailableError,
    UnknownTopicError,
)
from cdc.events import encode_key, int_to_lsn, lsn_to_int
from cdc.logstore import APPLY_CONSUMER, LogStore, Record, TopicConfig
from cdc.logstore.batch import Batch
from cdc.logstore.images import Images, images_path, iter_topic, rebuild
from cdc.metrics import Publisher
from cdc.publication import keep_publication
from cdc.reader.ddl import DdlFollower
from cdc.reader.plugin import (
    choose_plugin,
    note_reread,
    resnapshot_after_lost_slot,
)
from cdc.reader.replication import FALLBACKS, StreamControl, open_replication, stream
from cdc.reader.schema import RegistryColumns, SchemaFollower, SourceCatalog
from cdc.reader.slot import SlotFacts, decide
from cdc.reader.watch import SourceWatcher, table_names
from cdc.recorders.nonfinite import ensure_nonfinite, remember, tracked_columns
from cdc.registry import Column, Registry, State, TableReg, TableState
from snapshot import SnapshotError, create_exported_slot
from snapshot.chunk_state import (
    ChunkProgress,
    SnapshotOptions,
    ensure_watermark_table,
    load_progress,
    save_progress,
)
from snapshot.chunked import ChunkDriver, ChunkTracker, truncate_marker
from snapshot.progress import NullProgress


@dataclass
class _Detached:
    """A detached partition's rows to delete from ``reg``'s topic, at version ``(lsn, 0)``: written
    once the stream confirmed ``lsn`` (every earlier change of them is in the topic before)."""

    reg: TableReg
    leaves: list[tuple[str, str]]
    lsn: int
    records: list[Any]


def drop_before_key(schema: str, table: str) -> str:
    return TableState.DROP_BEFORE.key(schema, table)


__all__ = ["Reader", "ReaderOptions", "RunResult"]


class ReaderOptions(ReaderConfig):
    """Tuning of the reader: its keys of ``cdc.toml``, whose model (:class:`cdc.config.ReaderConfig`)
    holds each key's default and bounds."""

    @classmethod
    def from_settings(cls, settings: Settings) -> ReaderOptions:
        return section_options(cls, settings, None)


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


def _old_key(codec: TableCodec, before: dict[str, Any]) -> bytes | None:
    """The key bytes of a ``before`` object (None when it lacks a key column)."""
    return codec.key_bytes(before, 0) if all(k in before for k in codec.key) else None


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
        #: whether wal2json knows numeric-data-types-as-string (None: not tried yet). Not read back
        #: from the registry's ``"0"`` on purpose: each process asks once (a refused option costs one
        #: START_REPLICATION and a restart), so an upgrade to 2.6+ is noticed; a ``"1"`` is read back
        #: (:meth:`_ensure_nonfinite`: no recorder needed)
        self._numeric_as_string: bool | None = None
        #: the output plugin of the current session (the slot's; :func:`cdc.reader.plugin.choose_plugin`)
        self._plugin = output_plugin(settings.decoder)
        #: per table: the catalog digest and key last judged, and the problems found (the poll asks
        #: cdc.catalog.capture_problems again only when they changed)
        self._capture_checked: dict[
            tuple[str, str], tuple[tuple[str | None, tuple[str, ...]], list[Any]]
        ] = {}
        self.metrics = Publisher(settings.state_dir, "capture")  # on-call counters (cdc.metrics)
        #: each key's long values, to fill in what an UPDATE leaves out (cdc.logstore.images); open
        #: while :meth:`run` runs
        self.images: Images | None = None
        self._said_path = False  # the warning that the Python per-change path runs: said once

    # -- entry point ------------------------------------------------------------------------------
    def run(self, *, once: bool = False, stop: threading.Event | None = None) -> RunResult:
        with self.metrics:  # publishes <state>/metrics/capture.json; records an error that ends the run
            path = images_path(self.settings.state_dir)
            if self.options.fill_unchanged_toast:
                self.images = Images(path)
            else:  # a store that misses changes must never fill one: rebuilt from the topics when on again
                for stale in path.parent.glob(path.name + "*"):
                    stale.unlink()
            try:
                result = self._run(once=once, stop=stop)
            finally:
                if self.images is not None:
                    self.images.close()
            self._publish_progress(result.confirmed_lsn, result.events)
            return result

    def _run(self, *, once: bool = False, stop: threading.Event | None = None) -> RunResult:
        stop = stop or threading.Event()
        started = time.monotonic()
        target: int | None = None
        attempt = 0
        failing_since: float | None = None
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
                attempt, failing_since = 0, None
            except SlotLostError:
                raise
            except (psycopg.Error, psycopg2.Error, SourceError) as exc:
                if not is_transient(exc):
                    raise (exc if isinstance(exc, SourceError) else classify(exc, self.dsn)) from None
                now = time.monotonic()
                if (self.stats["changes"], self.confirmed) != progressed_before:
                    attempt, failing_since = 0, None
                failing_since = now if failing_since is None else failing_since
                attempt += 1
                detail = (
                    exc.message if isinstance(exc, SourceError) else redact_text(str(exc).strip(), self.dsn)
                )
                delay = min(self.options.backoff_max_s, self.options.backoff_initial_s * 2 ** (attempt - 1))
                spent = now - failing_since
                if attempt >= self.options.max_attempts or spent + delay > self.options.retry_max_s:
                    raise SourceUnavailableError(
                        f"lost the connection to the source {redact_dsn(self.dsn)} and could not restore it "
                        f"in {spent:.1f} s ({attempt} attempts): {detail}",
                        fix="check that the source is up and reachable; `cdc run` resumes from the slot "
                        "(retry_max_s in cdc.toml bounds the time spent retrying)",
                        attempts=attempt,
                        source=redact_dsn(self.dsn),
                    ) from None
                self.log(
                    f"source connection failed ({type(exc).__name__}: {detail[:300]}); "
                    f"retry {attempt} in {delay:.1f} s ({spent:.1f} of {self.options.retry_max_s:.0f} s spent)"
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
        return connect(self.dsn, options=SESSION_OPTIONS, application_name="cdc-reader")

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

    def _published_heartbeat(self, conn: psycopg.Connection[Any]) -> int:
        """A heartbeat whose LSN and wall time go to the metrics: once it is confirmed, everything
        committed before that time is captured (``cdc status`` computes capture lag from it)."""
        now = time.time()
        lsn = self._heartbeat(conn)
        prev = self.metrics.snapshot()["gauges"]
        self.metrics.set("prev_heartbeat_lsn", prev.get("heartbeat_lsn"))
        self.metrics.set("prev_heartbeat_emitted_ms", prev.get("heartbeat_emitted_ms"))
        self.metrics.set("heartbeat_lsn", lsn)
        self.metrics.set("heartbeat_emitted_ms", int(now * 1000))
        return lsn

    def _publish_progress(self, confirmed: int, events: int) -> None:
        m = self.metrics
        m.set("confirmed_lsn", confirmed)
        m.set("confirmed_ms", int(time.time() * 1000))
        m.total("changes_read", self.stats["changes"])
        # the compiled per-change path's fallbacks (cdc.reader.replication._count_fallbacks)
        m.total("native_python_values", self.stats.get("native_python_values", 0))
        m.total("native_python_changes", self.stats.get("native_python_changes", 0))
        # sessions that read the stream with psycopg2's read_message (cdc.reader.replication._fell_back)
        m.total(FALLBACKS, self.stats.get(FALLBACKS, 0))
        m.total("events_written", events)

    def _ensure_topics(self, regs: list[TableReg]) -> None:
        """Create each table's topic, and make the apply job a consumer of it from its first record
        (its start offsets, unless it has a position already): the embedded store compacts nothing a
        consumer has not read, and an update that leaves out its unchanged TOAST columns needs the
        key's earlier record, even when ``cdc apply`` starts long after ``cdc run``. The apply job's
        own commits move the position on."""
        for reg in regs:
            if reg.topic not in self._topics:
                with self.store_lock:
                    self.store.create_topic(
                        reg.topic, TopicConfig(partitions=self.settings.partitions, compacted=True)
                    )
                    self.store.hold(APPLY_CONSUMER, reg.topic)
                self._topics.add(reg.topic)

    def _codec(self, reg: TableReg, db: str, decoder: Decoder = WAL2JSON) -> TableCodec:
        """The table's codec; ``decoder``: the stream's (whose values it converts)."""
        codec = TableCodec(
            reg,
            prefix=self.settings.topic_prefix,
            db=db,
            partitions=self.settings.partitions,
            numeric_as_string=self._numeric_as_string is not False,
            decoder=decoder,
        )
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

    def _ensure_nonfinite(self, conn: psycopg.Connection[Any], regs: list[TableReg]) -> None:
        """Install or update the non-finite recorder's triggers (:mod:`cdc.recorders.nonfinite`)
        where wal2json cannot send NaN/Infinity itself (< 2.6, or not known yet); say, per table
        and column, where it could not be installed (once the plugin is known to be < 2.6).
        pgoutput sends them itself: no recorder."""
        if (
            not self._plugin.may_send_nonfinite_as_null
            or self._numeric_as_string
            or (
                self._numeric_as_string is None
                and self.registry.get_state(State.WAL2JSON_NUMERIC_AS_STRING) == "1"
            )
        ):
            remember(self.registry, [], regs)  # nothing is lost: no table needs the recorder
            return
        if not self.settings.config.nonfinite_recorder:
            for reg in regs:
                if tracked_columns(reg) and self._numeric_as_string is False:
                    self.log(
                        f"warning: this wal2json (< 2.6) sends NaN/Infinity in {reg.qualified} "
                        f"({', '.join(tracked_columns(reg))}) as null and nonfinite_recorder = false "
                        "in cdc.toml; fix: set it to true (or upgrade wal2json to 2.6+)"
                    )
            return
        outcomes = ensure_nonfinite(conn, regs, self.settings.config.nonfinite_recorder_when)
        remember(self.registry, outcomes, regs)  # shown by `cdc tables list`
        for outcome in outcomes:
            cols = ", ".join(tracked_columns(outcome.reg))
            if outcome.action == "installed":
                self.log(f"non-finite recorder installed on {outcome.reg.qualified} ({cols})")
            state = outcome.to_json()
            if state is not None and self._numeric_as_string is False:
                self.log(
                    f"warning: this wal2json (< 2.6) sends NaN/Infinity in {outcome.reg.qualified} "
                    f"({cols}) as null and the non-finite recorder does not cover "
                    f"{', '.join(outcome.uncovered) if outcome.uncovered else 'it'}: {state['reason']}"
                    + (f"; fix: {state['fix']}" if state["fix"] else "")
                )

    def _sync_publication(self, conn: psycopg.Connection[Any]) -> None:
        if self._plugin.uses_publication:
            keep_publication(conn, self.registry, self.settings, self._snapshot_options().watermark, self.log)

    def _refuse_if_plugin_refused(self, conn: psycopg.Connection[Any]) -> None:
        """Fail fast, before any slot work, when the server's ``output_plugin_libraries`` leaves out
        the session's plugin (the same rule and fix as ``cdc check``)."""
        refusal = server_info(conn).output_plugin_refusal(self._plugin.name)
        if refusal is not None:
            message, fix = refusal
            raise SourcePermanentError(message, fix=fix, source=redact_dsn(self.dsn))

    def _refuse_if_active(self, conn: psycopg.Connection[Any], slot: str) -> None:
        """Refuse to drop a slot another process is streaming from (read again just before)."""
        info = slot_info(conn, slot)
        if info.active:
            raise SourcePermanentError(
                f"replication slot {slot!r} is in use by another process (walsender pid "
                f"{info.active_pid}); refusing to drop and recreate it",
                fix="stop the other `cdc run` using this slot (another state directory with the same "
                "slot name?), or give this one its own slot (CDC_SLOT)",
                slot=slot,
                active_pid=info.active_pid,
            )

    # -- one session: snapshots, then stream until a registration change / stop / target ---------
    def _session(self, stop: threading.Event, target: int | None) -> str:
        slot = self.settings.slot_name
        with self._connect() as conn:
            db = str(conn.info.dbname)
            self._plugin = choose_plugin(conn, slot, self.settings.decoder)
            self._refuse_if_plugin_refused(conn)
            regs = self.registry.list_tables()
            self._follow_topics(conn, regs, slot)
            self._ensure_nonfinite(conn, regs)
            self._sync_publication(conn)  # before a new slot's consistent point
            start_lsn = self._slot_start(conn, regs, db, slot)
            self.registry.set_state(State.DECODER, self._plugin.name)
            self.confirmed = max(self.confirmed, start_lsn)
            regs, refused, chunking = self._session_tables(conn)
            watcher = SourceWatcher(
                conn, self.registry, regs, refused, functools.partial(self._refuse_lost_keys, conn), self.log
            )
            return self._stream_session(conn, db, slot, regs, watcher, chunking, stop, target)

    def _follow_topics(self, conn: psycopg.Connection[Any], regs: list[TableReg], slot: str) -> None:
        """Make the image store follow every registered table's topic (:mod:`cdc.logstore.images`):
        a topic new or empty is followed from its first record; one written before the store (an
        earlier version of cdc, or a store lost) is read first, up to what the slot confirmed.
        Images of topics no longer registered are dropped."""
        images = self.images
        if images is None:
            return
        followed = images.followed()
        wanted = {r.topic for r in regs}
        for topic in followed - wanted:
            images.forget(topic)
        todo = [r for r in regs if r.topic not in followed]
        if not todo:
            return
        info = slot_info(conn, slot)
        confirmed = (info.confirmed_flush_lsn or 0) if info.exists else 0
        db = str(conn.info.dbname)
        for reg in todo:
            with self.store_lock:
                try:
                    ends = self.store.end_offsets(reg.topic)
                    starts = self.store.start_offsets(reg.topic)
                except UnknownTopicError:
                    ends, starts = {}, {}
            if all(ends.get(p, 0) <= starts.get(p, 0) for p in ends):
                images.follow(reg.topic, time.time())
                continue
            codec = self._codec(reg, db)
            if codec.imaged:
                self.log(f"{reg.qualified}: reading its topic to rebuild the values updates leave out")
                with self.store_lock:
                    result = rebuild(
                        images,
                        reg.topic,
                        iter_topic(self.store, reg.topic),
                        confirmed,
                        codec.image_of_event,
                        functools.partial(_old_key, codec),
                    )
                self.log(
                    f"{reg.qualified}: {result.keys} key(s) rebuilt from {result.records} record(s)"
                    + (f"; values unknown: {result.unknown}" if result.unknown else "")
                )
                if result.unknown:
                    self._note_unknown(reg, sum(result.unknown.values()), result.unknown)
            images.follow(reg.topic, time.time())

    def _note_unknown(self, reg: TableReg, events: int, columns: Mapping[str, int] | None = None) -> None:
        """Record that ``reg``'s topic holds values the reader could not know (``cdc status`` and
        ``cdc check`` name it; a full snapshot of the table clears it)."""
        raw = self.registry.get_table_state(TableState.VALUES_UNKNOWN, reg.schema, reg.table)
        state: dict[str, Any] = (
            orjson.loads(raw) if raw else {"events": 0, "columns": {}, "since": int(time.time())}
        )
        state["events"] += events
        for name, n in (columns or {}).items():
            state["columns"][name] = state["columns"].get(name, 0) + n
        self.registry.set_table_state(
            TableState.VALUES_UNKNOWN, reg.schema, reg.table, orjson.dumps(state).decode()
        )
        if not raw:
            self.log(
                f"warning: {reg.qualified}: its topic holds values cdc cannot know (written before its "
                f"image store, or the store was lost); fix: `cdc snapshot {reg.qualified}`"
            )

    def _slot_start(self, conn: psycopg.Connection[Any], regs: list[TableReg], db: str, slot: str) -> int:
        """Carry out the slot decision (:func:`cdc.reader.slot.decide`); the position to stream from."""
        info = slot_info(conn, slot)
        initial_state = self.registry.get_state(State.INITIAL_SNAPSHOT)
        action = decide(
            SlotFacts(
                info.exists, info.wal_status, initial_state, any(r.snapshot_state == "done" for r in regs)
            )
        )
        if action == "foreign":
            raise SourceError(
                f"replication slot {slot!r} already exists, but this state directory "
                f"({self.settings.state_dir}) never created it: it may belong to another cdc deployment",
                fix=f"use another slot name (CDC_SLOT), or, if the slot is a leftover, drop it: "
                f"SELECT pg_drop_replication_slot('{slot}')",
                slot=slot,
            )
        if action in ("invalidated", "gone") and self.settings.config.slot_lost == "resnapshot":
            if action == "invalidated":
                self._refuse_if_active(conn, slot)
            resnapshot_after_lost_slot(conn, self.registry, slot, action, info.wal_status, self.log)
            action = "recover"
        if action == "invalidated":
            raise self._slot_lost("was invalidated (wal_status = 'lost')")
        if action == "gone":
            raise self._slot_lost("does not exist any more")
        self._ensure_topics(regs)
        if action in ("recover", "snapshot", "recreate") and self.images is not None:
            self.images.reset()  # a new slot: its snapshot brings every row (and image) again
        if action == "recover":
            # recovery after a lost slot (`cdc snapshot --all` made every table pending): a new
            # slot, and every table snapshotted in chunks while streaming from its start; each
            # full chunked snapshot ends with a TRUNCATE marker that removes the rows whose
            # deletes the lost slot never delivered
            lsn = create_logical_slot(conn, slot, self._plugin.name)  # a failover slot on PG 17+
            self.log(f"slot {slot} created at {int_to_lsn(lsn)}; every table is snapshotted in chunks")
            return lsn
        if action in ("snapshot", "recreate"):
            if action == "recreate":
                # we created it (state "running"), but the snapshot it exported is gone
                self._refuse_if_active(conn, slot)
                self.log(f"slot {slot} exists but its initial snapshot never completed: recreating it")
                conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])
            start_lsn = self._snapshot(regs, db, slot, temporary=False)
            self.registry.set_state(State.INITIAL_SNAPSHOT, "done")
            return start_lsn
        return max(self.confirmed, info.confirmed_flush_lsn or 0)

    def _session_tables(
        self, conn: psycopg.Connection[Any]
    ) -> tuple[list[TableReg], list[TableReg], list[TableReg]]:
        """The tables this session streams, those refused for their key, and those it snapshots in
        chunks while streaming."""
        regs = self.registry.list_tables()
        self._ensure_topics(regs)
        # a table whose key columns are gone at the source (dropped or renamed) is refused,
        # loudly, and left out of this session; the others go on
        refused = self._refuse_lost_keys(conn, regs)
        refused_regs = [r for r in regs if (r.schema, r.table) in refused]
        regs = [r for r in regs if (r.schema, r.table) not in refused]
        # partitions attached or detached since the last session streamed: read or delete their rows
        if self._partitions_changed(conn, regs):
            regs = [r for r in self.registry.list_tables() if (r.schema, r.table) not in refused]
        # tables registered (or re-snapshot-requested) after the initial snapshot: chunked
        # snapshots while every table streams (snapshot.chunked, docs/snapshots.md)
        chunking = self._prepare_chunks(regs)
        regs = [r for r in self.registry.list_tables() if (r.schema, r.table) not in refused]
        return regs, refused_regs, chunking

    def _builder(self, codecs: dict[tuple[str, str], TableCodec]) -> EventBuilder:
        """The session's event builder, filling in from the image store (its staging: the batch's)."""
        images = self.images
        staging = None
        if images is not None:
            images.restart()  # what a failed batch staged is sent again by the slot
            staging = images.staging()
        return EventBuilder(
            codecs,
            # pgoutput's publication is shared state: a table registered since this session started
            # is published before the session restarts with it (its chunked snapshot covers it)
            skip_unlisted=self._plugin.uses_publication,
            images=images,
            staging=staging,
            report_left_out=True,
        )

    def _schema(self, conn: psycopg.Connection[Any], builder: EventBuilder) -> SchemaFollower:
        """The session's column changes, settled on ``conn`` (:mod:`cdc.reader.schema`)."""
        record = RegistryColumns(
            self.registry, self.images, functools.partial(self._ensure_nonfinite, conn), self.log
        )
        return SchemaFollower(builder, SourceCatalog(conn), record)

    def _control(
        self,
        conn: psycopg.Connection[Any],
        stop: threading.Event,
        watcher: SourceWatcher,
        target: int | None,
        ddl: DdlFollower,
        schema: SchemaFollower,
    ) -> StreamControl:
        """What a session's stream loop watches besides the stream (:class:`StreamControl`)."""
        return StreamControl(
            stop=stop,
            should_restart=watcher.should_restart,
            heartbeat=lambda: self._published_heartbeat(conn),
            heartbeat_interval_s=self.options.heartbeat_interval_s,
            target=target,
            poll_s=self.options.poll_s,
            batch_max_events=self.options.batch_max_events,
            batch_max_ms=self.options.batch_max_ms,
            batch_linger_ms=self.options.batch_linger_ms,
            stats=self.stats,
            ddl=ddl,
            schema=schema.settle,
            log=self.log,
        )

    def _stream_session(
        self,
        conn: psycopg.Connection[Any],
        db: str,
        slot: str,
        regs: list[TableReg],
        watcher: SourceWatcher,
        chunking: list[TableReg],
        stop: threading.Event,
        target: int | None,
    ) -> str:
        """Stream ``regs`` (and the chunked snapshots of ``chunking``) until stopped, caught up, or
        a restart is due; the reason."""
        decoder = self._plugin.decoder(conn, self.settings.publication, self.settings.state_dir / "spool")
        compiled, path = native_status()
        if not compiled and not self._said_path:
            self._said_path = True
            self.log(f"warning: {path}")  # slower (about 4x the CPU a change), the same events
        codecs = {(r.schema, r.table): self._codec(r, db, decoder) for r in regs}
        for parent, parts in watcher.leaves.items():
            for leaf in parts:
                codecs[leaf] = codecs[parent]
        self.registry.set_state(State.STREAMED_TABLES, orjson.dumps(sorted(codecs)).decode())
        builder = self._builder(codecs)
        schema = self._schema(conn, builder)
        follower = self._ddl_follower(conn, builder, schema, regs, watcher)
        batch = Batch(self.store, self.store_lock, staging=builder.staging)
        ctl = self._control(conn, stop, watcher, target, follower, schema)

        detaches = self._detached_rows(conn, regs, db)

        def on_confirm(pos: int) -> None:
            self.confirmed = pos
            self._publish_progress(pos, self.events + batch.written)
            if builder.unknown:
                self._flush_unknown(builder, codecs)
            if detaches:
                self._write_detached(detaches, pos)

        ctl.on_confirm = on_confirm
        tables = [(r.schema, r.table) for r in regs] + [
            leaf for parts in watcher.leaves.values() for leaf in parts
        ]
        driver = None
        if chunking:
            driver = self._chunk_driver(conn, chunking, db)
            ctl.chunks = driver.tracker
            tables.append(driver.tracker.schema_table)
            self._sync_publication(conn)  # the watermark table exists now
        self.log(f"streaming {len(regs)} table(s) from {int_to_lsn(self.confirmed)}")
        self._publish_progress(self.confirmed, self.events)
        if driver is not None:
            ctl.on_started = driver.start
        try:
            reason, pos = stream(
                self.dsn,
                slot,
                tables,
                self.confirmed,
                builder,
                batch,
                ctl,
                numeric_as_string=self._plugin.may_send_nonfinite_as_null
                and self._numeric_as_string is not False,
                decoder=decoder,
            )
            if self._plugin.may_send_nonfinite_as_null:
                if self._numeric_as_string is None:
                    self.registry.set_state(State.WAL2JSON_NUMERIC_AS_STRING, "1")
                self._numeric_as_string = self._numeric_as_string is not False
        except psycopg2.errors.InvalidParameterValue:
            if self._numeric_as_string is not None or not self._plugin.may_send_nonfinite_as_null:
                raise
            # wal2json < 2.6 refuses the option in its startup callback (SQLSTATE 22023)
            self._numeric_as_string = False
            self.registry.set_state(State.WAL2JSON_NUMERIC_AS_STRING, "0")
            return "restart"  # the next session checks the non-finite recorder and says what lacks it
        finally:
            if driver is not None:
                driver.stop()
            decoder.close()
            batch.close()
            self.events += batch.written
            if builder.unknown:
                self._flush_unknown(builder, codecs)
        self.confirmed = max(self.confirmed, pos)
        return reason

    def _flush_unknown(self, builder: EventBuilder, codecs: Mapping[tuple[str, str], TableCodec]) -> None:
        """Count the events written with values the images lacked (metrics, registry)."""
        regs = {c.reg.qualified: c.reg for c in codecs.values()}
        for table, n in builder.unknown.items():
            self.metrics.add("values_unavailable", n)
            if table in regs:
                self._note_unknown(regs[table], n)
        builder.unknown.clear()

    # -- partitioned tables -----------------------------------------------------------------------
    def _partitions_changed(self, conn: psycopg.Connection[Any], regs: list[TableReg]) -> bool:
        """Each partitioned table's leaves against those the last session streamed (state
        ``streamed_partitions``), whether they changed while streaming or while ``cdc run`` was down:

        * a leaf attached (or created): its rows, and only its, are read in chunks while streaming
          (request ``{"partitions": [...]}``: no TRUNCATE marker, the other rows keep their history);
        * a leaf detached: its rows are deleted from the topic (:meth:`_detached_rows`);
        * a leaf dropped (its rows can no longer be read), or a change while the table's own
          snapshot is not done: the table is snapshotted again in full (its TRUNCATE marker removes
          the rows no longer there).

        True when a table is to be snapshotted (its registration changed)."""

        requested = False
        raw = self.registry.get_state(State.STREAMED_PARTITIONS)
        state = {(k[0], k[1]): [(s, t) for s, t in v] for k, v in (orjson.loads(raw) if raw else [])}
        now = source_tables(conn, table_names(regs))
        for reg in regs:
            key = (reg.schema, reg.table)
            was, leaves = state.get(key), now.get(key)
            if leaves is None:
                continue
            state[key] = list(leaves)
            if was is None or set(was) == set(leaves):
                continue
            attached = [leaf for leaf in leaves if leaf not in was]
            detached = [leaf for leaf in was if leaf not in leaves]
            dropped = [leaf for leaf in detached if not is_table(conn, leaf)]
            names = ", ".join(f"{s}.{t}" for s, t in attached + detached)
            if dropped or reg.snapshot_state != "done":
                self.log(f"partitions of {reg.qualified} changed ({names}); snapshotting it again")
                self.registry.set_table_state(TableState.SNAPSHOT_REQUEST, *key, None)
                self.registry.set_snapshot_state(*key, "pending")
                requested = True
                continue
            if detached:
                old = self.registry.get_table_state(TableState.PARTITIONS_DETACHED, *key)
                pending = sorted({*(tuple(x) for x in (orjson.loads(old) if old else [])), *detached})
                self.registry.set_table_state(
                    TableState.PARTITIONS_DETACHED, *key, orjson.dumps(pending).decode()
                )
                self.log(f"{reg.qualified}: partition(s) {detached} detached; deleting their rows")
            if attached:
                self.log(f"{reg.qualified}: partition(s) {attached} attached; reading their rows")
                self.registry.set_table_state(
                    TableState.SNAPSHOT_REQUEST, *key, orjson.dumps({"partitions": attached}).decode()
                )
                self.registry.set_snapshot_state(*key, "pending")
                requested = True
        body = [[list(k), [list(leaf) for leaf in v]] for k, v in sorted(state.items())]
        self.registry.set_state(State.STREAMED_PARTITIONS, orjson.dumps(body).decode())
        return requested

    def _detached_rows(self, conn: psycopg.Connection[Any], regs: list[TableReg], db: str) -> list[_Detached]:
        """The delete events of the rows of partitions detached from ``regs`` (state
        ``partitions_detached``): the keys the detached tables hold and the parent does not (a row
        moved back stays), read in one snapshot, at version (its WAL position, 0)."""
        out: list[_Detached] = []
        for reg in regs:
            raw = self.registry.get_table_state(TableState.PARTITIONS_DETACHED, reg.schema, reg.table)
            if not raw:
                continue
            leaves = [(str(s), str(t)) for s, t in orjson.loads(raw)]
            codec = self._codec(reg, db)
            keys = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(k)) for k in reg.key)
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
            try:
                row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
                assert row is not None
                lsn = lsn_to_int(str(row[0]))
                found: list[tuple[Any, ...]] = []
                for leaf in leaves:
                    if is_table(conn, leaf):
                        found += conn.execute(
                            sql.SQL("SELECT {k} FROM {leaf} EXCEPT SELECT {k} FROM {parent}").format(
                                k=keys,
                                leaf=sql.Identifier(*leaf),
                                parent=sql.Identifier(reg.schema, reg.table),
                            )
                        ).fetchall()
            finally:
                conn.execute("COMMIT")
            now = str(int(time.time() * 1000)).encode()
            src = codec.snapshot_source(lsn, int(now), last=False)
            records: list[Any] = []
            for values in sorted(set(found)):
                before = {
                    k: v if v is None or (f := codec.text_converters.get(k)) is None else f(v)
                    for k, v in zip(reg.key, values, strict=True)
                }
                key_b = encode_key(before)
                records += [Record(key_b, codec.value(before, None, src, b"d", [], now)), Record(key_b, None)]
            out.append(_Detached(reg, leaves, lsn, records))
        return out

    def _write_detached(self, detaches: list[_Detached], confirmed: int) -> None:
        """Write the deletes of each detached partition whose version the stream confirmed."""
        for d in [d for d in detaches if confirmed >= d.lsn]:
            with self.store_lock:
                if d.records:
                    self.store.append_many({d.reg.topic: d.records})
            self.registry.set_table_state(TableState.PARTITIONS_DETACHED, d.reg.schema, d.reg.table, None)
            detaches.remove(d)
            self.log(
                f"{d.reg.qualified}: {len(d.records) // 2} row(s) of detached partition(s) "
                f"{[f'{s}.{t}' for s, t in d.leaves]} deleted"
            )

    def _refuse_lost_keys(self, conn: psycopg.Connection[Any], regs: list[TableReg]) -> set[tuple[str, str]]:
        """The registered tables whose changes can no longer be keyed: a key column no longer
        exists at the source (dropped, or renamed: logical decoding carries no DDL, and every event
        of the table would lack its key), or the table's replica identity no longer holds the key
        (``REPLICA IDENTITY NOTHING``, a primary key dropped, an identity index without a key
        column: wal2json then drops its UPDATEs and DELETEs with only a server warning). Each is
        recorded (registry state ``schema_refused:[schema, table]``: reason and fix, shown by
        ``cdc tables list`` and ``cdc status``) and logged; a table that is keyable again is
        cleared, and one refused for its replica identity is snapshotted again (in chunks, while
        streaming), since the changes made meanwhile never reached the stream."""

        if not regs:
            return set()
        refused: set[tuple[str, str]] = set()
        digests = capture_digests(conn, [(r.schema, r.table) for r in regs])
        for reg in regs:
            # the one rule (cdc.catalog.capture_problems), asked again when the catalog facts it
            # judges changed; the reader refuses for a key it cannot carry: a key column gone (kind
            # ``key``), a replica identity without it (``identity``)
            digest = (digests.get((reg.schema, reg.table)), reg.key)
            known = self._capture_checked.get((reg.schema, reg.table))
            if known is not None and known[0] == digest:
                problems = known[1]
            else:
                try:
                    desc: TableDescription | None = describe_table(conn, reg.schema, reg.table)
                except RegistryError:
                    desc = None  # gone: the source check records it missing
                problems = [
                    p
                    for p in capture_problems(reg.schema, reg.table, desc, reg.key, role="")
                    if p.kind in ("key", "identity")
                ]
                self._capture_checked[(reg.schema, reg.table)] = (digest, problems)
            if problems:
                self._record_refusal(reg, problems[0])
            else:
                before = self.registry.get_table_state(TableState.SCHEMA_REFUSED, reg.schema, reg.table)
                if before is not None:
                    self.registry.set_table_state(TableState.SCHEMA_REFUSED, reg.schema, reg.table, None)
                    if orjson.loads(before).get("kind") == "identity":
                        self.log(
                            f"{reg.qualified}: its replica identity holds the key again; snapshotting "
                            "it again (chunked) for the changes the stream lost meanwhile"
                        )
                        self.registry.set_table_state(
                            TableState.SNAPSHOT_REQUEST, reg.schema, reg.table, None
                        )
                        self.registry.set_snapshot_state(reg.schema, reg.table, "pending")
                continue
            refused.add((reg.schema, reg.table))
        return refused

    def _refuse(self, reg: TableReg, lost: list[str]) -> None:
        """Record (once) that ``reg`` is refused: its key column(s) ``lost`` are gone at the source."""
        self._record_refusal(reg, key_columns_gone(reg.schema, reg.table, lost))

    def _record_refusal(self, reg: TableReg, problem: CaptureProblem) -> None:
        """Record (once) and log that ``reg`` is refused for ``problem`` (:func:`capture_problems`)."""
        if self.registry.get_table_state(TableState.SCHEMA_REFUSED, reg.schema, reg.table) is not None:
            return
        kind = problem.kind
        reason = f"{problem.message}, so {reg.qualified} is no longer captured"
        fix = problem.fix + ("; cdc then snapshots it again by itself" if kind == "identity" else "")
        self.log(f"REFUSED {reg.qualified}: {reason} -- fix: {fix}")
        self.registry.set_table_state(
            TableState.SCHEMA_REFUSED,
            reg.schema,
            reg.table,
            orjson.dumps({"reason": reason, "fix": fix, "kind": kind}).decode(),
        )

    def _ddl_follower(
        self,
        conn: psycopg.Connection[Any],
        builder: EventBuilder,
        schema: SchemaFollower,
        regs: list[TableReg],
        watcher: SourceWatcher,
    ) -> DdlFollower:
        """The DDL recorder's side of this session (:mod:`cdc.reader.ddl`): a registered table
        dropped or renamed is recorded missing at once (with what happened), one whose key column
        went is refused at once; column changes go to ``schema``."""

        oids = table_oids(conn, table_names(regs))

        def on_gone(reg: TableReg, what: str, to: str | None, tag: str) -> None:
            self.log(
                f"{reg.qualified} {what}{f' to {to}' if to else ''} at the source ({tag}, told by the "
                "DDL recorder); no longer captured, the others go on"
            )
            body = {"what": what, "to": to, "tag": tag}
            self.registry.set_table_state(
                TableState.SOURCE_MISSING_DDL, reg.schema, reg.table, orjson.dumps(body).decode()
            )
            if self.registry.get_table_state(TableState.SOURCE_MISSING, reg.schema, reg.table) is None:
                self.registry.set_table_state(
                    TableState.SOURCE_MISSING, reg.schema, reg.table, str(int(time.time()))
                )
            watcher.gone(reg)  # the source check need not tell it again

        return DdlFollower(builder, schema, oids, on_gone=on_gone, on_key_lost=self._refuse)

    # -- chunked snapshots (snapshot.chunked) -----------------------------------------------------
    def _prepare_chunks(self, regs: list[TableReg]) -> list[TableReg]:
        """The tables whose snapshot this session does in chunks: a table ``pending`` (registered,
        or a re-snapshot requested) starts a new run; one ``running`` resumes its run after its last
        done chunk. Their stream changes are never dropped (``drop_before`` 0)."""

        opts = self._snapshot_options()
        out = []
        for reg in regs:
            if reg.snapshot_state == "done":
                continue
            progress = load_progress(self.registry, reg.schema, reg.table)
            if reg.snapshot_state == "pending" or progress is None or progress.done:
                raw = self.registry.get_table_state(TableState.SNAPSHOT_REQUEST, reg.schema, reg.table)
                request = orjson.loads(raw) if raw else {}
                where, parts = request.get("where"), request.get("partitions")
                progress = ChunkProgress(
                    run=uuid.uuid4().hex,
                    full=where is None and parts is None,
                    where=where,
                    partitions=parts,
                    chunk_size=opts.chunk_size,
                )
                save_progress(self.registry, reg.schema, reg.table, progress)
                self.registry.set_table_state(TableState.SNAPSHOT_REQUEST, reg.schema, reg.table, None)
                self.registry.set_state(drop_before_key(reg.schema, reg.table), "0")
                self.registry.set_snapshot_state(reg.schema, reg.table, "running")
            out.append(reg)
        return out

    def _snapshot_options(self) -> Any:

        return SnapshotOptions.from_settings(self.settings)

    def _chunk_driver(self, conn: psycopg.Connection[Any], regs: list[TableReg], db: str) -> Any:

        opts = self._snapshot_options()
        wm = opts.watermark
        if ensure_watermark_table(conn, *wm):
            self.log(f"created the watermark table {wm[0]}.{wm[1]}")
        tracker = ChunkTracker(self.settings.slot_name, wm, {r.topic for r in regs})

        def codec_for(reg: TableReg) -> TableCodec:
            return TableCodec(
                reg, prefix=self.settings.topic_prefix, db=db, partitions=self.settings.partitions
            )

        def on_done(reg: TableReg, cols: tuple[Column, ...], rows: int, alignment: Any) -> None:
            progress = load_progress(self.registry, reg.schema, reg.table)
            if progress is not None and progress.full:  # every row read again: every value known
                self.registry.set_table_state(TableState.VALUES_UNKNOWN, reg.schema, reg.table, None)
            self.registry.set_columns(reg.schema, reg.table, cols)
            self.registry.set_snapshot_state(reg.schema, reg.table, "done", alignment)
            self.snapshots[reg.qualified] = rows
            note_reread(self.registry, reg.qualified, rows)

        return ChunkDriver(
            dsn=self.dsn,
            slot=self.settings.slot_name,
            registry=self.registry,
            store=self.store,
            store_lock=self.store_lock,
            tracker=tracker,
            options=opts,
            regs=regs,
            codec_for=codec_for,
            session_options=SESSION_OPTIONS,
            on_done=on_done,
            log=self.log,
        )

    def _supersede_earlier_rows(self, regs: list[TableReg], db: str, consistent_lsn: int) -> None:
        """Before an initial snapshot at ``consistent_lsn`` into topics that already hold events (an
        earlier snapshot that was killed, or a slot that was lost): a TRUNCATE marker at version
        ``(consistent_lsn - 1, 0)``, so sinks drop every older row -- keys deleted at the source
        since, whose delete the new slot cannot see -- and keep the new snapshot's rows."""

        for reg in regs:
            with self.store_lock:
                if not any(self.store.end_offsets(reg.topic).values()):
                    continue
                codec = TableCodec(
                    reg, prefix=self.settings.topic_prefix, db=db, partitions=self.settings.partitions
                )
                self.store.append_many({reg.topic: truncate_marker(codec, consistent_lsn - 1)})
            self.log(f"{reg.qualified}: rows of an earlier snapshot superseded (TRUNCATE marker)")

    def _snapshot(self, regs: list[TableReg], db: str, slot: str, *, temporary: bool) -> int:
        """Snapshot ``regs`` from a new slot's exported snapshot; record each table's alignment.
        Returns the consistent point."""

        streamed_raw = self.registry.get_state(State.STREAMED_TABLES)
        streamed = {tuple(x) for x in orjson.loads(streamed_raw)} if streamed_raw and temporary else set()
        if not temporary:
            self.registry.set_state(State.INITIAL_SNAPSHOT, "running")
        for reg in regs:
            self.registry.set_snapshot_state(reg.schema, reg.table, "running")
        repl = open_replication(self.dsn)
        try:
            snap = create_exported_slot(repl.cursor(), slot, temporary=temporary, plugin=self._plugin)
            self.log(
                f"{'initial' if not temporary else 'table'} snapshot of {len(regs)} table(s) at "
                f"{int_to_lsn(snap.consistent_lsn)}"
            )
            self._supersede_earlier_rows(regs, db, snap.consistent_lsn)
            progress = self.progress_factory() if self.progress_factory else NullProgress()
            from snapshot.exported import read_tables  # deferred: pyarrow, only for a snapshot

            try:
                results = (
                    read_tables(
                        self.dsn,
                        snap,
                        regs,
                        self.store,
                        images=self.images,
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
            except SnapshotError as exc:
                # the tables that completed are kept; the others are snapshotted in chunks while
                # streaming from this slot (the initial snapshot counts as done: the slot stays)
                self._record_snapshots(exc.done, streamed, snap.consistent_lsn)
                finished = {(r.reg.schema, r.reg.table) for r in exc.done}
                for reg in regs:
                    if (reg.schema, reg.table) not in finished:
                        self.registry.set_snapshot_state(reg.schema, reg.table, "pending")
                if not temporary:
                    self.registry.set_state(State.INITIAL_SNAPSHOT, "done")
                cause = exc.__cause__
                raise (cause if isinstance(cause, Exception) and is_transient(cause) else exc) from None
            finally:
                progress.close()
        finally:
            repl.close()  # a temporary slot is dropped with its connection
        self._record_snapshots(results, streamed, snap.consistent_lsn)
        return snap.consistent_lsn

    def _record_snapshots(self, results: list[Any], streamed: set[Any], consistent_lsn: int) -> None:
        """Record each completed table snapshot (a :class:`snapshot.TableSnapshot`) as done."""
        for res in results:
            # A table the stream already carried up to the restart position keeps its changes
            # between that position and the snapshot (dropping them would lose its deletes); a
            # table new to the stream drops them: the snapshot holds them.
            drop_before = 0 if (res.reg.schema, res.reg.table) in streamed else consistent_lsn
            self.registry.set_state(drop_before_key(res.reg.schema, res.reg.table), str(drop_before))
            self.registry.set_columns(res.reg.schema, res.reg.table, res.columns)
            self.registry.set_table_state(TableState.VALUES_UNKNOWN, res.reg.schema, res.reg.table, None)
            self.registry.set_snapshot_state(res.reg.schema, res.reg.table, "done", res.alignment)
            self.snapshots[res.reg.qualified] = res.rows
            self.events += res.rows
            self.log(f"snapshot of {res.reg.qualified}: {res.rows} rows")
