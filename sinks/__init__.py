"""The apply stage's sinks: the interface every derived-table backend implements.

One module per backend beside this one: :mod:`sinks.warehouse` (Delta Lake via ``deltalake``:
current state + history) and :mod:`sinks.search` (tantivy). The Spark apply job (``spark_jobs/``)
hands each micro-batch's log-store records for one table to :func:`parse_batch`, sends the resulting
:class:`DeadLetter` records to the dead-letter topic, and calls :meth:`Sink.apply` on every sink.

Guarantees shared by every sink (DESIGN.md "Delivery and idempotence"):

* **Version guard.** A sink keeps, per key, the version (``(commit_lsn, seq)``, see
  :class:`cdc.events.Version`) of what it stored and ignores an event whose version is not newer.
  Out-of-order and repeated events are harmless.
* **Deletes stick.** A delete's version is remembered for a retention window (default 7 days), so an
  older event for that key arriving later does not resurrect the row. A TRUNCATE's version is
  remembered the same way for the whole table.
* **Idempotent batches.** ``apply(batch, batch_id, app_id)`` called again with the same
  ``(app_id, batch_id)`` after a crash (Spark replays a failed batch with the same offsets and id)
  is a no-op or gives the same result.
* **Unavailable TOAST values** (``ChangeEvent.unavailable``) keep the stored value; never null.
* A failure raises (:class:`cdc.errors.ApplyError` for a known cause); the caller fails the batch,
  never skips it.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import orjson

from cdc.events import TRUNCATE_KEY_FIELD, Version
from cdc.registry import TableReg

if TYPE_CHECKING:
    from cdc.config import Settings
    from sinks.columnar import Columns

__all__ = [
    "OPS",
    "ChangeBatch",
    "ChangeEvent",
    "DeadLetter",
    "RawRecord",
    "Sink",
    "open_sinks",
    "parse_batch",
]

OPS = frozenset("rcudt")


@dataclass(frozen=True, slots=True)
class RawRecord:
    """One log-store record as the Spark source hands it over."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes | None
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class ChangeEvent:
    """One parsed change (see :mod:`cdc.events` for the envelope).

    ``key_json`` is the canonical key: orjson of the key dict with the keys in the table's key-column
    order (for ``op='t'``: the envelope's ``{"__truncate__": <partition>}``). ``ts_ms`` is the source
    commit time (``source.ts_ms``). ``unavailable`` lists the columns absent from ``after`` because
    the source did not send them (unchanged TOAST): a sink keeps the stored value.
    """

    key: dict[str, Any]
    key_json: str
    op: str
    version: Version
    ts_ms: int
    after: dict[str, Any] | None
    before: dict[str, Any] | None
    unavailable: tuple[str, ...]
    partition: int
    offset: int
    snapshot: bool


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A record :func:`parse_batch` could not turn into an event, with the reason. The caller writes
    it to the dead-letter topic (``cdc.events.dead_letter_topic``) and counts it; never dropped."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes | None
    reason: str


class ChangeBatch:
    """Every parsed event of one micro-batch for one table, sorted by version (ties: partition,
    offset). Tombstones (value None) are not in it: the ``d`` before them carries the delete.

    Built from the event list, or from :class:`sinks.columnar.Columns` (the columnar parse of a plain
    batch: no TRUNCATE, no unavailable column, no dead letter); then ``columns`` is set and ``events``
    is built from it on first use. A sink may take either form; both describe the same events.
    """

    def __init__(
        self, table: TableReg, events: list[ChangeEvent] | None = None, *, columns: Columns | None = None
    ) -> None:
        if (events is None) == (columns is None):
            raise ValueError("a ChangeBatch needs either events or columns")
        self.table = table
        self.columns = columns
        self._events = events

    @property
    def events(self) -> list[ChangeEvent]:
        if self._events is None:
            assert self.columns is not None
            self._events = self.columns.events()
        return self._events

    def __len__(self) -> int:
        return len(self.columns) if self.columns is not None else len(self.events)

    def ts_ms(self) -> list[int]:
        """The source commit time of every event, in version order."""
        if self.columns is not None:
            return list(self.columns.table.column("ts_ms").to_pylist())
        return [e.ts_ms for e in self.events]

    def newest_ts_ms(self) -> int | None:
        """The source commit time of the newest event (by version), None for an empty batch."""
        if self.columns is not None:
            return self.columns.table.column("ts_ms")[-1].as_py() if len(self.columns) else None
        return self.events[-1].ts_ms if self.events else None

    def latest(self) -> list[ChangeEvent]:
        """The newest event per key (by version; a tie goes to the later record), plus every ``t``
        event; sorted by version."""
        newest: dict[str, ChangeEvent] = {}
        truncates: list[ChangeEvent] = []
        for ev in self.events:
            if ev.op == "t":
                truncates.append(ev)
                continue
            cur = newest.get(ev.key_json)
            if cur is None or _order(ev) >= _order(cur):
                newest[ev.key_json] = ev
        out = [*newest.values(), *truncates]
        out.sort(key=_order)
        return out

    def truncate_version(self) -> Version | None:
        """The newest TRUNCATE version in the batch, if any."""
        versions = [ev.version for ev in self.events if ev.op == "t"]
        return max(versions) if versions else None


def _order(ev: ChangeEvent) -> tuple[int, int, int, int]:
    """Sort key: (version, partition, offset) as plain ints (Version's dataclass comparisons are slow)."""
    v = ev.version
    return (v.commit_lsn, v.seq, ev.partition, ev.offset)


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
    for field, want in (("schema", table.schema), ("table", table.table)):
        got = source.get(field)
        if got is not None and got != want:
            raise _Bad(f"source.{field} is {got!r}, but this batch is for {table.qualified}")
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


def parse_batch(table: TableReg, records: Iterable[RawRecord]) -> tuple[ChangeBatch, list[DeadLetter]]:
    """Parse the envelopes of one table's records.

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
            dead.append(DeadLetter(rec.topic, rec.partition, rec.offset, rec.key, rec.value, str(bad)))
    events.sort(key=_order)
    return ChangeBatch(table, events), dead


class Sink(abc.ABC):
    """A derived table the apply job keeps equal to the source."""

    name: str

    @abc.abstractmethod
    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        """Apply one table's micro-batch. Called once per table per micro-batch, possibly again with
        the same (app_id, batch_id) after a crash (Spark replays a failed batch with the same id): must
        then be a no-op or give the same result. Version-guarded: an event whose version is not newer
        than the stored version of its key changes nothing (out-of-order and repeated events are
        harmless). A delete is remembered (its version) for a retention window so an older event
        arriving later cannot resurrect the row. Raises on failure; the caller fails the batch (never
        skips it)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the sink is not used afterwards."""


def open_sinks(settings: Settings) -> list[Sink]:
    """The warehouse sink and the search sink (which only acts on tables with search columns)."""
    from sinks.search import SearchSink
    from sinks.warehouse import WarehouseSink

    return [WarehouseSink.from_settings(settings), SearchSink.from_settings(settings)]
