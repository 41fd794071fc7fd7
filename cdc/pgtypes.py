"""Postgres column types, classified once: the kind of a ``format_type()`` string (the registry's
column types, the catalog's, a decoder's) as every stage asks it -- the codec (how a value is
encoded in an event), the sinks (the Arrow type a column is stored as) and ``cdc verify`` (how a
value compares, which keys have ranges).

Types are matched by their ``format_type()`` name and its aliases, case and surrounding blanks
ignored; ``oid`` and ``xid`` (unsigned 32-bit) are integers, held in 8 signed bytes.
"""

from __future__ import annotations

#: the integer types, each with the bytes of the smallest signed integer that holds all its values
INT_BYTES = {
    "smallint": 2, "int2": 2, "integer": 4, "int": 4, "int4": 4, "bigint": 8, "int8": 8, "oid": 8, "xid": 8,
}  # fmt: skip
#: the binary floating-point types, each with its bytes
FLOAT_BYTES = {"real": 4, "float4": 4, "double precision": 8, "float8": 8}
#: the character types without blank padding: compared as their text (``character(n)`` is not)
VARCHAR_TYPES = frozenset({"text", "character varying", "varchar"})


def type_kind(pg_type: str) -> str:
    """``int``, ``numeric``, ``float``, ``bool``, ``bytea``, ``json``, ``array`` or ``text``
    for a ``format_type()`` string such as ``numeric(38,9)`` or ``integer[]``."""
    t = pg_type.strip().lower()
    if t.endswith("[]"):
        return "array"
    base = t.split("(", 1)[0].strip()
    if base in INT_BYTES:
        return "int"
    if base in ("numeric", "decimal"):
        return "numeric"
    if base in FLOAT_BYTES:
        return "float"
    if base in ("boolean", "bool"):
        return "bool"
    if base == "bytea":
        return "bytea"
    if base in ("json", "jsonb"):
        return "json"
    return "text"


def element_type(pg_type: str) -> str:
    """The element type of an array type (``integer[][]`` -> ``integer``); any other type as it is."""
    t = pg_type.strip()
    while t.endswith("[]"):
        t = t[:-2].rstrip()
    return t


def is_blank_padded(pg_type: str) -> bool:
    """``character(n)`` / ``char(n)`` / ``bpchar`` (not ``character varying``)."""
    t = pg_type.strip().lower()
    return t == "bpchar" or t.startswith("bpchar(") or t == "character" or t.startswith("character(")
