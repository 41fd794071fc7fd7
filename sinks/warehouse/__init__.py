"""The warehouse sink: per registered table a current-state and a history Delta table (``deltalake``).

The tables, their meta columns, the guarantees of :meth:`WarehouseSink.apply` and what a batch costs
are described in ``docs/warehouse.md``. Parts: :mod:`.layout` (meta columns, paths, options, bucket
clustering), :mod:`.plan` (the decisions -- which events apply, what closes each history row, which
rows the current and tombstone tables get, where an unchanged TOAST value comes from -- pure Arrow),
:mod:`.columnar` (the source rows of a batch, from the plan), :mod:`.fill` (the unchanged TOAST
values), :mod:`.stored` (stored rows in event encoding) and :mod:`.delta` (the Delta file writes and
reads).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Schema, Transaction

from cdc import sink_locations
from cdc.errors import ApplyError
from cdc.registry import TableReg
from sinks import ChangeBatch, KeyRanges, Rejection, Sink, StoredRows
from sinks import types as T
from sinks.toast import Stored
from sinks.warehouse import background, compact, evolve, leases, reclaim
from sinks.warehouse import stored as lookups
from sinks.warehouse.delta import (
    Commit,
    arrow_schema,
    layout_of,
    not_applied,
    read_all,
    read_spans,
    ts_literal,
)
from sinks.warehouse.files import TableWrite, commit_all
from sinks.warehouse.handles import TASK_HANDLES, Handles, mark, refresh
from sinks.warehouse.layout import (
    BUCKET,
    CURRENT_META,
    END_LSN,
    END_OP,
    END_SEQ,
    HISTORY_META,
    HISTORY_PARTITIONS,
    HISTORY_RESERVED,
    IS_CURRENT,
    KEY,
    LAYOUT_CONF,
    LSN,
    META_PREFIX,
    OP,
    SEQ,
    TOMBSTONES,
    TRUNCATE_MARKER,
    TS,
    VALID_FROM,
    VALID_TO,
    Layout,
    WarehouseOptions,
    bucket_of,
    table_paths,
)

if TYPE_CHECKING:
    from cdc.config import Settings

__all__ = [
    "BUCKET",
    "DROPPED_CONF",
    "END_LSN",
    "END_OP",
    "END_SEQ",
    "IS_CURRENT",
    "KEY",
    "LSN",
    "OP",
    "SEQ",
    "TRUNCATE_MARKER",
    "TS",
    "VALID_FROM",
    "VALID_TO",
    "Layout",
    "WarehouseOptions",
    "WarehouseSink",
    "bucket_of",
    "table_paths",
]


class WarehouseSink(Sink):
    """Delta Lake current-state + history tables per registered table (see the module docstring).

    Not thread-safe; one writer per table at a time (the apply job): the maintenance the driver
    hands to its own thread (:meth:`committed`, :mod:`.background`) is waited for before any other
    write of the sink's (:meth:`await_maintenance`). ``last_metrics`` holds the write
    metrics of the last :meth:`apply` per table kind (``current``/``history``,
    :meth:`.files.TableWrite.metrics`): ``num_target_files_removed``/``_added`` (files rewritten),
    ``num_target_rows_updated``/``_inserted``/``_deleted``.

    Memory is proportional to the batch (Python rows, then Arrow): load a large table in batches of
    ~100k events. Measured costs: ``docs/benchmarks/apply.md``.
    """

    name = "warehouse"
    commits_in_driver = True
    #: how a batch's rows reach its tables (:class:`.delta.Commit`: the file writes); a test oracle
    #: may put another write method here (``tests/sinks/merge_oracle.py``: delta-rs' MERGE)
    commit_type: ClassVar[type[Commit]] = Commit

    def __init__(self, state_dir: Path, options: WarehouseOptions | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.options = options or WarehouseOptions()
        self.last_metrics: dict[str, dict[str, Any]] = {}
        #: None commits each write at once; a list (:meth:`defer_commits`) collects the writes
        #: instead (:class:`sinks.warehouse.files.TableWrite`), for :meth:`commit_deferred`
        self.pending: list[TableWrite] | None = None
        #: per table (qualified name), the layout its tables get when created, instead of
        #: :meth:`Layout.choose`'s: ``cdc rebuild`` gives a staged copy the live table's, which the
        #: kept history table has (the three tables of a table must agree on it)
        self.layouts: dict[str, Layout] = {}
        #: open Delta tables, brought up to date at each use instead of opened anew (per thread)
        self.handles = Handles()
        #: the tables' bytes on disk, kept from their logs between walks (:class:`.reclaim.DiskTracker`)
        self.disk = reclaim.DiskTracker()
        #: what the last batch's incremental compaction did (:func:`.compact.step`)
        self.last_compaction = compact.Compacted()
        #: (batch id, seconds its tables' compactions spent): the budget is per batch; one for the
        #: driver's compactions, one for the maintenance thread's
        self._compacted: tuple[int, float] = (-1, 0.0)
        self._compacted_behind: tuple[int, float] = (-1, 0.0)
        #: the maintenance after the driver's commits, on a thread of its own (:meth:`committed`)
        self.background = background.Maintenance()
        #: per table (qualified name), the partitions a batch may rewrite that the last round found
        #: with small files to compact (:func:`.compact.due`): the driver compacts them
        self._due: dict[str, list[compact.Todo]] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> WarehouseSink:
        return cls(Path(settings.state_dir), WarehouseOptions.from_settings(settings))

    def paths(self, reg: TableReg) -> tuple[Path, Path, Path]:
        """``(current, history, tombstones)`` paths of a table."""
        return table_paths(self.state_dir, reg)

    # -- where it lives, what it holds (sinks.Sink) ----------------------------------------------------
    @classmethod
    def locations(cls, state_dir: Path, reg: TableReg) -> dict[str, Path]:
        """Every table: ``current``, ``history``, ``tombstones`` (:func:`cdc.sink_locations.warehouse`)."""
        return sink_locations.warehouse(state_dir, reg)

    @classmethod
    def listing(cls, state_dir: Path, reg: TableReg) -> dict[str, Any]:
        """``{"warehouse": {"current": path, "history": path}}`` (the tombstones are internal)."""
        where = cls.locations(state_dir, reg)
        return {cls.name: {"current": str(where["current"]), "history": str(where["history"])}}

    def read_back(self, reg: TableReg, only: KeyRanges | None = None) -> StoredRows:
        """The current-state table with its meta columns (``table`` None before the first apply).
        With ``only``: the rows of those key ranges, only the data columns and the version
        (:func:`.delta.read_spans`: a range layout reads only the buckets they reach), and the
        table's row count."""
        path = self.paths(reg)[0]
        with leases.lease(path, self.options.lease_max_age_s):
            if not DeltaTable.is_deltatable(str(path)):
                return StoredRows(None, LSN, 0 if only is not None else None)
            if only is None:
                return StoredRows(read_all(path, reg, True), LSN)
            columns = [*_columns(reg, ()), LSN]
            rows, total = read_spans(DeltaTable(str(path)), reg, only.spans, columns)
            return StoredRows(rows, LSN, total)

    def applied_batch(self, reg: TableReg, app_id: str) -> int | None:
        """The batch of ``app_id`` all three tables committed (each commit carries it as its Delta
        app transaction); None before the table's first batch."""
        done: list[int | None] = []
        for path in self.paths(reg):
            if not DeltaTable.is_deltatable(str(path)):
                return None
            done.append(DeltaTable(str(path)).transaction_version(app_id))
        return None if None in done else min(d for d in done if d is not None)

    # -- apply ---------------------------------------------------------------------------------------
    def reject(self, batch: ChangeBatch) -> list[Rejection]:
        """The events holding a value a Delta column cannot store (:func:`sinks.types.unstorable`):
        a BC date, a year past 9999, a numeric NaN/Infinity or too many digits for ``numeric(p,s)``.
        Also every non-null value of a column whose type changed at the source in a way the stored
        column cannot hold (:func:`.evolve.changes`). Writes nothing; reads only the current table's
        schema. See :meth:`sinks.Sink.reject`."""
        reg = batch.table
        types = {c.name: c.type for c in reg.columns if c.name not in reg.exclude}
        # a type changed at the source that the stored column cannot hold: every non-null value of it
        _widened, refused = evolve.changes(reg, self._stored_types(self.paths(reg)[0]))
        for name in refused:
            types.pop(name, None)
        cols = batch.columns
        t = cols.table
        names = set(cols.names()) if len(cols) else set()
        bad: dict[int, list[str]] = {}
        if refused:
            after = t.column("after").combine_chunks()
            for name, why in refused.items():
                if name in names:
                    valid = pc.is_valid(pc.struct_field(after, [name])).to_pylist()
                    for i, ok in enumerate(valid):
                        if ok:
                            bad.setdefault(i, []).append(why)
        for name, pg in types.items():
            if name not in names:
                continue
            try:
                cols.stored_values(name, pg)  # converted once, kept for apply
            except ApplyError:
                for i, why in cols.unstorable(name, pg).items():
                    bad.setdefault(i, []).append(f"column {name}: {why}")
        positions = list(zip(t.column("partition").to_pylist(), t.column("offset").to_pylist(), strict=True))
        if cols.lacks_values():  # unchanged TOAST values no row holds, once the rows above are gone
            at = {p: i for i, p in enumerate(positions)}
            kept = cols.without({positions[i] for i in bad})
            chains, rows = lookups.unresolved(reg, kept, [str(p) for p in self.paths(reg)])
            for r, pos in zip(rows, kept.positions(rows), strict=True):
                bad.setdefault(at[pos], []).append(_unresolved_reason(chains.op(r), chains.unavailable(r)))
        return [Rejection(*positions[i], "; ".join(bad[i])) for i in sorted(bad)]

    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        """See :class:`sinks.Sink` and the module docstring. An empty batch writes nothing."""
        reg = batch.table
        self.last_metrics = {}
        if not len(batch):
            return
        if self.pending is None:  # it commits here: never beside a maintenance round
            self.await_maintenance()
        columns = _columns(reg, batch.columns.names())
        current, history, tombs = self._open_tables(
            reg,
            columns,
            lambda: (
                self.layouts.get(reg.qualified)
                or Layout.choose(reg, self.options, lambda: _key_values(batch), lambda: _row_bytes(batch))
            ),
        )
        layout = layout_of(current)
        todo = [
            (name, table)
            for name, table in (("history", history), ("current", current), ("tombstones", tombs))
            if not_applied(table, app_id, batch_id)
        ]
        if not todo:
            return
        commit = self.commit_type(
            CommitProperties(app_transactions=[Transaction(app_id, version=batch_id)]),
            pending=self.pending,
            shard=None if batch.shard is None else (batch.shard, layout.shards),
        )
        # the apply's only: a process that reads the warehouse back (cdc verify) never loads it
        from sinks.warehouse.columnar import ColumnarApply

        fast = ColumnarApply(reg, batch.columns, columns, layout, tombs, current, history)
        _check_shard(reg, layout, batch.shard, fast.key_bucket)
        for name, _table in todo:
            if name == "history":
                self.last_metrics["history"] = fast.history(history, commit)
            elif name == "current":
                self.last_metrics["current"] = fast.current(current, commit)
            else:
                fast.tombstones(tombs, commit)
        if self.pending is None:  # deferred: the committer calls committed() after its commit
            self._maintain_after(reg, batch_id)

    def shards(self, reg: TableReg) -> int | None:
        """See :meth:`sinks.Sink.shards`: the current table's :class:`Layout` shards; 1 before the
        table exists."""
        cur = self.handles.get(self.paths(reg)[0])
        return 1 if cur is None else layout_of(cur).shards

    def live_rows(self, reg: TableReg) -> int | None:
        """See :meth:`sinks.Sink.live_rows`: the current table's rows by its files' statistics (0
        before it exists)."""
        cur = self.handles.get(self.paths(reg)[0])
        if cur is None:
            return 0
        counts = pa.table(cur.get_add_actions(flatten=True)).column("num_records")
        return int(pc.sum(counts).as_py() or 0)

    def prepare(
        self, reg: TableReg, sample: Callable[[], tuple[ChangeBatch | None, float]] | None = None
    ) -> None:
        """See :meth:`sinks.Sink.prepare`: the registration's columns added, a widened type cast, the
        dropped columns recorded -- on tables that exist. A missing table is created only with a
        ``sample`` (:meth:`create_from_sample`), else by its first batch."""
        self.await_maintenance()  # it may commit (columns added, types cast): never beside a round
        cur = self.handles.get(self.paths(reg)[0])
        if cur is not None:
            layout = layout_of(cur)
            self._open_tables(reg, _columns(reg, ()), lambda: layout)
        elif sample is not None:
            self.create_from_sample(reg, sample)

    def create_from_sample(
        self, reg: TableReg, sample: Callable[[], tuple[ChangeBatch | None, float]]
    ) -> None:
        """Create ``reg``'s three tables, empty, with the layout :meth:`Layout.choose` picks from
        ``sample()`` (some of a batch's records, parsed, and the fraction of the batch they are; the
        layout :attr:`layouts` gives instead, when it has one), and the columns the batch brings;
        nothing when the sample holds no event. Creating is idempotent (``mode="ignore"``; a crash
        between the three creates is resumed by :meth:`_open_tables`), and writes no row: the
        batch's tasks then write one shard each, the driver commits."""
        self.await_maintenance()
        batch, fraction = sample()
        if batch is None or not len(batch):
            return
        layout = self.layouts.get(reg.qualified) or Layout.choose(
            reg,
            self.options,
            lambda: _key_values(batch),
            lambda: _row_bytes(batch),
            sampled=fraction,
        )
        self._open_tables(reg, _columns(reg, batch.columns.names()), lambda: layout)

    def _open_tables(
        self, reg: TableReg, columns: dict[str, str | None], layout: Callable[[], Layout]
    ) -> tuple[DeltaTable, DeltaTable, DeltaTable]:
        """The table's (current, history, tombstones), created with ``layout()`` when missing, and
        brought in line with ``columns`` (added; a safe type change at the source cast once; a
        refused one keeps the stored type) and the registration's dropped columns."""
        cur_path, hist_path, tomb_path = self.paths(reg)
        _refuse_lost_tables(reg, (cur_path, hist_path, tomb_path))
        stored = self._stored_types(cur_path) or {}
        widened, refused = evolve.changes(reg, stored)
        for name in refused:  # its non-null values were rejected: the stored type stays
            columns[name] = evolve.pg_type_of(stored[name]) or columns[name]
        if widened:  # a safe type change at the source: cast the stored column, once
            for path in (hist_path, cur_path):
                if DeltaTable.is_deltatable(str(path)):
                    evolve.widen(path, widened)
        current = self._ensure(cur_path, columns, CURRENT_META, layout)
        chosen = layout_of(current)
        history = self._ensure(hist_path, columns, HISTORY_META, lambda: chosen, HISTORY_PARTITIONS)
        tombs = self._ensure(tomb_path, {}, TOMBSTONES, lambda: chosen)
        current = _mark_dropped(current, reg)
        history = _mark_dropped(history, reg)
        if layout_of(history) != chosen or layout_of(tombs) != chosen:
            raise ApplyError(
                f"the warehouse tables of {reg.qualified} disagree on their layout (cdc.layout)",
                fix=f"delete {cur_path.parent}/{cur_path.name}* and re-snapshot the table",
            )
        return current, history, tombs

    def defer_commits(self, into: list[Any] | None) -> None:
        """See :meth:`sinks.Sink.defer_commits`: with a list, every write's
        :class:`~sinks.warehouse.files.TableWrite` is appended there, not committed."""
        self.pending = into

    def commit_deferred(self, writes: Sequence[Any], app_id: str, batch_id: int) -> None:
        """See :meth:`sinks.Sink.commit_deferred`: :func:`sinks.warehouse.files.commit_all` with
        the batch's Delta application transaction, once the maintenance of the batches before is done
        (:meth:`await_maintenance`)."""
        self.await_maintenance()
        commit_all(
            writes,
            CommitProperties(app_transactions=[Transaction(app_id, version=batch_id)]),
            self.handles.get,
        )

    def in_task(self) -> None:
        """See :meth:`sinks.Sink.in_task`: the process's Delta handles (:data:`.handles.TASK_HANDLES`)."""
        self.handles = TASK_HANDLES

    def committed(self, reg: TableReg, batch_id: int) -> None:
        """See :meth:`sinks.Sink.committed`: the table's maintenance after the batch, most of it on
        the maintenance thread (:mod:`.background`, ``docs/warehouse.md``, Maintenance), whose round
        the next batch's commit waits for, not this call: the disk rule (:func:`.reclaim.after_batch`),
        then the compaction of the partitions batches only append to (the history's closed rows,
        :func:`.compact.append_only`) within the batch's ``compact_budget_s``. Here, in the driver:
        the compaction of the partitions a batch may rewrite (:func:`.compact.rewritten`: a bucket's
        new keys, the tombstones) that the table's last round found due (:func:`.compact.due`;
        none: no listing here; planned again if the batch changed the table), within the same
        budget; and every ``maintain_every`` batches :meth:`maintain`, once the rounds before are
        done.
        ``maintain_in_background`` false: all of it here, in line (:meth:`_maintain_after`)."""
        if not self.options.maintain_in_background:
            with self.background.timed("inline"):
                self._maintain_after(reg, batch_id)
            return
        if reclaim.due(self.options.maintain_every, batch_id):
            self.await_maintenance()
            with self.background.timed("full"):
                self._maintain_after(reg, batch_id)
            return
        todo = self._due.pop(reg.qualified, [])
        if todo:
            with self.background.timed("compact"):
                self._compacted = self._compact(reg, batch_id, self._compacted, compact.rewritten, todo)
        self.background.submit(lambda: self._round(reg, batch_id))

    def await_maintenance(self) -> None:
        """See :meth:`sinks.Sink.await_maintenance`: wait for the maintenance rounds handed to the
        maintenance thread (raising the first one's error)."""
        self.background.wait()

    def maintain_phases(self) -> dict[str, float]:
        """See :meth:`sinks.Sink.maintain_phases`: ``compact`` (the driver's, rewritten partitions),
        ``full`` (a batch's :meth:`maintain`), ``inline`` (all of it, ``maintain_in_background``
        false); of the rounds on the maintenance thread: ``round`` and its steps ``open`` (the
        tables brought up to date), ``vacuum``, ``bound`` (the ratio: its ``usage`` and
        ``reclaim``), ``listing`` (the partitions with a compaction due) and ``closed`` (the
        closed rows' compaction)."""
        return self.background.phases()

    def _round(self, reg: TableReg, batch_id: int) -> None:
        """A round on the maintenance thread: the disk rule first (so that it deletes only files a
        commit of this batch or before superseded), then the compaction of the append-only
        partitions within the budget (:mod:`.background`)."""
        reclaim.after_batch(
            self.paths(reg),
            self.options,
            batch_id,
            open_table=self.handles.get,
            tracker=self.disk,
            timed=self.background.add,
        )
        with self.background.timed("listing"):
            todo = compact.due(
                self.paths(reg),
                self.handles.get,
                target_size=self.options.target_file_size,
                min_files=self.options.compact_min_files,
            )
        self._due[reg.qualified] = [t for t in todo if compact.rewritten(t.partition)]
        with self.background.timed("closed"):
            self._compacted_behind = self._compact(
                reg, batch_id, self._compacted_behind, compact.append_only, todo
            )

    def _compact(
        self,
        reg: TableReg,
        batch_id: int,
        spent: tuple[int, float],
        where: compact.Where | None,
        todo: list[compact.Todo] | None = None,
    ) -> tuple[int, float]:
        """:func:`.compact.step` on ``reg``'s tables' partitions ``where`` accepts (of ``todo``,
        default: listed now), within what is left of the batch's budget (``spent``: the batch and
        seconds spent so far); the new ``spent``."""
        opts = self.options
        used = spent[1] if spent[0] == batch_id else 0.0
        self.last_compaction = compact.step(
            self.paths(reg),
            self.handles.get,
            target_size=opts.target_file_size,
            budget_s=max(opts.compact_budget_s - used, 0.0),
            min_files=opts.compact_min_files,
            where=where,
            todo=todo,
        )
        return (batch_id, used + self.last_compaction.seconds)

    def _maintain_after(self, reg: TableReg, batch_id: int) -> None:
        """Every ``maintain_every`` batches :meth:`maintain` (compaction and the full vacuum), else
        the incremental compaction within what is left of the batch's ``compact_budget_s``
        (:func:`.compact.step`), then the
        disk rule every Delta table of the project follows (:func:`.reclaim.after_batch`)."""
        maintained = reclaim.due(self.options.maintain_every, batch_id)
        if maintained:
            self.maintain(reg)
        else:  # the budget is the batch's, shared by its tables in turn
            self._compacted = self._compact(reg, batch_id, self._compacted, None)
        reclaim.after_batch(
            self.paths(reg),
            self.options,
            batch_id,
            vacuumed=maintained,
            open_table=self.handles.get,
            tracker=self.disk,
        )

    def recover(self, reg: TableReg) -> int:
        """See :meth:`sinks.Sink.recover`: each of ``reg``'s Delta tables loses the files that killed
        writes left (:func:`.reclaim.orphans`: no commit ever referenced them; the periodic full vacuum
        would take them only after ``vacuum_retention_hours``), then is brought within its garbage
        ratio (:func:`.reclaim.bound`), which until now ran only after a committed batch -- a job
        killed before every commit freed nothing. Returns the bytes deleted."""
        self.await_maintenance()
        tables = {p: t for p in self.paths(reg) if (t := self.handles.get(p)) is not None}
        freed = sum(reclaim.orphans(path, table)[1] for path, table in tables.items())
        return freed + reclaim.bound(tables, self.options, tables.get).bytes

    def _ensure(
        self,
        path: Path,
        columns: dict[str, str | None],
        meta: pa.Schema,
        layout: Callable[[], Layout],
        partitions: Sequence[str] = (BUCKET,),
    ) -> DeltaTable:
        """Open the table, creating it (with the layout ``layout()`` gives, partitioned by
        ``partitions``) or adding missing columns (old rows null)."""
        wanted = pa.schema([*meta, *((n, T.arrow_type(t or "text")) for n, t in columns.items())])
        table = self.handles.get(path)
        if table is None:
            path.mkdir(parents=True, exist_ok=True)
            created = DeltaTable.create(
                str(path),
                wanted,
                mode="ignore",
                partition_by=list(partitions),
                configuration={LAYOUT_CONF: layout().conf(), **reclaim.retention_conf(self.options)},
                raise_if_key_not_exists=False,
            )
            mark(path)
            return self.handles.put(path, created)
        have = set(arrow_schema(table).names)
        missing = [f for f in wanted if f.name not in have]
        if missing:
            table.alter.add_columns(list(Schema.from_arrow(pa.schema(missing)).fields))
            refresh(table)
        return table

    def _stored_types(self, path: Path) -> dict[str, pa.DataType] | None:
        """The Delta table's column types, or None when it does not exist yet."""
        table = self.handles.get(path)
        return None if table is None else {f.name: f.type for f in arrow_schema(table)}

    # -- maintenance ---------------------------------------------------------------------------------
    def maintain(
        self, reg: TableReg, *, compact: bool = True, vacuum_retention_hours: int | None = None
    ) -> dict[str, Any]:
        """Keep a table's Delta tables healthy: purge tombstones older than the retention, compact small
        files (``optimize.compact``) and vacuum files unreferenced for ``vacuum_retention_hours``
        (default from the options). Safe to run between batches; never changes what a reader sees.
        Returns per table ``{"compacted": metrics, "vacuumed": n_files}``."""
        self.await_maintenance()
        retention = (
            self.options.vacuum_retention_hours if vacuum_retention_hours is None else vacuum_retention_hours
        )
        out: dict[str, Any] = {}
        cur_path, hist_path, tomb_path = self.paths(reg)
        if DeltaTable.is_deltatable(str(tomb_path)):
            cutoff_ms = int((time.time() - self.options.tombstone_retention_hours * 3600) * 1000)
            DeltaTable(str(tomb_path)).delete(f"deleted_at < {ts_literal(cutoff_ms)}")
        for name, path in (("current", cur_path), ("history", hist_path), ("tombstones", tomb_path)):
            if not DeltaTable.is_deltatable(str(path)):
                continue
            table = DeltaTable(str(path))
            entry: dict[str, Any] = {}
            if compact:
                entry["compacted"] = table.optimize.compact(target_size=self.options.target_file_size)
            entry["vacuumed"] = reclaim.vacuum_full(path, retention)
            out[name] = entry
        return out

    # -- reading ---------------------------------------------------------------------------------------
    # A read by another process than the apply's holds a lease on the table it reads (.leases): the
    # apply's reclaim keeps every file of the version it opened until it is done.
    def current_rows(self, reg: TableReg, *, meta: bool = True) -> pa.Table:
        """The current state of ``reg`` (one row per live key). ``meta=False`` drops the ``_cdc_*``
        columns. ApplyError when the table was never applied."""
        with leases.lease(self.paths(reg)[0], self.options.lease_max_age_s):
            return read_all(self.paths(reg)[0], reg, meta)

    def history_rows(self, reg: TableReg, *, meta: bool = True) -> pa.Table:
        """Every history row of ``reg`` (see the module docstring for the meta columns)."""
        with leases.lease(self.paths(reg)[1], self.options.lease_max_age_s):
            return read_all(self.paths(reg)[1], reg, meta)

    def stored_before(self, reg: TableReg) -> Stored:
        """What the committed history holds for a key of ``reg`` just before a version, in event
        encoding (:data:`sinks.toast.Stored`): a primary-key change's old row, as this sink would
        complete the change's unchanged TOAST columns from it."""
        return lookups.stored_before(reg, str(self.paths(reg)[1]), _columns(reg, ()))

    def tombstone_rows(self, reg: TableReg) -> pa.Table:
        """The internal tombstones (key_json, version, deleted_at); for tests and debugging."""
        return read_all(self.paths(reg)[2], reg, True)

    def close(self) -> None:
        """Wait for the maintenance thread's rounds (raising a round's error), and end it."""
        self.background.close()


