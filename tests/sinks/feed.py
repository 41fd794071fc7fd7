"""Build log-store records with the envelopes the reader emits (cdc/events.py), for sink tests."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import orjson
import pyarrow as pa

from cdc.events import TRUNCATE_KEY_FIELD, encode_key
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
    )


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

    def _rec(self, key: dict[str, Any], value: Any, partition: int = 0) -> RawRecord:
        self.offset += 1
        raw = None if value is None else (value if isinstance(value, bytes) else orjson.dumps(value))
        return RawRecord(self.reg.topic, partition, self.offset, encode_key(key), raw, BASE_TS_MS)

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
        key = {k: row[k] for k in self.reg.key}
        value = {
            "before": before,
            "after": None if op == "d" else row,
            "source": {
                "version": "cdc-0.1.0",
                "connector": "postgresql",
                "name": "cdc",
                "ts_ms": BASE_TS_MS + lsn if ts_ms is None else ts_ms,
                "snapshot": "true" if op == "r" else "false",
                "db": "app",
                "schema": self.reg.schema,
                "table": self.reg.table,
                "txId": lsn,
                "lsn": lsn,
                "sequence": None,
                "commit_lsn": lsn,
                "seq": seq,
            },
            "op": op,
            "ts_ms": BASE_TS_MS,
            "unavailable": list(unavailable),
        }
        if op == "d":
            value["before"] = before or key
        return self._rec(key, value)

    def delete(self, key: dict[str, Any], lsn: int, seq: int = 1) -> list[RawRecord]:
        """A delete and its tombstone."""
        return [self.change("d", key, lsn, seq), self._rec(key, None)]

    def truncate(self, lsn: int, seq: int = 1, partitions: int = 2) -> list[RawRecord]:
        out = []
        for p in range(partitions):
            value = {
                "before": None,
                "after": None,
                "source": {
                    "ts_ms": BASE_TS_MS + lsn,
                    "schema": self.reg.schema,
                    "table": self.reg.table,
                    "commit_lsn": lsn,
                    "seq": seq,
                    "snapshot": "false",
                },
                "op": "t",
                "ts_ms": BASE_TS_MS,
            }
            out.append(self._rec({TRUNCATE_KEY_FIELD: p}, value, partition=p))
        return out

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
