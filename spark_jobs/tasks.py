"""The apply's work in Spark tasks: each task reads its own offset ranges from the log store, parses,
plans and writes one slice of a micro-batch, and hands the driver only what to commit.

The driver (:mod:`spark_jobs.apply`) gets the micro-batch as offset ranges (the ``cdclog`` source with
``emit = ranges``: one row per (topic, partition), never a record), cuts them into :class:`Slice`\\ s
(:func:`plan_slices`) and runs :func:`run_slices` on the executors, the slices grouped into one task per
executor core (:func:`group_slices`). A slice is
either one partition of a topic whose sinks are sharded like the topic -- shard ``p`` of every sink's
data is then written by the task of partition ``p`` alone -- or every partition of a topic (a table
that is not sharded, or a small one). A new table's tables are created by the driver from a sample
of its first batch (:class:`Planner`), so that batch too is one slice per shard. Each task:

1. reads its ranges from the log store (the records never cross into the JVM or to the driver);
2. parses them (a primary-key change lacking unchanged TOAST values whose old key is in another
   shard is first completed from the whole micro-batch and the warehouse's committed history:
   :func:`complete_moves`), asks every sink what it cannot hold, and applies the rest with a
   :class:`~spark_jobs.applier.BatchApplier` in which every sink declaring
   :attr:`~sinks.Sink.commits_in_driver` (the warehouse) only *writes* (:meth:`~sinks.Sink.defer_commits`:
   the warehouse's files, :class:`~sinks.warehouse.files.TableWrite`) and the others commit their
   own shard (the search index);
3. returns a :class:`SliceResult`: the writes to commit, its dead letters and its counts.

The driver then hands each such sink every task's writes (:meth:`~sinks.Sink.commit_deferred`: the
warehouse commits each table's in one Delta transaction with the batch's application transaction),
writes the dead letters, and commits the consumer positions. Guarantees (``docs/apply.md``): a task that dies leaves files no
commit references (vacuum removes them) and Spark retries it; a driver that dies before its commit
replays the batch from the checkpoint, and every sink recognises what it already applied.

No pyspark import here: :func:`run_slices` is a plain function of plain values, tested without a JVM
(``tests/apply/test_tasks.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from cdc.logstore.records import RECORDS, read_records
from cdc.registry import TableReg
from sinks import ChangeBatch, DeadLetter, Sink, Touched, touched_of
from sinks.columnar import concat
from sinks.parse import Parsed, parse
from sinks.toast import Chains, Stored
from spark_jobs.applier import BatchApplier, BatchOutcome, TableOutcome, open_sinks, reject

if TYPE_CHECKING:
    from cdc.config import Settings
    from cdc.logstore import LogStore

#: one partition's records of a micro-batch: (partition, start offset, end offset)
Range = tuple[int, int, int]


@dataclass(frozen=True)
class Slice:
    """One task's share of a micro-batch: records of ``topic`` in ``ranges``, applied as shard
    ``shard`` of every sink's data (None: the whole table). ``context``: the topic's other
    partitions' ranges of the micro-batch (a shard's slice only), read only to complete a primary-key
    change whose old key lives in another shard (:func:`complete_moves`)."""

    topic: str
    ranges: tuple[Range, ...]
    shard: int | None = None
    context: tuple[Range, ...] = ()


@dataclass
class SliceResult:
    """What a task hands the driver: never a row of data, only what to commit and count."""

    #: per sink (name) that commits in the driver, what its :meth:`~sinks.Sink.apply` deferred
    writes: dict[str, list[Any]] = field(default_factory=dict)
    dead: list[DeadLetter] = field(default_factory=list)
    tables: list[TableOutcome] = field(default_factory=list)
    records: int = 0
    read_seconds: float = 0.0
    prepare_seconds: float = 0.0
    sink_seconds: dict[str, float] = field(default_factory=dict)
    event_ts_ms: list[int] = field(default_factory=list)
    #: per table, what the slice changed (``run_slices(views=True)``: for the views from joins)
    touched: dict[str, Touched] = field(default_factory=dict)
    #: the slice's topic, its wall seconds in the task (read, parse, every sink), and for a task's
    #: first slice the seconds the task spent opening its sinks and log store (the per-task cost)
    topic: str = ""
    seconds: float = 0.0
    open_seconds: float = 0.0
    #: the wall clock (``time.time()``) when its task started and when the slice ended: the driver
    #: tells its Spark job's own time (scheduling, launch, results) from the tasks' work
    task_started: float = 0.0
    ended: float = 0.0


def table_shards(sinks: Sequence[Sink], reg: TableReg) -> int:
    """How many shards every sink keeps ``reg`` in, 1 when they differ or one is not sharded (or has
    not created the table yet): the table's batch is then one slice."""
    counts = {n for n in (s.shards(reg) for s in sinks) if n is not None}
    return counts.pop() if len(counts) == 1 else 1


