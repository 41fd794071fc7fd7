"""The one form of a micro-batch (:class:`Columns`): one table's events as Arrow columns.

Every :class:`sinks.ChangeBatch` holds one. :mod:`sinks.parse`'s columnar parse builds the common,
*plain* batch (every record well formed, no TRUNCATE, no unavailable TOAST column, every column of a
plain type) straight from the records; every other batch (the per-record parse's) is built from its
events (:func:`sinks.columns_of`) and also carries TRUNCATE rows, the unavailable and absent columns
of each row, the ``before`` image, and values the typed columns cannot take as JSON text. Nothing
turns the columns back into events: the sinks decide on the columns (:mod:`sinks.toast` for the
unchanged TOAST values) and read only the rows they write (:meth:`Columns.afters`); a Spark task's
completed key changes are written into the columns (:meth:`Columns.with_values`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from sinks.types import arrow_type, from_json_array, to_array, unstorable, unstorable_json

__all__ = ["Columns", "concat", "json_type", "key_starts", "typed_array"]

#: the ``unavailable``/``absent`` columns' type: per row, column names (null: none)
NAMES = pa.list_(pa.string())


def key_starts(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """For keys sorted so that equal keys are adjacent: True where a row starts a new key."""
    n = len(keys)
    first = np.ones(n, dtype=bool)
    if n > 1:
        first[1:] = pc.not_equal(keys.slice(1), keys.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    return first


def json_type(pg_type: str | None) -> pa.DataType | None:
    """The Arrow type of a column's *event* encoding (cdc.events), or None for a type the columnar path
    leaves to the per-record parse (arrays, unknown columns): JSON integers, numbers and booleans for
    the columns stored as such (:func:`sinks.types.arrow_type`), text for everything else (numeric,
    json/jsonb, bytea hex, timestamps, dates, text, ...)."""
    if pg_type is None:
        return None
    at = arrow_type(pg_type)
    if pa.types.is_list(at):
        return None
    if pa.types.is_integer(at):
        return pa.int64()
    if pa.types.is_floating(at):
        return pa.float64()
    if pa.types.is_boolean(at):
        return pa.bool_()
    return pa.string()


@dataclass(frozen=True)
class Columns:
    """One table's micro-batch as Arrow columns, sorted by version (ties: partition, offset).

    ``table`` columns: ``key_json`` (canonical key JSON, as ``ChangeEvent.key_json``), ``op`` (r/c/u/d),
    ``commit_lsn``, ``seq``, ``ts_ms`` (source commit time), ``partition``, ``offset``, ``snapshot``
    (bool), ``key`` (struct of the key columns), ``after`` (struct of every registered column in event
    encoding -- :func:`json_type` -- null for ``d``). No dead letter.

    ``plain`` (the columnar parse's batch): no ``t`` row, no unavailable column, every ``after``
    field a registered column in its :func:`json_type`. Otherwise (built from events,
    :func:`sinks.columns_of`) ``table`` may also hold ``t`` rows (``key_json`` the envelope's
    truncate key, ``key`` and ``after`` null) and the columns ``unavailable`` and ``absent`` (the
    columns a row's ``after`` lacks: not sent, unchanged TOAST -- or just not in the object; null:
    none) and ``before`` (the before image as JSON text, null: none); the ``after`` fields named in
    ``json_fields`` hold JSON text (a new column, an array or unknown type, or a value of another JSON
    type than the column's).
    """

    table: pa.Table
    plain: bool = True
    json_fields: frozenset[str] = frozenset()
    _stored: dict[tuple[str, str | None], pa.Array] = field(default_factory=dict, compare=False, repr=False)

    def stored_values(self, name: str, pg_type: str | None) -> pa.Array:
        """The ``after`` column ``name`` converted to the Arrow type it is stored as
        (:func:`sinks.types.from_json_array`), in row order; computed once per batch (a sink's
        :meth:`~sinks.Sink.reject` and its apply share it). Raises ApplyError when a value cannot be
        stored."""
        got = self._stored.get((name, pg_type))
        if got is None:
            values = pc.struct_field(self.table.column("after").combine_chunks(), [name])
            if name in self.json_fields:  # JSON text: converted as the events' values are
                got = to_array([None if v is None else orjson.loads(v) for v in values.to_pylist()], pg_type)
            else:
                got = from_json_array(values, pg_type)
            self._stored[(name, pg_type)] = got
        return got

    def unstorable(self, name: str, pg_type: str | None) -> dict[int, str]:
        """The rows whose ``after`` value of ``name`` cannot be stored as ``pg_type``
        (:func:`sinks.types.unstorable`), each with the reason."""
        values = pc.struct_field(self.table.column("after").combine_chunks(), [name])
        if name in self.json_fields:
            return unstorable([None if v is None else orjson.loads(v) for v in values.to_pylist()], pg_type)
        return unstorable_json(values, pg_type)

    def values_of(self, name: str, values: pa.Array) -> list[Any]:
        """``values`` of the ``key`` or ``after`` field ``name`` as the events hold them (JSON text
        decoded)."""
        if name in self.json_fields:
            return [None if v is None else orjson.loads(v) for v in values.to_pylist()]
        return list(values.to_pylist())

    def names(self) -> list[str]:
        """The ``after`` fields: every column the batch's events name."""
        return list(self.table.column("after").type.names)

    def lacks_values(self) -> bool:
        """Whether a row lacks unavailable (unchanged TOAST) columns."""
        if self.plain or "unavailable" not in self.table.column_names:
            return False
        return bool(pc.any(pc.is_valid(self.table.column("unavailable"))).as_py())

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def by_key(self) -> pa.Table:
        """The rows sorted by key, then version, partition, offset."""
        order = pc.sort_indices(
            self.table,
            sort_keys=[(c, "ascending") for c in ("key_json", "commit_lsn", "seq", "partition", "offset")],
        )
        return self.table.take(order)

    def latest(self) -> pa.Table:
        """The rows of :meth:`latest_rows`."""
        return self.table.take(pa.array(self.latest_rows()))

    def latest_rows(self) -> np.ndarray:
        """The positions of the newest row per key (by version; a tie goes to the later record) and
        of every ``t`` row, in version order (ascending positions: the rows are in version order)."""
        t = self.table
        n = t.num_rows
        if not n:
            return np.zeros(0, dtype=np.int64)
        order = pc.sort_indices(
            t, sort_keys=[(c, "ascending") for c in ("key_json", "commit_lsn", "seq", "partition", "offset")]
        ).to_numpy()
        last = np.ones(n, dtype=bool)
        last[:-1] = key_starts(t.column("key_json").take(pa.array(order)))[1:]
        keep = np.zeros(n, dtype=bool)
        keep[order[last]] = True
        keep |= pc.equal(t.column("op"), "t").to_numpy(zero_copy_only=False)
        return np.flatnonzero(keep)

    def afters(self, rows: np.ndarray | list[int]) -> list[dict[str, Any] | None]:
        """The ``after`` values of the rows at ``rows`` as the envelope held them: JSON text decoded,
        without the columns a row lacks (``unavailable``, ``absent``); None for ``d`` and ``t``."""
        t = self.table.take(pa.array(rows, pa.int64()))
        loads = orjson.loads
        text = self.json_fields
        names = self.names()
        none = [None] * t.num_rows  # a plain batch lacks nothing
        lacks = (t.column(c).to_pylist() if c in t.column_names else none for c in ("unavailable", "absent"))
        out: list[dict[str, Any] | None] = []
        for after, unavailable, absent in zip(t.column("after").to_pylist(), *lacks, strict=True):
            if after is not None:
                gone = {*(unavailable or ()), *(absent or ())}
                after = {
                    n: (loads(after[n]) if n in text and after[n] is not None else after[n])
                    for n in names
                    if n not in gone
                }
            out.append(after)
        return out

    def positions(self, rows: np.ndarray | list[int]) -> list[tuple[int, int]]:
        """The ``(partition, offset)`` of the rows at ``rows``."""
        t = self.table.take(pa.array(rows, pa.int64()))
        return list(zip(t.column("partition").to_pylist(), t.column("offset").to_pylist(), strict=True))

    def without(self, positions: set[tuple[int, int]]) -> Columns:
        """The rows whose ``(partition, offset)`` is not in ``positions``."""
        parts = self.table.column("partition").to_pylist()
        offs = self.table.column("offset").to_pylist()
        keep = [(p, o) not in positions for p, o in zip(parts, offs, strict=True)]
        return self.filter(pa.array(keep))

    def with_values(self, rows: Sequence[int], values: Sequence[dict[str, Any]]) -> Columns:
        """The batch with the ``after`` values of the rows at ``rows`` replaced by ``values`` (event
        encoding, every value sent: the rows then lack nothing). A field whose new values are not
        all of its type becomes JSON text."""
        t = self.table
        n = t.num_rows
        if not len(rows):
            return self
        idx = np.arange(n)
        idx[list(rows)] = n + np.arange(len(rows))
        take = pa.array(idx)
        after = t.column("after").combine_chunks()
        text = set(self.json_fields)
        fields = []
        for name in self.names():
            old = pc.struct_field(after, [name])
            new = [v.get(name) for v in values]
            typed = None if name in text else typed_array(new, old.type)
            if typed is None:
                if name not in text:
                    text.add(name)
                    old = _as_text(old)
                typed = pa.array([None if v is None else orjson.dumps(v).decode() for v in new], old.type)
            fields.append(pa.concat_arrays([old, typed]).take(take))
        valid = pa.concat_arrays([after.is_valid(), pa.array([True] * len(rows))]).take(take)
        struct = pa.StructArray.from_arrays(fields, names=self.names(), mask=pc.invert(valid))
        names = self.names()
        absent = pa.array([[c for c in names if c not in v] or None for v in values], NAMES)
        t = t.set_column(t.column_names.index("after"), "after", struct)
        for col, more in (("unavailable", pa.nulls(len(rows), NAMES)), ("absent", absent)):
            if col in t.column_names:
                t = t.set_column(
                    t.column_names.index(col),
                    col,
                    pa.concat_arrays([t.column(col).combine_chunks(), more]).take(take),
                )
        if text - set(self.json_fields) and not text.isdisjoint(self.key_fields()):
            key = t.column("key").combine_chunks()
            kf = [
                _as_text(f) if name in text else f
                for name, f in ((n, pc.struct_field(key, [n])) for n in self.key_fields())
            ]
            t = t.set_column(
                t.column_names.index("key"),
                "key",
                pa.StructArray.from_arrays(kf, names=self.key_fields(), mask=pc.invert(key.is_valid())),
            )
        return Columns(t, self.plain, frozenset(text))

    def key_fields(self) -> list[str]:
        """The ``key`` struct's fields: the key columns."""
        return list(self.table.column("key").type.names)

    def filter(self, mask: pa.Array) -> Columns:
        """The rows where ``mask`` is true (same kind of batch)."""
        return Columns(self.table.filter(mask), self.plain, self.json_fields)


#: the Python type of a value of each :func:`json_type` (exactly: ``bool`` is no int)
_PY = {pa.int64(): int, pa.float64(): float, pa.bool_(): bool, pa.string(): str}


def typed_array(values: Sequence[Any], at: pa.DataType | None) -> pa.Array | None:
    """``values`` as an array of ``at``; None when one is not exactly of its JSON type (or ``at``
    is None or not a :func:`json_type`)."""
    want = _PY.get(at) if at is not None else None
    if want is None or any(v is not None and type(v) is not want for v in values):
        return None
    try:
        arr = pa.array(values, at)
    except (pa.ArrowInvalid, OverflowError):  # an integer beyond int64
        return None
    return None if isinstance(arr, pa.ChunkedArray) else arr


def _as_text(arr: pa.Array) -> pa.Array:
    """A typed field's values as JSON text (how a field of ``json_fields`` holds them)."""
    if arr.type == pa.large_string():
        return arr
    return pa.array(
        [None if v is None else orjson.dumps(v).decode() for v in arr.to_pylist()], pa.large_string()
    )


#: the columns of a batch that is not plain, in order (:class:`Columns`)
_ROW_COLUMNS = ("key_json", "op", "commit_lsn", "seq", "ts_ms", "partition", "offset", "snapshot")


def concat(parts: Sequence[Columns]) -> Columns:
    """The rows of ``parts`` (batches of one table, at least one) as one batch, sorted by version
    (ties: partition, offset), not plain: a field JSON text in one part (or typed differently) is
    JSON text in all, and a row of a part that does not name a column another part names lacks it
    (``absent``)."""
    if len(parts) == 1:
        return parts[0]
    text = set().union(*(p.json_fields for p in parts))
    types: dict[str, dict[str, pa.DataType]] = {"after": {}, "key": {}}
    for p in parts:
        for struct, seen in types.items():
            for f in p.table.column(struct).type:
                if seen.setdefault(f.name, f.type) != f.type:
                    text.add(f.name)
    tables = []
    for p in parts:
        t = p.table
        n = t.num_rows
        cols: dict[str, Any] = {c: t.column(c) for c in _ROW_COLUMNS}
        for struct, seen in types.items():
            whole = t.column(struct).combine_chunks()
            have = set(whole.type.names)
            fields = []
            for name, at in seen.items():
                arr = pc.struct_field(whole, [name]) if name in have else pa.nulls(n, at)
                if name in text and (name not in p.json_fields or name not in have):
                    arr = _as_text(arr)
                fields.append(arr)
            cols[struct] = pa.StructArray.from_arrays(
                fields, names=list(seen), mask=pc.invert(whole.is_valid())
            )
        lacking = [name for name in types["after"] if name not in p.names()]
        for c, at in (("unavailable", NAMES), ("absent", NAMES), ("before", pa.large_string())):
            cols[c] = t.column(c) if c in t.column_names else pa.nulls(n, at)
        if lacking:
            valid = t.column("after").is_valid().to_pylist()
            cols["absent"] = pa.array(
                [
                    [*(a or ()), *lacking] if ok else a
                    for a, ok in zip(cols["absent"].to_pylist(), valid, strict=True)
                ],
                NAMES,
            )
        tables.append(pa.table(cols))
    t = pa.concat_tables(tables)
    order = pc.sort_indices(
        t, sort_keys=[(c, "ascending") for c in ("commit_lsn", "seq", "partition", "offset")]
    )
    return Columns(t.take(order), plain=False, json_fields=frozenset(text))
