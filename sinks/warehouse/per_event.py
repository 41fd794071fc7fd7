"""The warehouse's per-event write path: a batch of :class:`sinks.ChangeEvent` (with TRUNCATEs,
unavailable TOAST columns, new columns) turned into the source rows of the history, current and
tombstone writes. The decisions come from :mod:`sinks.warehouse.plan` (the events as an Arrow table,
:func:`~sinks.warehouse.plan.events_table`), as for :mod:`sinks.warehouse.columnar`; this module adds
the values, resolving unavailable TOAST columns from the key's previous event or the stored rows."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from deltalake import DeltaTable

from cdc.errors import ApplyError
from cdc.events import Version
from cdc.registry import TableReg
from sinks import ChangeBatch, ChangeEvent
from sinks import types as T
from sinks.toast import Chains
from sinks.toast import Stored as StoredRow
from sinks.warehouse.delta import (
    Commit,
    arrow_schema,
    cast_to_field,
    confirming,
    current_versions,
    layout_of,
    read_rows,
    stored_guards,
)
from sinks.warehouse.layout import (
    BUCKET,
    END_LSN,
    END_OP,
    END_SEQ,
    HISTORY_META,
    IS_CURRENT,
    KEY,
    LSN,
    OP,
    SEQ,
    SRC_KIND,
    TOMBSTONES,
    TRUNCATE_MARKER,
    TS,
    VALID_FROM,
    VALID_TO,
    Layout,
)
from sinks.warehouse.plan import NONE, Plan, Stored, events_table

_DATA = "__cdc_data"  # key of a merge-source row dict holding its data values (event encoding)


def _ts(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).replace(microsecond=(ms % 1000) * 1000)


class BatchContext:
    """What every table's write of one batch needs: columns, keys, buckets and the pre-batch guards
    from the tombstones table (written last, so always its pre-batch state while others are written)."""

    def __init__(
        self,
        reg: TableReg,
        batch: ChangeBatch,
        columns: dict[str, str | None],
        layout: Layout,
        tombs: DeltaTable,
        current: DeltaTable,
    ) -> None:
        self.reg = reg
        self.types = columns
        self.events = batch.events
        self.plan = Plan(events_table(self.events))
        self.idx = self.plan.t.column("idx").to_numpy()  # plan row -> position in self.events
        self.truncates = _dedupe_truncates([ev for ev in self.events if ev.op == "t"])
        self.by_key: dict[str, list[ChangeEvent]] = {}
        for ev in self.events:
            if ev.op != "t":
                self.by_key.setdefault(ev.key_json, []).append(ev)
        self.keys: list[str] = self.plan.keys.to_pylist()
        first_values = [self.by_key[k][0].key.get(reg.key[0]) for k in self.keys]
        self.key_buckets = dict(
            zip(self.keys, layout.buckets(reg, self.keys, first_values).tolist(), strict=True)
        )
        for k in self.keys:
            _check_lsn(self.by_key[k][-1].version)
        self.markers = layout.marker_buckets(batch.shard)
        self.stored = stored_guards(tombs, self.plan.keys, [*self.key_buckets.values()], self.markers)
        self.tombstones = {
            k: Version(int(lsn), int(seq))
            for k, lsn, seq in zip(self.keys, self.stored.tomb_lsn, self.stored.tomb_seq, strict=True)
            if lsn >= 0
        }
        self.marker = Version(*self.stored.marker)
        self.converted = _Converted()
        self.layout = layout
        self.chains = Chains(self.events, reg.key)
        self._history_of: dict[str, list[dict[str, Any]]] = {}
        self._current = current
        self._cur_versions: tuple[np.ndarray, np.ndarray] | None = None
        self._cur_rows: dict[str, dict[str, Any]] = {}

    def current_versions(self) -> tuple[np.ndarray, np.ndarray]:
        """Per key of the plan, the version of its stored current row -- and so of its open history
        row -- ((-1, -1): none); read once from the current table as it was before the batch (written
        after the history, and only by :func:`apply_current`)."""
        if self._cur_versions is None:
            self._cur_versions = current_versions(self._current, self.plan.keys, self.key_buckets.values())
        return self._cur_versions

    def confirmed(self, stored: Stored) -> np.ndarray:
        """The plan's snapshot reads (:meth:`Plan.snapshot_reads`) whose values equal the row they come
        to, as the current table stores them: the stored current row, or the row of the key's previous
        event in the batch -- when that event holds all its values (one lacking unchanged TOAST
        columns, or a key change, is not compared: the read opens a version)."""
        reads, against = self.plan.snapshot_reads(stored)
        whole = np.array(
            [a == NONE or not ((ev := self.event(a)).unavailable or Chains.is_moved(ev)) for a in against],
            dtype=bool,
        )
        if not whole.any():
            none: np.ndarray = reads[whole]
            return none
        schema = arrow_schema(self._current)

        def rows_of(at: np.ndarray) -> pa.Table:
            rows = [{**self.meta_row(ev), _DATA: ev.after or {}} for ev in map(self.event, at)]
            return _to_table(rows, schema, self.types)

        def buckets(at: np.ndarray) -> set[int]:
            return self.buckets_of(self.event(r).key_json for r in at)

        return confirming(self._current, reads[whole], against[whole], rows_of, buckets)

    def current_rows(self, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The stored current rows of ``keys`` (those that have one), as they were before the batch."""
        todo = sorted(k for k in set(keys) if k not in self._cur_rows)
        if todo:
            got = {r[KEY]: r for r in read_rows(self._current, todo, self.buckets_of(todo)).to_pylist()}
            self._cur_rows.update({k: got.get(k, {}) for k in todo})
        return {k: r for k in keys if (r := self._cur_rows[k])}

    def stored_rows(self, history: DeltaTable, keys: Sequence[str]) -> dict[str, dict[str, Any]]:
        """What an unavailable TOAST value is taken from when no earlier event of the batch holds it:
        the key's stored current row, else its latest history row (a key deleted or truncated)."""
        found = self.current_rows(keys)
        rest = [k for k in keys if k not in found]
        if rest:
            found.update(_latest_rows(history, rest, self))
        return found

    def bucket(self, key_json: str) -> int:
        """The bucket of a key, also of one without an event in the batch (a primary-key change's old
        key whose delete an earlier batch applied)."""
        b = self.key_buckets.get(key_json)
        if b is None:
            first = orjson.loads(key_json).get(self.reg.key[0])
            b = int(self.layout.buckets(self.reg, [key_json], [first])[0])
        return b

    def history_before(self, history: DeltaTable, key_json: str, v: Version) -> dict[str, Any] | None:
        """The key's newest history row older than ``v`` in event encoding (None: none): what the
        row held just before ``v``, whether the delete that closed it is in this batch or applied."""
        rows = self._history_of.get(key_json)
        if rows is None:
            self._read_history(history, key_json)
            rows = self._history_of[key_json]
        return newest_before(rows, v, self.types)

    def _read_history(self, history: DeltaTable, key_json: str) -> None:
        """The history rows of ``key_json`` and of every old key of the batch's primary-key changes
        not read yet, in one scan of their buckets: a scan per key made a batch of many key changes
        cost one pass over the history's bucket files each (a replayed chaos batch stalled on it)."""
        keys = sorted({key_json, *self.chains.old_keys(self.events)} - self._history_of.keys())
        got: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
        for r in read_rows(history, keys, {self.bucket(k) for k in keys}).to_pylist():
            got[r[KEY]].append(r)
        self._history_of.update(got)

    def event(self, row: int) -> ChangeEvent:
        """The event at a row of the plan."""
        return self.events[int(self.idx[row])]

    def buckets_of(self, keys: Iterable[str]) -> set[int]:
        return {self.key_buckets[k] for k in keys}

    def guard(self, key_json: str) -> Version:
        """Newest version an event of this key must exceed, from deletes and truncates before the batch."""
        t = self.tombstones.get(key_json)
        return self.marker if t is None or t < self.marker else t

    def meta_row(self, ev: ChangeEvent) -> dict[str, Any]:
        return {
            KEY: ev.key_json,
            BUCKET: self.key_buckets[ev.key_json],
            LSN: ev.version.commit_lsn,
            SEQ: ev.version.seq,
            TS: ev.ts_ms * 1000,
            OP: ev.op,
        }


