"""The envelope parser: one table's log-store records -> a :class:`sinks.ChangeBatch` and its dead letters.

One entry point, :func:`parse`. It tries the columnar parse first (Arrow's JSON reader over the whole
batch, :class:`sinks.columnar.Columns`) and takes the per-record parse when the columnar one declines:
a batch with a TRUNCATE, an unavailable (unchanged TOAST) column, an unknown or excluded column, a
value of an unexpected JSON type, a key that is not canonical, or a malformed record. The columnar
parse never decides what is corrupt; it only declines. The per-record parse (msgspec for the common
record, the plain path for the rest) gives the same events, and for a record it cannot parse a
:class:`sinks.DeadLetter` with the reason -- never a silent skip; its events then become the same
Arrow form (:func:`sinks.columns_of`): every batch is :class:`sinks.columnar.Columns`.

Columns the registration excludes (``cdc tables add --exclude``) are dropped here, so no sink ever
sees them, even in events written before the exclusion. Records of a topic that is no longer
registered are all dead letters.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from cdc.events import TRUNCATE_KEY_FIELD, Version
from cdc.logstore.records import RECORDS
from cdc.registry import TableReg
from sinks import OPS, ChangeBatch, ChangeEvent, DeadLetter, RawRecord, columns_of, order
from sinks.columnar import Columns, json_type

__all__ = [
    "MIN_RECORDS",
    "Form",
    "Parsed",
    "parse",
    "parse_batch",
    "parse_columns",
    "parse_events",
    "records_table",
]

Form = Literal["auto", "events", "columns"]


@dataclass
class Parsed:
    """What :func:`parse` gives: the batch (None for an unregistered topic), its dead letters, the form
    it took (``columns`` or ``events``) and why the columnar parse declined (None when it did not)."""

    batch: ChangeBatch | None
    dead: list[DeadLetter]
    form: str
    declined: str | None = None
    records: pa.Table = field(default_factory=RECORDS.empty_table)

    def raw(self, positions: set[tuple[int, int]]) -> dict[tuple[int, int], RawRecord]:
        """The original records at ``(partition, offset)`` positions (for dead letters of rejected
        events)."""
        t = self.records
        parts = t.column("partition").to_pylist()
        offs = t.column("offset").to_pylist()
        rows = [i for i, po in enumerate(zip(parts, offs, strict=True)) if po in positions]
        return {(r.partition, r.offset): r for r in _raw_records(t.take(rows))}


def records_table(records: Sequence[RawRecord]) -> pa.Table:
    """Records as an Arrow table of :data:`RECORDS` (the form :func:`parse` reads)."""
    return pa.table(
        {
            "topic": pa.array([r.topic for r in records], pa.string()),
            "partition": pa.array([r.partition for r in records], pa.int32()),
            "offset": pa.array([r.offset for r in records], pa.int64()),
            "key": pa.array([r.key for r in records], pa.binary()),
            "value": pa.array([r.value for r in records], pa.binary()),
            "timestamp": pa.array([r.timestamp_ms for r in records], pa.int64()),
        }
    )


def _raw_records(t: pa.Table) -> list[RawRecord]:
    return [
        RawRecord(*row)
        for row in zip(
            *(
                t.column(name).to_pylist()
                for name in ("topic", "partition", "offset", "key", "value", "timestamp")
            ),
            strict=True,
        )
    ]


def parse(
    reg: TableReg | None,
    records: pa.Table | Sequence[RawRecord],
    *,
    form: Form = "auto",
    min_records: int | None = None,
) -> Parsed:
    """Parse one table's records (an Arrow table of :data:`RECORDS`, or RawRecords), sorted by
    partition and offset or not. ``reg`` None: the topic is no longer registered (every record is a
    dead letter). ``form``: ``auto`` tries the columnar parse for :data:`MIN_RECORDS` records or more;
    ``columns`` tries it for any number (tests: :attr:`Parsed.form` says whether it was taken);
    ``events`` parses record by record. Tombstones are dropped; events come out sorted by version."""
    if not isinstance(records, pa.Table):
        records = records_table(records)
    if reg is None:
        topics = records.column("topic").unique().to_pylist() if records.num_rows else []
        dead = [
            DeadLetter(
                r.topic, r.partition, r.offset, r.key, r.value, f"topic {r.topic} is no longer registered"
            )
            for r in _raw_records(records)
        ]
        return Parsed(None, dead, "events", f"topics {topics} are not registered", records)
    declined: str | None = "per-record parse asked for"
    if form != "events":
        limit = min_records if min_records is not None else (1 if form == "columns" else MIN_RECORDS)
        columns, declined = parse_columns(
            reg,
            records.column("key"),
            records.column("value"),
            records.column("partition"),
            records.column("offset"),
            min_records=limit,
        )
        if columns is not None:
            return Parsed(ChangeBatch(reg, columns), [], "columns", None, records)
    batch, dead = _parse_records(reg, _raw_records(records))
    return Parsed(batch, dead, "events", declined, records)


def parse_batch(table: TableReg, records: Sequence[RawRecord]) -> tuple[ChangeBatch, list[DeadLetter]]:
    """The per-record parse of :func:`parse` (``form="events"``): the batch and its dead letters."""
    return _parse_records(table, list(records))


class _Bad(Exception):
    pass


_NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class _FastSource(msgspec.Struct):
    commit_lsn: _NonNeg
    seq: _NonNeg
    ts_ms: int | None = None
    schema: str | None = None
    table: str | None = None
    snapshot: Any = "false"


class _FastEnvelope(msgspec.Struct):
    """The envelope's fields the sinks read; ``after``/``before`` stay raw and are decoded by orjson,
    exactly as the per-record path does."""

    op: str
    source: _FastSource
    after: msgspec.Raw = msgspec.Raw(b"null")
    before: msgspec.Raw = msgspec.Raw(b"null")
    unavailable: list[str] | None = None
    ts_ms: Any = None


_ENVELOPE = msgspec.json.Decoder(_FastEnvelope)


def _parse_fast(table: TableReg, rec: RawRecord, key_cols: tuple[str, ...]) -> ChangeEvent | None:
    """The common, well-formed case through msgspec; None when anything is unusual (the caller then
    runs :func:`_parse_one`, which gives the same event or the dead-letter reason)."""
    assert rec.value is not None
    try:
        env = _ENVELOPE.decode(rec.value)
        src = env.source
        op = env.op
        if op not in OPS or op == "t":
            return None
        ts_ms = src.ts_ms if src.ts_ms is not None else env.ts_ms
        if type(ts_ms) is not int:
            return None
        if (src.schema is not None and src.schema != table.schema) or (
            src.table is not None and src.table != table.table
        ):
            return None
        key = orjson.loads(rec.key)
        if type(key) is not dict or len(key) != len(key_cols):
            return None
        if tuple(key) != key_cols:
            if set(key) != set(key_cols):
                return None
            key = {k: key[k] for k in key_cols}
        after = orjson.loads(memoryview(env.after))
        before = orjson.loads(memoryview(env.before))
    except (msgspec.DecodeError, orjson.JSONDecodeError):
        return None
    if op == "d":
        if after is not None:
            return None
    elif type(after) is not dict:
        return None
    if before is not None and type(before) is not dict:
        return None
    unavailable = env.unavailable or []
    if (
        unavailable
        and after is not None
        and (any(c in after for c in unavailable) or any(k in unavailable for k in key_cols))
    ):
        return None
    return ChangeEvent(
        key=key,
        key_json=orjson.dumps(key).decode(),
        op=op,
        version=Version(src.commit_lsn, src.seq),
        ts_ms=ts_ms,
        after=after,
        before=before,
        unavailable=tuple(unavailable),
        partition=rec.partition,
        offset=rec.offset,
        snapshot=str(src.snapshot) in ("true", "last"),
    )


def _parse_one(table: TableReg, rec: RawRecord) -> ChangeEvent:
    try:
        value = orjson.loads(rec.value) if rec.value is not None else None
    except orjson.JSONDecodeError as exc:
        raise _Bad(f"value is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise _Bad("value is not a JSON object")
    op = value.get("op")
    if op not in OPS:
        raise _Bad(f"unknown op {op!r} (expected one of r c u d t)")
    source = value.get("source")
    if not isinstance(source, dict):
        raise _Bad("value has no 'source' object")
    try:
        commit_lsn = source["commit_lsn"]
        seq = source["seq"]
    except KeyError as exc:
        raise _Bad(f"source has no {exc.args[0]!r}") from exc
    if not isinstance(commit_lsn, int) or isinstance(commit_lsn, bool) or commit_lsn < 0:
        raise _Bad(f"source.commit_lsn is not a non-negative integer: {commit_lsn!r}")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise _Bad(f"source.seq is not a non-negative integer: {seq!r}")
    ts_ms = source.get("ts_ms")
    if ts_ms is None:  # wal2json sent no commit timestamp: the time the reader built the event
        ts_ms = value.get("ts_ms")
    if not isinstance(ts_ms, int) or isinstance(ts_ms, bool):
        raise _Bad(f"source.ts_ms is not an integer: {ts_ms!r}")
    for name, want in (("schema", table.schema), ("table", table.table)):
        got = source.get(name)
        if got is not None and got != want:
            raise _Bad(f"source.{name} is {got!r}, but this batch is for {table.qualified}")
    try:
        key = orjson.loads(rec.key)
    except orjson.JSONDecodeError as exc:
        raise _Bad(f"key is not JSON: {exc}") from exc
    if not isinstance(key, dict):
        raise _Bad("key is not a JSON object")
    if op == "t":
        if TRUNCATE_KEY_FIELD not in key:
            raise _Bad(f"a truncate event's key must hold {TRUNCATE_KEY_FIELD!r}")
        key_json = orjson.dumps(key).decode()
    else:
        if set(key) != set(table.key) or len(key) != len(table.key):
            raise _Bad(f"key columns {sorted(key)} do not match the table's key {list(table.key)}")
        key = {k: key[k] for k in table.key}
        key_json = orjson.dumps(key).decode()
    after = value.get("after")
    before = value.get("before")
    if op in ("r", "c", "u"):
        if not isinstance(after, dict):
            raise _Bad(f"op {op!r} without an 'after' object")
    elif after is not None:
        raise _Bad(f"op {op!r} with an 'after' value")
    if before is not None and not isinstance(before, dict):
        raise _Bad("'before' is neither an object nor null")
    unavailable = value.get("unavailable") or []
    if not isinstance(unavailable, list) or not all(isinstance(c, str) for c in unavailable):
        raise _Bad(f"'unavailable' is not a list of column names: {unavailable!r}")
    if after is not None:
        clash = [c for c in unavailable if c in after]
        if clash:
            raise _Bad(f"columns {clash} are both in 'after' and 'unavailable'")
        missing_key = [k for k in table.key if k in unavailable]
        if missing_key:
            raise _Bad(f"key columns {missing_key} are marked unavailable")
    return ChangeEvent(
        key=key,
        key_json=key_json,
        op=op,
        version=Version(commit_lsn, seq),
        ts_ms=ts_ms,
        after=after,
        before=before,
        unavailable=tuple(unavailable),
        partition=rec.partition,
        offset=rec.offset,
        snapshot=str(source.get("snapshot", "false")) in ("true", "last"),
    )


def _parse_records(table: TableReg, records: Sequence[RawRecord]) -> tuple[ChangeBatch, list[DeadLetter]]:
    """:func:`parse_events`, the events as :class:`Columns` (:func:`sinks.columns_of`)."""
    events, dead = parse_events(table, records)
    return ChangeBatch(table, columns_of(table, events)), dead


def parse_events(table: TableReg, records: Sequence[RawRecord]) -> tuple[list[ChangeEvent], list[DeadLetter]]:
    """Parse the envelopes of one table's records, one by one.

    A tombstone (value None) is dropped: the ``d`` event before it carries the delete. A record that
    cannot be parsed (bad JSON, missing ``source.commit_lsn``/``seq``/``ts_ms``, unknown op, key not
    matching the table's key columns, ``after`` missing for r/c/u, a different source table) becomes a
    :class:`DeadLetter` with the reason -- never skipped silently. Events come out sorted by version.
    """
    events: list[ChangeEvent] = []
    dead: list[DeadLetter] = []
    key_cols = tuple(table.key)
    for rec in records:
        if rec.value is None:
            continue
        fast = _parse_fast(table, rec, key_cols)
        if fast is not None:
            events.append(fast)
            continue
        try:
            events.append(_parse_one(table, rec))
        except _Bad as bad:
            dead.append(
                DeadLetter(
                    rec.topic, rec.partition, rec.offset, rec.key, rec.value, str(bad), table=table.qualified
                )
            )
    if table.exclude:
        excluded = frozenset(table.exclude)
        events = [_without(ev, excluded) for ev in events]
    events.sort(key=order)
    return events, dead


def _without(ev: ChangeEvent, excluded: frozenset[str]) -> ChangeEvent:
    """The event without the excluded columns (events written before the exclusion hold them)."""
    after, before = ev.after, ev.before
    if not (
        (after is not None and not excluded.isdisjoint(after))
        or (before is not None and not excluded.isdisjoint(before))
        or not excluded.isdisjoint(ev.unavailable)
    ):
        return ev
    return replace(
        ev,
        after=None if after is None else {k: v for k, v in after.items() if k not in excluded},
        before=None if before is None else {k: v for k, v in before.items() if k not in excluded},
        unavailable=tuple(c for c in ev.unavailable if c not in excluded),
    )


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
        ("schema_version", pa.int64()),
        ("txId", pa.int64()),
        ("lsn", pa.int64()),
        ("sequence", pa.string()),
        ("commit_lsn", pa.int64()),
        ("seq", pa.int64()),
    ]
)


def parse_columns(
    reg: TableReg,
    keys: pa.Array | pa.ChunkedArray,
    values: pa.Array | pa.ChunkedArray,
    partitions: pa.Array | pa.ChunkedArray,
    offsets: pa.Array | pa.ChunkedArray,
    *,
    min_records: int = MIN_RECORDS,
) -> tuple[Columns | None, str | None]:
    """Parse one table's records (tombstones -- null values -- are dropped) into :class:`Columns`, or
    (None, why) when the batch needs the per-record parse (see the module docstring). The arrays are
    binary (keys, values), int32 (partitions) and int64 (offsets), one element per record."""
    keys, values, partitions, offsets = (_one_chunk(a) for a in (keys, values, partitions, offsets))
    live = pc.is_valid(values)
    if not pc.all(live).as_py():
        keys, values, partitions, offsets = (a.filter(live) for a in (keys, values, partitions, offsets))
    n = len(values)
    if n < min_records:
        return None, "fewer records than the columnar parse is worth"
    after_type = _after_type(reg)
    key_type = _key_type(reg, after_type)
    if after_type is None or key_type is None:
        return None, "a column type (or an excluded column) the columnar parse leaves to the per-record parse"
    values = _as_binary(values)
    keys = _as_binary(keys)
    if values is None or keys is None:
        return None, "more bytes than one Arrow array holds"
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
        return (
            None,
            "a record does not match the table's JSON shape (new, excluded or retyped column, TRUNCATE, malformed JSON)",
        )
    key_struct = _parse_keys(keys, key_type)
    if key_struct is None:
        return None, "a key that is not canonical"
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
        return (
            None,
            "a record needs the per-record checks (TRUNCATE, unavailable column, bad version, other table, unknown op)",
        )
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
    by_version = pc.sort_indices(
        table, sort_keys=[(c, "ascending") for c in ("commit_lsn", "seq", "partition", "offset")]
    )
    return Columns(table.take(by_version)), None


def _after_type(reg: TableReg) -> pa.StructType | None:
    fields = []
    for col in reg.columns:
        if col.name in reg.exclude:
            continue  # an event holding it does not match the schema: the per-record parse drops it
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
