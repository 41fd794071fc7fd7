"""The apply job: log-store topics -> Structured Streaming -> sinks (warehouse + search index).

Runnable as ``cdc apply [--once]`` or ``spark-submit spark_jobs/apply.py [--once] ...`` (same flags).

How a micro-batch is applied (:meth:`ApplyJob.process_batch`, called by ``foreachBatch``)
-------------------------------------------------------------------------------------------
1. The batch's records (read by the ``cdclog`` source, :mod:`spark_jobs.source`) are collected to
   the driver as Arrow and grouped by topic -> registered table.
2. A table's records are parsed in columns first (:func:`sinks.columnar.parse_columns`, Arrow's JSON
   reader); a batch with anything unusual in it (a TRUNCATE, unchanged TOAST columns, a new column,
   a malformed record) is parsed record by record instead. There,
   :func:`sinks.parse_batch` turns a record it cannot parse into a dead letter, appended
   to the dead-letter topic (``<prefix>.__dead_letter``, not compacted) with the reason and the
   source position (headers and a JSON value holding the original bytes), and counted in
   ``<state>/spark/apply-metrics.json``. The good records of the batch are still applied.
3. Every sink applies every table's batch: ``sink.apply(batch, batch_id, app_id)``. A sink that
   raises fails the micro-batch, which fails the query (the job exits non-zero); nothing is
   skipped. On restart Spark replays that batch from its checkpoint with the same batch id and
   offsets; sinks are idempotent per ``(app_id, batch_id)`` and version-guarded per key.
4. After every sink succeeded, the batch's end offsets (read from Spark's offset log for that batch
   id) are committed in the log store under the consumer name ``apply``, so lag = end offsets -
   committed positions. This commit is advisory (for lag and ``cdc verify``); Spark's checkpoint is
   the truth for where the job resumes.

Stopping (:meth:`ApplyJob.stop`, SIGTERM in ``cdc apply``): the micro-batch in progress completes --
its sinks and Spark's commit of it -- before the query is stopped, and no new batch starts (one that
would start meanwhile fails at once, having done nothing, and is replayed by the next run). The same
holds when the job restarts its query because the registered tables changed.

Guarantees: exactly-once *effect* on the sinks (a crash anywhere -- before, between or after sink
writes, before the checkpoint -- is repaired by the replay). Dead letters: a replayed batch does not
append its dead letters again (the metrics file records the last batch whose dead letters were
written); only a crash between that append and that record can write them twice (at least once).
``<state>/spark/apply-metrics.json`` holds the counters of the current checkpoint (batches, records,
events, dead letters, last batch id, newest applied source commit time).

Identity: ``app_id = "cdc-apply-" + uuid`` stored in ``<state>/spark/checkpoint/apply.id``, created
together with the checkpoint (deleting the checkpoint directory gives a new app id, so sinks do not
mistake the new query's batch 0 for the old one's).

Tables registered while the job runs: the job polls :meth:`cdc.registry.Registry.generation` and
restarts its query (same checkpoint) when the set of topics changed; a new topic is read from its
start offset.
"""

from __future__ import annotations

import argparse
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from cdc.config import Settings
from cdc.errors import ApplyError, UnknownTopicError
from cdc.events import dead_letter_topic
from cdc.logstore import LogStore, Record, TopicConfig, open_log_store
from cdc.registry import Registry, TableReg

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming.query import StreamingQuery

    from sinks import ChangeBatch, DeadLetter, Sink

CONSUMER = "apply"
#: the message of the error a micro-batch raises when it starts after a stop was requested (it has
#: done nothing; Spark replays it on the next run)
STOP_REQUESTED = "cdc apply: stop requested before this micro-batch started"
DEAD_LETTER_CONFIG = TopicConfig(compacted=False, retention_ms=7 * 24 * 3600 * 1000)


def checkpoint_dir(state_dir: Path) -> Path:
    return state_dir / "spark" / "checkpoint" / "apply"


def metrics_path(state_dir: Path) -> Path:
    return state_dir / "spark" / "apply-metrics.json"


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


def batch_end_offsets(ckpt: Path, batch_id: int) -> dict[str, dict[int, int]]:
    """The end offsets of ``batch_id`` from Spark's offset log (written before the batch runs):
    ``{topic: {partition: next_offset}}``; empty if the log has no entry."""
    path = ckpt / "offsets" / str(batch_id)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    # "v1", the batch metadata, then one line per source ("-" when the source had no offset)
    out: dict[str, dict[int, int]] = {}
    for line in lines[2:3]:
        if not line.strip() or line.strip() == "-":
            continue
        for key, off in orjson.loads(line).items():
            topic, _, part = str(key).rpartition("|")
            out.setdefault(topic, {})[int(part)] = int(off)
    return out