class _Resolver:
    """Column values of an event, with unavailable (unchanged TOAST) columns filled from the key's
    previous event in the batch or the stored row (``fetch(keys) -> {key: row}``)."""

    def __init__(self, ctx: BatchContext, history: DeltaTable) -> None:
        self.ctx = ctx
        self.history = history
        self.prev: dict[str, dict[str, Any]] = {}  # key -> last resolved values in this batch
        self.stored: dict[str, dict[str, Any]] | None = None
        self.deleted: set[str] = set()  # keys deleted/truncated earlier in the batch: no stored row

    def forget(self, key_json: str) -> None:
        """The key was deleted (or truncated) by an applied event of this batch."""
        self.prev.pop(key_json, None)
        self.deleted.add(key_json)

    def values(self, ev: ChangeEvent) -> dict[str, Any]:
        assert ev.after is not None
        vals = ev.after  # read-only from here on: a copy only when values are filled in
        if Chains.is_moved(ev):  # a primary-key change: the old key's row holds the values
            moved = self.ctx.chains.values(ev, lambda k, v: self.ctx.history_before(self.history, k, v))
            if moved is None:
                raise self._unresolved(ev)
            vals = moved
        elif ev.unavailable:
            vals = dict(vals)
            base = self.prev.get(ev.key_json)
            if base is None and ev.key_json not in self.deleted:
                if self.stored is None:
                    need = sorted(
                        {
                            e.key_json
                            for evs in self.ctx.by_key.values()
                            for e in evs
                            if e.unavailable and not Chains.is_moved(e)
                        }
                    )
                    self.stored = {
                        k: _row_to_event_values(v, self.ctx.types)
                        for k, v in self.ctx.stored_rows(self.history, need).items()
                    }
                base = self.stored.get(ev.key_json)
            if base is None:
                raise self._unresolved(ev)
            for c in ev.unavailable:
                vals[c] = base.get(c)
        self.prev[ev.key_json] = vals
        return vals

    def _unresolved(self, ev: ChangeEvent) -> ApplyError:
        """A backstop: :meth:`sinks.warehouse.WarehouseSink.reject` dead-letters such events first."""
        return ApplyError(
            f"{self.ctx.reg.qualified}: key {ev.key_json} at version {ev.version} lacks the unchanged "
            f"TOAST columns {list(ev.unavailable)} and the warehouse has no stored row to take them from",
            fix=f"re-snapshot the table (`cdc snapshot {self.ctx.reg.qualified}`) so every row is complete",
            key=ev.key_json,
            columns=list(ev.unavailable),
        )


