"""The apply job: log-store topics -> Structured Streaming -> sinks (warehouse + search index).

Runnable as ``cdc apply [--once]`` or ``spark-submit cdc/cli/spark_submit.py [--once] ...`` (same
flags). This module is the Spark glue: it reads a micro-batch, hands each table's records to
:func:`sinks.parse.parse`, removes what a sink rejects (:meth:`sinks.Sink.reject`), writes the dead
letters, calls every sink and commits the positions. How a micro-batch is applied, what stopping and
restarting guarantee, the dead letters and the job's identity: ``docs/apply.md``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from cdc import paths
from cdc.config import Settings
from cdc.errors import ApplyError, UnknownTopicError
from cdc.events import dead_letter_topic
from cdc.faults import Faults
from cdc.logstore import APPLY_CONSUMER, LogStore
from cdc.logstore.factory import open_log_store
from cdc.metrics import Publisher
from cdc.registry import Registry, TableReg
from sinks import ChangeBatch, DeadLetter, Sink, dead_letters
from sinks.parse import Parsed, parse
from spark_jobs.checkpoint import batch_end_offsets, checkpoint_dir

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from cdc.signals import StopSignals


#: the message of the error a micro-batch raises when it starts after a stop was requested (it has
#: done nothing; Spark replays it on the next run)
STOP_REQUESTED = "cdc apply: stop requested before this micro-batch started"


def ledger_path(state_dir: Path) -> Path:
    """The job's correctness ledger (:func:`cdc.paths.apply_ledger`)."""
    return paths.apply_ledger(state_dir)


def read_ledger(state_dir: Path) -> dict[str, Any]:
    """The ledger's content, ``{}`` when there is none. A state directory written before the ledger
    got its name holds it as ``apply-metrics.json`` (:func:`cdc.paths.legacy_apply_ledger`): that
    file is read when the ledger is absent; the next write creates the ledger and removes it."""
    for path in (ledger_path(state_dir), paths.legacy_apply_ledger(state_dir)):
        try:
            return dict(orjson.loads(path.read_bytes()))
        except FileNotFoundError:
            continue
        except orjson.JSONDecodeError:
            return {}
    return {}


def app_id_for(state_dir: Path) -> str:
    """The job's app id, created with the checkpoint (a new checkpoint gets a new id)."""
    ckpt = checkpoint_dir(state_dir)
    id_file = ckpt.parent / "apply.id"
    if id_file.exists() and ckpt.exists():
        text = id_file.read_text().strip()
        if text:
            return text
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    app_id = f"cdc-apply-{uuid.uuid4()}"
    tmp = id_file.with_suffix(".tmp")
    tmp.write_text(app_id + "\n")
    os.replace(tmp, id_file)
    ckpt.mkdir(parents=True, exist_ok=True)
    return app_id


def write_ledger(state_dir: Path, current: dict[str, Any]) -> None:
    """Replace the ledger atomically (stamped ``updated_ms``); the old-named file, read once by
    :func:`read_ledger`, is removed after the new one is in place."""
    path = ledger_path(state_dir)
    current["updated_ms"] = int(time.time() * 1000)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(current))
    os.replace(tmp, path)
    paths.legacy_apply_ledger(state_dir).unlink(missing_ok=True)


@dataclass(frozen=True)
class ApplyOptions:
    """How to run the job. ``faults``: the enabled fault-injection points (:mod:`cdc.faults`; the
    job offers ``apply.after_sink``), parsed by the entry point."""

    once: bool = False
    trigger_interval_s: float = 1.0
    max_records_per_batch: int = 0
    registry_poll_s: float = 2.0
    faults: Faults = field(default_factory=Faults)
    query_name: str = "cdc-apply"
    #: the watchdog: a micro-batch (trigger) that shows no sign of progress for this long fails the run
    #: with :class:`StalledError` after dumping every thread (0: no watchdog); see ``docs/apply.md``
    stall_timeout_s: float = 300.0
    #: if even the job's main loop stops checking in (blocked in py4j), a backstop thread dumps the
    #: threads and ends the process with ``os._exit(1)`` -- for the CLI process only, never in-process
    hard_exit_on_stall: bool = False


