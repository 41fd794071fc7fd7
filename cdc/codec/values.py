"""Value encoding by column type (the contract in :mod:`cdc.events`): Postgres' text output of a
column type to its event value, and the column kinds.

:func:`text_converter_for` turns Postgres' text output (the snapshot's ``COPY ... TO STDOUT``, a
domain's values in wal2json, every value of a text-format decoder) into the event value; a decoder
that sends typed values has its own converter (:func:`cdc.codec.wal2json.converter_for`), which
gives the same JSON value for the same datum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cdc.codec import Converter
from cdc.errors import DecodeError
from cdc.pgtypes import element_type, type_kind

#: the characters Postgres' array parser and output treat as white space (array_isspace)
_PG_SPACE = " \t\n\r\v\f"

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


# -- which columns can hold an out-of-line (TOASTed) value --------------------------------------------
#: Postgres' ``TOAST_TUPLE_THRESHOLD`` with 8 kB pages: a row is toasted only when longer than this
TOAST_TUPLE_THRESHOLD = 2032
#: a value of at most this many bytes is never moved out of line (``MAXALIGN(TOAST_POINTER_SIZE)``)
TOAST_POINTER_BYTES = 24
#: fixed-length types (``attlen > 0``): never toasted; their widths, for a row's longest length
_FIXED_WIDTH = {
    "smallint": 2, "int2": 2, "integer": 4, "int4": 4, "bigint": 8, "int8": 8, "oid": 4, "xid": 4,
    "xid8": 8, "cid": 4, "tid": 6, "real": 4, "float4": 4, "double precision": 8, "float8": 8,
    "boolean": 1, "bool": 1, "date": 4, "time without time zone": 8, "time": 8,
    "time with time zone": 12, "timetz": 12, "timestamp without time zone": 8, "timestamp": 8,
    "timestamp with time zone": 8, "timestamptz": 8, "interval": 16, "uuid": 16, "money": 8,
    "pg_lsn": 8, "macaddr": 6, "macaddr8": 8, '"char"': 1, "name": 64, "point": 16, "line": 24,
    "lseg": 32, "box": 32, "circle": 24,
}  # fmt: skip
#: a length-limited type: bytes per unit of its modifier (UTF-8's 4 bytes a character), header
_LIMITED = {"character": 4, "character varying": 4, "bit": 0.125, "bit varying": 0.125}


def max_width(pg_type: str) -> int | None:
    """The most bytes a value of ``pg_type`` (a ``format_type()`` string) takes in a row, rounded
    up; None when unbounded (a value that can be stored out of line). Overestimates, never under."""
    t = pg_type.strip().lower()
    if t.endswith("[]"):
        return None
    base, _, rest = t.partition("(")
    base = base.strip()
    mod = rest.split(")", 1)[0]
    if rest:  # time(3) with time zone -> time with time zone
        tail = rest.split(")", 1)[1].strip() if ")" in rest else ""
        named = f"{base} {tail}".strip()
        if named in _FIXED_WIDTH:
            return _FIXED_WIDTH[named]
    if base in _FIXED_WIDTH:
        return _FIXED_WIDTH[base]
    if base in _LIMITED:
        n = int(mod) if mod.strip().isdigit() else (1 if base == "character" else None)
        return None if n is None else int(n * _LIMITED[base]) + 8
    if base in ("numeric", "decimal") and mod:
        precision = mod.split(",", 1)[0].strip()
        return int(precision) + 16 if precision.isdigit() else None
    return None


def out_of_line_columns(types: dict[str, str]) -> tuple[str, ...]:
    """The columns (name -> ``format_type()``) whose values Postgres may store out of line, so that
    an UPDATE may leave them out unchanged: none when the longest possible row is under
    ``TOAST_TUPLE_THRESHOLD`` (the table has no TOAST table, as ``needs_toast_table()`` decides;
    widths here are upper bounds, with 8 bytes of alignment a column), else every column whose
    values can be longer than a TOAST pointer."""
    widths = {name: max_width(t) for name, t in types.items()}
    if all(w is not None for w in widths.values()):
        longest = 24 + (len(widths) + 7) // 8 + sum(w + 8 for w in widths.values() if w is not None)
        if longest <= TOAST_TUPLE_THRESHOLD:
            return ()
    return tuple(n for n, w in widths.items() if w is None or w > TOAST_POINTER_BYTES)


#: how much longer than its text a value of a kind of type can be stored (factor, bytes), for the
#: upper bound of a row's stored length: text-like types store their text and a 4-byte header; jsonb
#: stores a number of one digit in up to 12 bytes (a 4-byte entry, a numeric); arrays an element of
#: two characters (``1,``) in up to 8; other types (tsvector, ranges, composites, ...) alike
_TEXT_LIKE = frozenset(
    {"text", "character varying", "character", "json", "xml", "citext", "bytea", "numeric"}
)


def stored_factor(pg_type: str) -> tuple[int, int]:
    """(factor, bytes): a value of ``pg_type`` whose text is N bytes is stored in at most
    ``factor * N + bytes`` (uncompressed, header and alignment included)."""
    t = pg_type.strip().lower()
    if t.endswith("[]"):
        return 8, 32
    base = t.split("(", 1)[0].strip()
    if base in _TEXT_LIKE:
        return 1, 16
    return 8, 64


@dataclass(frozen=True)
class RowBound:
    """The longest a row of a table can be stored, from its event values: ``static`` bytes (the
    tuple header, alignment, and every column whose width is bounded), plus, per column of unbounded
    width, ``factor * len(text) + bytes`` (:func:`stored_factor`). ``dynamic`` None: a column that
    the events do not carry (excluded) is unbounded, so no row can be bounded."""

    static: int
    dynamic: tuple[tuple[str, int, int], ...] | None


def row_bound(types: dict[str, str], carried: set[str]) -> RowBound:
    """The :class:`RowBound` of a table's columns (name -> ``format_type()``); ``carried``: the
    columns its events carry (the others are excluded)."""
    static = 32 + 9 * len(types)
    dynamic: list[tuple[str, int, int]] = []
    for name, t in types.items():
        width = max_width(t)
        if width is not None:
            static += width
        elif name not in carried:
            return RowBound(static, None)
        else:
            dynamic.append((name, *stored_factor(t)))
    return RowBound(static, tuple(dynamic))