def unresolved(reg: TableReg, events: Sequence[ChangeEvent], paths: Sequence[str]) -> list[ChangeEvent]:
    """The events lacking unchanged TOAST columns that neither the batch nor the warehouse holds a
    row for (:mod:`sinks.toast`): an update of a key the warehouse never stored, a primary-key change
    whose old key it never stored. Reads only the key column, for the keys those events need: of
    the current table (``paths[0]``; a live key, the usual case), then of the history (``paths[1]``,
    every row the current table ever held) for the rest."""
    chains = Chains(events, reg.key)
    lacking = [ev for ev in events if ev.unavailable and ev.op != "d"]
    if not lacking:
        return []
    todo = sorted({ev.key_json for ev in lacking} | set(chains.old_keys(lacking)))
    stored: set[str] = set()
    for path in paths[:2]:
        if not todo or not DeltaTable.is_deltatable(path):
            break
        table = DeltaTable(path)
        buckets = layout_of(table).buckets(reg, todo, [orjson.loads(k).get(reg.key[0]) for k in todo])
        got = read_rows(table, todo, set(buckets.tolist()), columns=[KEY])
        stored.update(got.column(KEY).cast(pa.string()).to_pylist())
        todo = [k for k in todo if k not in stored]
    return chains.unresolved(lambda k, _v: {} if k in stored else None)


