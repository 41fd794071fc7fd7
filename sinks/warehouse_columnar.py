"""The warehouse sink's path for a columnar batch (:class:`sinks.columnar.Columns`).

Same writes as the per-event path of :class:`sinks.warehouse.WarehouseSink` -- the same rows, the same
merges, the same commits -- computed with Arrow and numpy over whole columns instead of a Python loop
per event. A columnar batch has no TRUNCATE and no unavailable (TOAST) column, which is what makes the
history a matter of array shifts: per key, the events newer than the key's guard (its tombstone, the
last TRUNCATE and its open history row) each open a row that the next one closes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable

from cdc.registry import TableReg
from sinks import types as T
from sinks.columnar import Columns, key_starts
from sinks.warehouse import (
    _SRC_KIND,
    _TS_TYPE,
    BUCKET,
    END_LSN,
    END_OP,
    END_SEQ,
    IS_CURRENT,
    KEY,
    LSN,
    OP,
    SEQ,
    TOMBSTONES,
    TRUNCATE_MARKER,
    TS,
    VALID_FROM,
    VALID_TO,
    Layout,
    _arrow_schema,
    _cast_to_field,
    _read,
    _write_current,
    _write_history,
    _write_tombstones,
)


def _newer(a_lsn: np.ndarray, a_seq: np.ndarray, b_lsn: np.ndarray, b_seq: np.ndarray) -> np.ndarray:
    """Element-wise: version a is strictly newer than version b."""
    out: np.ndarray = (a_lsn > b_lsn) | ((a_lsn == b_lsn) & (a_seq > b_seq))
    return out


def _versions_of(
    keys: pa.Array, table: pa.Table, key: str, lsn: str, seq: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per key, the version held in ``table`` (one row per key), (-1, -1) where it holds none."""
    n = len(keys)
    out_lsn = np.full(n, -1, dtype=np.int64)
    out_seq = np.full(n, -1, dtype=np.int64)
    if table.num_rows:
        idx = pc.index_in(keys, value_set=table.column(key).combine_chunks().cast(pa.string()))
        found = pc.is_valid(idx).to_numpy(zero_copy_only=False)
        if found.any():
            at = idx.filter(pc.is_valid(idx))
            out_lsn[found] = table.column(lsn).take(at).to_numpy()
            out_seq[found] = table.column(seq).take(at).to_numpy()
    return out_lsn, out_seq


