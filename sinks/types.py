"""Postgres types -> Arrow/Delta types, and event values -> Arrow values.

The mapping is faithful (no value changes on the way) except where ``docs/warehouse.md`` ("Types")
says otherwise: timestamp/date ``infinity`` clamps to the largest/smallest value every reader holds;
float NaN/Infinity (JSON strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` in events) are stored as
the float values; a multi-dimensional array (nested lists in events) is stored as its elements in
row-major order, the order ``unnest()`` returns them, in the column's ``list<T>``: every element is
kept, its dimensions are not. A value a column cannot hold (a BC date, a year past 9999, a numeric NaN/Infinity or
too many digits for ``numeric(p,s)``) raises :class:`cdc.errors.ApplyError`; :func:`unstorable` finds
such values per record, so the apply job dead-letters those records and applies the others.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable, Sequence
from decimal import Context, Decimal, InvalidOperation
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from cdc.errors import ApplyError
from cdc.pgtypes import FLOAT_BYTES, INT_BYTES

UTC = dt.UTC
TS_MAX = dt.datetime(9999, 12, 31, 23, 59, 59, 999999)
TS_MIN = dt.datetime(1, 1, 1)
DATE_MAX = dt.date(9999, 12, 31)
DATE_MIN = dt.date(1, 1, 1)

_NUMERIC = re.compile(r"^numeric(?:\((\d+)(?:,\s*(-?\d+))?\))?$")
_TS = re.compile(
    r"^(\d{4,})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"(?:([+-])(\d\d)(?::?(\d\d))?(?::?(\d\d))?)?( BC)?$"
)
_DATE = re.compile(r"^(\d{4,})-(\d\d)-(\d\d)( BC)?$")

Converter = Callable[[Any], Any]
_DEC = Context(prec=200)  # exact for any decimal128 (38 digits); the default 28 would round


def plain_types(schema: pa.Schema) -> pa.Schema:
    """``schema`` with the view types delta-rs reads and writes (string and binary views, at any
    depth of a list or a struct) as plain strings and binaries, which every Arrow kernel and reader
    takes."""
    return pa.schema([f.with_type(_plain(f.type)) for f in schema])


def _plain(t: pa.DataType) -> pa.DataType:
    if t == pa.string_view():
        return pa.string()
    if t == pa.binary_view():
        return pa.binary()
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_list_view(t):
        return pa.list_(t.value_field.with_type(_plain(t.value_type)))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_plain(t.field(i).type)) for i in range(t.num_fields)])
    return t


def base_type(pg_type: str) -> str:
    """The type without the typmod of timestamp/time/varchar etc.: ``timestamp(3) with time zone`` ->
    ``timestamp with time zone``; ``character varying(20)`` -> ``character varying``."""
    t = pg_type.strip().lower()
    if t.startswith("numeric"):
        return t
    return re.sub(r"\(\d+(?:,\s*\d+)?\)", "", t).strip()


def arrow_type(pg_type: str) -> pa.DataType:
    """The Arrow type a Postgres column of ``pg_type`` (``format_type()`` text) is stored as."""
    t = base_type(pg_type)
    if t.endswith("[]"):
        elem = t[:-2]
        while elem.endswith("[]"):  # format_type never prints these, but be safe
            elem = elem[:-2]
        return pa.list_(arrow_type(elem))
    if t in INT_BYTES:  # oid/xid are unsigned 32-bit: int64 holds them
        return {2: pa.int16(), 4: pa.int32()}.get(INT_BYTES[t], pa.int64())
    m = _NUMERIC.match(t)
    if m:
        if m.group(1) is None:
            return pa.string()
        p = int(m.group(1))
        s = int(m.group(2) or 0)
        if p <= 38 and 0 <= s <= p:
            return pa.decimal128(p, s)
        return pa.string()
    if t in FLOAT_BYTES:
        return pa.float32() if FLOAT_BYTES[t] == 4 else pa.float64()
    if t in ("boolean", "bool"):
        return pa.bool_()
    if t in ("timestamp with time zone", "timestamptz"):
        return pa.timestamp("us", tz="UTC")
    if t in ("timestamp without time zone", "timestamp"):
        return pa.timestamp("us")
    if t == "date":
        return pa.date32()
    if t == "bytea":
        return pa.binary()
    return pa.string()


# --- value conversion -------------------------------------------------------------------------------
def _bad(value: Any, pg_type: str, why: str) -> ApplyError:
    return ApplyError(
        f"cannot store {value!r} as {pg_type}: {why}",
        fix="this value cannot be represented in the warehouse; exclude the column "
        "(`cdc tables add ... --exclude COL`) or report the value",
        value=repr(value)[:200],
        type=pg_type,
    )


def _int(value: Any, pg_type: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _bad(value, pg_type, "not an integer")
    try:
        return int(value)
    except ValueError as exc:
        raise _bad(value, pg_type, "not an integer") from exc


def _decimal(value: Any, pg_type: str, scale: int) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, str | int):
        # a float has lost digits already; the event contract sends numeric as a string
        raise _bad(value, pg_type, "numeric must arrive as a string with every digit")
    try:
        d = Decimal(str(value))
    except InvalidOperation as exc:
        raise _bad(value, pg_type, "not a number") from exc
    if not d.is_finite():
        raise _bad(value, pg_type, "not finite")
    try:
        q = d.quantize(Decimal(1).scaleb(-scale), context=_DEC)
    except InvalidOperation as exc:
        raise _bad(value, pg_type, "too many digits") from exc
    if q != d:
        raise _bad(value, pg_type, f"more than {scale} decimal places")
    return q


def _numeric_text(value: Any, pg_type: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _bad(value, pg_type, "numeric must arrive as a string with every digit")
    return str(value)


def _float(value: Any, pg_type: str) -> float:
    if isinstance(value, bool):
        raise _bad(value, pg_type, "not a number")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):  # the event contract sends NaN/Infinity/-Infinity as these strings
        special = _SPECIAL_FLOATS.get(value)
        if special is not None:
            return special
    raise _bad(value, pg_type, 'not a number (special values arrive as "NaN", "Infinity", "-Infinity")')


_SPECIAL_FLOATS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _bool(value: Any, pg_type: str) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("t", "true"):
        return True
    if value in ("f", "false"):
        return False
    raise _bad(value, pg_type, "not a boolean")


def parse_timestamp(value: Any, pg_type: str, *, with_tz: bool) -> dt.datetime:
    """Postgres' ISO text output -> datetime (aware UTC when ``with_tz``, else naive), exactly to the
    microsecond. ``infinity``/``-infinity`` clamp (see the module docstring)."""
    if not isinstance(value, str):
        raise _bad(value, pg_type, "not a timestamp text")
    if value == "infinity":
        return TS_MAX.replace(tzinfo=UTC) if with_tz else TS_MAX
    if value == "-infinity":
        return TS_MIN.replace(tzinfo=UTC) if with_tz else TS_MIN
    m = _TS.match(value)
    if not m:
        raise _bad(value, pg_type, "not a Postgres ISO timestamp")
    year, mon, day, hh, mi, ss, frac, sign, oh, om, os_, bc = m.groups()
    if bc or len(year) > 4:
        raise _bad(value, pg_type, "outside years 1..9999")
    micro = int((frac or "").ljust(6, "0")) if frac else 0
    try:
        naive = dt.datetime(int(year), int(mon), int(day), int(hh), int(mi), int(ss), micro)
    except ValueError as exc:
        raise _bad(value, pg_type, str(exc)) from exc
    if not with_tz:
        if sign:
            raise _bad(value, pg_type, "a timestamp without time zone has an offset")
        return naive
    if not sign:
        raise _bad(value, pg_type, "a timestamp with time zone has no offset")
    offset = dt.timedelta(hours=int(oh), minutes=int(om or 0), seconds=int(os_ or 0))
    if sign == "-":
        offset = -offset
    try:
        return naive.replace(tzinfo=dt.timezone(offset)).astimezone(UTC)
    except OverflowError as exc:
        raise _bad(value, pg_type, "outside years 1..9999 in UTC") from exc


def parse_date(value: Any, pg_type: str) -> dt.date:
    if not isinstance(value, str):
        raise _bad(value, pg_type, "not a date text")
    if value == "infinity":
        return DATE_MAX
    if value == "-infinity":
        return DATE_MIN
    m = _DATE.match(value)
    if not m or m.group(4) or len(m.group(1)) > 4:
        raise _bad(value, pg_type, "not a Postgres ISO date in years 1..9999")
    try:
        return dt.date(int(m.group(1)), int(m.group(2)), int(m.group(3)))
    except ValueError as exc:
        raise _bad(value, pg_type, str(exc)) from exc


def _bytes(value: Any, pg_type: str) -> bytes:
    if not isinstance(value, str):
        raise _bad(value, pg_type, "bytea must arrive as hex text")
    text = value[2:] if value.startswith("\\x") else value
    try:
        return bytes.fromhex(text)
    except ValueError as exc:
        raise _bad(value[:40], pg_type, "not hex") from exc


def _text(value: Any, pg_type: str) -> str:
    if isinstance(value, str):
        return value
    return orjson.dumps(value).decode()


def converter(pg_type: str) -> Converter:
    """A function turning one event value (as encoded by :mod:`cdc.events`, not None) of a column of
    ``pg_type`` into the Python value pyarrow stores for :func:`arrow_type`. Raises ApplyError."""
    t = base_type(pg_type)
    if t.endswith("[]"):
        elem_type = t[:-2]
        elem = converter(elem_type)

        def conv_list(value: Any) -> list[Any]:
            if not isinstance(value, list):
                raise _bad(value, pg_type, "an array must arrive as a JSON list")
            out: list[Any] = []
            flatten(value, out)
            return out

        def flatten(value: list[Any], out: list[Any]) -> None:
            """A multi-dimensional array's elements in row-major order (as ``unnest()`` returns
            them): see the module docstring."""
            for v in value:
                if isinstance(v, list):
                    flatten(v, out)
                else:
                    out.append(None if v is None else elem(v))

        return conv_list
    at = arrow_type(t)
    if pa.types.is_integer(at):
        return lambda v: _int(v, pg_type)
    if pa.types.is_decimal(at):
        scale = at.scale
        return lambda v: _decimal(v, pg_type, scale)
    if t.startswith("numeric"):
        return lambda v: _numeric_text(v, pg_type)
    if pa.types.is_floating(at):
        return lambda v: _float(v, pg_type)
    if pa.types.is_boolean(at):
        return lambda v: _bool(v, pg_type)
    if pa.types.is_timestamp(at):
        with_tz = at.tz is not None
        return lambda v: parse_timestamp(v, pg_type, with_tz=with_tz)
    if pa.types.is_date(at):
        return lambda v: parse_date(v, pg_type)
    if pa.types.is_binary(at):
        return lambda v: _bytes(v, pg_type)
    return lambda v: _text(v, pg_type)


def to_array(values: Sequence[Any], pg_type: str | None) -> pa.Array:
    """One column's event values (None = null) as an Arrow array of :func:`arrow_type`;
    ``pg_type`` None (a column the registration does not know yet) -> string."""
    typ = pg_type or "text"
    at = arrow_type(typ)
    if pa.types.is_decimal(at) and all(v is None or type(v) is str for v in values):
        try:  # vectorised: exact (a cast that would round or overflow raises), else the slow path's error
            return pa.array(values, type=pa.string()).cast(at)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
    fast = _fast_array(values, at)
    if fast is not None:
        return fast
    conv = converter(typ)
    py = [None if v is None else conv(v) for v in values]
    try:
        return pa.array(py, type=at)
    except (pa.ArrowInvalid, OverflowError) as exc:
        raise ApplyError(
            f"values do not fit the column type {typ} ({at}): {exc}",
            fix="check the registration's column types (`cdc tables list`) against the source",
            type=typ,
        ) from exc


# years 0002..9998 only: the slow path owns the clamping/overflow edge cases near 1 and 9999
_FAST_YEAR = r"(?:000[2-9]|00[1-9][0-9]|0[1-9][0-9][0-9]|[1-8][0-9]{3}|9[0-8][0-9][0-9]|99[0-8][0-9])"
_FAST_TS = _FAST_YEAR + r"-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9](?:\.[0-9]{1,6})?"
_FAST_TSTZ_RE = "^" + _FAST_TS + r"[+-][0-9][0-9](?::[0-9][0-9])?$"
_FAST_TS_RE = "^" + _FAST_TS + "$"


def _fast_array(values: Sequence[Any], at: pa.DataType) -> pa.Array | None:
    """Vectorised conversion for the common shapes (every value already of the stored Python type, or
    a plain ISO timestamp text); None when a value needs the per-value path (which also gives the
    exact error). Same result as the per-value path wherever it answers."""
    try:
        if pa.types.is_string(at):
            if all(v is None or type(v) is str for v in values):
                return pa.array(values, type=at)
        elif pa.types.is_integer(at) or pa.types.is_floating(at):
            if all(v is None or type(v) is int for v in values) or (
                pa.types.is_floating(at) and all(v is None or type(v) in (int, float) for v in values)
            ):
                return pa.array(values, type=at)
        elif pa.types.is_timestamp(at) and all(v is None or type(v) is str for v in values):
            return _fast_timestamps(pa.array(values, type=pa.string()), at)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
        return None
    return None


def _fast_timestamps(text: pa.Array, at: pa.DataType) -> pa.Array | None:
    """Timestamp texts cast by Arrow when every one is a plain ISO timestamp, else None."""
    pattern = _FAST_TSTZ_RE if at.tz is not None else _FAST_TS_RE
    ok = pc.match_substring_regex(text, pattern)
    if pc.all(pc.fill_null(ok, True)).as_py():
        return text.cast(at)
    return None


def from_json_array(values: pa.Array, pg_type: str | None) -> pa.Array:
    """Like :func:`to_array`, for a column already parsed into the Arrow type of its event encoding
    (:func:`sinks.columnar.json_type`): Arrow casts where they are exact (a cast that would overflow
    or round raises and the per-value path decides, with its error), else the per-value path."""
    at = arrow_type(pg_type or "text")
    if values.type == at:
        return values
    try:
        if pa.types.is_integer(at) or pa.types.is_floating(at) or pa.types.is_decimal(at):
            return values.cast(at)
        if pa.types.is_timestamp(at) and pa.types.is_string(values.type):
            fast = _fast_timestamps(values, at)
            if fast is not None:
                return fast
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
        pass
    return to_array(values.to_pylist(), pg_type)


def to_event_value(value: Any) -> Any:
    """An Arrow/Python value back in the event's JSON encoding (decimals and bytes as text,
    timestamps ISO), for documents and JSON output."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, list):
        return [to_event_value(v) for v in value]
    if isinstance(value, dict):
        return {k: to_event_value(v) for k, v in value.items()}
    return value