@dataclass
class BatchReport:
    """What one micro-batch did (passed to the progress callback)."""

    batch_id: int
    records: int
    events: int
    dead_letters: int
    tables: int
    seconds: float
    applied_at_ms: int
    columnar: int = 0  # tables of the batch parsed in columns (the others record by record)
    event_ts_ms: list[int] = field(default_factory=list)  # filled when ApplyJob.keep_event_ts
    read_parse_seconds: float = 0.0  # collecting the records and parsing them
    sink_seconds: dict[str, float] = field(default_factory=dict)  # per sink name

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ApplySummary:
    """What a run of the job did (``cdc apply --json``)."""

    app_id: str
    batches: int = 0
    records: int = 0
    events: int = 0
    dead_letters: int = 0
    columnar: int = 0  # table batches parsed in columns (sinks.columnar); the rest record by record
    seconds: float = 0.0
    tables: list[str] = field(default_factory=list)
    last_batch_id: int | None = None
    dead_letters_total: int = 0  # over the checkpoint's life, from the ledger

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class StalledError(ApplyError):
    """The watchdog's verdict: a micro-batch made no progress for ``stall_timeout_s``. The job cannot
    be stopped cleanly any more (a thread is stuck in Spark, py4j or a sink); the process must exit."""


class ApplyJob:
    """One apply job: a streaming query over the registered tables' topics feeding the sinks.

    ``sinks``: defaults to :func:`open_sinks` (closed by :meth:`close`).
    ``registry``: defaults to ``Registry(settings.state_dir)``; ``tables`` overrides it with a fixed
    list (tests, benchmarks).
    """

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        options: ApplyOptions | None = None,
        *,
        sinks: Sequence[Sink] | None = None,
        tables: Sequence[TableReg] | None = None,
        on_batch: Callable[[BatchReport], None] | None = None,
        keep_event_ts: bool = False,
    ) -> None:
        from spark_jobs.source import register

        self.spark = spark
        self.settings = settings
        self.options = options or ApplyOptions()
        self.state_dir = Path(settings.state_dir)
        self.ckpt = checkpoint_dir(self.state_dir)
        self.app_id = app_id_for(self.state_dir)
        self._own_sinks = sinks is None
        if sinks is None:
            sinks = open_sinks(settings)
        self.sinks: list[Sink] = list(sinks)
        self._fixed_tables = list(tables) if tables is not None else None
        self._registry: Registry | None = None
        self.on_batch = on_batch
        self.keep_event_ts = keep_event_ts
        self._store: LogStore | None = None
        self._by_topic: dict[str, TableReg] = {}
        self.summary = ApplySummary(app_id=self.app_id)
        self.metrics = Publisher(self.state_dir, "apply")  # on-call counters (cdc.metrics)
        self._stop = threading.Event()
        # a stop waits for the micro-batch in progress (a query stopped mid-batch is interrupted
        # inside the sinks, and Spark may die on the way, e.g. a StackOverflowError formatting it)
        self._batch_cond = threading.Condition()
        self._in_batch = False
        self._halt = threading.Event()  # set while the query is being stopped: no batch may start
        self._last_batch: int | None = None  # the last batch id whose foreachBatch body finished
        # the watchdog (:meth:`_check_stall`): the last sign of life and what it was
        self._alive_at = time.monotonic()
        self._alive_mark: Any = None
        self._stalled = False
        self._jvm_pid: int | None = None
        self._loop_at = time.monotonic()  # the main loop's last check-in (for the backstop)
        self.query: StreamingQuery | None = None
        # py4j runs foreachBatch on varying callback threads; sinks hold thread-bound handles
        # (SQLite, index writers), so each sink is only ever called from its own thread
        self._threads = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cdc-sink-{i}")
            for i in range(len(self.sinks))
        ]
        register(spark)

    # -- tables --------------------------------------------------------------------------------------
    def registry(self) -> Registry:
        if self._registry is None:
            self._registry = Registry(self.state_dir)
        return self._registry

    def current_tables(self) -> tuple[int, list[TableReg]]:
        """(registry generation, tables) -- generation -1 for a fixed table list."""
        if self._fixed_tables is not None:
            return -1, list(self._fixed_tables)
        reg = self.registry()
        gen = reg.generation()
        return gen, reg.list_tables()

    def store(self) -> LogStore:
        if self._store is None:
            self._store = open_log_store(self.settings, writer=True)
        return self._store

    # -- one micro-batch -----------------------------------------------------------------------------
    def process_batch(self, df: DataFrame, batch_id: int) -> None:
        """``foreachBatch`` body; see the module docstring for the guarantees."""
        with self._batch_cond:
            if self._halt.is_set():  # nothing done: the batch fails and is replayed by the next query
                raise ApplyError(STOP_REQUESTED, fix="run `cdc apply` again", batch_id=batch_id)
            self._in_batch = True
            self._alive_at = time.monotonic()
        # a batch allocates millions of acyclic objects (records, events, rows): the cyclic collector's
        # generational passes over them cost about a third of the parse; it runs again between batches
        gc_was_on = gc.isenabled()
        gc.disable()
        done = None
        try:
            self._process_batch(df, batch_id)
            done = batch_id
        finally:
            if gc_was_on:
                gc.enable()
            with self._batch_cond:
                self._in_batch = False
                self._alive_at = time.monotonic()
                if done is not None:
                    self._last_batch = done
                self._batch_cond.notify_all()

    def _process_batch(self, df: DataFrame, batch_id: int) -> None:
        import pyarrow.compute as pc

        started = time.monotonic()
        arrow = df.toArrow()
        n = arrow.num_rows
        batches: list[ChangeBatch] = []
        dead: list[DeadLetter] = []
        topics = sorted(arrow.column("topic").unique().to_pylist()) if n else []
        for topic in topics:
            part = arrow.filter(pc.equal(arrow.column("topic"), topic))
            parsed = parse(self._table_for(topic), part)
            dead.extend(parsed.dead)
            if parsed.batch is not None:
                batch, rejected = self._reject(parsed)
                dead.extend(rejected)
                batches.append(batch)
        if dead:
            self._write_dead_letters(dead, batch_id)
        collected = time.monotonic()
        sink_s = self._apply_sinks(batches, batch_id)
        self._commit_positions(batch_id)
        events = sum(len(b) for b in batches)
        newest = max((t for b in batches if (t := b.newest_ts_ms()) is not None), default=None)
        self._update_metrics(batch_id, n, events, newest)
        self._publish_batch(batches, batch_id, n, events, len(dead), time.monotonic() - started)
        report = BatchReport(
            batch_id=batch_id,
            records=n,
            events=events,
            dead_letters=len(dead),
            tables=len(batches),
            columnar=sum(b.columns is not None for b in batches),
            seconds=time.monotonic() - started,
            applied_at_ms=int(time.time() * 1000),
            read_parse_seconds=collected - started,
            sink_seconds=sink_s,
        )
        if self.keep_event_ts:
            report.event_ts_ms = [t for b in batches for t in b.ts_ms()]
        s = self.summary
        s.batches += 1
        s.records += n
        s.events += events
        s.dead_letters += len(dead)
        s.columnar += report.columnar
        s.last_batch_id = batch_id
        if self.on_batch is not None:
            self.on_batch(report)

    def _reject(self, parsed: Parsed) -> tuple[ChangeBatch, list[DeadLetter]]:
        """The batch without the events a sink cannot hold (:meth:`sinks.Sink.reject`), and their dead
        letters: a poison record never stops the others."""
        batch = parsed.batch
        assert batch is not None
        reasons: dict[tuple[int, int], list[str]] = {}
        rest = batch
        while True:  # until no sink rejects more: an event may need one rejected before it (TOAST)
            new = False
            for sink in self.sinks:
                for r in sink.reject(rest):
                    new = new or (r.partition, r.offset) not in reasons
                    reasons.setdefault((r.partition, r.offset), []).append(f"{sink.name}: {r.reason}")
            if not new:
                break
            rest = batch.without(set(reasons))
        if not reasons:
            return batch, []
        positions = set(reasons)
        raw = parsed.raw(positions)
        events = {(e.partition, e.offset): e for e in batch.events if (e.partition, e.offset) in positions}
        dead = []
        for pos in sorted(positions):
            rec, ev = raw[pos], events[pos]
            dead.append(
                DeadLetter(
                    rec.topic,
                    rec.partition,
                    rec.offset,
                    rec.key,
                    rec.value,
                    "; ".join(reasons[pos]),
                    table=batch.table.qualified,
                    key_json=ev.key_json,
                    version=ev.version,
                )
            )
        return batch.without(positions), dead

    def _apply_sinks(self, batches: Sequence[ChangeBatch], batch_id: int) -> dict[str, float]:
        """Every sink applies every table's batch; the sinks run concurrently (each on its own
        thread), the tables of one sink in order. Returns seconds per sink; re-raises the first
        failure after every sink finished (so no sink is still writing when the batch fails)."""

        def one(sink: Sink) -> float:
            t0 = time.monotonic()
            for batch in batches:
                sink.apply(batch, batch_id, self.app_id)
            return time.monotonic() - t0

        futures = [self._threads[i].submit(one, sink) for i, sink in enumerate(self.sinks)]
        if futures and self.options.faults.on("apply.after_sink", batch_id):
            futures[0].result()
            self.options.faults.point("apply.after_sink", batch_id, self._crash)
        wait(futures)
        out: dict[str, float] = {}
        for sink, fut in zip(self.sinks, futures, strict=True):
            out[getattr(sink, "name", type(sink).__name__)] = fut.result()  # raises the sink's error
        return out

    def _table_for(self, topic: str) -> TableReg | None:
        reg = self._by_topic.get(topic)
        if reg is None:
            _, tables = self.current_tables()
            self._by_topic = {t.topic: t for t in tables}
            reg = self._by_topic.get(topic)
        return reg

    def _write_dead_letters(self, dead: Sequence[DeadLetter], batch_id: int) -> None:
        """Append the batch's dead letters once per (app id, batch id): the ledger records the
        last batch whose dead letters were written and counted, so a replayed batch skips them (only
        a crash between the append and that record can write them twice)."""
        metrics = self._read_metrics()
        done = metrics.get("dead_letter_batch")
        if done is not None and int(done) >= batch_id:
            return
        topic = dead_letter_topic(self.settings.topic_prefix)
        store = self.store()
        store.create_topic(topic, dead_letters.TOPIC_CONFIG)
        records = [dead_letters.encode(d, batch_id, self.app_id) for d in dead]
        store.append(topic, records)
        metrics["dead_letter_batch"] = batch_id
        metrics["dead_letters"] = int(metrics.get("dead_letters", 0)) + len(dead)
        self._write_metrics(metrics)

    def _commit_positions(self, batch_id: int) -> None:
        ends = batch_end_offsets(self.ckpt, batch_id)
        if not ends:
            return
        store = self.store()
        for topic, offsets in ends.items():
            try:
                store.commit(APPLY_CONSUMER, topic, offsets)
            except UnknownTopicError:
                continue

    def _hold_positions(self, tables: Sequence[TableReg]) -> None:
        """Commit a position at its start offsets in every topic the job has none in yet, before the
        first micro-batch (which can take a while on a loaded host): the embedded log store never
        compacts away what a consumer has not read (an update without its unchanged TOAST columns needs
        the key's earlier row), and without a position the job is not a consumer yet. A later batch's
        commit moves it on."""
        store = self.store()
        for reg in tables:
            try:
                store.hold(APPLY_CONSUMER, reg.topic)
            except UnknownTopicError:
                continue

    def _read_metrics(self) -> dict[str, Any]:
        """This checkpoint's ledger (``<state>/spark/apply-ledger.json``, :func:`read_ledger`): the
        last batch whose dead letters were written, and the counters; reset for a new app id."""
        current = read_ledger(self.state_dir)
        if current.get("app_id") != self.app_id:
            current = {"app_id": self.app_id, "batches": 0, "records": 0, "events": 0, "dead_letters": 0}
        return current

    def _write_metrics(self, current: dict[str, Any]) -> None:
        write_ledger(self.state_dir, current)
        self.summary.dead_letters_total = int(current.get("dead_letters", 0))

    def _update_metrics(self, batch_id: int, records: int, events: int, newest_ts_ms: int | None) -> None:
        """Count a finished batch once (a replayed batch id is not counted again); dead letters are
        counted when written (:meth:`_write_dead_letters`). ``newest_event_ts_ms`` is the newest source
        commit time applied (for time lag)."""
        current = self._read_metrics()
        last = current.get("last_batch_id")
        if last is None or batch_id > int(last):
            current["batches"] += 1
            current["records"] += records
            current["events"] += events
            current["last_batch_id"] = batch_id
        if newest_ts_ms is not None:
            current["newest_event_ts_ms"] = max(int(current.get("newest_event_ts_ms") or 0), newest_ts_ms)
        current["applied_ms"] = int(time.time() * 1000)
        self._write_metrics(current)

    def _publish_batch(
        self, batches: Sequence[ChangeBatch], batch_id: int, records: int, events: int, dead: int, s: float
    ) -> None:
        """Counters for on-call (``<state>/metrics/apply.json``, per process life)."""
        m = self.metrics
        m.add("records_read", records)
        m.add("events_applied", events)
        m.add("dead_letters", dead)
        m.batch(s)
        m.set("last_batch_id", batch_id)
        for b in batches:
            m.newest(b.table.qualified, b.newest_ts_ms())

    def _crash(self) -> None:
        """Fault ``apply.after_sink`` (:mod:`cdc.faults`): SIGKILL the JVM and this process, mid-batch."""
        sys.stderr.write("cdc-fault: apply.after_sink: killing the JVM and the driver now\n")
        sys.stderr.flush()
        try:
            jvm_pid = int(self.spark.sparkContext._jvm.ProcessHandle.current().pid())  # type: ignore[union-attr]
            os.kill(jvm_pid, signal.SIGKILL)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)

    # -- the query -----------------------------------------------------------------------------------
    def start_query(self, tables: Sequence[TableReg]) -> StreamingQuery:
        self._by_topic = {t.topic: t for t in tables}
        self._hold_positions(tables)
        reader = (
            self.spark.readStream.format("cdclog")
            .option("state", str(self.state_dir))
            .option("log", self.settings.log_url or "")
            .option("topics", ",".join(sorted(self._by_topic)))
        )
        if self.options.max_records_per_batch > 0:
            reader = reader.option("maxRecordsPerBatch", str(self.options.max_records_per_batch))
        writer = (
            reader.load()
            .writeStream.foreachBatch(self.process_batch)
            .option("checkpointLocation", str(self.ckpt))
            .queryName(self.options.query_name)
        )
        if self.options.once:
            writer = writer.trigger(availableNow=True)
        else:
            writer = writer.trigger(
                processingTime=f"{int(self.options.trigger_interval_s * 1000)} milliseconds"
            )
        self.query = writer.start()
        if self._jvm_pid is None:  # for the watchdog's thread dump (SIGQUIT)
            try:
                self._jvm_pid = int(self.spark.sparkContext._jvm.ProcessHandle.current().pid())  # type: ignore[union-attr]
            except Exception:  # a remote/Connect session: no JVM of ours to dump
                self._jvm_pid = None
        return self.query

    def stop(self) -> None:
        """Ask :meth:`run` to finish (from another thread or a signal handler): the micro-batch in
        progress completes -- sinks and checkpoint -- and no new one starts; :meth:`run` then stops the
        query (within ``registry_poll_s``) and returns normally."""
        self._stop.set()

    def _stop_between_batches(self, query: StreamingQuery) -> None:
        """Stop ``query`` once no micro-batch is in progress (for :meth:`stop` and for a restart on a
        registry change). A batch that would start meanwhile fails at once, having done nothing
        (:data:`STOP_REQUESTED`), and is replayed by the next query on the same checkpoint. Bounded: a
        batch still running after ``stall_timeout_s`` is a stall (:class:`StalledError`), and a query
        that does not stop is an error, never a hang."""
        self._halt.set()
        timeout = self.options.stall_timeout_s if self.options.stall_timeout_s > 0 else None
        try:
            with self._batch_cond:
                if not self._batch_cond.wait_for(lambda: not self._in_batch, timeout):
                    self._stall(
                        query, f"the micro-batch in progress did not finish within {timeout:.0f} s of a stop"
                    )
                last = self._last_batch
            if last is not None:  # Spark writes the batch's commit log entry right after the body returns
                commit = self.ckpt / "commits" / str(last)
                deadline = time.monotonic() + 60
                while not commit.exists() and query.isActive and time.monotonic() < deadline:
                    self._loop_at = time.monotonic()
                    time.sleep(0.05)
            try:
                query.stop()
            except (
                Exception
            ) as exc:  # py4j: the query's thread did not stop (spark.sql.streaming.stopTimeout)
                self._stalled = True
                raise ApplyError(
                    f"the streaming query did not stop: {_first_lines(str(exc))}",
                    fix="the process must exit and be restarted; the batch in progress is retried from the "
                    f"checkpoint ({self.ckpt}), nothing is skipped",
                    checkpoint=str(self.ckpt),
                ) from exc
        finally:
            self._halt.clear()

    # -- the watchdog --------------------------------------------------------------------------------
    def _check_stall(self, query: StreamingQuery) -> None:
        """Called by :meth:`_run` between waits: a sign of life is a micro-batch body starting or
        finishing, a new progress report of the query, or the query idle between triggers. A trigger
        with none of these for ``stall_timeout_s`` raises :class:`StalledError` (after a thread dump)."""
        self._loop_at = now = time.monotonic()
        timeout = self.options.stall_timeout_s
        if timeout <= 0:
            return
        with self._batch_cond:
            in_batch = self._in_batch
        status = query.status or {}
        progress = query.lastProgress
        mark = (progress.get("batchId"), progress.get("timestamp")) if progress else None
        if mark != self._alive_mark or (not in_batch and not status.get("isTriggerActive", True)):
            self._alive_mark = mark
            self._alive_at = now
            return
        if now - self._alive_at >= timeout:
            what = "a micro-batch's sinks" if in_batch else f"Spark ({status.get('message', '?')})"
            self._stall(query, f"no progress for {now - self._alive_at:.0f} s in {what}")

    def _stall(self, query: StreamingQuery | None, what: str) -> None:
        """Dump every thread (Python's here, the JVM's through SIGQUIT, which it prints to its stdout)
        and raise :class:`StalledError`; :meth:`close` then does not wait for the stuck threads."""
        self._stalled = True
        self._dump_threads(what)
        raise StalledError(
            f"the apply job is stuck: {what}",
            fix="restart `cdc apply` (a supervisor does): the batch is retried from the checkpoint "
            f"({self.ckpt}), nothing is skipped; the thread dump above shows where it hung; if batches "
            "legitimately take longer, raise --stall-timeout",
            checkpoint=str(self.ckpt),
            stall_timeout_s=self.options.stall_timeout_s,
        )

    def _dump_threads(self, what: str) -> None:
        sys.stderr.write(f"cdc apply: watchdog: {what}; thread dump follows\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self._jvm_pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self._jvm_pid, signal.SIGQUIT)  # the JVM prints its thread dump to its stdout
        sys.stderr.flush()

    def _backstop(self, done: threading.Event) -> None:
        """The last line of defence (``ApplyOptions.hard_exit_on_stall``, set by ``cdc apply``): if
        :meth:`_run`'s loop itself stops checking in (blocked in py4j), dump the threads and exit the
        process hard -- a process that hangs is never restarted by its supervisor."""
        limit = 2 * self.options.stall_timeout_s + 180  # stop() may wait for a batch, the commit, the query
        while not done.wait(1.0):
            idle = time.monotonic() - self._loop_at
            if idle > limit:
                self._dump_threads(f"the job's main loop made no progress for {idle:.0f} s")
                sys.stderr.write(
                    "error: the apply job is stuck and exits now (exit code 1)\n  fix: restart `cdc apply`; "
                    f"the batch is retried from the checkpoint ({self.ckpt}), nothing is skipped\n"
                )
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(1)

    def run(self) -> ApplySummary:
        """Run until caught up (``once``) or until :meth:`stop`; raise ApplyError if a batch fails, and
        :class:`StalledError` if one makes no progress for ``stall_timeout_s`` (the watchdog)."""
        from py4j.protocol import Py4JError, Py4JJavaError  # deferred with pyspark (heavy)

        self._loop_at = time.monotonic()
        done = threading.Event()
        if self.options.hard_exit_on_stall and self.options.stall_timeout_s > 0:
            threading.Thread(
                target=self._backstop, args=(done,), name="cdc-apply-backstop", daemon=True
            ).start()
        try:
            with self.metrics:  # publishes <state>/metrics/apply.json; records an error that ends the run
                try:
                    return self._run()
                except (ConnectionError, Py4JError) as exc:
                    # the JVM exited or was killed: the gateway's socket fails (Py4JNetworkError), or
                    # pyspark's conversion of the query's error finds no JVM to ask ("... does not exist
                    # in the JVM", seen when a full disk ended the JVM); a Java error is not this case
                    if isinstance(exc, Py4JJavaError):
                        raise
                    self._stalled = True  # nothing may wait on the JVM any more
                    raise ApplyError(
                        f"the Spark JVM of the apply job went away ({exc}); its log above says why",
                        fix="restart `cdc apply`: the batch is retried from the checkpoint "
                        f"({self.ckpt}), nothing is skipped; check the free space and memory of this host",
                        checkpoint=str(self.ckpt),
                    ) from exc
        finally:
            done.set()

    def _run(self) -> ApplySummary:
        from pyspark.errors import StreamingQueryException

        started = time.monotonic()
        failed = True
        try:
            while not self._stop.is_set():
                gen, tables = self.current_tables()
                self.summary.tables = [t.qualified for t in tables]
                if not tables:
                    if self.options.once:
                        break
                    self._stop.wait(self.options.registry_poll_s)
                    continue
                query = self.start_query(tables)
                restart = False
                while not self._stop.is_set():
                    wait_s = 1 if self.options.once else max(1, round(self.options.registry_poll_s))
                    try:
                        if query.awaitTermination(wait_s):
                            break
                    except StreamingQueryException:
                        break
                    self._check_stall(query)
                    if gen >= 0:
                        new_gen, new_tables = self.current_tables()
                        if new_gen != gen and {t.topic for t in new_tables} != {t.topic for t in tables}:
                            restart = True
                            self._stop_between_batches(query)
                            break
                        gen = new_gen
                if self._stop.is_set() and query.isActive:
                    self._stop_between_batches(query)
                self._raise_if_failed(query)
                if restart:
                    continue
                if self.options.once or self._stop.is_set():
                    break
            failed = False
        finally:
            self.summary.seconds = time.monotonic() - started
            q = self.query
            # interrupted (Ctrl-C): no batch may run after close(); a stalled query would not stop
            if q is not None and not self._stalled:
                try:
                    if q.isActive:
                        q.stop()
                except Exception:
                    if not failed:
                        raise
                    # the run already failed with its own error, which is the one to report (a JVM
                    # that died, a query that does not stop): this cleanup must not replace it
        return self.summary

    def _raise_if_failed(self, query: StreamingQuery) -> None:
        exc = query.exception()
        if exc is None:
            return
        text = str(exc)
        if STOP_REQUESTED in text:
            return  # a batch that started while the query was being stopped did nothing; it is replayed
        cause = "fix the cause"
        if "No space left on device" in text or "ENOSPC" in text:
            cause = f"free space on the filesystem of the state directory ({self.state_dir})"
        raise ApplyError(
            f"micro-batch failed, the apply job stopped: {_first_lines(text)}",
            fix=f"{cause} and run `cdc apply` again: the failed batch is retried from the checkpoint "
            f"({self.ckpt}), nothing was skipped",
            checkpoint=str(self.ckpt),
        )

    def close(self) -> None:
        """Close the sinks and the stores. After a stall nothing waits for the stuck threads (the
        process is about to exit)."""
        if self._stalled:
            for pool in self._threads:
                pool.shutdown(wait=False, cancel_futures=True)
            return
        timeout = self.options.stall_timeout_s if self.options.stall_timeout_s > 0 else None
        if self._own_sinks:
            for i, sink in enumerate(self.sinks):
                try:
                    self._threads[i].submit(sink.close).result(timeout)
                except FuturesTimeout as exc:
                    self._stalled = True
                    for pool in self._threads:
                        pool.shutdown(wait=False, cancel_futures=True)
                    raise StalledError(
                        f"closing the sink {getattr(sink, 'name', type(sink).__name__)} did not finish "
                        f"within {timeout:.0f} s",
                        fix="restart `cdc apply`: it resumes from the checkpoint, nothing is skipped",
                        checkpoint=str(self.ckpt),
                    ) from exc
        for pool in self._threads:
            pool.shutdown(wait=True)
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._registry is not None:
            self._registry.close()
            self._registry = None


def _first_lines(text: str, limit: int = 1500) -> str:
    """The useful part of a StreamingQueryException: the Python error, not the JVM stack."""
    head = text.split("=== Streaming Query ===")[0]
    lines = [ln.strip() for ln in head.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Warning)\b.*:", ln)]
    out = errors[-1] if errors else " | ".join(lines[:3])
    return out[:limit]


def open_sinks(settings: Settings) -> list[Sink]:
    """The job's sinks: every one of :data:`sinks.all.SINKS`, in its order (a sink acts only on the
    tables it keeps: the search index on those with search columns)."""
    from sinks.all import SINKS  # deferred: the sinks import deltalake and tantivy

    return [cls.from_settings(settings) for cls in SINKS]


def run_apply(
    settings: Settings,
    options: ApplyOptions,
    *,
    spark: SparkSession | None = None,
    on_batch: Callable[[BatchReport], None] | None = None,
    stop_signals: StopSignals | None = None,
) -> ApplySummary:
    """Build (or reuse) the session and run the job once; the entry point of ``cdc apply``.
    ``stop_signals``: a stop they request (SIGTERM, SIGINT) is the job's :meth:`ApplyJob.stop`."""
    if spark is None:
        from spark_jobs.session import get_session

        spark = get_session()
    job = ApplyJob(spark, settings, options, on_batch=on_batch)
    if stop_signals is not None:
        stop_signals.on_stop(job.stop)
    failed: BaseException | None = None
    try:
        return job.run()
    except BaseException as exc:
        failed = exc
        raise
    finally:
        try:
            job.close()
        except Exception as exc:
            if failed is None:
                raise
            # the run's error is the cause (e.g. ENOSPC); a sink failing to close after it (a tantivy
            # writer whose thread died on the same full disk) must not replace it: it is told, then
            # the run's error is raised
            sys.stderr.write(f"cdc apply: closing the sinks after the failure also failed: {exc!r}\n")
        if job._stalled and options.hard_exit_on_stall and job._jvm_pid is not None:
            # a stuck JVM may not exit on its own (its shutdown hooks wait for the stuck query):
            # give it a moment to print the thread dump it was asked for, then end it
            time.sleep(2)
            with contextlib.suppress(OSError):
                os.kill(job._jvm_pid, signal.SIGKILL)