#: a table is applied as one slice of a micro-batch, even when sharded, while its batch holds fewer
#: records than this and its sinks hold fewer rows than :data:`SHARD_MIN_ROWS` (:class:`Planner`):
#: a slice pays a fixed cost per table it writes (its Delta tables opened and read, a file written
#: per partition, its commit actions), which four shards of a small table pay four times over for
#: no gain -- on a loaded ``local[2]`` under pgbench, a slice of the 20-row ``pgbench_tellers`` cost
#: 0.3-0.8 s whatever it held (docs/benchmarks/freshness.md, Sustained); a large table's slices
#: each rewrite a shard of it (copy-on-write), which is worth running in parallel
SHARD_MIN_RECORDS = 50_000
SHARD_MIN_ROWS = 50_000


def plan_slices(
    ranges: Iterable[tuple[str, int, int, int]],
    shards: Callable[[str], int],
    partitions: Callable[[str], int],
    whole: Callable[[str, int], bool] | None = None,
) -> list[Slice]:
    """The tasks of a micro-batch of ``ranges`` ((topic, partition, start, end), empty ones left out):
    one per partition of a topic whose table is kept in as many shards as the topic has partitions
    (``shards(topic) == partitions(topic) > 1``), unless ``whole(topic, records in the batch)``
    says to apply it whole; else one per topic (a whole-table slice: its sinks write every shard,
    as the driver path does)."""
    by_topic: dict[str, list[Range]] = {}
    for topic, part, start, end in ranges:
        if end > start:
            by_topic.setdefault(topic, []).append((int(part), int(start), int(end)))
    out: list[Slice] = []
    for topic, rs in sorted(by_topic.items()):
        rs.sort()
        n = (
            1
            if whole is not None and whole(topic, sum(end - start for _, start, end in rs))
            else shards(topic)
        )
        if n > 1 and n == partitions(topic):
            out.extend(Slice(topic, (r,), r[0], tuple(o for o in rs if o != r)) for r in rs)
        else:
            out.append(Slice(topic, tuple(rs)))
    return out


def group_slices(slices: Sequence[Slice], tasks: int) -> list[list[Slice]]:
    """``slices`` in at most ``tasks`` groups, one Spark task each (the executors' cores: more tasks
    than cores only queue, and each task pays its launch and its sinks' opening again), balanced by
    records (the largest slice first, into the group with the fewest records); a slice keeps its
    shard whichever task runs it."""
    groups: list[list[Slice]] = [[] for _ in range(max(1, min(tasks, len(slices))))]
    load = [0] * len(groups)
    for sl in sorted(slices, key=lambda s: -sum(end - start for _, start, end in s.ranges)):
        i = load.index(min(load))
        groups[i].append(sl)
        load[i] += sum(end - start for _, start, end in sl.ranges)
    return [g for g in groups if g]


