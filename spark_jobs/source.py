"""``cdclog``: a Python Data Source that streams log-store offset ranges into Structured Streaming.

Rows: one per partition's offset range of the micro-batch, ``topic string, partition int, start long,
end long`` (:data:`RANGES_DDL`): the records stay in the log store, for the task that applies them
to read them itself (``spark_jobs/tasks.py``); offsets ``{"<topic>|<partition>": next_offset}``, checkpointed by Spark, so a
restarted query resumes exactly there and a failed batch is replayed with the same offsets. Usage,
options and every guarantee (new topics, recreated topics, read limits, ``availableNow``):
``docs/spark_source.md``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.types import StructType

from spark_jobs.checkpoint import offset_key, parse_offset_key

if TYPE_CHECKING:
    from cdc.config import Settings
    from cdc.logstore.factory import StoreAddress

try:  # Spark 4.2+: admission control and Trigger.AvailableNow for Python sources
    from pyspark.sql.streaming.datasource import (
        ReadAllAvailable,
        ReadLimit,
        ReadMaxRows,
        SupportsTriggerAvailableNow,
    )
except ImportError:  # pragma: no cover - Spark 4.0/4.1 have neither
    ReadLimit = object  # type: ignore[assignment,misc]
    ReadAllAvailable = None  # type: ignore[assignment,misc]
    ReadMaxRows = None  # type: ignore[assignment,misc]

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass


SOURCE_NAME = "cdclog"
#: the source's rows: one per (topic, partition) of a micro-batch, records [start, end)
RANGES_DDL = "topic string, partition int, start long, end long"
RANGES = pa.schema(
    [("topic", pa.string()), ("partition", pa.int32()), ("start", pa.int64()), ("end", pa.int64())]
)
#: when behind, a micro-batch takes 1/CATCH_UP_BATCHES of the backlog (up to the cap): the apply
#: catches up in a few batches, each rewrite of a table's files carrying many more changes
CATCH_UP_BATCHES = 2
#: a partition's record size is estimated from this many of its next records (key + value bytes) ...
SIZE_SAMPLE = 64
#: ... and estimated again once its position moved this many records past the sample
RESAMPLE_AFTER = 50_000


def store_address(options: Mapping[str, str], address: StoreAddress | None = None) -> StoreAddress:
    """Where the log store is: ``address`` (:func:`register`: with the ``[kafka]`` section's TLS and
    SASL), else the ``state`` and ``log`` options alone."""
    from cdc.logstore.factory import StoreAddress
    from cdc.paths import DEFAULT_STATE

    if address is not None:
        return address
    return StoreAddress(Path(options.get("state") or DEFAULT_STATE), options.get("log") or None)


class LogRange(InputPartition):
    """Records ``[start, end)`` of one partition of one topic (picklable, sent to executors)."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end


