"""What the warehouse stored, in event encoding (:mod:`cdc.events`): a key's history row just before a
version (:class:`HistoryLookup`, the sink's :meth:`~sinks.Sink.stored_before`), a stored row's values
(:func:`row_to_event_values`: what an unavailable TOAST value is taken from), and the rows lacking
values that no row holds (:func:`unresolved`)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
import pyarrow as pa
from deltalake import DeltaTable

from cdc.events import Version
from cdc.registry import TableReg
from sinks import types as T
from sinks.columnar import Columns
from sinks.toast import Chains
from sinks.toast import Stored as StoredRow
from sinks.warehouse.delta import layout_of, read_rows
from sinks.warehouse.layout import KEY, LSN, SEQ

__all__ = ["HistoryLookup", "newest_before", "row_to_event_values", "stored_before", "unresolved"]


def unresolved(reg: TableReg, columns: Columns, paths: Sequence[str]) -> tuple[Chains, list[int]]:
    """The rows lacking unchanged TOAST columns that neither the batch nor the warehouse holds a
    row for (:mod:`sinks.toast`), as positions in ``columns`` with the chains that name them: an
    update of a key the warehouse never stored, a primary-key change whose old key it never stored.
    Reads only the key column, for the keys those rows need: of the current table (``paths[0]``; a
    live key, the usual case), then of the history (``paths[1]``, every row the current table ever
    held) for the rest."""
    chains = Chains(columns, reg.key)
    lacking = chains.lacking
    if not lacking:
        return chains, []
    todo = sorted({chains.key_json(r) for r in lacking} | set(chains.old_keys(lacking)))
    stored: set[str] = set()
    for path in paths[:2]:
        if not todo or not DeltaTable.is_deltatable(path):
            break
        table = DeltaTable(path)
        buckets = layout_of(table).buckets(reg, todo, [orjson.loads(k).get(reg.key[0]) for k in todo])
        got = read_rows(table, todo, set(buckets.tolist()), columns=[KEY])
        stored.update(got.column(KEY).cast(pa.string()).to_pylist())
        todo = [k for k in todo if k not in stored]
    return chains, chains.unresolved(lambda k, _v: {} if k in stored else None)


def newest_before(
    rows: Iterable[dict[str, Any]], v: Version, types: dict[str, str | None]
) -> dict[str, Any] | None:
    """The newest of a key's history ``rows`` older than ``v``, in event encoding (None: none)."""
    before = [r for r in rows if (r[LSN], r[SEQ]) < (v.commit_lsn, v.seq)]
    if not before:
        return None
    return row_to_event_values(max(before, key=lambda r: (r[LSN], r[SEQ])), types)


def stored_before(reg: TableReg, history_path: str, types: dict[str, str | None]) -> StoredRow:
    """What the history at ``history_path`` holds for a key just before a version, in event encoding
    (:data:`sinks.toast.Stored`; None: nothing, or no history yet): the table as committed, whatever
    a batch being written beside it does (:class:`HistoryLookup`)."""
    if not DeltaTable.is_deltatable(history_path):
        return lambda _k, _v: None
    return HistoryLookup(reg, DeltaTable(history_path), types)


class HistoryLookup:
    """A key's newest history row older than a version, in event encoding. Reads each key's rows
    once: :meth:`prefetch` reads many keys in one scan of their buckets (a key asked for alone is
    read alone)."""

    def __init__(self, reg: TableReg, history: DeltaTable, types: dict[str, str | None]) -> None:
        self.reg, self.history, self.types = reg, history, types
        self.layout = layout_of(history)
        self.rows: dict[str, list[dict[str, Any]]] = {}

    def prefetch(self, keys: Iterable[str]) -> None:
        todo = sorted(set(keys) - self.rows.keys())
        if not todo:
            return
        firsts = [orjson.loads(k).get(self.reg.key[0]) for k in todo]
        buckets = self.layout.buckets(self.reg, todo, firsts)
        for k in todo:
            self.rows[k] = []
        for row in read_rows(self.history, todo, set(buckets.tolist())).to_pylist():
            self.rows[str(row[KEY])].append(row)

    def __call__(self, key_json: str, v: Version) -> dict[str, Any] | None:
        if key_json not in self.rows:
            self.prefetch([key_json])
        return newest_before(self.rows[key_json], v, self.types)


def row_to_event_values(row: dict[str, Any], types: dict[str, str | None]) -> dict[str, Any]:
    """A stored row's data columns back in event encoding, so they convert like event values."""
    out: dict[str, Any] = {}
    for name, pg in types.items():
        v = row.get(name)
        out[name] = None if v is None else _to_event(v, pg)
    return out


def _to_event(v: Any, pg: str | None) -> Any:
    if isinstance(v, dt.datetime):
        if v.tzinfo is not None:
            return v.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f") + "+00"
        return v.strftime("%Y-%m-%d %H:%M:%S.%f")
    if isinstance(v, dt.date):
        return v.isoformat()
    if isinstance(v, list):
        elem = pg[:-2] if pg and pg.endswith("[]") else None
        return [None if x is None else _to_event(x, elem) for x in v]
    return T.to_event_value(v)