#: the records of a new table's first batch the driver reads and parses to create its tables
#: (:meth:`Planner.plan`): at most this many, from at most :data:`SAMPLE_PARTITIONS` of its
#: partitions, in :data:`SAMPLE_CHUNKS` runs spread over each one's range. A key's partition is
#: its hash, so one partition's keys are a uniform sample of the batch's, and its runs span the
#: batch's time; each run costs a read of a stored block of the log store (the embedded store's
#: compressed batches: 48 runs of 12 partitions took 1.6 s of a 75,000-record batch, 14 s of the
#: plan at load 15), so the runs are few, at a fixed cost per new table
SAMPLE_RECORDS = 4_096
SAMPLE_PARTITIONS = 2
SAMPLE_CHUNKS = 4


def sample_ranges(
    ranges: Sequence[Range],
    records: int = SAMPLE_RECORDS,
    chunks: int = SAMPLE_CHUNKS,
    partitions: int = SAMPLE_PARTITIONS,
) -> list[Range]:
    """About ``records`` of a topic's ``ranges`` (partition, start, end), spread evenly over the
    ``partitions`` largest ranges (the first of equal ones): a range with more than its share
    (``records / partitions``) gives ``chunks`` runs of consecutive records, the first at its
    start, the last at (about) its end, the others evenly between; a smaller range is taken
    whole."""
    chosen = sorted(sorted(ranges, key=lambda r: -(r[2] - r[1]))[: max(1, partitions)])
    share = max(1, -(-records // max(1, len(chosen))))
    out: list[Range] = []
    for part, start, end in chosen:
        if end - start <= share:
            out.append((part, start, end))
            continue
        n = max(1, min(chunks, share))
        run = max(1, share // n)
        gap = (end - start - run) // max(1, n - 1)
        out.extend((part, start + i * gap, start + i * gap + run) for i in range(n))
    return out


class Planner:
    """The driver's side of a micro-batch in tasks, before the tasks run: each table's metadata
    brought in line with its registration (:meth:`sinks.Sink.prepare`, once per registration), a
    new table's tables created from a sample of its first batch (``store``, below), and the slices
    (:func:`plan_slices`). A table's shard count, once more than one, is kept: a table's layout
    never changes while its registration does not.

    ``store`` (the driver's log store, opened when first needed): a table in a batch that would be
    applied per shard (see ``min_shard_records``) while its sinks say one shard -- they have not
    created it: its layout is chosen from its rows -- is first given to every sink's
    :meth:`~sinks.Sink.prepare` with a sample of its records in the batch (:func:`sample_ranges`:
    a few runs of two partitions; parsed as a task parses them), once per registration; a sink creates the table from it, so the
    first batch too is one slice per shard. Without ``store`` the first batch is one slice (its task
    creates the tables)."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        min_shard_records: int = 0,
        min_shard_rows: int = 0,
        store: Callable[[], LogStore] | None = None,
    ) -> None:
        self.sinks = list(sinks)
        #: a table whose batch is smaller than ``min_shard_records`` and whose sinks hold fewer rows
        #: than ``min_shard_rows`` (:meth:`sinks.Sink.live_rows`) is one slice (0, 0: never)
        self.min_shard_records = min_shard_records
        self.min_shard_rows = min_shard_rows
        self.store = store
        self._prepared: dict[str, TableReg] = {}
        self._shards: dict[str, tuple[TableReg, int]] = {}
        #: the records a sample holds at most (:func:`sample_ranges`)
        self.sample_size = SAMPLE_RECORDS
        #: per topic, the registration a sample was offered for (once each)
        self._sampled: dict[str, TableReg] = {}
        #: the records read for samples and the seconds they took (in the batch's ``plan`` phase)
        self.sample_records = 0
        self.sample_seconds = 0.0

    def plan(
        self,
        ranges: Sequence[tuple[str, int, int, int]],
        regs: Mapping[str, TableReg],
        partitions: Callable[[str], int],
    ) -> list[Slice]:
        """The slices of a micro-batch of ``ranges``; ``regs``: topic -> registration (a topic
        without one is applied whole, its records become dead letters)."""
        for topic, reg in regs.items():
            if self._prepared.get(topic) != reg:
                for sink in self.sinks:
                    sink.prepare(reg)
                self._prepared[topic] = reg
        if self.store is not None:
            self._create_new(ranges, regs, partitions)
        return plan_slices(
            ranges,
            lambda t: self._shards_of(t, regs.get(t)),
            partitions,
            lambda t, n: self._whole(regs.get(t), n),
        )

    def _create_new(
        self,
        ranges: Sequence[tuple[str, int, int, int]],
        regs: Mapping[str, TableReg],
        partitions: Callable[[str], int],
    ) -> None:
        """Offer a sample of the batch to every sink of each table that would be applied per shard
        but that its sinks keep in one shard (see the class docstring)."""
        by_topic: dict[str, list[Range]] = {}
        for topic, part, start, end in ranges:
            if end > start:
                by_topic.setdefault(topic, []).append((int(part), int(start), int(end)))
        for topic, rs in sorted(by_topic.items()):
            reg = regs.get(topic)
            if reg is None or self._sampled.get(topic) == reg:
                continue
            records = sum(end - start for _, start, end in rs)
            if self._whole(reg, records) or partitions(topic) < 2 or self._shards_of(topic, reg) > 1:
                continue
            sample = self._sampler(reg, sorted(rs), records)
            for sink in self.sinks:
                sink.prepare(reg, sample)
            self._sampled[topic] = reg

    def _sampler(
        self, reg: TableReg, rs: Sequence[Range], records: int
    ) -> Callable[[], tuple[ChangeBatch | None, float]]:
        """The ``sample`` of :meth:`sinks.Sink.prepare` for a table's ``rs`` (``records`` in all):
        read and parsed at its first call only (by the first sink that needs it)."""
        loaded: list[tuple[ChangeBatch | None, float]] = []

        def sample() -> tuple[ChangeBatch | None, float]:
            if not loaded:
                assert self.store is not None
                t0 = time.monotonic()
                store = self.store()
                picked = sample_ranges(rs, self.sample_size)
                batches = [
                    b for p, start, end in picked for b in read_records(store, reg.topic, p, start, end)
                ]
                table = pa.Table.from_batches(batches, schema=RECORDS)
                parsed = parse(reg, table)  # as a task parses its slice (sinks.parse: the same form)
                self.sample_records += table.num_rows
                self.sample_seconds += time.monotonic() - t0
                loaded.append((parsed.batch, table.num_rows / max(records, 1)))
            return loaded[0]

        return sample

    def _whole(self, reg: TableReg | None, records: int) -> bool:
        """Whether a table's ``records`` of a micro-batch are applied as one slice (see __init__)."""
        if reg is None or records >= self.min_shard_records:
            return False
        return max((sink.live_rows(reg) or 0 for sink in self.sinks), default=0) < self.min_shard_rows

    def _shards_of(self, topic: str, reg: TableReg | None) -> int:
        if reg is None:
            return 1
        known = self._shards.get(topic)
        if known is not None and known[0] == reg:
            return known[1]
        n = table_shards(self.sinks, reg)
        if n > 1:
            self._shards[topic] = (reg, n)
        return n


def complete_moves(batch: ChangeBatch, whole: ChangeBatch, stored: Stored) -> ChangeBatch:
    """``batch`` (one shard's slice of a table) with the unchanged TOAST columns of its primary-key
    changes filled in, each then a plain insert of its new key: from ``whole`` (the table's rows of
    the micro-batch that the warehouse accepts: the slice's and its key changes' old keys') and
    ``stored`` (the committed rows of the sink that keeps them, :meth:`sinks.Sink.stored_before`:
    the warehouse's).

    The old key of a key change lives in another shard when the keys hash apart: its rows of the
    batch are in another task's slice, and its stored row in a shard another task is writing at the
    same time (the search index commits its shard in the task), so no sink of this slice can read
    it as it was before the batch. The warehouse's committed tables are that state: the driver
    commits only after every task. A change whose old row no row of the batch or stored row holds
    (or whose old key's rows the warehouse rejects) stays as it is: the sinks' reject makes it a
    dead letter with their reason, as for a whole table's batch."""
    mine = Chains(batch.columns, batch.table.key)
    moves = [r for r in mine.lacking if mine.is_moved(r)]
    if not moves:
        return batch
    chains = Chains(whole.columns, batch.table.key)
    at = dict(zip(whole.columns.positions(chains.lacking), chains.lacking, strict=True))
    todo = [(r, at[pos]) for r, pos in zip(moves, batch.columns.positions(moves), strict=True) if pos in at]
    prefetch = getattr(stored, "prefetch", None)  # a lookup that reads many keys in one go
    if prefetch is not None:
        prefetch(chains.stored_keys(w for _r, w in todo))
    memo: dict[int, dict[str, Any] | None] = {}
    rows: list[int] = []
    values: list[dict[str, Any]] = []
    for r, w in todo:
        got = chains.values(w, stored, memo)
        if got is not None:
            rows.append(r)
            values.append(got)
    return ChangeBatch(batch.table, batch.columns.with_values(rows, values), shard=batch.shard)


def _completer(
    sl: Slice, records: pa.Table, store: LogStore, reg: TableReg | None, sinks: Sequence[Sink]
) -> Callable[[ChangeBatch], ChangeBatch] | None:
    """:func:`complete_moves` for a shard's slice (None for a whole table's: its sinks see every
    row), from the first sink that keeps committed rows (:meth:`sinks.Sink.stored_before`).

    Only a key change lacking columns that its own ``before`` does not hold needs another shard:
    the reader fills a key change's unchanged TOAST values in (``docs/events.md``), so such a change
    comes from a topic written before it did, or after the reader lost its image store. Then only
    the old keys' records are taken from the other partitions' ranges of the micro-batch (the
    ``key`` bytes matched in Arrow, before any parse: a key's records are all in its partition, and
    the reader writes a key as its canonical JSON, which :meth:`sinks.toast.Chains.old_key` gives),
    and only those are parsed -- again for the keys they moved from in turn, until no new old key
    turns up; the keeper's ``reject`` is then asked about them together with the slice's own
    rows (one batch: :func:`sinks.columnar.concat`), which is what it would accept of the whole batch
    for these keys (a rejection follows a key's chain, and the chains of the changes to complete run
    through these keys only). No other record of the batch is parsed, and the slice's own not twice;
    the rows are followed in Arrow (:class:`sinks.toast.Chains`), never turned into events."""
    if sl.shard is None or not sl.context or reg is None:
        return None

    def complete(batch: ChangeBatch) -> ChangeBatch:
        mine = Chains(batch.columns, reg.key)
        lacking = [r for r in mine.lacking if mine.is_moved(r) and not mine.before_holds(r)]
        if not lacking:
            return batch
        keeper = next(((s, st) for s in sinks if (st := s.stored_before(reg)) is not None), None)
        if keeper is None:
            return batch
        others = [b for p, start, end in sl.context for b in read_records(store, sl.topic, p, start, end)]
        pool = pa.Table.from_batches(others, schema=RECORDS)
        keys = pool.column("key")
        wanted = set(mine.old_keys(lacking))
        asked: set[str] = set()
        found: list[pa.Table] = []
        parts = [batch.columns]
        while wanted - asked:
            new = sorted(wanted - asked)
            asked.update(new)
            got = pool.filter(pc.is_in(keys, value_set=pa.array([k.encode() for k in new], pa.binary())))
            parsed = parse(reg, got, form="events")
            if parsed.batch is None or not len(parsed.batch):
                continue
            found.append(got)
            parts.append(parsed.batch.columns)
            theirs = Chains(concat(parts), reg.key)
            wanted.update(theirs.old_keys(theirs.lacking))
        if not found:
            return batch
        # the slice's rows and the old keys', one batch (the records are parsed once)
        both = Parsed(
            ChangeBatch(reg, concat(parts)), [], "events", None, pa.concat_tables([records, *found])
        )
        whole, _dead = reject([keeper[0]], both)  # the other tasks dead-letter their own records
        return complete_moves(batch, whole, keeper[1])

    return complete


def task_settings(settings: Settings) -> Settings:
    """``settings`` without its secrets (the source DSN, the serve token): what a task is sent."""
    return dataclasses.replace(settings, source=None, serve_token=None)


def run_slices(
    settings: Settings,
    app_id: str,
    batch_id: int,
    tables: Mapping[str, TableReg],
    slices: Iterable[Slice],
    *,
    keep_event_ts: bool = False,
    views: bool = False,
    make_sinks: Callable[[Settings], Sequence[Sink]] = open_sinks,
) -> Iterator[SliceResult]:
    """A task's body: apply each of ``slices`` of micro-batch ``batch_id`` (``tables``: topic ->
    registration, as the driver saw the registry) and yield its :class:`SliceResult`. The writes
    of a sink that commits in the driver (:attr:`sinks.Sink.commits_in_driver`: the warehouse) are
    left for the driver to commit; the other sinks commit here (the search index, its shard).
    ``views``: views from joins are registered: the result says which keys the slice changed (also
    when the batch is a replay its sinks skip: the views may still lack it). ``make_sinks``: the
    job's sinks from ``settings`` (:class:`spark_jobs.apply.ApplyJob`)."""
    from cdc.logstore.factory import open_log_store

    task_started, opened = time.time(), time.monotonic()
    sinks = list(make_sinks(settings))
    for sink in sinks:
        sink.in_task()
    store = open_log_store(settings, writer=False)  # with the [kafka] section's TLS and SASL
    applier = BatchApplier(sinks, tables.get, app_id, keep_event_ts=keep_event_ts)
    deferring = [s for s in sinks if s.commits_in_driver]
    open_s = time.monotonic() - opened
    try:
        for sl in slices:
            pending: dict[str, list[Any]] = {s.name: [] for s in deferring}
            for sink in deferring:
                sink.defer_commits(pending[sink.name])
            t0 = time.monotonic()
            batches = [b for p, start, end in sl.ranges for b in read_records(store, sl.topic, p, start, end)]
            records = pa.Table.from_batches(batches, schema=RECORDS)
            t1 = time.monotonic()
            prepared = applier.prepare(
                records, complete=_completer(sl, records, store, tables.get(sl.topic), sinks)
            )
            for b in prepared.batches:
                b.shard = sl.shard
            outcome = applier.apply(prepared, batch_id)
            yield SliceResult(
                writes=pending,
                dead=outcome.dead,
                tables=outcome.tables,
                records=outcome.records,
                read_seconds=t1 - t0,
                prepare_seconds=outcome.prepare_seconds,
                sink_seconds=outcome.sink_seconds,
                event_ts_ms=outcome.event_ts_ms,
                touched=touched_of(prepared.batches) if views else {},
                topic=sl.topic,
                seconds=time.monotonic() - t0,
                open_seconds=open_s,
                task_started=task_started,
                ended=time.time(),
            )
            open_s = 0.0
    finally:
        try:
            applier.close(close_sinks=True, timeout=None)
        finally:
            store.close()


def outcome_of(batch_id: int, results: Sequence[SliceResult]) -> BatchOutcome:
    """The tasks' results of a micro-batch as one :class:`BatchOutcome` (tables in topic order; the
    sinks' seconds summed over tasks)."""
    seconds: dict[str, float] = {}
    for r in results:
        for name, s in r.sink_seconds.items():
            seconds[name] = seconds.get(name, 0.0) + s
    return BatchOutcome(
        batch_id=batch_id,
        records=sum(r.records for r in results),
        tables=_merged_tables([t for r in results for t in r.tables]),
        dead=[d for r in results for d in r.dead],
        prepare_seconds=sum(r.read_seconds + r.prepare_seconds for r in results),
        sink_seconds=seconds,
        event_ts_ms=[t for r in results for t in r.event_ts_ms],
    )


def touched_by(results: Sequence[SliceResult]) -> dict[str, Touched]:
    """Per table, what the tasks' slices of a micro-batch changed (:attr:`SliceResult.touched`)."""
    out: dict[str, Touched] = {}
    for r in results:
        for name, t in r.touched.items():
            have = out.setdefault(name, Touched())
            have.key_jsons.extend(t.key_jsons)
            have.truncated = have.truncated or t.truncated
    return out


def _merged_tables(parts: Sequence[TableOutcome]) -> list[TableOutcome]:
    """One :class:`TableOutcome` per table from its slices' (events summed, columnar when all were)."""
    by: dict[str, list[TableOutcome]] = {}
    for t in parts:
        by.setdefault(t.table, []).append(t)
    return [
        TableOutcome(
            name,
            sum(t.events for t in ts),
            all(t.columnar for t in ts),
            max((t.newest_ts_ms for t in ts if t.newest_ts_ms is not None), default=None),
        )
        for name, ts in sorted(by.items())
    ]


def commit_slices(
    sinks: Sequence[Sink],
    regs: Iterable[TableReg],
    results: Sequence[SliceResult],
    app_id: str,
    batch_id: int,
) -> dict[str, float]:
    """The driver's commit of a micro-batch the tasks applied: each sink that commits in the driver
    (:attr:`sinks.Sink.commits_in_driver`) commits every task's deferred writes
    (:meth:`~sinks.Sink.commit_deferred`: one transaction per table, with the batch's identity; a
    replayed batch commits nothing twice: the tasks find it applied and write nothing), then each
    sink's :meth:`~sinks.Sink.committed` (maintenance) for the batch's tables, starting from a
    different one at each batch (a sink may share a time budget among them). Returns the wall
    seconds of each: ``maintain <sink> wait`` (for the maintenance the previous batch left running,
    :meth:`~sinks.Sink.await_maintenance`), ``commit <sink>`` and ``maintain <sink>`` (summed over
    the tables), and the steps of the sink's maintenance done since the previous batch
    (``maintain <sink> <step>``, :meth:`~sinks.Sink.maintain_phases`)."""
    phases: dict[str, float] = {}
    for sink in sinks:
        if sink.commits_in_driver:
            t0 = time.monotonic()
            sink.await_maintenance()
            phases[f"maintain {sink.name} wait"] = time.monotonic() - t0
            t0 = time.monotonic()
            sink.commit_deferred([w for r in results for w in r.writes.get(sink.name, ())], app_id, batch_id)
            phases[f"commit {sink.name}"] = time.monotonic() - t0
    order = list(regs)
    start = batch_id % len(order) if order else 0  # a table first in turn: a per-batch budget is fair
    for reg in order[start:] + order[:start]:
        for sink in sinks:
            t0 = time.monotonic()
            sink.committed(reg, batch_id)
            key = f"maintain {sink.name}"
            phases[key] = phases.get(key, 0.0) + time.monotonic() - t0
    for sink in sinks:
        for step, seconds in sink.maintain_phases().items():
            phases[f"maintain {sink.name} {step}"] = seconds
    return phases


def slice_phases(results: Sequence[SliceResult], submitted: float, returned: float) -> dict[str, float]:
    """What the tasks of a micro-batch spent, for its report: ``task start`` (from the Spark job's
    submission, wall clock ``submitted``, to its first task starting), ``slowest task`` (a task's
    start to its last slice's end), ``task results`` (the last slice's end to the job's return,
    ``returned``), ``task open`` (the longest a task took to open its sinks and log store),
    ``slice <table>`` (the longest slice of each table: read, parse and every sink) and ``slowest
    slice``."""
    out: dict[str, float] = {}
    if results:
        started = min(r.task_started for r in results)
        ends: dict[float, float] = {}
        for r in results:
            ends[r.task_started] = max(ends.get(r.task_started, 0.0), r.ended)
        out["task start"] = max(started - submitted, 0.0)
        out["slowest task"] = max(end - start for start, end in ends.items())
        out["task results"] = max(returned - max(ends.values()), 0.0)
    out["task open"] = max((r.open_seconds for r in results), default=0.0)
    for r in results:
        key = f"slice {r.topic}"
        out[key] = max(out.get(key, 0.0), r.seconds)
    out["slowest slice"] = max((r.seconds for r in results), default=0.0)
    return out
