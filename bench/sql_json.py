"""The snapshot's earlier read, kept as a benchmark peer (``bench/capture.py``, ``bench/snapshot.py``):
a ``COPY (SELECT ...)`` in which Postgres builds each value's JSON text as the stream encodes it.
The snapshot no longer uses it (:mod:`snapshot.exported` reads a plain CSV ``COPY``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from cdc.pgtypes import type_kind
from snapshot.table_info import table_columns

#: types whose text output never holds a character JSON escapes: quoted as they are
_PLAIN_TEXT_TYPES = frozenset(
    {
        "timestamp with time zone",
        "timestamp without time zone",
        "date",
        "time with time zone",
        "time without time zone",
        "uuid",
        "interval",
    }
)
#: types whose cast to text is not their text output: JSON-quoted by ``to_json(col)`` instead
_OUTPUT_TEXT_TYPES = frozenset({"character", "char", "bpchar", "inet", "cidr"})


def _base_type(pg_type: str) -> str:
    """``timestamp(3) with time zone`` -> ``timestamp with time zone``."""
    t = pg_type.strip().lower()
    if "(" in t:
        head, _, rest = t.partition("(")
        t = (head.rstrip() + " " + rest.partition(")")[2].lstrip()).strip()
    return t


def sql_json_value(name: str, pg_type: str, nullable: bool) -> tuple[sql.Composable, bool] | None:
    """The SELECT expression giving column ``name``'s JSON value text as the stream encodes it (NULL
    stays NULL: COPY writes it as ``null``), and whether the template must put quotes around it;
    None when Python must encode the column (floats, arrays)."""
    kind = type_kind(pg_type)
    col = sql.Identifier(name)
    if kind == "int":
        return col, False
    if kind == "numeric":
        text = sql.SQL("NULLIF(NULLIF(NULLIF({}::text, 'NaN'), 'Infinity'), '-Infinity')").format(col)
        return sql.SQL("'\"' || {} || '\"'").format(text), False
    if kind == "bool":
        return sql.SQL("{}::text").format(col), False
    if kind == "bytea":
        hexed = sql.SQL("encode({}, 'hex')").format(col)
        if nullable:
            return sql.SQL("'\"' || {} || '\"'").format(hexed), False
        return hexed, True
    if kind == "text" and _base_type(pg_type) in _PLAIN_TEXT_TYPES:
        if nullable:
            return sql.SQL("'\"' || {}::text || '\"'").format(col), False
        return sql.SQL("{}::text").format(col), True
    if kind == "text" and _base_type(pg_type) in _OUTPUT_TEXT_TYPES:
        # their cast to text differs from their output (char(n) drops its padding, inet shows the
        # netmask); to_json() of these calls the output function, as wal2json does
        return sql.SQL("to_json({})").format(col), False
    if kind in ("text", "json"):
        return sql.SQL("to_json({}::text)").format(col), False
    return None


def json_copy_query(schema: str, table: str, exprs: Sequence[sql.Composable]) -> sql.Composed:
    """The snapshot's ``COPY`` of a table whose every value's JSON Postgres builds (``exprs`` from
    :func:`sql_json_value`, in column order); NULL is written as ``null``."""
    return sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT WITH (NULL 'null')").format(
        sql.SQL(", ").join(exprs), sql.Identifier(schema, table)
    )


def json_exprs(conn: psycopg.Connection[Any], schema: str, table: str) -> list[sql.Composable] | None:
    """:func:`sql_json_value` of every column of the table, or None when Python must encode one."""
    exprs = []
    for col in table_columns(conn, schema, table):
        e = sql_json_value(col.name, col.type, col.nullable)
        if e is None:
            return None
        exprs.append(e[0])
    return exprs
