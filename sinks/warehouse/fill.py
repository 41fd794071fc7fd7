"""The unavailable (unchanged TOAST) values of a batch's rows, for the warehouse's columnar write.

A row lacking a column's value takes it from the row it continues (:mod:`sinks.toast`): the key's
previous applied upsert in the batch, else the key's stored row (the current table's, else its newest
history row), and a primary-key change's ``c`` from the old key's row (:class:`sinks.toast.Chains`
over the batch, then the history just before the change). Which row each value comes from is decided
in Arrow (:meth:`.plan.Plan.fill_sources`); the values come from the batch's converted columns, and
only the stored rows and key changes' old rows are read, in event encoding
(:func:`.stored.row_to_event_values`), as the events' values are converted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from cdc.errors import ApplyError
from cdc.events import Version
from cdc.registry import TableReg
from sinks import types as T
from sinks.columnar import Columns
from sinks.toast import Chains
from sinks.warehouse.delta import read_rows
from sinks.warehouse.layout import KEY, LSN, SEQ
from sinks.warehouse.plan import NONE, HistoryPlan, Plan
from sinks.warehouse.stored import HistoryLookup, row_to_event_values

__all__ = ["Filled", "Lacking", "fill"]


@dataclass(frozen=True)
class Lacking:
    """Per plan row: the columns it lacks (``names``: list array, plan order), whether it lacks any,
    and whether it is a primary-key change's ``c`` lacking them (``moved``)."""

    names: pa.ListArray
    any: np.ndarray
    moved: np.ndarray

    @classmethod
    def of(cls, plan: Plan, columns: Columns) -> Lacking:
        names = columns.table.column("unavailable").combine_chunks().take(pa.array(plan.order))
        n = plan.t.num_rows
        lacks = np.zeros(n, dtype=bool)
        lacks[pc.list_parent_indices(names).to_numpy()] = True
        lacks &= ~plan.is_delete
        inserts = pc.is_in(plan.t.column("op"), pa.array(["c", "r"])).to_numpy(zero_copy_only=False)
        return cls(names, lacks, lacks & inserts)

    def rows_of(self, name: str) -> np.ndarray:
        """The rows lacking ``name`` (a key change's ``c`` too)."""
        flat = pc.list_flatten(self.names)
        rows: np.ndarray = pc.list_parent_indices(self.names).to_numpy()[
            pc.equal(flat, name).to_numpy(zero_copy_only=False)
        ]
        return rows


@dataclass(frozen=True)
class Filled:
    """Per column some row lacks: per plan row, the position of its value in the column's converted
    values followed by ``extra`` (event-encoded values taken from stored rows and key changes' old
    rows). ``stale``: the rows still lacking values (not applied: the version guard skips them)."""

    index: dict[str, np.ndarray]
    extra: dict[str, list[Any]]
    types: dict[str, str | None]
    stale: np.ndarray

    def values(self, name: str, converted: pa.Array) -> pa.Array:
        """The column's values in plan row order (``converted``: as the batch holds them), filled."""
        idx = self.index.get(name)
        if idx is None:
            return converted
        more = T.to_array(self.extra[name], self.types[name]).cast(converted.type)
        return pa.concat_arrays([converted, more]).take(pa.array(idx))


