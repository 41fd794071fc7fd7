"""Log-store records as Arrow: the one definition of their columns, for the Spark source
(:mod:`spark_jobs.source`, which hands them over in this form and declares it to Spark as
:data:`RECORDS_DDL`) and the sinks' parse (:mod:`sinks.parse`). Imports pyarrow only, so a Spark
Python worker loads it without numpy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from cdc.logstore import LogStore

__all__ = ["READ_CHUNK", "RECORDS", "RECORDS_DDL", "read_records"]

#: records per Arrow batch of :func:`read_records`
READ_CHUNK = 10_000

#: one log-store record a row: ``value`` null for a tombstone, ``timestamp`` in ms
RECORDS = pa.schema(
    [
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("timestamp", pa.int64()),
    ]
)

_SPARK_TYPES = {pa.string(): "string", pa.int32(): "int", pa.int64(): "long", pa.binary(): "binary"}

#: :data:`RECORDS` as Spark's DDL schema string
RECORDS_DDL = ", ".join(f"{f.name} {_SPARK_TYPES[f.type]}" for f in RECORDS)


def _batch(cols: tuple[list[Any], ...]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(c, type=f.type) for c, f in zip(cols, RECORDS, strict=True)], schema=RECORDS
    )


def read_records(
    store: LogStore, topic: str, partition: int, start: int, end: int
) -> Iterator[pa.RecordBatch]:
    """The records ``[start, end)`` of one partition of ``topic`` as Arrow batches of at most
    :data:`READ_CHUNK` rows."""
    cols: tuple[list[Any], ...] = ([], [], [], [], [], [])
    for rec in store.iter_partition(topic, partition, start, end, batch=READ_CHUNK):
        cols[0].append(rec.topic)
        cols[1].append(rec.partition)
        cols[2].append(rec.offset)
        cols[3].append(rec.key)
        cols[4].append(rec.value)
        cols[5].append(rec.timestamp_ms)
        if len(cols[0]) >= READ_CHUNK:
            yield _batch(cols)
            cols = ([], [], [], [], [], [])
    if cols[0]:
        yield _batch(cols)