@dataclass(frozen=True)
class ApplyOptions:
    """How to run the job.

    ``crash_after_sink_batch`` is a test hook (``CDC_TEST_CRASH_AFTER_SINK``): after the first
    sink applied batch N, SIGKILL the JVM and this process (a kill -9 between a sink write and the
    checkpoint).
    """

    once: bool = False
    trigger_interval_s: float = 1.0
    max_records_per_batch: int = 0
    registry_poll_s: float = 2.0
    crash_after_sink_batch: int | None = None
    query_name: str = "cdc-apply"


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
    dead_letters_total: int = 0  # over the checkpoint's life, from the metrics file

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ApplyJob:
    """One apply job: a streaming query over the registered tables' topics feeding the sinks.

    ``sinks``: defaults to :func:`sinks.open_sinks` (closed by :meth:`close`).
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
            from sinks import open_sinks

            sinks = open_sinks(settings)
        self.sinks: list[Sink] = list(sinks)
        self._fixed_tables = list(tables) if tables is not None else None
        self._registry: Registry | None = None
        self.on_batch = on_batch
        self.keep_event_ts = keep_event_ts
        self._store: LogStore | None = None
        self._by_topic: dict[str, TableReg] = {}
        self.summary = ApplySummary(app_id=self.app_id)
        self._stop = threading.Event()
        # a stop waits for the micro-batch in progress (a query stopped mid-batch is interrupted
        # inside the sinks, and Spark may die on the way, e.g. a StackOverflowError formatting it)
        self._batch_cond = threading.Condition()
        self._in_batch = False
        self._halt = threading.Event()  # set while the query is being stopped: no batch may start
        self._last_batch: int | None = None  # the last batch id whose foreachBatch body finished
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
                if done is not None:
                    self._last_batch = done
                self._batch_cond.notify_all()

    def _process_batch(self, df: DataFrame, batch_id: int) -> None:
        import pyarrow.compute as pc

        from sinks import ChangeBatch, RawRecord, parse_batch
        from sinks.columnar import parse_columns

        started = time.monotonic()
        arrow = df.toArrow()
        n = arrow.num_rows
        batches: list[ChangeBatch] = []
        dead: list[DeadLetter] = []
        topics = sorted(arrow.column("topic").unique().to_pylist()) if n else []
        for topic in topics:
            part = arrow.filter(pc.equal(arrow.column("topic"), topic)).sort_by(
                [("partition", "ascending"), ("offset", "ascending")]
            )
            reg = self._table_for(topic)
            if reg is not None:
                columns = parse_columns(
                    reg,
                    part.column("key"),
                    part.column("value"),
                    part.column("partition"),
                    part.column("offset"),
                )
                if columns is not None:
                    batches.append(ChangeBatch(reg, columns=columns))
                    continue
            records = [
                RawRecord(*row)
                for row in zip(
                    *(
                        part.column(name).to_pylist()
                        for name in ("topic", "partition", "offset", "key", "value", "timestamp")
                    ),
                    strict=True,
                )
            ]
            if reg is None:
                from sinks import DeadLetter as DL

                dead.extend(
                    DL(
                        r.topic,
                        r.partition,
                        r.offset,
                        r.key,
                        r.value,
                        f"topic {topic} is no longer registered",
                    )
                    for r in records
                )
                continue
            batch, bad = parse_batch(reg, records)
            dead.extend(bad)
            batches.append(batch)
        if dead:
            self._write_dead_letters(dead, batch_id)
        collected = time.monotonic()
        sink_s = self._apply_sinks(batches, batch_id)
        self._commit_positions(batch_id)
        events = sum(len(b) for b in batches)
        newest = max((t for b in batches if (t := b.newest_ts_ms()) is not None), default=None)
        self._update_metrics(batch_id, n, events, newest)
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
        if self.options.crash_after_sink_batch == batch_id and futures:
            futures[0].result()
            self._crash()
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
        """Append the batch's dead letters once per (app id, batch id): the metrics file records the
        last batch whose dead letters were written and counted, so a replayed batch skips them (only
        a crash between the append and that record can write them twice)."""
        metrics = self._read_metrics()
        done = metrics.get("dead_letter_batch")
        if done is not None and int(done) >= batch_id:
            return
        topic = dead_letter_topic(self.settings.topic_prefix)
        store = self.store()
        store.create_topic(topic, DEAD_LETTER_CONFIG)
        records = [dead_letter_record(d, batch_id, self.app_id) for d in dead]
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
                store.commit(CONSUMER, topic, offsets)
            except UnknownTopicError:
                continue

    def _read_metrics(self) -> dict[str, Any]:
        """This checkpoint's counters (``<state>/spark/apply-metrics.json``); reset for a new app id."""
        path = metrics_path(self.state_dir)
        try:
            current = dict(orjson.loads(path.read_bytes()))
        except (FileNotFoundError, orjson.JSONDecodeError):
            current = {}
        if current.get("app_id") != self.app_id:
            current = {"app_id": self.app_id, "batches": 0, "records": 0, "events": 0, "dead_letters": 0}
        return current

    def _write_metrics(self, current: dict[str, Any]) -> None:
        path = metrics_path(self.state_dir)
        current["updated_ms"] = int(time.time() * 1000)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(current))
        os.replace(tmp, path)
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

    def _crash(self) -> None:
        """Test hook: SIGKILL the JVM and this process, mid-batch."""
        sys.stderr.write("CDC_TEST_CRASH_AFTER_SINK: killing the JVM and the driver now\n")
        sys.stderr.flush()
        try:
            jvm_pid = int(self.spark.sparkContext._jvm.ProcessHandle.current().pid())  # type: ignore[union-attr]
            os.kill(jvm_pid, signal.SIGKILL)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)

    # -- the query -----------------------------------------------------------------------------------
    def start_query(self, tables: Sequence[TableReg]) -> StreamingQuery:
        self._by_topic = {t.topic: t for t in tables}
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
        return self.query

    def stop(self) -> None:
        """Ask :meth:`run` to finish (from another thread or a signal handler): the micro-batch in
        progress completes -- sinks and checkpoint -- and no new one starts; :meth:`run` then stops the
        query (within ``registry_poll_s``) and returns normally."""
        self._stop.set()

    def _stop_between_batches(self, query: StreamingQuery) -> None:
        """Stop ``query`` once no micro-batch is in progress (for :meth:`stop` and for a restart on a
        registry change). A batch that would start meanwhile fails at once, having done nothing
        (:data:`STOP_REQUESTED`), and is replayed by the next query on the same checkpoint."""
        self._halt.set()
        try:
            with self._batch_cond:
                self._batch_cond.wait_for(lambda: not self._in_batch)
                last = self._last_batch
            if last is not None:  # Spark writes the batch's commit log entry right after the body returns
                commit = self.ckpt / "commits" / str(last)
                deadline = time.monotonic() + 60
                while not commit.exists() and query.isActive and time.monotonic() < deadline:
                    time.sleep(0.05)
            query.stop()
        finally:
            self._halt.clear()

    def run(self) -> ApplySummary:
        """Run until caught up (``once``) or until :meth:`stop`; raise ApplyError if a batch fails."""
        from pyspark.errors import StreamingQueryException

        started = time.monotonic()
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
        finally:
            self.summary.seconds = time.monotonic() - started
            q = self.query
            if q is not None and q.isActive:  # interrupted (Ctrl-C): no batch may run after close()
                q.stop()
        return self.summary

    def _raise_if_failed(self, query: StreamingQuery) -> None:
        exc = query.exception()
        if exc is None:
            return
        text = str(exc)
        if STOP_REQUESTED in text:
            return  # a batch that started while the query was being stopped did nothing; it is replayed
        raise ApplyError(
            f"micro-batch failed, the apply job stopped: {_first_lines(text)}",
            fix="fix the cause and run `cdc apply` again: the failed batch is retried from the checkpoint "
            f"({self.ckpt}), nothing was skipped",
            checkpoint=str(self.ckpt),
        )

    def close(self) -> None:
        if self._own_sinks:
            for i, sink in enumerate(self.sinks):
                self._threads[i].submit(sink.close).result()
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


