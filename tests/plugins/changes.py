"""Writing synthetic change events into a log store the way the reader does (tests).

:class:`ChangeWriter` chooses changes and their versions (``source.commit_lsn`` and ``seq``) and has
the reader's own envelope code build their records
(:meth:`cdc.codec.envelope.TableCodec.change_records`: ``unavailable`` for unchanged TOAST values, a
tombstone after every delete, a primary-key change as ``d`` + tombstone + ``c``, TRUNCATE as one
``t`` per partition), appended with the reader's partitioning (murmur2 of the key bytes). Its events
are synthetic: a test that claims equality with a source captures the source with ``cdc run``
instead (``tests/plugins/items.py``, ``tests/apply/test_verify.py``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import msgspec

from cdc.codec.envelope import TableCodec, transaction_part
from cdc.logstore import LogStore, Record, TopicConfig
from cdc.registry import Column, TableReg


def make_reg(
    schema: str,
    table: str,
    columns: Sequence[tuple[str, str]],
    key: Sequence[str] = ("id",),
    search: Sequence[str] = (),
    prefix: str = "cdc",
) -> TableReg:
    from cdc.events import topic_name

    return TableReg(
        schema=schema,
        table=table,
        topic=topic_name(prefix, schema, table),
        key=tuple(key),
        search=tuple(search),
        columns=tuple(Column(n, t, n not in key) for n, t in columns),
        snapshot_state="done",
    )


class ChangeWriter:
    """Appends envelopes for one table. Versions: ``commit_lsn`` grows by 16 per transaction (or is
    given), ``seq`` counts changes within the transaction from 1."""

    def __init__(
        self,
        store: LogStore,
        reg: TableReg,
        *,
        partitions: int = 4,
        db: str = "test",
        prefix: str = "cdc",
        start_lsn: int = 0x1_0000_0000,
    ) -> None:
        self.store = store
        self.reg = reg
        self.partitions = partitions
        self.db = db
        self.prefix = prefix
        store.create_topic(reg.topic, TopicConfig(partitions=partitions))
        self.commit_lsn = start_lsn
        self.seq = 0
        self.pending: list[Record] = []
        self.written: list[Record] = []
        self.ts_ms: int | None = None
        self.codec = TableCodec(reg, prefix, db, partitions)

    # -- transactions --------------------------------------------------------------------------------
    @contextmanager
    def txn(self, commit_lsn: int | None = None, ts_ms: int | None = None) -> Iterator[int]:
        self.commit_lsn = commit_lsn if commit_lsn is not None else self.commit_lsn + 16
        self.seq = 0
        self.ts_ms = ts_ms
        yield self.commit_lsn
        self.flush()

    def flush(self) -> None:
        if self.pending:
            self.store.append(self.reg.topic, self.pending)
            self.written.extend(self.pending)
            self.pending = []

    # -- changes (the reader's own envelope code builds the records) -------------------------------
    def _append(self, records: list[Record]) -> None:
        if self.ts_ms is not None:
            records = [msgspec.structs.replace(r, timestamp_ms=self.ts_ms) for r in records]
        self.pending.extend(records)

    def _change(
        self,
        op: bytes,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        unavailable: Sequence[str] = (),
        new_key: dict[str, Any] | None = None,
    ) -> None:
        """One change of the open transaction: its ``seq`` is the next one, its WAL position below
        the commit LSN, its xid derived from the commit LSN."""
        self.seq += 1
        ts = self.ts_ms if self.ts_ms is not None else int(time.time() * 1000)
        lsn = self.commit_lsn - 8 + min(self.seq, 7)
        tx = transaction_part(ts, self.commit_lsn % 100_000, self.commit_lsn)
        source = self.codec.change_source(tx, lsn, self.commit_lsn, self.seq)
        self._append(
            self.codec.change_records(op, before, after, source, str(ts).encode(), unavailable, lsn, new_key)
        )

    def _key(self, row: dict[str, Any]) -> dict[str, Any]:
        return {k: row[k] for k in self.reg.key}

    def upsert(self, row: dict[str, Any], op: str = "c", unavailable: Sequence[str] = ()) -> None:
        after = {k: v for k, v in row.items() if k not in unavailable}
        self._change(op.encode(), None, after, unavailable, self._key(row))

    def insert(self, row: dict[str, Any]) -> None:
        self.upsert(row, "c")

    def update(self, row: dict[str, Any], unavailable: Sequence[str] = ()) -> None:
        self.upsert(row, "u", unavailable)

    def delete(self, key: dict[str, Any]) -> None:
        """A delete (and its tombstone)."""
        self._change(b"d", dict(key), None)

    def change_key(self, old_key: dict[str, Any], new_row: dict[str, Any]) -> None:
        """A primary-key change: ``d`` old + tombstone + ``c`` new, sharing one seq."""
        self._change(b"u", dict(old_key), new_row)

    def truncate(self) -> None:
        """One TRUNCATE marker per partition."""
        self._change(b"t", None, None)

    def raw(self, key: bytes, value: bytes | None) -> None:
        """A record as-is (corrupt input)."""
        self.pending.append(Record(key, value, timestamp_ms=self.ts_ms))