def newest_before(
    rows: Iterable[dict[str, Any]], v: Version, types: dict[str, str | None]
) -> dict[str, Any] | None:
    """The newest of a key's history ``rows`` older than ``v``, in event encoding (None: none)."""
    before = [r for r in rows if (r[LSN], r[SEQ]) < (v.commit_lsn, v.seq)]
    if not before:
        return None
    return _row_to_event_values(max(before, key=lambda r: (r[LSN], r[SEQ])), types)


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


def _row_to_event_values(row: dict[str, Any], types: dict[str, str | None]) -> dict[str, Any]:
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


def _check_lsn(v: Version) -> None:
    if v.commit_lsn >= 1 << 63:
        raise ApplyError(f"commit LSN {v.commit_lsn} does not fit int64", fix="report this source")


def _dedupe_truncates(events: list[ChangeEvent]) -> list[ChangeEvent]:
    seen: dict[Version, ChangeEvent] = {}
    for ev in events:
        seen.setdefault(ev.version, ev)
    return [seen[v] for v in sorted(seen)]


def _close(row: dict[str, Any], ev: ChangeEvent) -> None:
    row.update(
        {
            VALID_TO: ev.ts_ms * 1000,
            IS_CURRENT: False,
            END_LSN: ev.version.commit_lsn,
            END_SEQ: ev.version.seq,
            END_OP: ev.op,
        }
    )


def _latest_rows(history: DeltaTable, keys: Sequence[str], ctx: BatchContext) -> dict[str, dict[str, Any]]:
    """Per key, the history row with the newest version (open or closed)."""
    rows = read_rows(history, keys, ctx.buckets_of(keys)).to_pylist()
    best: dict[str, dict[str, Any]] = {}
    for r in rows:
        b = best.get(r[KEY])
        if b is None or (r[LSN], r[SEQ]) > (b[LSN], b[SEQ]):
            best[r[KEY]] = r
    return best


class _Converted:
    """Data columns converted once per batch: the first table's source rows' value dicts become the
    rows of this cache; the next table takes its columns from it when every value dict of its rows is
    one of them (the usual case: current rows are a subset of the history's new rows)."""

    def __init__(self) -> None:
        self.index: dict[int, int] | None = None  # id(value dict) -> row of the cache
        self.rows: list[dict[str, Any]] = []
        self.columns: dict[tuple[str, pa.DataType], pa.Array] = {}

    def positions(self, datas: list[dict[str, Any] | None]) -> list[int | None] | None:
        if self.index is None:
            index: dict[int, int] = {}
            for d in datas:
                if d is not None and id(d) not in index:
                    index[id(d)] = len(self.rows)
                    self.rows.append(d)
            self.index = index
        pos: list[int | None] = []
        for d in datas:
            if d is None:
                pos.append(None)
                continue
            i = self.index.get(id(d))
            if i is None:
                return None  # a value dict this cache does not hold: the table converts its own
            pos.append(i)
        return pos

    def column(self, f: pa.Field, types: dict[str, str | None]) -> pa.Array:
        arr = self.columns.get((f.name, f.type))
        if arr is None:
            arr = _convert(f, types, [d.get(f.name) for d in self.rows])
            self.columns[(f.name, f.type)] = arr
        return arr


