"""What a snapshot reads about a table in the source's catalog, on the connection that reads it (so
inside the snapshot's transaction): its columns and its estimated row count."""

from __future__ import annotations

from typing import Any

import psycopg

from cdc.catalog import COLUMNS_OF
from cdc.registry import Column

__all__ = ["row_estimate", "table_columns"]

_COLUMNS = COLUMNS_OF.replace(
    "{rel}",
    """(SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                    WHERE n.nspname = %(schema)s AND c.relname = %(table)s)""",
)
_ESTIMATE = """
SELECT GREATEST(c.reltuples, 0)::int8 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = %(schema)s AND c.relname = %(table)s
"""


def table_columns(conn: psycopg.Connection[Any], schema: str, table: str) -> tuple[Column, ...]:
    """The table's columns in order (name, ``format_type`` type through domains to the base type,
    nullable, the domain's name); empty if it does not exist."""
    rows = conn.execute(_COLUMNS, {"schema": schema, "table": table})
    return tuple(Column(str(n), str(t), bool(nullable), str(d)) for n, t, nullable, d in rows)


def row_estimate(conn: psycopg.Connection[Any], schema: str, table: str) -> int:
    """The planner's estimate of the table's rows (``reltuples``; 0 when never analysed)."""
    row = conn.execute(_ESTIMATE, {"schema": schema, "table": table}).fetchone()
    return int(row[0]) if row else 0
