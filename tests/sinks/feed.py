"""Log-store records of chosen changes for sink tests, built by the reader's own envelope code
(:meth:`cdc.codec.envelope.TableCodec.change_records`): the bytes are the reader's, only the rows,
operations and versions are chosen here."""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterable
from typing import Any

import orjson
import pyarrow as pa

from cdc.codec.envelope import TableCodec, transaction_part
from cdc.events import encode_key
from cdc.logstore import Record
from cdc.registry import Column, TableReg
from sinks import ChangeBatch, RawRecord
from sinks.columnar import Columns
from sinks.parse import Form, parse, parse_columns


class ColumnarFallback(UserWarning):
    """The columnar form was asked for, the columnar parse declined the batch: the per-event form was
    used (shown in pytest's warnings summary, so a test that meant to cover the columnar form sees it)."""


BASE_TS_MS = 1_790_000_000_000  # 2026-09-21


def table(
    name: str = "items",
    *,
    columns: Iterable[tuple[str, str]] = (("id", "bigint"), ("name", "text"), ("note", "text")),
    key: tuple[str, ...] = ("id",),
    search: tuple[str, ...] = (),
    schema: str = "public",
) -> TableReg:
    return TableReg(
        schema=schema,
        table=name,
        topic=f"cdc.{schema}.{name}",
        key=key,
        search=search,
        columns=tuple(Column(n, t) for n, t in columns),
        snapshot_state="done",
    )


def columns_of(reg: TableReg, records: list[RawRecord]) -> Columns | None:
    """The columnar parse of ``records`` (any number of them), None when it declines."""
    return parse_columns(
        reg,
        pa.array([r.key for r in records], pa.binary()),
        pa.array([r.value for r in records], pa.binary()),
        pa.array([r.partition for r in records], pa.int32()),
        pa.array([r.offset for r in records], pa.int64()),
        min_records=1,
    )[0]


class Feed:
    """Records for one table's topic; offsets increase per partition 0.

    ``form``: the batch form :meth:`batch` builds: ``events`` (per-event), or ``columns`` (the columnar
    form whenever the columnar parse takes the batch; otherwise the per-event form with a
    :class:`ColumnarFallback` warning, and the reason in :attr:`fallbacks`)."""

    def __init__(self, reg: TableReg, form: Form = "events") -> None:
        self.reg = reg
        self.offset = 0
        self.form = form
        self.fallbacks: list[str] = []
        self._codecs: dict[int, TableCodec] = {}

    def _rec(self, key: dict[str, Any], value: Any, partition: int = 0) -> RawRecord:
        """A record as given (``value``: bytes, a JSON-able object, or None for a tombstone)."""
        self.offset += 1
        raw = None if value is None else (value if isinstance(value, bytes) else orjson.dumps(value))
        return RawRecord(self.reg.topic, partition, self.offset, encode_key(key), raw, BASE_TS_MS)

    def _raw(self, records: list[Record]) -> list[RawRecord]:
        out = []
        for r in records:
            self.offset += 1
            out.append(RawRecord(self.reg.topic, r.partition or 0, self.offset, r.key, r.value, BASE_TS_MS))
        return out

    def _events(
        self,
        op: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        lsn: int,
        seq: int,
        ts_ms: int | None = None,
        unavailable: Iterable[str] = (),
        partitions: int = 1,
    ) -> list[RawRecord]:
        """The reader's records of one change at version (``lsn``, ``seq``); ``lsn`` is also the
        commit LSN, the change's WAL position and the xid. ``r``: a snapshot row at ``lsn`` (whose
        ``seq`` is always 0)."""
        codec = self._codecs.get(partitions)
        if codec is None:
            codec = self._codecs[partitions] = TableCodec(self.reg, "cdc", "app", partitions)
        now = str(BASE_TS_MS).encode()
        ts = BASE_TS_MS + lsn if ts_ms is None else ts_ms
        if op == "r":
            assert after is not None
            return self._raw([codec.snapshot_record(after, codec.snapshot_source(lsn, ts, last=False), now)])
        source = codec.change_source(transaction_part(ts, lsn, lsn), lsn, lsn, seq)
        return self._raw(
            codec.change_records(op.encode(), before, after, source, now, list(unavailable), lsn)
        )

    def change(
        self,
        op: str,
        row: dict[str, Any],
        lsn: int,
        seq: int = 1,
        *,
        ts_ms: int | None = None,
        unavailable: Iterable[str] = (),
        before: dict[str, Any] | None = None,
    ) -> RawRecord:
        """One event: ``row`` is the new row (``c``, ``u``, ``r``) or the old key/row (``d``; its
        tombstone is left out, see :meth:`delete`)."""
        if op == "d":
            return self._events("d", before or row, None, lsn, seq, ts_ms)[0]
        (rec,) = self._events(op, before, row, lsn, seq, ts_ms, unavailable)
        return rec

    def delete(self, key: dict[str, Any], lsn: int, seq: int = 1) -> list[RawRecord]:
        """A delete and its tombstone."""
        return self._events("d", key, None, lsn, seq)

    def truncate(self, lsn: int, seq: int = 1, partitions: int = 2) -> list[RawRecord]:
        """The TRUNCATE markers, one per partition."""
        return self._events("t", None, None, lsn, seq, partitions=partitions)

    def batch(self, *records: RawRecord | list[RawRecord]) -> ChangeBatch:
        flat: list[RawRecord] = []
        for r in records:
            flat.extend(r if isinstance(r, list) else [r])
        parsed = parse(self.reg, flat, form=self.form)
        assert parsed.dead == [], parsed.dead
        assert parsed.batch is not None
        if self.form == "columns" and parsed.form != "columns":
            self.fallbacks.append(str(parsed.declined))
            warnings.warn(
                ColumnarFallback(f"{self.reg.qualified}: per-event form used: {parsed.declined}"),
                stacklevel=2,
            )
        return parsed.batch


