"""The ``--where`` filter of ``cdc snapshot SCHEMA.TABLE --where "..."``: a restricted form, parsed,
never pasted into SQL.

Grammar (case-insensitive keywords)::

    filter    := condition ( AND condition )*
    condition := column op literal | column IS [NOT] NULL
    op        := = | <> | != | < | <= | > | >=
    literal   := integer | decimal | 'text with '' doubled quotes' | true | false
    column    := name | "quoted name"      (a column of the table)

:func:`parse_where` checks every column against the table's columns and returns the conditions;
:func:`where_sql` builds the SQL with :mod:`psycopg.sql` (``Identifier`` for columns, ``Literal`` for
values, operators from a fixed table). Anything else (functions, OR, subqueries, comments,
semicolons) is a :class:`~cdc.errors.ConfigError` naming the position and the accepted form.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from psycopg import sql

from cdc.errors import ConfigError

OPERATORS = {"=": "=", "<>": "<>", "!=": "<>", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
FORM = (
    "use COLUMN OP VALUE [AND COLUMN OP VALUE ...] with OP one of = <> != < <= > >= (or COLUMN IS [NOT] "
    "NULL) and VALUE a number, a 'quoted string' (double a quote inside: 'it''s'), true or false; "
    "e.g. --where \"created_at >= '2026-01-01' AND region = 'eu'\""
)

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![A-Za-z_\d])
      | (?P<str>'(?:[^']|'')*')
      | (?P<qid>"(?:[^"]|"")+")
      | (?P<id>[A-Za-z_][A-Za-z0-9_$]*)
      | (?P<op><>|!=|<=|>=|=|<|>)
    )""",
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class Condition:
    """``column op value``; ``op`` is ``IS NULL`` / ``IS NOT NULL`` with ``value`` None."""

    column: str
    op: str
    value: Any


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out: list[tuple[str, str, int]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            at = pos + (len(text[pos:]) - len(text[pos:].lstrip()))
            raise ConfigError(
                f"--where {text!r}: unexpected {text[at : at + 10]!r} at position {at + 1}",
                fix=FORM,
                where=text,
            )
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    return out


def parse_where(text: str, columns: list[str] | tuple[str, ...]) -> tuple[Condition, ...]:
    """Parse ``text`` (see the module docstring); every column must be one of ``columns``."""
    toks = _tokens(text)
    if not toks:
        raise ConfigError("--where is empty", fix=FORM, where=text)
    conds: list[Condition] = []
    i = 0

    def bad(why: str, at: int | None = None) -> ConfigError:
        where = f" at position {at + 1}" if at is not None else ""
        return ConfigError(f"--where {text!r}: {why}{where}", fix=FORM, where=text)

    def take() -> tuple[str, str, int]:
        nonlocal i
        if i >= len(toks):
            raise bad("it ends too early")
        tok = toks[i]
        i += 1
        return tok

    while True:
        kind, val, at = take()
        if kind == "qid":
            col = val[1:-1].replace('""', '"')
        elif kind == "id":
            col = val.lower()
        else:
            raise bad(f"expected a column name, got {val!r}", at)
        if col not in columns:
            raise bad(f"{col!r} is not a column of the table (columns: {', '.join(columns)})", at)
        kind, val, at = take()
        if kind == "id" and val.lower() == "is":
            kind2, val2, at2 = take()
            negate = False
            if kind2 == "id" and val2.lower() == "not":
                negate = True
                kind2, val2, at2 = take()
            if not (kind2 == "id" and val2.lower() == "null"):
                raise bad(f"expected NULL after IS, got {val2!r}", at2)
            conds.append(Condition(col, "IS NOT NULL" if negate else "IS NULL", None))
        elif kind == "op":
            kind, lit, at = take()
            value: Any
            if kind == "num":
                value = int(lit) if re.fullmatch(r"[-+]?\d+", lit) else Decimal(lit)
            elif kind == "str":
                value = lit[1:-1].replace("''", "'")
            elif kind == "id" and lit.lower() in ("true", "false"):
                value = lit.lower() == "true"
            else:
                raise bad(f"expected a value (number, 'string', true, false), got {lit!r}", at)
            conds.append(Condition(col, OPERATORS[val], value))
        else:
            raise bad(f"expected an operator, got {val!r}", at)
        if i == len(toks):
            return tuple(conds)
        kind, val, at = take()
        if not (kind == "id" and val.lower() == "and"):
            raise bad(f"expected AND, got {val!r}", at)


def where_sql(conds: tuple[Condition, ...]) -> sql.Composable:
    """The conditions as SQL (``TRUE`` when there are none), built with :mod:`psycopg.sql`."""
    if not conds:
        return sql.SQL("TRUE")
    parts: list[sql.Composable] = []
    for c in conds:
        if c.value is None:
            parts.append(
                sql.SQL("{} " + ("IS NOT NULL" if c.op == "IS NOT NULL" else "IS NULL")).format(
                    sql.Identifier(c.column)
                )
            )
            continue
        op = OPERATORS[c.op]
        # a string literal stays untyped ('...'): Postgres reads it as the column's type
        lit = sql.Literal(str(c.value)) if isinstance(c.value, Decimal) else sql.Literal(c.value)
        parts.append(sql.SQL("{} " + op + " {}").format(sql.Identifier(c.column), lit))
    return sql.SQL("(") + sql.SQL(" AND ").join(parts) + sql.SQL(")")
