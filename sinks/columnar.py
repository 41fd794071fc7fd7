"""The columnar form of a micro-batch: one table's envelopes parsed by Arrow's JSON reader, not per record.

:func:`parse_columns` is the fast path of :func:`sinks.parse_batch` for the common batch: every record
well formed, no TRUNCATE, no unavailable (unchanged TOAST) column, every column of a plain type. It
gives ``None`` whenever anything in the batch is unusual -- a record that does not match the table's
JSON shape, an unknown column, a key that is not canonical, a TRUNCATE -- and the caller then parses the
batch record by record, which produces the same events and the dead letters with their reasons. So the
fast path never decides what is corrupt; it only declines.

A sink may use :class:`Columns` (``ChangeBatch.columns``) instead of the per-event list; the events are
built from the columns only when something asks for them (``ChangeBatch.events``).
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from cdc.events import Version
from cdc.registry import TableReg

if TYPE_CHECKING:
    from sinks import ChangeEvent

__all__ = ["Columns", "json_type", "parse_columns"]

#: below this many records the per-record parse is as fast (Arrow's reader has a fixed cost)
MIN_RECORDS = 64

_SOURCE = pa.struct(
    [
        ("version", pa.string()),
        ("connector", pa.string()),
        ("name", pa.string()),
        ("ts_ms", pa.int64()),
        ("snapshot", pa.string()),
        ("db", pa.string()),
        ("schema", pa.string()),
        ("table", pa.string()),
        ("txId", pa.int64()),
        ("lsn", pa.int64()),
        ("sequence", pa.string()),
        ("commit_lsn", pa.int64()),
        ("seq", pa.int64()),
    ]
)


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
    from sinks.types import arrow_type

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
    encoding -- :func:`json_type` -- null for ``d``). Guarantees: no ``t`` event, no unavailable column,
    no dead letter.
    """

    table: pa.Table

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

    def events(self) -> list[ChangeEvent]:
        """The per-event form (what :func:`sinks.parse_batch` gives for the same records)."""
        from sinks import ChangeEvent

        t = self.table
        key_cols = t.column("key").type
        names = [key_cols.field(i).name for i in range(key_cols.num_fields)]
        cols = [
            t.column(c).to_pylist()
            for c in (
                "key_json",
                "op",
                "commit_lsn",
                "seq",
                "ts_ms",
                "after",
                "partition",
                "offset",
                "snapshot",
            )
        ]
        keys = t.column("key").to_pylist()
        out = []
        for key, (kj, op, lsn, seq, ts, after, part, off, snap) in zip(
            keys, zip(*cols, strict=True), strict=True
        ):
            out.append(
                ChangeEvent(
                    key={n: key[n] for n in names},
                    key_json=kj,
                    op=op,
                    version=Version(lsn, seq),
                    ts_ms=ts,
                    after=after,
                    before=None,
                    unavailable=(),
                    partition=part,
                    offset=off,
                    snapshot=snap,
                )
            )
        return out


def parse_columns(
    reg: TableReg,
    keys: pa.Array | pa.ChunkedArray,
    values: pa.Array | pa.ChunkedArray,
    partitions: pa.Array | pa.ChunkedArray,
    offsets: pa.Array | pa.ChunkedArray,
    *,
    min_records: int = MIN_RECORDS,
) -> Columns | None:
    """Parse one table's records (tombstones -- null values -- are dropped) into :class:`Columns`, or
    None when the batch needs the per-record parse (see the module docstring). The arrays are binary
    (keys, values), int32 (partitions) and int64 (offsets), one element per record."""
    keys, values, partitions, offsets = (_one_chunk(a) for a in (keys, values, partitions, offsets))
    live = pc.is_valid(values)
    if not pc.all(live).as_py():
        keys, values, partitions, offsets = (a.filter(live) for a in (keys, values, partitions, offsets))
    n = len(values)
    if n < min_records:
        return None
    after_type = _after_type(reg)
    key_type = _key_type(reg, after_type)
    if after_type is None or key_type is None:
        return None
    values = _as_binary(values)
    keys = _as_binary(keys)
    if values is None or keys is None:
        return None
    env = _read_lines(
        values,
        pa.schema(
            [
                ("before", after_type),
                ("after", after_type),
                ("source", _SOURCE),
                ("op", pa.string()),
                ("ts_ms", pa.int64()),
                ("unavailable", pa.list_(pa.string())),
            ]
        ),
    )
    if env is None:
        return None
    key_struct = _parse_keys(keys, key_type)
    if key_struct is None:
        return None
    src = env.column("source").combine_chunks()
    op = env.column("op").combine_chunks()
    after = env.column("after").combine_chunks()
    commit_lsn = src.field("commit_lsn")
    seq = src.field("seq")
    ts_ms = pc.coalesce(src.field("ts_ms"), env.column("ts_ms").combine_chunks())
    unavailable = env.column("unavailable").combine_chunks()
    is_delete = pc.equal(op, "d")
    checks = [
        pc.is_in(op, pa.array(["r", "c", "u", "d"])),
        pc.is_valid(src),
        pc.greater_equal(commit_lsn, 0),
        pc.greater_equal(seq, 0),
        pc.is_valid(ts_ms),
        pc.or_(pc.is_null(src.field("schema")), pc.equal(src.field("schema"), reg.schema)),
        pc.or_(pc.is_null(src.field("table")), pc.equal(src.field("table"), reg.table)),
        pc.or_(pc.is_null(unavailable), pc.equal(pc.list_value_length(unavailable), 0)),
        # r/c/u carry an after object, d none
        pc.not_equal(is_delete, pc.is_valid(after)),
    ]
    ok = checks[0]
    for c in checks[1:]:
        ok = pc.and_(ok, c)
    if not pc.all(pc.fill_null(ok, False)).as_py():
        return None
    snapshot = pc.is_in(src.field("snapshot"), pa.array(["true", "last"]))
    table = pa.table(
        {
            "key_json": keys.cast(pa.string()),
            "op": op,
            "commit_lsn": commit_lsn,
            "seq": seq,
            "ts_ms": ts_ms,
            "partition": partitions.cast(pa.int32()),
            "offset": offsets.cast(pa.int64()),
            "snapshot": pc.fill_null(snapshot, False),
            "key": key_struct,
            "after": after,
        }
    )
    order = pc.sort_indices(
        table, sort_keys=[(c, "ascending") for c in ("commit_lsn", "seq", "partition", "offset")]
    )
    return Columns(table.take(order))


