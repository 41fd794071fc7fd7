"""wal2json format-version 2: plugin options, message decoding, and value encoding by column type.

What wal2json 2.5 sends (measured on Debian's postgresql-15-wal2json 2.5):

* ``B`` (begin): ``lsn`` is the transaction's *commit* LSN, ``nextlsn`` the end of its commit record;
  ``C`` (commit) repeats both. B/C are sent even when ``add-tables`` filtered every change out.
* ``I``/``U``/``D``: one change per message, ``columns`` (new row), ``identity`` (old key, or the full
  old row under REPLICA IDENTITY FULL), ``pk``. An unchanged out-of-line TOASTed column is absent
  from ``columns``. ``T``: TRUNCATE of one table. ``M``: a logical message (``prefix``, ``content``, ``transactional``):
  our heartbeat, or the DDL recorder's (:mod:`cdc.reader.ddl`) or the non-finite recorder's
  (:mod:`cdc.reader.nonfinite`), which come inside their transaction, in order with the changes.
* ``numeric`` and floats are bare JSON numbers: they are decoded with a float hook that keeps the
  exact text (a float parse would lose digits); integers of any size stay Python ints. NaN and
  +-Infinity come as null -- unless the plugin knows ``numeric-data-types-as-string`` (wal2json
  2.6+; the reader asks for it when it does), then every numeric/float value is a JSON string of
  its text output; with 2.5 the non-finite recorder's messages carry them. Arrays are text literals either way, so their elements keep NaN/Infinity.

Value encoding (the contract in :mod:`cdc.events`) is implemented by :func:`converter_for` (values
as wal2json sends them) and :func:`text_converter_for` (values as Postgres' text output, used by the
snapshot's ``COPY ... TO STDOUT``); both give the same JSON value for the same datum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from cdc.errors import DecodeError

#: prefix of the reader's heartbeat messages (non-transactional, empty)
HEARTBEAT_PREFIX = "cdc_heartbeat"
#: prefix of the DDL recorder's messages (transactional, JSON; :mod:`cdc.reader.ddl`)
DDL_PREFIX = "cdc.ddl"
#: prefix of the non-finite recorder's messages (transactional, JSON; :mod:`cdc.reader.nonfinite`)
NONFINITE_PREFIX = "cdc.nonfinite"

#: Options every START_REPLICATION passes (``add-tables`` is added per call). ``add-msg-prefixes``
#: (exact prefixes, wal2json 2.5 knows it): logical messages of other software (pgstream's, ...)
#: are left out by the plugin.
BASE_OPTIONS: dict[str, str] = {
    "format-version": "2",
    "include-lsn": "1",
    "include-xids": "1",
    "include-timestamp": "1",
    "include-pk": "1",
    "include-transaction": "1",
    "add-msg-prefixes": f"{HEARTBEAT_PREFIX},{DDL_PREFIX},{NONFINITE_PREFIX}",
}

#: ``add-tables`` value that matches no table (wal2json treats an absent option as "every table").
NO_TABLE = "pg_catalog.cdc\\.no\\.table"


class Col(msgspec.Struct, gc=False):
    """One column of a change: ``value`` is absent from ``pk`` entries. (Structs here are not
    tracked by the cyclic GC: one message per change, never in a reference cycle.)"""

    name: str
    type: str
    value: Any = None


class Message(msgspec.Struct, gc=False):
    """One wal2json v2 message (fields this service reads; others are skipped)."""

    action: str
    xid: int | None = None
    timestamp: str | None = None
    lsn: str | None = None
    nextlsn: str | None = None
    schema: str | None = None
    table: str | None = None
    columns: list[Col] | None = None
    identity: list[Col] | None = None
    transactional: bool | None = None
    prefix: str | None = None
    content: str | None = None  # of an ``M``: the message (wal2json sends it as text)


_decoder = msgspec.json.Decoder(Message, float_hook=str)


def decode(data: bytes) -> Message:
    """Decode one wal2json message. Floats/numerics come back as their exact text (``str``).
    Raises DecodeError (with the raw message) if it is not a wal2json message."""
    try:
        msg = _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise DecodeError(
            f"wal2json sent a message that is not valid JSON: {exc}",
            fix="check the wal2json version (2.5 with format-version 2 is supported)",
            reason=str(exc),
            raw=data[:200].decode("utf-8", "replace"),
        ) from exc
    return msg


#: the characters Postgres' array parser and output treat as white space (array_isspace)
_PG_SPACE = " \t\n\r\v\f"

_ESCAPE = str.maketrans({c: "\\" + c for c in "\\,.* "})


def escape_name(name: str) -> str:
    """wal2json ``add-tables`` escaping: a backslash makes the next character literal, so escape
    ``\\``, ``,``, ``.``, ``*`` (a wildcard) and space."""
    return name.translate(_ESCAPE)


def add_tables_option(tables: Iterable[tuple[str, str]]) -> str:
    """The ``add-tables`` value for (schema, table) pairs; :data:`NO_TABLE` when there are none."""
    parts = sorted(f"{escape_name(s)}.{escape_name(t)}" for s, t in tables)
    return ",".join(parts) if parts else NO_TABLE


#: wal2json >= 2.6: numeric, float4 and float8 values as JSON strings of their text output, so
#: NaN and +-Infinity arrive (2.5 and older send them as null and do not know the option)
NUMERIC_AS_STRING = "numeric-data-types-as-string"


def replication_options(
    tables: Iterable[tuple[str, str]], *, numeric_as_string: bool = False
) -> dict[str, str]:
    """START_REPLICATION options; ``numeric_as_string`` only for a wal2json that knows it (2.6+)."""
    options = {**BASE_OPTIONS, "add-tables": add_tables_option(tables)}
    if numeric_as_string:
        options[NUMERIC_AS_STRING] = "1"
    return options


# --- value encoding ------------------------------------------------------------------------------
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


Converter = Callable[[Any], Any]


#: float values that JSON has no number for: kept as these strings (the events contract)
FLOAT_SPECIALS = frozenset({"NaN", "Infinity", "-Infinity"})


def _numeric(v: Any) -> Any:
    if v is None or isinstance(v, str):  # a string: every digit, or NaN / Infinity / -Infinity
        return v
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    raise DecodeError(
        f"unexpected numeric value {v!r} from wal2json", fix="report this message", value=repr(v)
    )


def _float(v: Any) -> Any:
    if v is None or isinstance(v, float):
        return v
    if isinstance(v, str):
        return v if v in FLOAT_SPECIALS else float(v)
    return float(v)


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


def _array_converter(pg_type: str) -> Converter:
    elem = _element_text_converter(element_type(pg_type))

    def convert(v: Any) -> Any:
        if v is None:
            return None
        return parse_array(v, elem)

    return convert


def _int_any(v: Any) -> Any:
    return v if type(v) is int else int(v)


def converter_for(pg_type: str, *, numeric_as_string: bool = False) -> Converter | None:
    """How to turn the value wal2json sent for a column of ``pg_type`` into its event value;
    ``None`` when it is already right (text, ints, bool, json text, bytea hex).
    ``numeric_as_string``: the stream was started with ``numeric-data-types-as-string`` (values of
    the numeric family may come as strings)."""
    kind = type_kind(pg_type)
    if kind == "int" and numeric_as_string:
        return _int_any
    if kind == "numeric":
        return _numeric
    if kind == "float":
        return _float
    if kind == "array":
        return _array_converter(pg_type)
    return None


def text_converter_for(pg_type: str) -> Converter | None:
    """How to turn Postgres' text output (COPY text format, unescaped) into the event value;
    ``None`` when the text is the value."""
    kind = type_kind(pg_type)
    if kind == "array":
        return _array_converter(pg_type)
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