def fill(
    reg: TableReg,
    plan: Plan,
    hp: HistoryPlan,
    columns: Columns,
    lacking: Lacking,
    types: dict[str, str | None],
    tables: tuple[DeltaTable, DeltaTable],
    buckets: np.ndarray,
) -> Filled:
    """Where every applied row's lacking values come from (``tables``: the current and history
    tables as before the batch; ``buckets``: each key's). ApplyError for an applied row no row holds
    the values of (a backstop: the sink's ``reject`` dead-letters those first)."""
    n = plan.t.num_rows
    s = hp.applied
    moved = _moved_values(reg, plan, s[lacking.moved[s]], columns, types, tables[1])
    storable = np.ones(len(plan.keys), dtype=bool)
    storable[hp.closed_keys[hp.close_truncate != NONE]] = False
    per_column = {}
    wanted: set[int] = set()
    for name in pc.unique(pc.list_flatten(lacking.names)).to_pylist():
        lacks = np.zeros(n, dtype=bool)
        lacks[lacking.rows_of(name)] = True
        lacks &= lacking.any & ~lacking.moved
        src, from_stored = plan.fill_sources(hp, lacks, storable)
        need = lacks[s]
        if (need & (src == NONE) & ~from_stored).any():
            raise _unresolved(reg, plan, s[need & (src == NONE) & ~from_stored][0], columns)
        wanted.update(plan.key_of_row[s[need & from_stored]].tolist())
        per_column[name] = (lacks, src, from_stored)
    base = _stored_rows(plan, sorted(wanted), types, tables, buckets)
    rep = np.maximum.accumulate(np.where(plan.first_of_version, np.arange(n), 0))
    done = np.zeros(n, dtype=bool)
    done[s] = True
    index: dict[str, np.ndarray] = {}
    extra: dict[str, list[Any]] = {}
    for name, (lacks, src, _from_stored) in per_column.items():
        idx = np.arange(n)
        more: list[Any] = []
        for r in sorted(set(lacking.rows_of(name).tolist()) & moved.keys()):  # a key change: its old row
            idx[r] = n + len(more)
            more.append(moved[r].get(name))
        need = lacks[s]
        by_row = need & (src != NONE)  # rows that hold the value (a key change's: its old row's)
        idx[s[by_row]] = idx[src[by_row]]
        for r in s[need & (src == NONE)].tolist():
            row = base.get(int(plan.key_of_row[r]))
            if row is None:
                raise _unresolved(reg, plan, r, columns)
            idx[r] = n + len(more)
            more.append(row.get(name))
        dup = (rep != np.arange(n)) & (lacks | lacking.moved)  # a repeated version: as its first
        idx[dup] = idx[rep[dup]]
        index[name], extra[name] = idx, more
    stale = lacking.any & ~done[rep]
    return Filled(index, extra, types, stale)


def _moved_values(
    reg: TableReg,
    plan: Plan,
    rows: np.ndarray,
    columns: Columns,
    types: dict[str, str | None],
    history: DeltaTable,
) -> dict[int, dict[str, Any]]:
    """The values of the applied primary-key changes' ``c`` at plan ``rows``: the old key's row as
    :meth:`sinks.toast.Chains.values` follows it, through the batch then the history."""
    if not len(rows):
        return {}
    chains = Chains(columns, reg.key)
    lookup = HistoryLookup(reg, history, types)
    todo = [int(plan.order[r]) for r in rows]
    lookup.prefetch(chains.stored_keys(todo))
    out: dict[int, dict[str, Any]] = {}
    for r, i in zip(rows.tolist(), todo, strict=True):
        got = chains.values(i, lookup)
        if got is None:
            raise _unresolved_row(reg, columns, i)
        out[r] = got
    return out


def _stored_rows(
    plan: Plan,
    keys: list[int],
    types: dict[str, str | None],
    tables: tuple[DeltaTable, DeltaTable],
    buckets: np.ndarray,
) -> dict[int, dict[str, Any]]:
    """Per key (position in :attr:`Plan.keys`), its stored row in event encoding: the current
    table's, else its newest history row (a key deleted or truncated)."""
    if not keys:
        return {}
    names = plan.keys.take(pa.array(keys)).to_pylist()
    at = dict(zip(names, keys, strict=True))
    current, history = tables
    found: dict[int, dict[str, Any]] = {}
    for row in read_rows(current, names, set(buckets[keys].tolist())).to_pylist():
        found[at[row[KEY]]] = row
    rest = [k for k in names if at[k] not in found]
    if rest:
        newest: dict[str, dict[str, Any]] = {}
        for row in read_rows(history, rest, {int(buckets[at[k]]) for k in rest}).to_pylist():
            b = newest.get(row[KEY])
            if b is None or (row[LSN], row[SEQ]) > (b[LSN], b[SEQ]):
                newest[row[KEY]] = row
        found.update((at[k], r) for k, r in newest.items())
    return {k: row_to_event_values(r, types) for k, r in found.items()}


def _unresolved(reg: TableReg, plan: Plan, row: int, columns: Columns) -> ApplyError:
    return _unresolved_row(reg, columns, int(plan.order[row]))


def _unresolved_row(reg: TableReg, columns: Columns, i: int) -> ApplyError:
    """The batch's row ``i`` lacks values no row holds. A backstop:
    :meth:`sinks.warehouse.WarehouseSink.reject` dead-letters such rows first."""
    t = columns.table.slice(i, 1)
    key = t.column("key_json")[0].as_py()
    version = Version(t.column("commit_lsn")[0].as_py(), t.column("seq")[0].as_py())
    unavailable = t.column("unavailable")[0].as_py() or []
    return ApplyError(
        f"{reg.qualified}: key {key} at version {version} lacks the unchanged "
        f"TOAST columns {unavailable} and the warehouse has no stored row to take them from",
        fix=f"re-snapshot the table (`cdc snapshot {reg.qualified}`) so every row is complete",
        key=key,
        columns=unavailable,
    )