def _check_shard(reg: TableReg, layout: Layout, shard: int | None, buckets: Sequence[int] | Any) -> None:
    """A batch that is one shard's slice (``shard``) must be of a sharded table and hold only that
    shard's keys: another task owns the rest (``ChangeBatch.shard``)."""
    if shard is None:
        return
    if layout.shards == 1:
        raise ApplyError(
            f"{reg.qualified}: a slice of shard {shard} was given, but its warehouse tables have one shard",
            fix="report this: the apply must give an unsharded table's events in one batch",
            table=reg.qualified,
        )
    strays = [int(b) for b in buckets if int(b) % layout.shards != shard]
    if strays:
        raise ApplyError(
            f"{reg.qualified}: the slice of shard {shard} (of {layout.shards}) holds keys of buckets "
            f"{sorted(set(strays))[:5]}, of other shards",
            fix="report this: a key's records must all be in its shard's log-store partition",
            table=reg.qualified,
            shard=shard,
        )


def _unresolved_reason(op: str, unavailable: Sequence[str]) -> str:
    what = "this primary-key change's old key" if op == "c" else "the key"
    return (
        f"the unchanged TOAST columns {list(unavailable)} were not sent, and neither the batch nor the "
        f"warehouse holds a row of {what} to take them from (fix: re-snapshot the table, then replay)"
    )