class ColumnarApply:
    """One columnar batch of one table, prepared once for the three tables' writes."""

    def __init__(
        self,
        reg: TableReg,
        columns: Columns,
        types: dict[str, str | None],
        layout: Layout,
        tombs: DeltaTable,
    ) -> None:
        self.reg = reg
        self.types = types
        t = columns.by_key()
        self.t = t
        n = t.num_rows
        key = t.column("key_json").combine_chunks()
        self.lsn = t.column("commit_lsn").to_numpy()
        self.seq = t.column("seq").to_numpy()
        self.ts_us = t.column("ts_ms").to_numpy() * 1000
        self.op = t.column("op").combine_chunks()
        self.is_delete = pc.equal(self.op, "d").to_numpy(zero_copy_only=False)
        first = key_starts(key)
        self.first_of_key = first
        self.last_of_key = np.ones(n, dtype=bool)
        self.last_of_key[:-1] = first[1:]
        self.key_of_row = np.cumsum(first) - 1
        self.keys = key.filter(pa.array(first))
        self.key_list: list[str] = self.keys.to_pylist()
        first_values = pc.struct_field(t.column("key").combine_chunks().filter(pa.array(first)), [reg.key[0]])
        self.key_bucket = layout.buckets(reg, self.key_list, first_values.to_pylist())
        self.bucket_set = set(self.key_bucket.tolist())
        tomb = _read(tombs, [*self.key_list, TRUNCATE_MARKER], [*self.bucket_set, 0], key="key_json")
        is_marker = pc.equal(tomb.column("key_json").cast(pa.string()), TRUNCATE_MARKER)
        marker = tomb.filter(is_marker)
        m_lsn, m_seq = -1, -1
        if marker.num_rows:
            m_lsn, m_seq = marker.column("commit_lsn")[0].as_py(), marker.column("seq")[0].as_py()
        g_lsn, g_seq = _versions_of(
            self.keys, tomb.filter(pc.invert(is_marker)), "key_json", "commit_lsn", "seq"
        )
        older = _newer(np.full_like(g_lsn, m_lsn), np.full_like(g_seq, m_seq), g_lsn, g_seq)
        # the guard of a key before the batch: its tombstone or the last TRUNCATE, the newer of the two
        self.guard_lsn = np.where(older, m_lsn, g_lsn)
        self.guard_seq = np.where(older, m_seq, g_seq)

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
                arrays.append(_convert(f, self.types, pc.struct_field(after, [f.name]).take(take)))
            else:
                arrays.append(pa.nulls(len(rows), type=f.type))
        return pa.Table.from_arrays(arrays, schema=schema)

    def _meta(self, rows: np.ndarray) -> dict[str, pa.Array]:
        """The current table's meta columns of the batch's rows ``rows``."""
        keys = self.key_of_row[rows]
        return {
            KEY: self.keys.take(pa.array(keys)),
            BUCKET: pa.array(self.key_bucket[keys]),
            LSN: pa.array(self.lsn[rows]),
            SEQ: pa.array(self.seq[rows]),
            TS: pa.array(self.ts_us[rows]).cast(_TS_TYPE),
            OP: self.op.take(pa.array(rows)),
        }

    # -- the three tables ------------------------------------------------------------------------------
    def history(self, history: DeltaTable, commit: CommitProperties) -> dict[str, Any]:
        stored = _read(history, self.key_list, self.bucket_set, columns=[KEY, BUCKET, LSN, SEQ, IS_CURRENT])
        seen = pc.is_in(self.keys, value_set=stored.column(KEY).combine_chunks().cast(pa.string()))
        seen_key = seen.to_numpy(zero_copy_only=False)
        open_rows = stored.filter(pc.equal(stored.column(IS_CURRENT), True))
        o_lsn, o_seq = _versions_of(self.keys, open_rows, KEY, LSN, SEQ)
        has_open = o_lsn >= 0
        newer_open = _newer(o_lsn, o_seq, self.guard_lsn, self.guard_seq)
        g_lsn = np.where(newer_open, o_lsn, self.guard_lsn)[self.key_of_row]
        g_seq = np.where(newer_open, o_seq, self.guard_seq)[self.key_of_row]
        lsn, seq = self.lsn, self.seq
        first_of_version = self.first_of_key.copy()
        first_of_version[1:] |= (lsn[1:] != lsn[:-1]) | (seq[1:] != seq[:-1])
        # applied events: newer than the key's guard; a repeat of the same version counts once
        s = np.flatnonzero(first_of_version & _newer(lsn, seq, g_lsn, g_seq))
        if len(s) == 0:
            return {}  # nothing to write: a replay computes the same nothing
        s_key = self.key_of_row[s]
        closed = np.zeros(len(s), dtype=bool)  # closed by the next applied event of the same key
        closed[:-1] = s_key[1:] == s_key[:-1]
        nxt = np.where(closed, np.roll(s, -1), -1)
        # new rows: every applied upsert, closed by the key's next applied event if any
        up = ~self.is_delete[s]
        new, new_next = s[up], nxt[up]
        new_closed = new_next >= 0
        nn = np.where(new_closed, new_next, 0)
        mask = pa.array(~new_closed)
        meta = self._meta(new)
        meta.update(
            {
                VALID_FROM: meta[TS],
                VALID_TO: pa.array(self.ts_us[nn], mask=~new_closed).cast(_TS_TYPE),
                IS_CURRENT: pa.array(~new_closed),
                END_LSN: pa.array(lsn[nn], mask=~new_closed),
                END_SEQ: pa.array(seq[nn], mask=~new_closed),
                END_OP: pc.if_else(mask, pa.scalar(None, pa.string()), self.op.take(pa.array(nn))),
                _SRC_KIND: pa.array(["new"] * len(new), pa.string()),
            }
        )
        schema = pa.schema([*_arrow_schema(history), (_SRC_KIND, pa.string())])
        parts = [self._data(new, schema, meta)]
        # close rows: a key's stored open row, closed by the key's first applied event
        first_applied = np.ones(len(s), dtype=bool)
        first_applied[1:] = s_key[1:] != s_key[:-1]
        c = s[first_applied & has_open[s_key]]
        if len(c):
            c_key = self.key_of_row[c]
            none = np.full(len(c), -1)
            parts.append(
                self._data(
                    none,
                    schema,
                    {
                        KEY: self.keys.take(pa.array(c_key)),
                        BUCKET: pa.array(self.key_bucket[c_key]),
                        LSN: pa.array(o_lsn[c_key]),
                        SEQ: pa.array(o_seq[c_key]),
                        VALID_TO: pa.array(self.ts_us[c]).cast(_TS_TYPE),
                        IS_CURRENT: pa.array(np.zeros(len(c), dtype=bool)),
                        END_LSN: pa.array(lsn[c]),
                        END_SEQ: pa.array(seq[c]),
                        END_OP: self.op.take(pa.array(c)),
                        _SRC_KIND: pa.array(["close"] * len(c), pa.string()),
                    },
                )
            )
        source = pa.concat_tables(parts)
        match = set(self.key_bucket[c_key].tolist()) if len(c) else set()
        match |= set(self.key_bucket[self.key_of_row[new][seen_key[self.key_of_row[new]]]].tolist())
        return _write_history(history, source, match, [], commit)

    def current(self, current: DeltaTable, commit: CommitProperties) -> dict[str, Any]:
        last = np.flatnonzero(self.last_of_key)
        k = self.key_of_row[last]
        keep = self.is_delete[last] | _newer(
            self.lsn[last], self.seq[last], self.guard_lsn[k], self.guard_seq[k]
        )
        rows = last[keep]
        if len(rows) == 0:
            return {}  # nothing to write: a replay computes the same nothing
        data_rows = np.where(self.is_delete[rows], -1, rows)
        source = self._data(data_rows, _arrow_schema(current), self._meta(rows))
        return _write_current(current, source, None, commit)

    def tombstones(self, tombs: DeltaTable, commit: CommitProperties) -> None:
        rows = np.flatnonzero(self.last_of_key & self.is_delete)
        if len(rows) == 0:
            return
        k = self.key_of_row[rows]
        source = pa.Table.from_arrays(
            [
                self.keys.take(pa.array(k)),
                pa.array(self.key_bucket[k]),
                pa.array(self.lsn[rows]),
                pa.array(self.seq[rows]),
                pa.array(self.ts_us[rows]).cast(_TS_TYPE),
            ],
            schema=TOMBSTONES,
        )
        _write_tombstones(tombs, source, commit)


def _convert(f: pa.Field, types: dict[str, str | None], values: pa.Array) -> pa.Array:
    return _cast_to_field(f, types, T.from_json_array(values, types[f.name]))
