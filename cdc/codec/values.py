"""Value encoding by column type (the contract in :mod:`cdc.events`): Postgres' text output of a
column type to its event value, and the column kinds.

:func:`text_converter_for` turns Postgres' text output (the snapshot's ``COPY ... TO STDOUT``, a
domain's values in wal2json, every value of a text-format decoder) into the event value; a decoder
that sends typed values has its own converter (:func:`cdc.codec.wal2json.converter_for`), which
gives the same JSON value for the same datum.
"""

from __future__ import annotations

from typing import Any

from cdc.codec import Converter
from cdc.errors import DecodeError

#: the characters Postgres' array parser and output treat as white space (array_isspace)
_PG_SPACE = " \t\n\r\v\f"

_INT_TYPES = frozenset({"smallint", "integer", "bigint", "int2", "int4", "int8", "oid", "xid"})
_FLOAT_TYPES = frozenset({"real", "double precision", "float4", "float8"})
_JSON_TYPES = frozenset({"json", "jsonb"})


def type_kind(pg_type: str) -> str:
    """``int``, ``numeric``, ``float``, ``bool``, ``bytea``, ``json``, ``array`` or ``text``
    for a ``format_type()`` string such as ``numeric(38,9)`` or ``integer[]``."""
    t = pg_type.strip().lower()
    if t.endswith("[]"):
        return "array"
    base = t.split("(", 1)[0].strip()
    if base in _INT_TYPES:
        return "int"
    if base in ("numeric", "decimal"):
        return "numeric"
    if base in _FLOAT_TYPES:
        return "float"
    if base in ("boolean", "bool"):
        return "bool"
    if base == "bytea":
        return "bytea"
    if base in _JSON_TYPES:
        return "json"
    return "text"


def element_type(pg_type: str) -> str:
    t = pg_type.strip()
    while t.endswith("[]"):
        t = t[:-2].rstrip()
    return t


#: float values that JSON has no number for: kept as these strings (the events contract)
FLOAT_SPECIALS = frozenset({"NaN", "Infinity", "-Infinity"})


def _text_float(s: str) -> Any:
    return s if s in FLOAT_SPECIALS else float(s)


def _text_int(s: str) -> Any:
    return int(s)


def _text_numeric(s: str) -> Any:
    return s  # every digit; NaN, Infinity, -Infinity as those strings


def _text_bool(s: str) -> Any:
    return s == "t"


def _text_bytea(s: str) -> Any:
    return s[2:] if s.startswith("\\x") else s


def _identity(v: Any) -> Any:
    return v


def _element_text_converter(elem_type: str) -> Converter:
    table: dict[str, Converter] = {
        "int": _text_int,
        "numeric": _text_numeric,
        "float": _text_float,
        "bool": _text_bool,
        "bytea": _text_bytea,
    }
    return table.get(type_kind(elem_type), _identity)


def array_converter(pg_type: str) -> Converter:
    elem = _element_text_converter(element_type(pg_type))

    def convert(v: Any) -> Any:
        if v is None:
            return None
        return parse_array(v, elem)

    return convert


def text_converter_for(pg_type: str) -> Converter | None:
    """How to turn Postgres' text output (COPY text format, unescaped) into the event value;
    ``None`` when the text is the value."""
    kind = type_kind(pg_type)
    if kind == "array":
        return array_converter(pg_type)
    if kind in ("text", "json"):
        return None
    return _element_text_converter(pg_type)


def parse_array(text: str, elem: Converter = _identity) -> list[Any]:
    """Parse a Postgres array text literal (``{1,2,NULL,"a,b",{3}}``, optionally with a
    ``[lo:hi]=`` dimension prefix) into nested lists; unquoted ``NULL`` becomes ``None``, other
    elements go through ``elem``. Raises DecodeError on a malformed literal."""
    pos = 0
    n = len(text)
    if text.startswith("["):
        eq = text.find("=")
        if eq < 0:
            raise DecodeError(f"malformed array literal {text[:80]!r}", fix="report this value")
        pos = eq + 1
    if pos >= n or text[pos] != "{":
        raise DecodeError(f"malformed array literal {text[:80]!r}", fix="report this value")
    stack: list[list[Any]] = []
    result: list[Any] | None = None
    i = pos
    while i < n:
        c = text[i]
        if c == "{":
            new: list[Any] = []
            if stack:
                stack[-1].append(new)
            stack.append(new)
            i += 1
        elif c == "}":
            done = stack.pop()
            i += 1
            if not stack:
                result = done
                break
        elif c == ",":
            i += 1
        elif c == '"':
            i += 1
            buf: list[str] = []
            while i < n:
                ch = text[i]
                if ch == "\\":
                    buf.append(text[i + 1])
                    i += 2
                elif ch == '"':
                    i += 1
                    break
                else:
                    buf.append(ch)
                    i += 1
            stack[-1].append(elem("".join(buf)))
        elif c in _PG_SPACE:
            i += 1
        else:
            start = i
            buf2: list[str] = []
            while i < n and text[i] not in ",}":
                if text[i] == "\\":
                    buf2.append(text[i + 1])
                    i += 2
                else:
                    buf2.append(text[i])
                    i += 1
            token = "".join(buf2).strip(_PG_SPACE)  # array_isspace(): not Unicode spaces
            if token == "NULL" and "\\" not in text[start:i]:
                stack[-1].append(None)
            else:
                stack[-1].append(elem(token))
    if result is None:
        raise DecodeError(f"malformed array literal {text[:80]!r}", fix="report this value")
    return result
