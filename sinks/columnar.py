"""The one form of a micro-batch (:class:`Columns`): one table's events as Arrow columns.

Every :class:`sinks.ChangeBatch` holds one. :mod:`sinks.parse`'s columnar parse builds the common,
*plain* batch (every record well formed, no TRUNCATE, no unavailable TOAST column, every column of a
plain type) straight from the records; every other batch (the per-record parse's, a task's completed
slice) is built from its events (:func:`sinks.columns_of`) and also carries TRUNCATE rows, the
unavailable and absent columns of each row, the ``before`` image, and values the typed columns cannot
take as JSON text. The events are built from the columns only when something asks for them
(``ChangeBatch.events``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from sinks.types import arrow_type, from_json_array, to_array, unstorable, unstorable_json

__all__ = ["Columns", "json_type", "key_starts"]

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
        """The newest row per key (by version; a tie goes to the later record), sorted by version."""
        t = self.by_key()
        last = np.ones(t.num_rows, dtype=bool)
        last[:-1] = key_starts(t.column("key_json"))[1:]
        t = t.filter(pa.array(last))
        order = pc.sort_indices(
            t, sort_keys=[(c, "ascending") for c in ("commit_lsn", "seq", "partition", "offset")]
        )
        return t.take(order)

    def without(self, positions: set[tuple[int, int]]) -> Columns:
        """The rows whose ``(partition, offset)`` is not in ``positions``."""
        parts = self.table.column("partition").to_pylist()
        offs = self.table.column("offset").to_pylist()
        keep = [(p, o) not in positions for p, o in zip(parts, offs, strict=True)]
        return self.filter(pa.array(keep))

    def filter(self, mask: pa.Array) -> Columns:
        """The rows where ``mask`` is true (same kind of batch)."""
        return Columns(self.table.filter(mask), self.plain, self.json_fields)
