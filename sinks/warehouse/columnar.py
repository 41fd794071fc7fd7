"""The warehouse sink's write of a batch (:class:`sinks.columnar.Columns`, the one form).

The decisions come from :mod:`sinks.warehouse.plan`; this module turns them into the three tables'
source rows with Arrow over whole columns (the data columns converted from the batch's ``after``
struct; values kept as JSON text convert as the events' values do). A row lacking unchanged TOAST
values gets them from :mod:`.fill` (the key's earlier rows, its stored row, a key change's old row).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from cdc.events import Version
from cdc.registry import TableReg
from sinks.columnar import Columns
from sinks.warehouse.delta import (
    Commit,
    Truncate,
    arrow_schema,
    cast_to_field,
    confirming,
    current_versions,
    stored_guards,
)
from sinks.warehouse.fill import Filled, Lacking, fill
from sinks.warehouse.layout import (
    BUCKET,
    END_LSN,
    END_OP,
    END_SEQ,
    IS_CURRENT,
    KEY,
    LSN,
    OP,
    SEQ,
    SRC_KIND,
    TOMBSTONES,
    TRUNCATE_MARKER,
    TS,
    TS_TYPE,
    VALID_FROM,
    VALID_TO,
    Layout,
)
from sinks.warehouse.plan import NONE, HistoryPlan, Plan


def _take(arr: pa.Array | pa.ChunkedArray, rows: np.ndarray) -> pa.Array:
    """``arr`` at ``rows``; null where a row is NONE."""
    none = rows == NONE
    idx = pa.array(np.where(none, 0, rows), mask=none) if none.any() else pa.array(rows)
    return arr.take(idx)


class ColumnarApply:
    """One columnar batch of one table, planned once for the three tables' writes."""

    def __init__(
        self,
        reg: TableReg,
        columns: Columns,
        types: dict[str, str | None],
        layout: Layout,
        tombs: DeltaTable,
        current: DeltaTable,
        history: DeltaTable | None = None,
    ) -> None:
        self.reg = reg
        self.types = types
        self.plan = plan = Plan(columns.table)
        t = plan.t
        self.t = t
        self.ts_us = t.column("ts_ms").to_numpy() * 1000
        self.op = t.column("op").combine_chunks()
        self.keys = plan.keys
        self.key_list: list[str] = self.keys.to_pylist()
        first_values = columns.values_of(
            reg.key[0],
            pc.struct_field(
                t.column("key").combine_chunks().filter(pa.array(plan.first_of_key)), [reg.key[0]]
            ),
        )
        self.key_bucket = layout.buckets(reg, self.key_list, first_values)
        self.bucket_set = set(self.key_bucket.tolist())
        self.stored = stored_guards(tombs, self.keys, self.bucket_set, np.unique(plan.partition).tolist())
        self.columns = columns
        self._by_key: dict[str, pa.Array] = {}
        self._current = current
        self._history = history
        self._cur_versions: tuple[np.ndarray, np.ndarray] | None = None
        #: the rows lacking unchanged TOAST values (None: none does), their values once filled
        self.lacking = Lacking.of(plan, columns) if columns.lacks_values() else None
        self._filled: Filled | None = None
        self._hp: HistoryPlan | None = None

    def current_versions(self) -> tuple[np.ndarray, np.ndarray]:
        """Per key, the version of its stored current row -- and so of its open history row -- ((-1,
        -1): none); read once from the current table as it was before the batch (written after the
        history, and only by :meth:`current`)."""
        if self._cur_versions is None:
            self._cur_versions = current_versions(self._current, self.keys, self.bucket_set)
        return self._cur_versions

    def _values(self, name: str) -> pa.Array:
        """A data column converted to its stored type (once per batch, shared with the sink's
        ``reject``), in the plan's row order."""
        got = self._by_key.get(name)
        if got is None:
            got = self.columns.stored_values(name, self.types[name]).take(pa.array(self.plan.order))
            if self._filled is not None:
                got = self._filled.values(name, got)
            self._by_key[name] = got
        return got

    def history_plan(self) -> HistoryPlan:
        """The plan's history decisions (:meth:`Plan.history`), the snapshot reads that confirm the
        row they come to compared first; then the lacking values filled (:func:`.fill.fill`)."""
        if self._hp is not None:
            return self._hp
        plan = self.plan
        stored = self.stored.with_open(*self.current_versions())
        reads, against = plan.snapshot_reads(stored)
        if self.lacking is not None:  # a row lacking values is not compared: the read opens a version
            whole = (against == NONE) | ~self.lacking.any[np.maximum(against, 0)]
            reads, against = reads[whole], against[whole]
        if len(reads):  # those equal to the row they come to confirm it (docs/warehouse.md)
            schema = arrow_schema(self._current)
            reads = confirming(
                self._current,
                reads,
                against,
                lambda at: self._data(at, schema, self._meta(at)),
                lambda at: set(self.key_bucket[plan.key_of_row[at]].tolist()),
            )
        self._hp = hp = plan.history(stored, reads)
        if self.lacking is not None:
            assert self._history is not None, "a batch lacking values needs the history table"
            self._filled = fill(
                self.reg,
                plan,
                hp,
                self.columns,
                self.lacking,
                self.types,
                (self._current, self._history),
                self.key_bucket,
            )
            self._by_key.clear()  # converted before the fill: for the confirming reads only
        return hp

    # -- source tables -------------------------------------------------------------------------------
    def _data(self, rows: np.ndarray, schema: pa.Schema, meta: dict[str, pa.Array]) -> pa.Table:
        """A source table of ``schema``: ``meta`` columns as given, data columns from the batch's
        ``after`` values at ``rows`` (null where a row is a delete or a close row: ``rows`` -1)."""
        after = self.t.column("after").combine_chunks()
        has = rows >= 0
        take = pa.array(rows, mask=~has) if not has.all() else pa.array(rows)
        arrays = []
        names = set(after.type.names)
        for f in schema:
            if f.name in meta:
                arrays.append(meta[f.name])
            elif f.name in self.types and f.name in names:
                arrays.append(cast_to_field(f, self.types, self._values(f.name).take(take)))
            else:
                arrays.append(pa.nulls(len(rows), type=f.type))
        return pa.Table.from_arrays(arrays, schema=schema)

    def _meta(self, rows: np.ndarray) -> dict[str, pa.Array]:
        """The current table's meta columns of the batch's rows ``rows``."""
        keys = self.plan.key_of_row[rows]
        return {
            KEY: self.keys.take(pa.array(keys)),
            BUCKET: pa.array(self.key_bucket[keys]),
            LSN: pa.array(self.plan.lsn[rows]),
            SEQ: pa.array(self.plan.seq[rows]),
            TS: pa.array(self.ts_us[rows]).cast(TS_TYPE),
            OP: self.op.take(pa.array(rows)),
        }

    def _closers(self, ev: np.ndarray, tr: np.ndarray) -> dict[str, pa.Array]:
        """The close columns of rows closed by the batch's row ``ev`` or truncate ``tr`` (NONE: not
        closed by that kind; both NONE: the row stays open)."""
        plan = self.plan
        by_ev, by_tr = ev != NONE, tr != NONE
        e, t = np.where(by_ev, ev, 0), np.where(by_tr, tr, 0)
        t_lsn = (
            plan.truncates.column("commit_lsn").to_numpy()
            if plan.truncates.num_rows
            else np.zeros(1, np.int64)
        )
        t_seq = plan.truncates.column("seq").to_numpy() if plan.truncates.num_rows else np.zeros(1, np.int64)
        t_ts = plan.truncates.column("ts_ms").to_numpy() if plan.truncates.num_rows else np.zeros(1, np.int64)
        n = len(ev)
        ts = np.where(by_ev, self.ts_us[e] if n and len(self.ts_us) else 0, t_ts[t] * 1000)
        lsn = np.where(by_ev, plan.lsn[e] if n and len(plan.lsn) else 0, t_lsn[t])
        seq = np.where(by_ev, plan.seq[e] if n and len(plan.seq) else 0, t_seq[t])
        open_ = ~(by_ev | by_tr)
        op = pc.if_else(pa.array(by_tr), pa.scalar("t"), _take(self.op, ev))
        return {
            VALID_TO: pa.array(ts, mask=open_).cast(TS_TYPE),
            IS_CURRENT: pa.array(open_),
            END_LSN: pa.array(lsn, mask=open_),
            END_SEQ: pa.array(seq, mask=open_),
            END_OP: pc.if_else(pa.array(open_), pa.scalar(None, pa.string()), op),
        }

    # -- the three tables ------------------------------------------------------------------------------
    def history(self, history: DeltaTable, commit: Commit) -> dict[str, Any]:
        plan = self.plan
        o_lsn, o_seq = self.current_versions()
        hp = self.history_plan()
        moved = hp.moved_keys
        if (
            len(hp.applied) == 0
            and len(hp.closed_keys) == 0
            and len(moved) == 0
            and not plan.truncates.num_rows
        ):
            return {}  # nothing to write: a replay computes the same nothing
        new = hp.new
        meta = self._meta(new)
        meta.update(self._closers(hp.new_next, hp.new_truncate))
        meta[LSN], meta[SEQ] = pa.array(plan.lsn[hp.new_version]), pa.array(plan.seq[hp.new_version])
        meta[VALID_FROM] = meta[TS]
        meta[SRC_KIND] = pa.array(["new"] * len(new), pa.string())
        schema = pa.schema([*arrow_schema(history), (SRC_KIND, pa.string())])
        parts = [self._data(new, schema, meta)]
        c_key = hp.closed_keys
        if len(c_key):  # a key's stored open row, closed by the key's first applied event or a truncate
            close = {
                KEY: self.keys.take(pa.array(c_key)),
                BUCKET: pa.array(self.key_bucket[c_key]),
                LSN: pa.array(o_lsn[c_key]),
                SEQ: pa.array(o_seq[c_key]),
                SRC_KIND: pa.array(["close"] * len(c_key), pa.string()),
                **self._closers(hp.close_event, hp.close_truncate),
            }
            parts.append(self._data(np.full(len(c_key), NONE), schema, close))
        if len(moved):  # a key's stored open row, confirmed by a snapshot read: it moves to its version
            move = {
                KEY: self.keys.take(pa.array(moved)),
                BUCKET: pa.array(self.key_bucket[moved]),
                LSN: pa.array(o_lsn[moved]),
                SEQ: pa.array(o_seq[moved]),
                END_LSN: pa.array(plan.lsn[hp.moved_to]),
                END_SEQ: pa.array(plan.seq[hp.moved_to]),
                SRC_KIND: pa.array(["move"] * len(moved), pa.string()),
            }
            parts.append(self._data(np.full(len(moved), NONE), schema, move))
        source = pa.concat_tables(parts)
        # only a close (or move) row can match a stored (open) row: only its bucket's open rows are
        # rewritten
        touched = np.concatenate([c_key, moved])
        match = None if plan.truncates.num_rows else set(self.key_bucket[touched].tolist())
        return commit.history(history, source, match, _truncates(plan))

    def current(self, current: DeltaTable, commit: Commit) -> dict[str, Any]:
        rows = self.plan.current(self.stored)
        if self.lacking is not None:  # lacking values the version guard skips: not written
            self.history_plan()
            assert self._filled is not None
            rows = rows[~self._filled.stale[rows]]
        trunc = _truncates(self.plan)
        if len(rows) == 0 and not trunc:
            return {}  # nothing to write: a replay computes the same nothing
        data_rows = np.where(self.plan.is_delete[rows], NONE, rows)
        source = self._data(data_rows, arrow_schema(current), self._meta(rows))
        keys = self.plan.key_of_row[rows]
        match = set(self.key_bucket[keys[self.current_versions()[0][keys] >= 0]].tolist())
        return commit.current(current, source, None if trunc else match, trunc[-1][0] if trunc else None)

    def tombstones(self, tombs: DeltaTable, commit: Commit) -> None:
        plan = self.plan
        rows = plan.tombstones()
        k = plan.key_of_row[rows]
        source = pa.Table.from_arrays(
            [
                self.keys.take(pa.array(k)),
                pa.array(self.key_bucket[k]),
                pa.array(plan.lsn[rows]),
                pa.array(plan.seq[rows]),
                pa.array(self.ts_us[rows]).cast(TS_TYPE),
            ],
            schema=TOMBSTONES,
        )
        marks = plan.marks
        if marks.num_rows:  # each partition's newest marker, in the bucket of its partition
            marker = pa.Table.from_arrays(
                [
                    pa.array([TRUNCATE_MARKER] * marks.num_rows),
                    marks.column("partition").cast(pa.int64()),
                    marks.column("commit_lsn").cast(pa.int64()),
                    marks.column("seq").cast(pa.int64()),
                    pc.multiply(marks.column("ts_ms"), 1000).cast(TS_TYPE),
                ],
                schema=TOMBSTONES,
            )
            source = pa.concat_tables([source, marker])
        if source.num_rows == 0:
            return
        commit.tombstones(tombs, source)


def _truncates(plan: Plan) -> list[Truncate]:
    """The batch's truncates, in version order (what the Delta writes take)."""
    t = plan.truncates
    cols = (t.column(c).to_pylist() for c in ("commit_lsn", "seq", "ts_ms"))
    return [(Version(lsn, seq), ts) for lsn, seq, ts in zip(*cols, strict=True)]