def dead_letter_record(d: DeadLetter, batch_id: int, app_id: str) -> Record:
    """The dead-letter topic's record for ``d``: same key, headers with the reason and the source
    position, value a JSON object holding them and the original value (text, or hex if not UTF-8)."""
    body: dict[str, Any] = {
        "reason": d.reason,
        "source": {"topic": d.topic, "partition": d.partition, "offset": d.offset},
        "batch_id": batch_id,
        "app_id": app_id,
    }
    for name, raw in (("key", d.key), ("value", d.value)):
        if raw is None:
            body[name] = None
        else:
            try:
                body[name] = raw.decode("utf-8")
            except UnicodeDecodeError:
                body[f"{name}_hex"] = raw.hex()
    headers = (
        ("reason", d.reason.encode()),
        ("source_topic", d.topic.encode()),
        ("source_partition", str(d.partition).encode()),
        ("source_offset", str(d.offset).encode()),
    )
    return Record(key=d.key, value=orjson.dumps(body), headers=headers, partition=None)


def run_apply(
    settings: Settings,
    options: ApplyOptions,
    *,
    spark: SparkSession | None = None,
    on_batch: Callable[[BatchReport], None] | None = None,
) -> ApplySummary:
    """Build (or reuse) the session and run the job once; the entry point of ``cdc apply``."""
    if spark is None:
        from spark_jobs.session import get_session

        spark = get_session()
    job = ApplyJob(spark, settings, options, on_batch=on_batch)
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: job.stop())
    try:
        return job.run()
    finally:
        job.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """``spark-submit spark_jobs/apply.py [cdc apply flags]``: the same as ``cdc apply``."""
    from cdc.cli import main as cdc_main

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--state")
    parser.add_argument("--log")
    known, rest = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    pre = []
    if known.state:
        pre += ["--state", known.state]
    if known.log:
        pre += ["--log", known.log]
    if rest[:1] == ["apply"]:
        rest = rest[1:]
    return cdc_main([*pre, "apply", *rest])


if __name__ == "__main__":
    sys.exit(main())
