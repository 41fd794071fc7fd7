"""Events for tests: a batch's rows as :class:`sinks.ChangeEvent` (the per-record parse's form), and
a batch built from hand-made events. The product never turns columns back into events."""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from cdc.events import Version
from cdc.registry import TableReg
from sinks import ChangeBatch, ChangeEvent, columns_of
from sinks.columnar import Columns


def events_of(batch: ChangeBatch | Columns) -> list[ChangeEvent]:
    """The events of a batch's columns (what the per-record parse gives for the same records)."""
    columns = batch.columns if isinstance(batch, ChangeBatch) else batch
    t = columns.table
    loads = orjson.loads
    cols = [
        t.column(c).to_pylist()
        for c in ("key_json", "op", "commit_lsn", "seq", "ts_ms", "partition", "offset", "snapshot")
    ]
    none = [None] * t.num_rows  # a plain batch lacks nothing and has no before image
    lacks = [t.column(c).to_pylist() if c in t.column_names else none for c in ("unavailable", "before")]
    afters = columns.afters(list(range(t.num_rows)))
    return [
        ChangeEvent(
            key=loads(kj),
            key_json=kj,
            op=op,
            version=Version(lsn, seq),
            ts_ms=ts,
            after=after,
            before=None if before is None else loads(before),
            unavailable=tuple(unavailable or ()),
            partition=part,
            offset=off,
            snapshot=snap,
        )
        for (kj, op, lsn, seq, ts, part, off, snap), after, unavailable, before in zip(
            zip(*cols, strict=True), afters, *lacks, strict=True
        )
    ]


def batch_of(table: TableReg, events: Sequence[ChangeEvent], *, shard: int | None = None) -> ChangeBatch:
    """The batch of ``events`` (in version order)."""
    return ChangeBatch(table, columns_of(table, events), shard=shard)


def latest(batch: ChangeBatch) -> list[ChangeEvent]:
    """The events of the batch's :meth:`~sinks.columnar.Columns.latest_rows`."""
    evs = events_of(batch)
    return [evs[i] for i in batch.columns.latest_rows().tolist()]