def unstorable(values: Sequence[Any], pg_type: str | None) -> dict[int, str]:
    """The positions of the event values (None = null) that :func:`to_array` cannot store as
    :func:`arrow_type`, each with the reason (a BC date, a year past 9999, a numeric NaN or Infinity
    for a decimal column, too many digits, ...). Empty when the whole column converts, which is
    checked first, vectorised; the per-value check runs only then."""
    typ = pg_type or "text"
    at = arrow_type(typ)
    if pa.types.is_string(at):
        return {}
    try:
        to_array(values, typ)
        return {}
    except ApplyError:
        pass
    return _per_value(values, typ, at)


def unstorable_json(values: pa.Array, pg_type: str | None) -> dict[int, str]:
    """:func:`unstorable` for a column in the Arrow type of its event encoding
    (:func:`sinks.columnar.json_type`), as :func:`from_json_array` converts it."""
    typ = pg_type or "text"
    at = arrow_type(typ)
    if pa.types.is_string(at) or values.type == at:
        return {}
    try:
        from_json_array(values, typ)
        return {}
    except ApplyError:
        pass
    return _per_value(values.to_pylist(), typ, at)


def _per_value(values: Sequence[Any], typ: str, at: pa.DataType) -> dict[int, str]:
    conv = converter(typ)
    bad: dict[int, str] = {}
    for i, v in enumerate(values):
        if v is None:
            continue
        try:
            pa.array([conv(v)], type=at)
        except ApplyError as exc:
            bad[i] = exc.message
        except (pa.ArrowInvalid, OverflowError) as exc:
            bad[i] = f"cannot store {v!r} as {typ} ({at}): {exc}"
    return bad