def _refuse_lost_tables(reg: TableReg, trio: tuple[Path, Path, Path]) -> None:
    """ApplyError when one of a table's three Delta tables is gone while another has applied
    batches. The three are created together, before the first batch commits, and every applied
    batch commits to the current and history tables; so a sibling past its creating commit (Delta
    version >= 1) proves the missing one existed: it was deleted, with every row applied to it, and
    creating it afresh would hide that. A missing table whose siblings are absent or only just
    created (a crash between the three creates) is created as usual."""
    missing = [p for p in trio if not DeltaTable.is_deltatable(str(p))]
    if not missing or len(missing) == len(trio):
        return
    applied = [p for p in trio if p not in missing and DeltaTable(str(p)).version() >= 1]
    if not applied:
        return
    others = " ".join(str(p) for p in trio if p not in missing)
    raise ApplyError(
        f"the warehouse table {missing[0]} of {reg.qualified} is gone, but {applied[0].name} holds "
        f"applied batches: it was deleted, with every row applied to it before; nothing was written",
        fix=f"rebuild {reg.qualified} from the source: delete the rest of its warehouse tables "
        f"(rm -r {others}), run `cdc snapshot {reg.qualified}`, and let `cdc apply` run: it creates "
        "them afresh and the snapshot fills them (the history restarts at the snapshot)",
        table=reg.qualified,
        missing=[str(p) for p in missing],
        path=str(missing[0]),
    )