def _after_type(reg: TableReg) -> pa.StructType | None:
    fields = []
    for col in reg.columns:
        t = json_type(col.type)
        if t is None:
            return None
        fields.append(pa.field(col.name, t))
    if not fields:
        return None
    return pa.struct(fields)


def _key_type(reg: TableReg, after: pa.StructType | None) -> pa.StructType | None:
    if after is None or not reg.key:
        return None
    names = {after.field(i).name: after.field(i).type for i in range(after.num_fields)}
    if any(k not in names for k in reg.key):
        return None
    return pa.struct([(k, names[k]) for k in reg.key])


def _one_chunk(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    return arr.combine_chunks() if isinstance(arr, pa.ChunkedArray) else arr


#: above this many bytes of values in one table's batch the per-record parse takes it (Arrow's binary
#: arrays hold at most 2 GiB; a catch-up without maxRecordsPerBatch can bring more)
MAX_BYTES = 1 << 30


def _as_binary(arr: pa.Array) -> pa.Array | None:
    """The array as ``binary`` (32-bit offsets), None when it holds more than :data:`MAX_BYTES`."""
    if arr.nbytes > MAX_BYTES:
        return None
    if arr.type == pa.large_binary():
        arr = arr.cast(pa.binary())
    return arr


def _read_lines(arr: pa.Array, schema: pa.Schema, *, wrap: bool = False) -> pa.Table | None:
    """Parse one JSON object per element with Arrow's reader (``wrap``: each element becomes the
    value of the schema's single field). None when an element is not one line holding one object
    of the schema (the per-record parse then names what is wrong)."""
    lengths = pc.binary_length(arr)
    if len(arr) == 0 or pc.min(lengths).as_py() < 2:
        return None
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    data = np.frombuffer(bufs[2], dtype=np.uint8)[offsets[0] : offsets[-1]]
    if (data == 0x0A).any():  # a raw newline: the one-object-per-line framing would not hold
        return None
    name = schema.field(0).name
    parts: Sequence[Any] = arr.to_pylist()
    if wrap:
        prefix = b'{"' + name.encode() + b'":'
        buf = b"}\n".join(prefix + p for p in parts) + b"}"
    else:
        buf = b"\n".join(parts)
    try:
        table = pj.read_json(
            io.BytesIO(buf),
            read_options=pj.ReadOptions(block_size=max(1 << 20, min(len(buf) // 2 + 1, 64 << 20))),
            parse_options=pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="error"),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != len(arr):
        return None
    return table


_CANONICAL_INT = "0|-?[1-9][0-9]*"  # how orjson writes an integer


def _parse_keys(keys: pa.Array, key_type: pa.StructType) -> pa.StructArray | None:
    """The key columns of canonical keys (the bytes are then ``ChangeEvent.key_json``), or None when a
    key is not canonical. Integer keys: one regular expression over all keys; others: Arrow's JSON
    reader plus a per-key comparison with orjson's output."""
    names = [key_type.field(i).name for i in range(key_type.num_fields)]
    if all(pa.types.is_integer(key_type.field(i).type) for i in range(key_type.num_fields)):
        pattern = ",".join(
            re.escape(orjson.dumps(n).decode()) + f":(?P<k{i}>{_CANONICAL_INT})" for i, n in enumerate(names)
        )
        try:
            got = pc.extract_regex(keys.cast(pa.string()), "^\\{" + pattern + "\\}$")
            if got.null_count:
                return None
            fields = [pc.struct_field(got, [i]).cast(pa.int64()) for i in range(len(names))]
        except (pa.ArrowInvalid, OverflowError):  # not UTF-8, beyond int64: the per-record path decides
            return None
        return pa.StructArray.from_arrays(fields, names=names)
    tab = _read_lines(keys, pa.schema([("key", key_type)]), wrap=True)
    if tab is None or not _canonical_keys(keys, tuple(names)):
        return None
    return tab.column("key").combine_chunks()


def _canonical_keys(keys: pa.Array, key_cols: tuple[str, ...]) -> bool:
    """Every key is the canonical JSON object of exactly the key columns, in key-column order (what
    the reader writes): then the key bytes are ``ChangeEvent.key_json``."""
    loads, dumps = orjson.loads, orjson.dumps
    try:
        for raw in keys.to_pylist():
            k = loads(raw)
            if type(k) is not dict or tuple(k) != key_cols or dumps(k) != raw:
                return False
    except orjson.JSONDecodeError:
        return False
    return True
