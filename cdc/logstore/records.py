"""Log-store records as Arrow: the one definition of their columns, for the Spark source
(:mod:`spark_jobs.source`, which hands them over in this form and declares it to Spark as
:data:`RECORDS_DDL`) and the sinks' parse (:mod:`sinks.parse`). Imports pyarrow only, so a Spark
Python worker loads it without numpy."""

from __future__ import annotations

import pyarrow as pa

__all__ = ["RECORDS", "RECORDS_DDL"]

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