def _convert(f: pa.Field, types: dict[str, str | None], values: list[Any]) -> pa.Array:
    return cast_to_field(f, types, T.to_array(values, types[f.name]))


def _to_table(
    rows: list[dict[str, Any]],
    schema: pa.Schema,
    types: dict[str, str | None],
    cache: _Converted | None = None,
) -> pa.Table:
    """Rows (meta values as Python; data values, in event encoding, in the dict under ``_DATA``, absent
    for a row without data) as an Arrow table of ``schema``."""
    datas: list[dict[str, Any] | None] = list(map(dict.get, rows, repeat(_DATA)))
    pos = cache.positions(datas) if cache is not None else None
    take = pa.array(pos, type=pa.int64()) if pos is not None else None
    arrays = []
    for f in schema:
        meta = f.name in HISTORY_META.names or f.name == SRC_KIND
        if meta:  # map(dict.get) runs in C: ~2x a comprehension of r.get over 100k+ rows
            values = list(map(dict.get, rows, repeat(f.name)))
            if pa.types.is_timestamp(f.type):  # microseconds since the epoch
                arrays.append(pa.array(values, type=pa.int64()).cast(f.type))
            else:
                arrays.append(pa.array(values, type=f.type))
        elif f.name in types:
            if cache is not None and take is not None:
                arrays.append(cache.column(f, types).take(take))
            else:
                arrays.append(_convert(f, types, [None if d is None else d.get(f.name) for d in datas]))
        else:  # a column the table has but this batch does not know: null
            arrays.append(pa.nulls(len(rows), type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def apply_history(ctx: BatchContext, history: DeltaTable, commit: Commit) -> dict[str, Any]:
    """The history's source rows from the plan's decisions (:meth:`Plan.history`); values from the
    events, unavailable TOAST columns resolved in each key's version order."""
    plan = ctx.plan
    o_lsn, o_seq = ctx.current_versions()
    stored = ctx.stored.with_open(o_lsn, o_seq)
    hp = plan.history(stored, ctx.confirmed(stored))
    truncates = ctx.truncates
    resolver = _Resolver(ctx, history)
    close_rows: list[dict[str, Any]] = []
    for k, by_ev, by_t in zip(hp.closed_keys, hp.close_event, hp.close_truncate, strict=True):
        key_json = ctx.keys[k]
        row = {KEY: key_json, BUCKET: ctx.key_buckets[key_json], LSN: int(o_lsn[k]), SEQ: int(o_seq[k])}
        if by_ev != NONE:
            _close(row, ctx.event(by_ev))
        else:
            _close(row, truncates[by_t])
            resolver.forget(key_json)  # the truncate came before the key's events: no stored row
        close_rows.append(row)
    new_rows: list[dict[str, Any]] = []
    new_at = {int(r): j for j, r in enumerate(hp.new)}
    for r in hp.applied:
        ev = ctx.event(r)
        if ev.op == "d":
            resolver.forget(ev.key_json)
            continue
        j = new_at[int(r)]
        row = ctx.meta_row(ev)
        row[_DATA] = resolver.values(ev)
        row.update(
            {
                VALID_FROM: row[TS],
                VALID_TO: None,
                IS_CURRENT: True,
                END_LSN: None,
                END_SEQ: None,
                END_OP: None,
            }
        )
        if hp.new_version[j] != r:  # confirmed by later snapshot reads: at the last one's version
            v = ctx.event(hp.new_version[j]).version
            row[LSN], row[SEQ] = v.commit_lsn, v.seq
        if hp.new_next[j] != NONE:
            _close(row, ctx.event(hp.new_next[j]))
        elif hp.new_truncate[j] != NONE:
            _close(row, truncates[hp.new_truncate[j]])
            resolver.forget(ev.key_json)
        new_rows.append(row)
    for k, r in zip(hp.moved_keys, hp.moved_to, strict=True):  # the stored row stays open, at r's version
        v = ctx.event(r).version
        key_json = ctx.keys[k]
        close_rows.append(
            {
                KEY: key_json,
                BUCKET: ctx.key_buckets[key_json],
                LSN: int(o_lsn[k]),
                SEQ: int(o_seq[k]),
                END_LSN: v.commit_lsn,
                END_SEQ: v.seq,
                SRC_KIND: "move",
            }
        )
    if not close_rows and not new_rows and not truncates:
        return {}  # nothing to write: a replay computes the same nothing
    schema = pa.schema([*arrow_schema(history), (SRC_KIND, pa.string())])
    rows = [{SRC_KIND: "close", **r} for r in close_rows] + [{**r, SRC_KIND: "new"} for r in new_rows]
    source = _to_table(rows, schema, ctx.types, ctx.converted)
    # only a close (or move) row can match a stored (open) row: only its bucket's open rows are rewritten
    match = None if truncates else {r[BUCKET] for r in close_rows}
    return commit.history(history, source, match, [(t.version, t.ts_ms) for t in truncates])


def apply_current(
    ctx: BatchContext, current: DeltaTable, history: DeltaTable, commit: Commit
) -> dict[str, Any]:
    trunc = ctx.truncates[-1].version if ctx.truncates else None
    latest = [ctx.event(r) for r in ctx.plan.current(ctx.stored)]  # in key order
    # values of unavailable columns: the key's earlier events in the batch that are newer than the
    # stored row, else the stored current row, else the latest history row
    need = {
        ev.key_json for ev in latest if ev.op != "d" and any(e.unavailable for e in ctx.by_key[ev.key_json])
    }
    stored = ctx.current_rows(sorted(need)) if need else {}
    resolver = _Resolver(ctx, history)
    rows = []
    for ev in latest:
        row = ctx.meta_row(ev)
        if ev.op != "d":
            if ev.key_json in need:
                guard = ctx.guard(ev.key_json)
                s = stored.get(ev.key_json)
                if s is not None:
                    guard = max(guard, Version(s[LSN], s[SEQ]))
                if ev.version <= guard:
                    continue  # the merge would ignore it: nothing to resolve
                vals: dict[str, Any] = {}
                for e in ctx.by_key[ev.key_json]:
                    if e.version <= guard or e.version > ev.version:
                        continue
                    if e.op == "d":
                        resolver.forget(e.key_json)
                    else:
                        vals = resolver.values(e)
                row[_DATA] = vals
            else:
                row[_DATA] = ev.after or {}
        rows.append(row)
    if not rows and trunc is None:
        return {}  # nothing to write: a replay computes the same nothing
    source = _to_table(rows, arrow_schema(current), ctx.types, ctx.converted)
    has_row = ctx.current_versions()[0] >= 0
    present = {k for k, has in zip(ctx.keys, has_row, strict=True) if has}
    match = {r[BUCKET] for r in rows if r[KEY] in present}
    return commit.current(current, source, None if trunc else match, trunc)


def apply_tombstones(ctx: BatchContext, tombs: DeltaTable, commit: Commit) -> None:
    rows: list[dict[str, Any]] = []
    for r in ctx.plan.tombstones():
        ev = ctx.event(r)
        if ev.op == "d":
            rows.append(
                {
                    "key_json": ev.key_json,
                    BUCKET: ctx.key_buckets[ev.key_json],
                    "commit_lsn": ev.version.commit_lsn,
                    "seq": ev.version.seq,
                    "deleted_at": _ts(ev.ts_ms),
                }
            )
    if ctx.truncates:
        t = ctx.truncates[-1]
        rows.extend(
            {
                "key_json": TRUNCATE_MARKER,
                BUCKET: b,
                "commit_lsn": t.version.commit_lsn,
                "seq": t.version.seq,
                "deleted_at": _ts(t.ts_ms),
            }
            for b in ctx.markers
        )
    if not rows:
        return
    commit.tombstones(tombs, pa.Table.from_pylist(rows, schema=TOMBSTONES))