def split_budget(pending: Mapping[str, int], budget: int) -> dict[str, int]:
    """Share ``budget`` records over partitions with ``pending`` records each (water filling: small
    backlogs are taken whole, the rest is split evenly). At least one record is granted while any is
    pending, so a batch always makes progress."""
    grant: dict[str, int] = {}
    items = sorted(((n, k) for k, n in pending.items() if n > 0))
    budget = max(budget, 1)
    for i, (n, k) in enumerate(items):
        share = max(budget // (len(items) - i), 1) if budget > 0 else 0
        take = min(n, share)
        if take > 0:
            grant[k] = take
            budget -= take
    return grant


def batch_budget(backlog: int, base: int, behind: int) -> int:
    """The records the next micro-batch may take with ``backlog`` records pending: ``base`` (the
    ``maxRecordsPerBatch``) while the backlog is small; when it is large, a
    :data:`CATCH_UP_BATCHES`-th of it, up to ``behind`` (``maxRecordsPerBatchBehind``; at most
    ``base`` switches the growth off). So a caught-up apply keeps its usual batches and a lagging one
    carries many more changes per rewrite of a table's files (``docs/apply.md``, Batch size)."""
    if behind <= base:
        return base
    return min(behind, max(base, backlog // CATCH_UP_BATCHES))


def byte_bounded(
    grant: Mapping[str, int], record_bytes: Mapping[str, float], max_bytes: int
) -> dict[str, int]:
    """``grant`` (records per partition, :func:`split_budget`) cut so that its estimated bytes --
    records times the partition's mean record size (``record_bytes``: key + value bytes; a partition
    without an estimate counts nothing) -- stay within ``max_bytes`` (``maxBytesPerBatch``; 0: no
    byte bound). The bytes are shared over the sized partitions as :func:`split_budget` shares
    records (small ones whole, the rest evenly), each partition at most its record grant. At least
    one record is granted while any was: a record larger than the bound still goes, alone."""
    if max_bytes <= 0 or sum(n * record_bytes.get(k, 0.0) for k, n in grant.items()) <= max_bytes:
        return dict(grant)
    sized = {k: int(n * record_bytes[k]) for k, n in grant.items() if record_bytes.get(k, 0.0) > 0}
    out = {k: n for k, n in grant.items() if k not in sized}
    for k, b in split_budget(sized, max_bytes).items():
        n = min(grant[k], int(b // record_bytes[k]))
        if n > 0:
            out[k] = n
    if not out and grant:
        first = min(k for k, n in grant.items() if n > 0)
        out[first] = 1
    return out


class CdcLogStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The stream reader (lives in Spark's planner worker for the life of the query)."""

    def __init__(self, options: Mapping[str, str], address: StoreAddress | None = None) -> None:
        self.address = store_address(options, address)
        self.topics = [t.strip() for t in (options.get("topics") or "").split(",") if t.strip()]
        raw_max = options.get("maxRecordsPerBatch") or options.get("maxrecordsperbatch") or ""
        self.max_records = int(raw_max) if raw_max else 0
        raw_behind = options.get("maxRecordsPerBatchBehind") or options.get("maxrecordsperbatchbehind") or ""
        self.max_behind = int(raw_behind) if raw_behind else 0
        raw_bytes = options.get("maxBytesPerBatch") or options.get("maxbytesperbatch") or ""
        self.max_bytes = int(raw_bytes) if raw_bytes else 0
        #: per partition (offset key): (the offset sampled at, mean record bytes there); the source's
        #: state for the life of the query (:meth:`_record_bytes`)
        self._sizes: dict[str, tuple[int, float]] = {}
        self._store: Any = None
        self._target: dict[str, int] | None = None

    # -- plumbing ------------------------------------------------------------------------------------
    def _log_store(self) -> Any:
        if self._store is None:
            self._store = self.address.open()
        return self._store

    def _bounds(self) -> tuple[dict[str, int], dict[str, int]]:
        """(start offsets, end offsets) of every partition of the existing topics in the option."""
        from cdc.errors import UnknownTopicError

        store = self._log_store()
        starts: dict[str, int] = {}
        ends: dict[str, int] = {}
        for topic in self.topics:
            try:
                s = store.start_offsets(topic)
                e = store.end_offsets(topic)
            except UnknownTopicError:
                continue
            for p, off in e.items():
                ends[offset_key(topic, p)] = int(off)
                starts[offset_key(topic, p)] = int(s.get(p, 0))
        return starts, ends

    # -- Spark's calls -------------------------------------------------------------------------------
    def initialOffset(self) -> dict[str, int]:
        starts, _ = self._bounds()
        return starts

    def prepareForTriggerAvailableNow(self) -> None:
        _, self._target = self._bounds()

    def getDefaultReadLimit(self) -> Any:
        if self.max_records > 0 and ReadMaxRows is not None:
            return ReadMaxRows(self.max_records)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def latestOffset(self, start: dict[str, int] | None = None, limit: Any = None) -> dict[str, int]:
        starts, ends = self._bounds()
        if self._target is not None:
            ends = {k: min(v, self._target[k]) for k, v in ends.items() if k in self._target}
        begin = {k: int((start or {}).get(k, starts.get(k, 0))) for k in ends}
        for k, v in ends.items():
            if v < begin[k]:  # the log ends before our position: the topic was recreated, read it again
                begin[k] = starts.get(k, 0)
        if ReadMaxRows is not None and isinstance(limit, ReadMaxRows):
            # decided here, at planning: Spark logs these end offsets before the batch runs, so a
            # replayed batch reads the same ranges whatever the backlog is by then
            pending = {k: ends[k] - begin[k] for k in ends}
            budget = batch_budget(sum(pending.values()), int(limit.max_rows), self.max_behind)
            grant = split_budget(pending, budget)
            grant = byte_bounded(grant, self._record_bytes(begin, grant), self.max_bytes)
            ends = {k: begin[k] + grant.get(k, 0) for k in ends}
        # keep offsets of partitions this query no longer reads out of the result (topic removed)
        return ends

    def _record_bytes(self, begin: Mapping[str, int], grant: Mapping[str, int]) -> dict[str, float]:
        """The mean size (key + value bytes) of the next records of each partition in ``grant``,
        for :func:`byte_bounded` (empty without ``maxBytesPerBatch``). Neither log store knows its
        records' sizes cheaply (the embedded store counts its compressed batch bytes per partition,
        Kafka nothing per offset range), so :data:`SIZE_SAMPLE` records at the partition's position
        are read and their mean kept until the position moved :data:`RESAMPLE_AFTER` records past:
        one small read per partition per large batch, or every 50,000 records when caught up."""
        from cdc.errors import LogStoreError

        if self.max_bytes <= 0:
            return {}
        store = self._log_store()
        for k in grant:
            at, known = begin[k], self._sizes.get(k)
            if known is not None and known[0] <= at < known[0] + RESAMPLE_AFTER:
                continue
            topic, part = parse_offset_key(k)
            try:
                recs = store.read(topic, part, at, max_records=SIZE_SAMPLE)
            except LogStoreError:  # moved by retention meanwhile: the batch's read tells
                continue
            if recs:
                mean = sum(len(r.key) + len(r.value or b"") for r in recs) / len(recs)
                self._sizes[k] = (at, mean)
        return {k: v[1] for k, v in self._sizes.items()}

    def reportLatestOffset(self) -> dict[str, int] | None:
        _, ends = self._bounds()
        return ends or None

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[LogRange]:
        needs_bounds = any(k not in start or int(start[k]) > int(end[k]) for k in end)
        starts, _ = self._bounds() if needs_bounds else ({}, {})
        ranges: list[LogRange] = []
        for key in sorted(end):
            topic, part = parse_offset_key(key)
            lo = int(start.get(key, starts.get(key, 0)))
            hi = int(end[key])
            if lo > hi:  # see latestOffset: a recreated topic is read from its start
                lo = starts.get(key, 0)
            if lo < hi:  # a partition's range is one task's shard: never split
                ranges.append(LogRange(topic, part, lo, hi))
        return ranges

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, LogRange)
        yield pa.RecordBatch.from_pylist(
            [
                {
                    "topic": partition.topic,
                    "partition": partition.partition,
                    "start": partition.start,
                    "end": partition.end,
                }
            ],
            schema=RANGES,
        )

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to do: positions live in Spark's checkpoint; the apply job commits the "apply"
        consumer position itself after its sinks succeeded."""

    def stop(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.close()
            self._store = None


#: the module Spark runs a Python streaming source's reader in (``python -m``), one process per query
RUNNER_MODULE = "pyspark.sql.streaming.python_streaming_source_runner"


def _hung_up(exc: BaseException | None) -> bool:
    """Whether ``exc`` and every exception it was raised while handling say only that the JVM closed
    the runner's socket: an ``EOFError`` reading Spark's next call, an ``OSError`` of the connection
    (``BrokenPipeError``) writing the answer or the error."""
    seen = 0
    while exc is not None:
        if not isinstance(exc, (EOFError, ConnectionError)):
            return False
        seen += 1
        exc = exc.__cause__ or exc.__context__
    return seen > 0


def quiet_hang_up() -> None:
    """In Spark's streaming source runner: its end, when the JVM closed its socket, says nothing.

    ``query.stop()`` interrupts the query's thread, and a thread interrupted while it waits on the
    runner's socket (a ``latestOffset`` in flight) closes it (Java NIO). The runner then reads EOF,
    fails to write that error back (the socket is closed) and prints both as a traceback that reaches
    the user through the driver JVM's stderr, on every stop that lands mid-call. The JVM has already
    moved on: it stopped the query and ends the runner. Any other error still prints, and the exit
    status is unchanged. Outside the runner (the driver, the executors) this does nothing."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if getattr(spec, "name", None) != RUNNER_MODULE or getattr(sys.excepthook, "cdc_quiet", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not _hung_up(exc):
            previous(kind, exc, tb)

    hook.cdc_quiet = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class CdcLogDataSource(DataSource):
    """The ``cdclog`` data source (streaming read only)."""

    #: where the log store is, when :func:`register` was given settings (else the ``state`` and
    #: ``log`` options)
    store: ClassVar[StoreAddress | None] = None

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> str:
        return RANGES_DDL

    def streamReader(self, schema: StructType) -> CdcLogStreamReader:
        quiet_hang_up()  # in the source runner; Spark's planning worker calls this too: a no-op there
        return CdcLogStreamReader(self.options, self.store)


def register(spark: Any, settings: Settings | None = None) -> str:
    """Register the data source with the session and return its format name (idempotent).

    Without ``settings``: ``cdclog``, which opens the log store its ``state`` and ``log`` options
    name (no ``[kafka]`` section: a plaintext Kafka). With ``settings``: a ``cdclog_<hash>`` source
    of its own that opens the store at their :class:`~cdc.logstore.factory.StoreAddress`, the
    ``[kafka]`` section's TLS and SASL included (the SASL password too: it travels pickled with the
    class, to the planner and the source runner, never in the options that Spark prints in its plans
    and UI; nothing else of the settings goes, neither the source DSN nor the configuration loader
    the planner would import to unpickle them); several jobs in one session each keep their own."""
    if settings is None:
        spark.dataSource.register(CdcLogDataSource)
        return SOURCE_NAME
    import hashlib

    from cdc.logstore.factory import StoreAddress

    address = StoreAddress.of(settings)
    digest = hashlib.sha256(repr((str(address.state_dir), address.log_url)).encode()).hexdigest()[:12]
    fmt = f"{SOURCE_NAME}_{digest}"
    cls = type(
        f"CdcLogDataSource_{digest}",
        (CdcLogDataSource,),
        {"store": address, "name": classmethod(lambda c: fmt), "__module__": __name__},
    )
    spark.dataSource.register(cls)
    return fmt