def mixed_batches(f: Feed, seed: int, partitions: int | None = None) -> list[list[Any]]:
    """Batches of a random workload over 40 keys: inserts, updates, deletes, re-inserts and snapshot
    reads (most equal to the stored row, some not), each batch's records shuffled, some events
    delivered again in a later batch, older versions late, and a TRUNCATE in batch 3 (that batch takes
    the per-event form; later ones bring events older than it)."""
    rng = random.Random(seed)
    lsn = 1_000
    live: set[int] = set()
    vals: dict[int, dict[str, Any]] = {}
    sent: list[Any] = []
    batches = []
    for _ in range(6):
        recs: list[Any] = []
        touched: set[int] = set()  # keys changed in this batch: a read is compared with the stored row
        for _ in range(rng.randint(70, 140)):
            k = rng.randint(1, 40)
            lsn += rng.choice((1, 1, 2, 5))
            if k in live and rng.random() < 0.25:
                recs.extend(f.delete({"id": k}, lsn))
                live.discard(k)
            elif k in live and k not in touched and rng.random() < 0.3:  # a read: equal, or a missed change
                row = vals[k] if rng.random() < 0.7 else {**vals[k], "name": f"r{lsn}"}
                recs.append(f.change("r", row, lsn))
                vals[k] = row
            else:
                op = "u" if k in live else "c"
                vals[k] = {"id": k, "name": f"n{lsn}", "note": rng.choice((None, "x"))}
                recs.append(f.change(op, vals[k], lsn))
                live.add(k)
            touched.add(k)
        recs.extend(rng.sample(sent, min(len(sent), 30)))  # redelivered and late events
        sent.extend(r for r in recs if r.value is not None)
        if len(batches) == 3:
            lsn += 1
            recs.extend(f.truncate(lsn) if partitions is None else f.truncate(lsn, partitions=partitions))
            live.clear()
        rng.shuffle(recs)
        batches.append(recs)
    return batches


def join_tables() -> tuple[TableReg, TableReg, TableReg]:
    """``(orders, customers, regions)``: three tables joined many-to-one (an order's customer, a
    customer's region: a text key), for the views' tests and benchmark."""
    orders = table(
        "orders", columns=(("id", "bigint"), ("customer_id", "bigint"), ("total", "bigint"), ("note", "text"))
    )
    customers = table("customers", columns=(("id", "bigint"), ("name", "text"), ("region", "text")))
    regions = table("regions", columns=(("code", "text"), ("label", "text")), key=("code",))
    return orders, customers, regions
