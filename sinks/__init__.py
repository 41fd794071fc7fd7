"""The apply stage's sink contract: what every derived-table backend implements and is handed.

One module per backend beside this one: :mod:`sinks.warehouse` (Delta Lake: current state + history)
and :mod:`sinks.search` (tantivy), listed once in :data:`sinks.all.SINKS`. Everything that handles
sinks loops over that list: the apply job builds them (:meth:`Sink.from_settings`), ``cdc verify``
reads them back (:meth:`Sink.read_back`), ``cdc status`` and ``cdc tables list`` ask where they live
(:meth:`Sink.locations`); each also reports the last batch it committed (:meth:`Sink.applied_batch`).
A new sink is its module, its tests and one entry there. :mod:`sinks.parse` turns a table's log-store records into a
:class:`ChangeBatch` and its :class:`DeadLetter` records; the apply job (``spark_jobs/``) writes the
dead letters, then calls :meth:`Sink.reject` and :meth:`Sink.apply` of every sink. The shared
guarantees (version guard, deletes that stick, idempotent batches, unavailable TOAST values, poison
records) are written on :class:`Sink`; ``docs/apply.md`` tells the whole story.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from cdc.errors import ApplyError
from cdc.events import Version
from cdc.logstore.partitioner import partition_for
from cdc.registry import TableReg
from sinks.columnar import NAMES, Columns, json_type, typed_array

if TYPE_CHECKING:
    from cdc.config import Settings

__all__ = [
    "OPS",
    "ChangeBatch",
    "ChangeEvent",
    "DeadLetter",
    "RawRecord",
    "ReadBack",
    "Rejection",
    "Sink",
    "Stored",
    "StoredRows",
    "StoredTexts",
    "Touched",
    "columns_of",
    "touched_of",
]

#: what a sink stored for a key as of just before a version (None: nothing; :meth:`Sink.stored_before`)
Stored = Callable[[str, Version], dict[str, Any] | None]

OPS = frozenset("rcudt")


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One log-store record as the Spark source hands it over."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes | None
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """One parsed change (see :mod:`cdc.events` for the envelope).

    ``key_json`` is the canonical key: orjson of the key dict with the keys in the table's key-column
    order (for ``op='t'``: the envelope's ``{"__truncate__": <partition>}``). ``ts_ms`` is the source
    commit time (``source.ts_ms``). ``unavailable`` lists the columns absent from ``after`` because
    the source did not send them (unchanged TOAST): a sink keeps the stored value. Columns the
    registration excludes are never in ``after``/``before``/``unavailable``.
    """

    key: dict[str, Any]
    key_json: str
    op: str
    version: Version
    ts_ms: int
    after: dict[str, Any] | None
    before: dict[str, Any] | None
    unavailable: tuple[str, ...]
    partition: int
    offset: int
    snapshot: bool


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record the pipeline cannot apply, with the reason: it does not parse (:mod:`sinks.parse`), or
    a sink cannot hold one of its values (:meth:`Sink.reject`). ``table``, ``key_json`` and
    ``version`` are known when the envelope parsed. The apply job writes it to the dead-letter topic
    (``cdc.events.dead_letter_topic``, format in :mod:`sinks.dead_letters`) and counts it; never
    dropped."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes | None
    reason: str
    table: str | None = None
    key_json: str | None = None
    version: Version | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    """A sink cannot hold a value of the event at ``(partition, offset)`` (:meth:`Sink.reject`)."""

    partition: int
    offset: int
    reason: str


#: a key range's bound: the key's values in key order (None: unbounded)
Bound = tuple[Any, ...] | None


@dataclass(frozen=True, slots=True)
class KeyRanges:
    """The part of a table a read-back is asked for (an incremental ``cdc verify``'s checked key
    ranges): ``spans``, merged ``[lo, hi)`` intervals of key tuples (integers compared by value, text
    by code point; None: unbounded), and ``keys``, canonical key JSONs known to lie in them (the keys
    the source and the rows sinks hold there: a sink that can only look keys up reads those).

    A sink may return more than was asked (verify keeps only the spans' rows); it must return every
    row of the spans, and give the whole table's count in ``total``."""

    spans: tuple[tuple[Bound, Bound], ...]
    keys: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class StoredRows:
    """A sink's live rows of one table, as it stores them (:meth:`Sink.read_back`): one row per key,
    the registered columns (less the excluded ones) in the sink's Arrow types, and ``version_column``
    holding each row's ``commit_lsn``. ``table`` None: the sink has stored nothing for it yet.
    ``cdc verify`` converts the source's values to ``table``'s types and compares row by row.
    ``total``: the whole table's row count when only some :class:`KeyRanges` were read (None: ``table``
    is the whole table)."""

    table: pa.Table | None
    version_column: str
    total: int | None = None


@dataclass(frozen=True, slots=True)
class StoredTexts:
    """A sink's live documents of one table (:meth:`Sink.read_back`): canonical key JSON
    (``ChangeEvent.key_json``) -> {search column: the text it indexed}. ``cdc verify`` compares them
    with the source's values of the table's search columns. ``total``: the whole index's document
    count when only some :class:`KeyRanges` were read (None: ``docs`` are all of them)."""

    docs: dict[str, dict[str, str]]
    total: int | None = None


#: what :meth:`Sink.read_back` returns: the values it holds, or the texts it indexed
ReadBack = StoredRows | StoredTexts


class ChangeBatch:
    """Every parsed event of one micro-batch for one table, sorted by version (ties: partition,
    offset). Tombstones (value None) are not in it: the ``d`` before them carries the delete.

    One form: :class:`sinks.columnar.Columns` (``columns``), whatever the parse that built it; a
    sink decides on the columns, in Arrow, and reads rows into Python only to write them.

    ``shard``: None, the batch holds the table's events of every log-store partition; an int ``p``,
    it holds only those of partition ``p`` (a slice of the micro-batch applied by one Spark task, which
    owns the shard ``p`` of each sink's data: :func:`shard_of` of a key is its partition). A sink then
    reads and writes only shard ``p`` of a table sharded like the topic, so that the slices of one
    table run in parallel without touching each other's files.
    """

    def __init__(self, table: TableReg, columns: Columns, *, shard: int | None = None) -> None:
        self.table = table
        self.columns = columns
        self.shard = shard

    def __len__(self) -> int:
        return len(self.columns)

    def ts_ms(self) -> list[int]:
        """The source commit time of every event, in version order."""
        return list(self.columns.table.column("ts_ms").to_pylist())

    def newest_ts_ms(self) -> int | None:
        """The source commit time of the newest event (by version), None for an empty batch."""
        return self.columns.table.column("ts_ms")[-1].as_py() if len(self.columns) else None

    def truncate_version(self) -> Version | None:
        """The newest TRUNCATE version in the batch, if any."""
        t = self.columns.table
        t = t.filter(pc.equal(t.column("op"), "t"))
        versions = zip(t.column("commit_lsn").to_pylist(), t.column("seq").to_pylist(), strict=True)
        return max((Version(lsn, seq) for lsn, seq in versions), default=None)

    def without(self, positions: set[tuple[int, int]]) -> ChangeBatch:
        """The batch without the events at ``(partition, offset)`` in ``positions``."""
        if not positions:
            return self
        return ChangeBatch(self.table, self.columns.without(positions), shard=self.shard)


@dataclass
class Touched:
    """What a micro-batch changed of one table, as a view from joins needs it
    (:mod:`sinks.warehouse.views`): the canonical key JSON of each of its events but TRUNCATE (a key
    change: both keys), and whether it truncated the table. Small and picklable: what a Spark task
    hands the driver instead of the events."""

    key_jsons: list[str] = field(default_factory=list)
    truncated: bool = False


def touched_of(batches: Iterable[ChangeBatch], into: dict[str, Touched] | None = None) -> dict[str, Touched]:
    """Per table (qualified name) what ``batches`` changed, added to ``into`` when given (the
    slices of one micro-batch)."""
    out = {} if into is None else into
    for b in batches:
        if not len(b):
            continue
        t = out.setdefault(b.table.qualified, Touched())
        rows = b.columns.table
        is_t = pc.equal(rows.column("op"), "t")
        t.key_jsons.extend(rows.column("key_json").filter(pc.invert(is_t)).to_pylist())
        t.truncated = t.truncated or bool(pc.any(is_t).as_py())
    return out


def shard_of(key_json: str, shards: int) -> int:
    """The shard of a key among ``shards``: the log-store partition the reader puts it in when the
    topic has ``shards`` partitions (Kafka's murmur2 of the key's canonical JSON), so that a Spark task
    reading one partition's records owns one shard of every sink's data."""
    return partition_for(key_json.encode(), shards)


def order(ev: ChangeEvent) -> tuple[int, int, int, int]:
    """Sort key: (version, partition, offset) as plain ints (Version's dataclass comparisons are slow)."""
    v = ev.version
    return (v.commit_lsn, v.seq, ev.partition, ev.offset)


class Sink(abc.ABC):
    """A derived table the apply job keeps equal to the source.

    Guarantees every sink gives (the apply job relies on them):

    * **Version guard.** A sink keeps, per key, the version (``(commit_lsn, seq)``,
      :class:`cdc.events.Version`) of what it stored and ignores an event whose version is not newer.
      Out-of-order and repeated events are harmless; a replayed dead letter never overwrites newer data.
    * **Deletes stick.** A delete's version is remembered for a retention window (default 7 days), so
      an older event for that key arriving later does not resurrect the row. A TRUNCATE's version is
      remembered the same way for the whole table.
    * **Unavailable TOAST values** (``ChangeEvent.unavailable``) keep the stored value; never null.
      For the ``c`` of a primary-key change that is the old key's row (:mod:`sinks.toast`). An event
      whose values no row holds is rejected (:meth:`reject`), never an error of the whole batch.
    * **A poison record never stops the others.** A value the sink cannot hold is reported by
      :meth:`reject` before any sink applies the batch; the job dead-letters that record and applies
      the rest.
    * **Written in the task, committed in the driver** -- a sink declaring :attr:`commits_in_driver`.
      In a Spark task of the apply (``spark_jobs/tasks.py``), after :meth:`defer_commits`, its
      :meth:`apply` writes data no reader sees yet and hands back what would make it visible; the
      driver, once every task of the micro-batch is done, passes all of them to
      :meth:`commit_deferred`: each table's writes of every task in one atomic commit carrying the
      batch's ``(app_id, batch_id)``. So a micro-batch is visible in such a sink whole or not at
      all; a task that dies leaves only unreferenced data (removed by the sink's own cleanup); a
      driver that dies before its commit replays the batch, and a replayed batch commits nothing
      twice. An empty write commits nothing. A sink not declaring it commits in :meth:`apply`, in a
      task only the shard the task owns (``ChangeBatch.shard``; the search index).
    * **It describes itself.** Its paths (:meth:`locations`, built by :mod:`cdc.paths` only), its
      rows for ``cdc verify`` (:meth:`read_back`) and its progress (:meth:`applied_batch`) come from
      the sink, so no other module knows where or how it stores a table. The describing methods
      only read: they never create a file, and may run while the apply job writes (they see its
      last commit).

    A sink is listed once, in :data:`sinks.all.SINKS` (no registration by import), and must then
    implement every describing method (``tests/sinks/test_contract.py`` checks each listed sink).
    Their defaults describe a sink that keeps nothing of any table: they exist for test doubles
    handed to the apply job directly, never for a listed sink.
    """

    #: the sink's name: in ``cdc status`` (one apply stage per table and sink), ``cdc verify``
    #: and the job's per-sink timings; also its section of ``cdc.toml`` when it has options
    name: str
    #: the sink writes in the task and commits in the driver (the guarantee above): it implements
    #: :meth:`defer_commits` and :meth:`commit_deferred`, which the apply calls instead of asking
    #: the sink's class
    commits_in_driver: ClassVar[bool] = False
    #: what :meth:`read_back` holds per key: ``rows`` or ``docs`` (``cdc verify --json`` reports
    #: their number as ``<name>_<unit>``: ``warehouse_rows``, ``search_docs``)
    unit: str = "rows"

    @classmethod
    def from_settings(cls, settings: Settings) -> Sink:
        """The sink of ``settings.state_dir`` with its options (``cdc.toml``, section :attr:`name`;
        ConfigError naming the fix for an invalid one). Called once per apply job or ``cdc verify``
        run; creates no file (a table's files appear on its first :meth:`apply`)."""
        raise NotImplementedError(f"{cls.__name__} is not built from settings")

    @classmethod
    def locations(cls, state_dir: Path, reg: TableReg) -> dict[str, Path]:
        """Where the sink keeps ``reg``: role -> path (in ``docs/architecture.md``'s state layout),
        each built by a function of :mod:`cdc.paths` (inside the state directory, names made safe).
        Empty when the sink keeps nothing for the table (the index of a table without search
        columns): the sink then has no apply stage for it in ``cdc status`` and no check in
        ``cdc verify``. Pure: the paths need not exist."""
        return {}

    @classmethod
    def listing(cls, state_dir: Path, reg: TableReg) -> dict[str, Any]:
        """The sink's entry in a table's ``cdc tables list --json`` object (merged into it).
        Default: ``{name: {role: path}}`` of :meth:`locations`, ``{name: None}`` when empty."""
        where = cls.locations(state_dir, reg)
        return {cls.name: {role: str(p) for role, p in where.items()} if where else None}

    def read_back(self, reg: TableReg, only: KeyRanges | None = None) -> ReadBack | None:
        """What the sink holds of ``reg`` now, for ``cdc verify``: its live rows
        (:class:`StoredRows`) or the texts it indexed (:class:`StoredTexts`), deleted keys left
        out; None when it keeps nothing for the table (empty :meth:`locations`). With ``only``, at
        least the rows or documents of those key ranges, and the whole table's count. Reads the last
        committed state; raises (:class:`cdc.errors.ApplyError` for a known cause) when the stored
        data cannot be read -- verify then fails, it never reports a partial comparison."""
        return None

    def applied_batch(self, reg: TableReg, app_id: str) -> int | None:
        """The sink's own progress on ``reg``: the newest micro-batch of the job ``app_id`` whose
        changes to the table it committed (None: none yet, or it keeps nothing for the table).
        This is its resume state, kept with its data in the same commit: :meth:`apply` of a batch
        id at or below it is a replay and changes nothing. A table gets a batch id only from
        batches holding its records, so the gap to the job's newest batch says how far behind the
        sink is only together with the table's offsets."""
        return None

    def shards(self, reg: TableReg) -> int | None:
        """How many shards the sink keeps ``reg``'s data in (a key's shard: :func:`shard_of`): a
        micro-batch of the table may be applied as that many slices in parallel
        (``ChangeBatch.shard``) when the topic has as many partitions. 1: the table's batch must be
        applied whole (not sharded, or not created yet: :meth:`prepare` with a sample may create
        it, else one task does). None: the sink keeps nothing of the table. Reads only."""
        return None

    def live_rows(self, reg: TableReg) -> int | None:
        """About how many rows the sink holds of ``reg`` now, from its metadata (None: it does not
        say; the default). The apply cuts a sharded table's micro-batch into one slice per shard
        only when the table is large enough for a slice's rewrite to outweigh its fixed cost
        (:class:`spark_jobs.tasks.Planner`). Reads only."""
        return None

    def prepare(  # noqa: B027 - optional hook
        self, reg: TableReg, sample: Callable[[], tuple[ChangeBatch | None, float]] | None = None
    ) -> None:
        """Called by the apply's driver before a micro-batch of ``reg`` is applied in tasks: bring
        the table's metadata in line with the registration (new, dropped or widened columns), so
        that the tasks, which may run at once, only write data.

        ``sample`` (given for a micro-batch large enough to be applied in one task per shard, while
        :meth:`shards` still says 1): a sink that has not created the table yet and whose layout
        depends on its rows may call it, once, for some of the batch's records, parsed, and the
        fraction of the batch's records they are (1.0: all); it then creates the table -- empty,
        with the layout (shards, clustering) those rows decide, as its :meth:`apply` of the whole
        batch would have -- so that the tasks find it and the batch is cut into one slice per
        shard. Guarantees: writes no row and no batch id (the tasks write, the driver commits, as
        for any batch); idempotent: a table that exists is never re-created nor its layout changed,
        so a call repeated after a crash at any point (tables created, batch not committed) is
        harmless and the replayed batch keeps the layout already created. Without ``sample``, or
        when it returns no batch, it never creates the table (the batch's one task does)."""

    def recover(self, reg: TableReg) -> int:
        """Called by ``cdc apply`` once as it starts, holding the apply lock, before its first
        micro-batch: no write of this sink to ``reg`` is in flight anywhere (the job is the tables'
        only writer, and a killed job's tasks died with it), so what killed writes left behind --
        files no commit references -- may be deleted. Never changes what a reader sees. Returns
        the bytes freed. The default: nothing to do."""
        return 0

    def stored_before(self, reg: TableReg) -> Stored | None:
        """The committed rows this sink keeps of ``reg``, as a lookup of a key's row just before a
        version, in event encoding (:data:`sinks.toast.Stored`); None: it keeps no rows (the
        default). Called in a Spark task: a primary-key change whose old key lives in another shard
        takes its unchanged TOAST columns from the first sink that answers
        (:func:`spark_jobs.tasks.complete_moves`), so the answer must be the state committed before
        the micro-batch, whatever this batch's tasks write beside it."""
        return None

    def in_task(self) -> None:  # noqa: B027 - optional hook
        """Called in a Spark task of the apply (``spark_jobs/tasks.py``) before the sink applies
        anything: a sink may then keep what it opens for the next tasks this process runs (a Python
        worker runs one task at a time), e.g. the warehouse's open Delta tables. What it keeps must
        give the same results as opening anew (brought up to date at each use)."""

    def committed(self, reg: TableReg, batch_id: int) -> None:  # noqa: B027 - optional hook
        """Called by the apply's driver once the writes of micro-batch ``batch_id`` of ``reg`` that
        the tasks left to it are committed: periodic maintenance belongs here, never in a task. A
        sink may hand it to a thread of its own and return before it is done; it then waits for it
        in :meth:`await_maintenance`, before its next write."""

    def await_maintenance(self) -> None:  # noqa: B027 - optional hook
        """Called by the apply's driver before it commits a batch (:meth:`commit_deferred`): wait for
        the maintenance :meth:`committed` left running, raising its error."""

    def maintain_phases(self) -> dict[str, float]:
        """The seconds per step of the maintenance done since the last call (for the batch's
        report: ``maintain <sink> <step>``); empty by default."""
        return {}

    def defer_commits(self, into: list[Any] | None) -> None:
        """Only for a sink with :attr:`commits_in_driver`, called in a Spark task before it applies
        a slice: with a list, :meth:`apply` from now on commits nothing and appends to ``into``
        what :meth:`commit_deferred` commits (picklable: it travels to the driver); with None, it
        commits its own writes again. Maintenance then waits for :meth:`committed`."""
        raise NotImplementedError(f"{type(self).__name__} commits its own writes (commits_in_driver)")

    def commit_deferred(self, writes: Sequence[Any], app_id: str, batch_id: int) -> None:
        """Only for a sink with :attr:`commits_in_driver`, called by the apply's driver once every
        task of micro-batch ``batch_id`` is done: commit ``writes`` (what :meth:`apply` appended
        in every task, in any order) as described on the class -- one commit per table, carrying
        ``(app_id, batch_id)``; a table whose write was computed from another table as it was before
        the batch commits after it, so that a replay after some tables committed computes the others'
        writes as the first run did. Raises when a table refuses (another writer replaced what a task
        read), committing no table that comes after it: the job fails the batch and Spark replays
        it."""
        raise NotImplementedError(f"{type(self).__name__} commits its own writes (commits_in_driver)")

    def reject(self, batch: ChangeBatch) -> list[Rejection]:
        """The events of ``batch`` this sink cannot hold (a value outside what its storage represents),
        each with the reason. Called per table per micro-batch, before any sink's :meth:`apply`, and
        again on the batch without the events rejected so far until no sink rejects more (an event
        may rely on one rejected before it: an update lacking its unchanged TOAST values on the
        rejected insert); pure (writes nothing). The job removes the rejected events from the batch
        for every sink. The default: none."""
        return []

    @abc.abstractmethod
    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        """Apply one table's micro-batch (without its rejected events). Called once per table per
        micro-batch, from one thread at a time, possibly again with the same ``(app_id, batch_id)``
        after a crash (Spark replays a failed batch with the same id and offsets): it must then be a
        no-op or give the same result. Version-guarded as described on the class. Raises on a failure
        of the sink itself (:class:`cdc.errors.ApplyError` for a known cause); the job then fails the
        micro-batch, which Spark retries from its checkpoint -- nothing is skipped."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the sink is not used afterwards."""


def columns_of(table: TableReg, events: Sequence[ChangeEvent]) -> Columns:
    """``events`` (in version order) as :class:`Columns` (not ``plain``): every event, TRUNCATEs too,
    with what the events carry beyond the plain columns (see there): :meth:`Columns.afters` gives
    their ``after`` values back."""
    afters = [e.after for e in events]
    names = [c.name for c in table.columns if c.name not in table.exclude]
    seen = set(names)
    pg = {c.name: c.type for c in table.columns}
    for e in events:  # every column an event names, in the order the events name them
        for name in (*(e.after or ()), *(e.before or ()), *e.unavailable):
            if name not in seen:
                seen.add(name)
                names.append(name)
        if e.version.commit_lsn >= 1 << 63 or e.version.seq >= 1 << 63:
            raise ApplyError(f"version {e.version} does not fit int64", fix="report this source")
    keys = [None if e.op == "t" else e.key for e in events]
    key, text = _struct(keys, list(table.key), pg)
    after, text = _struct(afters, names, pg, text)
    if not text.isdisjoint(table.key):  # a key column held as JSON text: in both structs
        key, _ = _struct(keys, list(table.key), pg, text)

    def names_of(rows: Iterable[Sequence[str]]) -> pa.Array:
        return pa.array([list(r) if r else None for r in rows], NAMES)

    cols = {
        "key_json": pa.array([e.key_json for e in events], pa.string()),
        "op": pa.array([e.op for e in events], pa.string()),
        "commit_lsn": pa.array([e.version.commit_lsn for e in events], pa.int64()),
        "seq": pa.array([e.version.seq for e in events], pa.int64()),
        "ts_ms": pa.array([e.ts_ms for e in events], pa.int64()),
        "partition": pa.array([e.partition for e in events], pa.int32()),
        "offset": pa.array([e.offset for e in events], pa.int64()),
        "snapshot": pa.array([e.snapshot for e in events], pa.bool_()),
        "key": key,
        "after": after,
        "unavailable": names_of(e.unavailable for e in events),
        "absent": names_of(
            [n for n in names if n not in a and n not in e.unavailable] if a is not None else ()
            for e, a in zip(events, afters, strict=True)
        ),
        "before": pa.array(
            [None if e.before is None else orjson.dumps(e.before).decode() for e in events], pa.large_string()
        ),
    }
    return Columns(pa.table(cols), plain=False, json_fields=text)


def _struct(
    rows: Sequence[dict[str, Any] | None],
    names: Sequence[str],
    pg: Mapping[str, str | None],
    forced: frozenset[str] = frozenset(),
) -> tuple[pa.StructArray, frozenset[str]]:
    """Per-row dicts (None: a null row) as a struct of ``names``: a field in its :func:`json_type`
    when every value is exactly of that JSON type and it is not in ``forced``, else JSON text; returns
    the struct and ``forced`` with the names held as JSON text."""
    valid = pa.array([r is not None for r in rows], pa.bool_())
    arrays: list[pa.Array] = []
    text = set(forced)
    for name in names:
        values = [None if r is None else r.get(name) for r in rows]
        arr = None if name in text else typed_array(values, json_type(pg.get(name)))
        if arr is None:
            text.add(name)
            arr = pa.array(
                [None if v is None else orjson.dumps(v).decode() for v in values], pa.large_string()
            )
        arrays.append(arr)
    mask = pc.invert(valid) if len(rows) else None
    struct = (
        pa.StructArray.from_arrays(arrays, names=list(names), mask=mask)
        if names
        else pa.nulls(len(rows), pa.struct([]))
    )
    return struct, frozenset(text)
