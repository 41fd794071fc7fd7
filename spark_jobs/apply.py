"""The apply job: log-store topics -> Structured Streaming -> sinks (warehouse + search index).

Runnable as ``cdc apply [--once]`` or ``spark-submit cdc/cli/spark_submit.py [--once] ...`` (same
flags). This module is the Spark glue, a thin driver of the others: each micro-batch's offset ranges
are cut into slices that Spark tasks apply (:mod:`spark_jobs.tasks`: each reads, parses and writes its
own slice with the Spark-free :class:`spark_jobs.applier.BatchApplier`) -- on a cluster and on
``local[N]`` alike; the driver then writes the dead letters, commits every task's writes, and commits
the positions and the ledger (:mod:`spark_jobs.ledger`). The query's life -- restarts,
stopping between batches, failures, a JVM gone -- is :mod:`spark_jobs.lifecycle`; the stall watchdog
and its backstop :mod:`spark_jobs.watchdog`. How a micro-batch is applied, what stopping and
restarting guarantee, the dead letters and the job's identity: ``docs/apply.md``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cdc.config import TRIGGER_INTERVAL_S, Settings
from cdc.events import dead_letter_topic
from cdc.faults import Faults
from cdc.logstore import LogStore
from cdc.logstore.factory import open_log_store
from cdc.metrics import Publisher
from cdc.registry import Registry, TableReg, ViewReg
from sinks import DeadLetter, Sink
from sinks.search import SearchSink
from sinks.warehouse.layout import WarehouseOptions
from sinks.warehouse.views import ViewMaintainer
from spark_jobs.applier import AFTER_SINK, BatchOutcome, open_sinks
from spark_jobs.checkpoint import batch_ranges, checkpoint_dir
from spark_jobs.ledger import (
    Ledger,
    app_id_for,
    commit_positions,
    hold_positions,
    ledger_path,
    read_ledger,
    write_ledger,
)
from spark_jobs.lifecycle import (
    STOP_REQUESTED,
    BatchGate,
    QueryLoop,
    jvm_gone_is_an_error,
    jvm_pid,
    task_progress,
)
from spark_jobs.tasks import SHARD_MIN_RECORDS, SHARD_MIN_ROWS, Planner
from spark_jobs.watchdog import StalledError, Watchdog

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from cdc.signals import StopSignals

__all__ = [
    "STOP_REQUESTED",
    "ApplyJob",
    "ApplyOptions",
    "ApplySummary",
    "BatchReport",
    "StalledError",
    "app_id_for",
    "ledger_path",
    "open_sinks",
    "read_ledger",
    "run_apply",
    "write_ledger",
]


@dataclass(frozen=True)
class ApplyOptions:
    """How to run the job. ``faults``: the enabled fault-injection points (:mod:`cdc.faults`; the
    job offers ``apply.after_sink``), parsed by the entry point."""

    once: bool = False
    trigger_interval_s: float = TRIGGER_INTERVAL_S
    max_records_per_batch: int = 0
    #: when the apply is behind (a large backlog), a micro-batch may take up to this many records:
    #: half the backlog, never less than ``max_records_per_batch`` (0, or not above it: no growth);
    #: ``docs/apply.md``, Batch size
    max_records_per_batch_behind: int = 0
    #: with ``max_records_per_batch``: a micro-batch's records are also bounded by their estimated
    #: bytes (key + value; 0: no byte bound); ``docs/apply.md``, Batch size
    max_bytes_per_batch: int = 0
    registry_poll_s: float = 2.0
    faults: Faults = field(default_factory=Faults)
    query_name: str = "cdc-apply"
    #: the watchdog: a micro-batch (trigger) that shows no sign of progress for this long fails the run
    #: with :class:`StalledError` after dumping every thread (0: no watchdog); see ``docs/apply.md``
    stall_timeout_s: float = 300.0
    #: if even the job's main loop stops checking in (blocked in py4j), a backstop thread dumps the
    #: threads and ends the process with ``os._exit(1)`` -- for the CLI process only, never in-process
    hard_exit_on_stall: bool = False
    #: the job holds the apply lock (``cdc apply``): before its first micro-batch each of its sinks
    #: removes what killed writes left of every registered table (:meth:`sinks.Sink.recover`)
    sole_writer: bool = False
    #: in tasks, a small table's batch is one slice, not one per shard: below this many records in
    #: the batch and :attr:`shard_min_rows` rows in its sinks (:data:`spark_jobs.tasks.SHARD_MIN_RECORDS`,
    #: :data:`~spark_jobs.tasks.SHARD_MIN_ROWS`; 0, 0: always per shard)
    shard_min_records: int = SHARD_MIN_RECORDS
    shard_min_rows: int = SHARD_MIN_ROWS


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
    event_ts_ms: list[int] = field(default_factory=list)  # filled when ApplyJob(keep_event_ts=True)
    read_parse_seconds: float = 0.0  # collecting the records and parsing them
    sink_seconds: dict[str, float] = field(default_factory=dict)  # per sink name
    #: in tasks: the driver's wall time per phase (``plan``: the offset ranges and slices; ``tasks``:
    #: the Spark job of the slices, of which ``task open``, ``slice <topic>`` and ``slowest slice``
    #: (:func:`spark_jobs.tasks.slice_phases`); ``commit <sink>`` and ``maintain <sink>``
    #: (:func:`spark_jobs.tasks.commit_slices`), ``views``, ``positions``; ``commit``: all after the
    #: tasks: dead letters, the tables' commits, maintenance, views, positions)
    phases: dict[str, float] = field(default_factory=dict)

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


class ApplyJob:
    """One apply job: a streaming query over the registered tables' topics feeding the sinks.

    ``make_sinks``: builds the job's sinks from its settings (default
    :func:`~spark_jobs.applier.open_sinks`); called once in the driver (which prepares the tables and
    commits the tasks' writes) and in every Spark task, to which it travels pickled (cloudpickle: a
    test's sink class must be importable there). The driver's are closed by :meth:`close`.
    ``registry``: defaults to ``Registry(settings.state_dir)``; ``tables`` overrides it with a fixed
    list (tests, benchmarks). ``watchdog.timeout_s`` starts as ``options.stall_timeout_s``.
    """

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        options: ApplyOptions | None = None,
        *,
        make_sinks: Callable[[Settings], Sequence[Sink]] = open_sinks,
        tables: Sequence[TableReg] | None = None,
        on_batch: Callable[[BatchReport], None] | None = None,
        keep_event_ts: bool = False,
    ) -> None:
        from spark_jobs.source import register

        self.spark = spark
        self.settings = settings
        self.options = options = options or ApplyOptions()
        self.state_dir = Path(settings.state_dir)
        self.ckpt = checkpoint_dir(self.state_dir)
        self.app_id = app_id_for(self.state_dir)
        self.make_sinks = make_sinks
        self.sinks: list[Sink] = list(make_sinks(settings))
        self._fixed_tables = list(tables) if tables is not None else None
        self._registry: Registry | None = None
        self.on_batch = on_batch
        self._store: LogStore | None = None
        self._by_topic: dict[str, TableReg] = {}
        self.summary = ApplySummary(app_id=self.app_id)
        self.metrics = Publisher(self.state_dir, "apply")  # on-call counters (cdc.metrics)
        self.ledger = Ledger(self.state_dir, self.app_id)
        self.keep_event_ts = keep_event_ts
        # the work in tasks: their slices (spark_jobs.tasks)
        # (a new table's tables created in the driver from a sample of its first batch: the store)
        self.planner = Planner(self.sinks, options.shard_min_records, options.shard_min_rows, self.store)
        # the views (cdc.views), recomputed after each batch's commits; none with a fixed table list
        self.views = (
            None
            if tables is not None
            else ViewMaintainer(
                self.state_dir,
                self._views,
                self.app_id,
                lambda name, why: self.registry().set_view_refused(name, why),
                SearchSink.from_settings(settings),
                WarehouseOptions.from_settings(settings),
            )
        )
        self.watchdog = Watchdog(options.stall_timeout_s, self.ckpt)
        # a stop waits for the micro-batch in progress (a query stopped mid-batch is interrupted
        # inside the sinks, and Spark may die on the way, e.g. a StackOverflowError formatting it)
        self.gate = BatchGate(self.watchdog.edge)
        self.loop = QueryLoop(
            once=options.once,
            registry_poll_s=options.registry_poll_s,
            ckpt=self.ckpt,
            state_dir=self.state_dir,
            tables=self.current_tables,
            start=self.start_query,
            gate=self.gate,
            watchdog=self.watchdog,
            summary=self.summary,
        )
        self.source_format = register(spark, settings)  # the [kafka] section reaches the reads

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

    def _views(self) -> tuple[list[ViewReg], list[TableReg]]:
        reg = self.registry()
        return reg.list_views(), reg.list_tables()

    def _table_for(self, topic: str) -> TableReg | None:
        reg = self._by_topic.get(topic)
        if reg is None:
            _, tables = self.current_tables()
            self._by_topic = {t.topic: t for t in tables}
            reg = self._by_topic.get(topic)
        return reg

    def store(self) -> LogStore:
        if self._store is None:
            self._store = open_log_store(self.settings, writer=True)
        return self._store

    # -- one micro-batch -----------------------------------------------------------------------------
    def process_batch(self, df: DataFrame, batch_id: int) -> None:
        """``foreachBatch`` body: the micro-batch's offset ranges (read from Spark's offset log,
        :func:`batch_ranges`; for a query's first batch, from the source's rows: no record reaches the
        driver) cut into slices, each applied by a Spark task (:func:`spark_jobs.tasks.run_slices`);
        then the dead letters, one commit per table and sink of every task's writes, the views, the
        positions and the ledger (``docs/apply.md`` says what each guarantees)."""
        with self.gate.batch(batch_id):
            self._process(df, batch_id)

    def _process(self, df: DataFrame, batch_id: int) -> None:
        from spark_jobs import tasks

        started = time.monotonic()
        ranges = batch_ranges(self.ckpt, batch_id)  # no Spark job, but for a query's first batch
        if ranges is None:
            ranges = [(r.topic, r.partition, r.start, r.end) for r in df.collect()]
        regs = {t: reg for t in {r[0] for r in ranges} if (reg := self._table_for(t)) is not None}
        slices = self.planner.plan(ranges, regs, lambda t: len(self.store().end_offsets(t)))
        planned = time.monotonic()
        results: list[tasks.SliceResult] = []
        views = self.views is not None and bool(self._views()[0])
        submitted = time.time()
        if slices:
            settings, app_id, keep_ts = tasks.task_settings(self.settings), self.app_id, self.keep_event_ts
            make_sinks = self.make_sinks
            by_topic = dict(regs)
            sc = self.spark.sparkContext
            groups = tasks.group_slices(slices, sc.defaultParallelism)  # one task per executor core
            results = (
                sc.parallelize(groups, len(groups))
                .mapPartitions(
                    lambda it: tasks.run_slices(
                        settings,
                        app_id,
                        batch_id,
                        by_topic,
                        (sl for group in it for sl in group),
                        keep_event_ts=keep_ts,
                        views=views,
                        make_sinks=make_sinks,
                    )
                )
                .collect()
            )
        ran, returned = time.monotonic(), time.time()
        outcome = tasks.outcome_of(batch_id, results)
        if outcome.dead:
            self._write_dead_letters(outcome.dead, batch_id)
        if results:
            self.options.faults.point(AFTER_SINK, batch_id, self._crash)
        phases = {
            "plan": planned - started,
            "tasks": ran - planned,
            **tasks.slice_phases(results, submitted, returned),
        }
        phases.update(tasks.commit_slices(self.sinks, regs.values(), results, self.app_id, batch_id))
        t0 = time.monotonic()
        if views:  # the tasks said which keys they changed: the views recompute those
            assert self.views is not None
            self.views.maintain_touched(tasks.touched_by(results), batch_id)
        phases["views"] = time.monotonic() - t0
        t0 = time.monotonic()
        commit_positions(self.store, self.ckpt, batch_id)
        phases["positions"] = time.monotonic() - t0
        phases["commit"] = time.monotonic() - ran
        self._record(outcome, started, outcome.prepare_seconds, phases)

    def _write_dead_letters(self, dead: Sequence[DeadLetter], batch_id: int) -> None:
        topic = dead_letter_topic(self.settings.topic_prefix)
        self.ledger.write_dead_letters(self.store(), topic, dead, batch_id)
        self.summary.dead_letters_total = self.ledger.dead_letters_total

    def _record(
        self,
        outcome: BatchOutcome,
        started: float,
        read_parse_s: float,
        phases: dict[str, float] | None = None,
    ) -> None:
        """The ledger's counters, the on-call metrics, the summary and the progress callback."""
        batch_id, n, events, dead = outcome.batch_id, outcome.records, outcome.events, len(outcome.dead)
        self.ledger.count_batch(batch_id, n, events, outcome.newest_ts_ms)
        self.summary.dead_letters_total = self.ledger.dead_letters_total
        m = self.metrics  # counters for on-call (<state>/metrics/apply.json, per process life)
        m.add("records_read", n)
        m.add("events_applied", events)
        m.add("dead_letters", dead)
        m.batch(time.monotonic() - started)
        m.set("last_batch_id", batch_id)
        for t in outcome.tables:
            m.newest(t.table, t.newest_ts_ms)
        report = BatchReport(
            batch_id=batch_id,
            records=n,
            events=events,
            dead_letters=dead,
            tables=len(outcome.tables),
            columnar=outcome.columnar,
            seconds=time.monotonic() - started,
            applied_at_ms=int(time.time() * 1000),
            event_ts_ms=outcome.event_ts_ms,
            read_parse_seconds=read_parse_s,
            sink_seconds=outcome.sink_seconds,
            phases=phases or {},
        )
        s = self.summary
        s.batches += 1
        s.records += n
        s.events += events
        s.dead_letters += dead
        s.columnar += report.columnar
        s.last_batch_id = batch_id
        if self.on_batch is not None:
            self.on_batch(report)

    def _crash(self) -> None:
        """Fault ``apply.after_sink`` (:mod:`cdc.faults`): SIGKILL the JVM and this process, mid-batch."""
        sys.stderr.write("cdc-fault: apply.after_sink: killing the JVM and the driver now\n")
        sys.stderr.flush()
        try:
            pid = jvm_pid(self.spark)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)

    # -- the query -----------------------------------------------------------------------------------
    def start_query(self, tables: Sequence[TableReg]) -> StreamingQuery:
        self._by_topic = {t.topic: t for t in tables}
        hold_positions(self.store(), tables)
        reader = (
            self.spark.readStream.format(self.source_format)
            .option("state", str(self.state_dir))
            .option("log", self.settings.log_url or "")
            .option("topics", ",".join(sorted(self._by_topic)))
        )
        if self.options.max_records_per_batch > 0:
            reader = reader.option("maxRecordsPerBatch", str(self.options.max_records_per_batch))
            reader = reader.option("maxRecordsPerBatchBehind", str(self.options.max_records_per_batch_behind))
            reader = reader.option("maxBytesPerBatch", str(self.options.max_bytes_per_batch))
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
        query = writer.start()
        if self.watchdog.jvm_pid is None:  # for the watchdog's thread dump (SIGQUIT)
            self.watchdog.jvm_pid = jvm_pid(self.spark)
        if self.watchdog.tasks is None:  # a task finishing is a batch's sign of life
            self.watchdog.tasks = task_progress(self.spark)
        return query

    def stop(self) -> None:
        """Ask :meth:`run` to finish (from another thread or a signal handler): the micro-batch in
        progress completes -- sinks and checkpoint -- and no new one starts; :meth:`run` then stops the
        query (within ``registry_poll_s``) and returns normally."""
        self.loop.stop()

    def run(self) -> ApplySummary:
        """Run until caught up (``once``) or until :meth:`stop`; raise ApplyError if a batch fails, and
        :class:`StalledError` if one makes no progress for ``stall_timeout_s`` (the watchdog)."""
        with (
            self.watchdog.backstop(self.options.hard_exit_on_stall),
            self.metrics,  # publishes <state>/metrics/apply.json; records an error that ends the run
            jvm_gone_is_an_error(self.ckpt, self.watchdog),
        ):
            started = time.monotonic()
            if self.options.sole_writer:
                self._recover()
            try:
                self.loop.run()
            finally:
                self.summary.seconds = time.monotonic() - started
        return self.summary

    def _recover(self) -> None:
        """Each sink recovers each registered table (:meth:`sinks.Sink.recover`), said on stderr when
        it freed anything."""
        freed = sum(sink.recover(reg) for reg in self.current_tables()[1] for sink in self.sinks)
        if freed:
            sys.stderr.write(f"cdc apply: removed {freed / 1e6:,.1f} MB that killed writes left\n")
            sys.stderr.flush()

    def close(self) -> None:
        """Close the driver's sinks and the stores. After a stall nothing is closed: the process is
        about to exit."""
        if self.watchdog.stalled:
            return
        for sink in self.sinks:
            sink.close()
        if self.views is not None:
            self.views.close()
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._registry is not None:
            self._registry.close()
            self._registry = None


def run_apply(
    settings: Settings,
    options: ApplyOptions,
    *,
    spark: SparkSession | None = None,
    on_batch: Callable[[BatchReport], None] | None = None,
    master: str | None = None,
    stop_signals: StopSignals | None = None,
) -> ApplySummary:
    """Build (or reuse) the session (on ``master``, see :func:`spark_jobs.session.get_session`) and
    run the job once; the entry point of ``cdc apply``. ``stop_signals``: a stop they request
    (SIGTERM, SIGINT) is the job's :meth:`ApplyJob.stop`."""
    if spark is None:
        from spark_jobs.session import get_session

        spark = get_session(master=master)
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
        if options.hard_exit_on_stall:
            job.watchdog.end_stuck_jvm()