def _columns(reg: TableReg, names: Sequence[str] = ()) -> dict[str, str | None]:
    """Data columns in order: the registration's (without the excluded ones), then any new ones a
    batch's events name (``names``: :meth:`sinks.columnar.Columns.names`; type unknown)."""
    cols: dict[str, str | None] = {c.name: c.type for c in reg.columns if c.name not in reg.exclude}
    # dropped at the source: kept in the warehouse, null from then on (docs/schema-changes.md)
    dropped_types = reg.extra.get("dropped_types", {})
    for name in reg.dropped_columns:
        if name not in cols and name not in reg.exclude:
            cols[name] = dropped_types.get(name)
    for name in names:
        if name not in cols:
            cols[name] = None
    bad = [c for c in cols if c.startswith(META_PREFIX) or c in HISTORY_RESERVED]
    if bad:
        raise ApplyError(
            f"{reg.qualified} has columns {bad} that clash with the warehouse's meta columns "
            f"({META_PREFIX}*, {', '.join(HISTORY_RESERVED)})",
            fix="exclude them (`cdc tables add ... --exclude COL`) or rename them at the source",
        )
    return cols


#: Delta table property listing the columns dropped at the source (kept, null from then on)
DROPPED_CONF = "cdc.dropped_columns"


def _mark_dropped(table: DeltaTable, reg: TableReg) -> DeltaTable:
    """Record the registration's dropped columns in the table's configuration (``cdc.dropped_columns``,
    comma-separated) when it says otherwise."""
    want = ",".join(reg.dropped_columns)
    if table.metadata().configuration.get(DROPPED_CONF, "") == want:
        return table
    table.alter.set_table_properties({DROPPED_CONF: want}, raise_if_not_exists=False)
    refresh(table)
    return table


def _row_bytes(batch: ChangeBatch) -> float:
    """The mean size of a batch's rows as its columns carry them (for :meth:`Layout.choose`; an
    upper bound of their Parquet size, which is compressed)."""
    t = batch.columns.table
    return float(t.column("after").nbytes / max(t.num_rows, 1))


def _key_values(batch: ChangeBatch) -> list[Any]:
    """The values of the first key column in a batch (for :meth:`Layout.choose`)."""
    col = batch.table.key[0]
    t = batch.columns.table
    keys = pc.struct_field(t.column("key").combine_chunks(), [col]).filter(pc.not_equal(t.column("op"), "t"))
    return batch.columns.values_of(col, keys)
