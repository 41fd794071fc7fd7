"""The wal2json decoder (format-version 2): plugin options, message decoding, and its values.

What wal2json 2.5 sends (measured on Debian's postgresql-15-wal2json 2.5):

* ``B`` (begin): ``lsn`` is the transaction's *commit* LSN, ``nextlsn`` the end of its commit record;
  ``C`` (commit) repeats both. B/C are sent even when ``add-tables`` filtered every change out.
* ``I``/``U``/``D``: one change per message, ``columns`` (new row), ``identity`` (old key, or the full
  old row under REPLICA IDENTITY FULL), ``pk``. An unchanged out-of-line TOASTed column is absent
  from ``columns``. ``T``: TRUNCATE of one table. ``M``: a logical message (``prefix``, ``content``, ``transactional``):
  our heartbeat, or the DDL recorder's (:mod:`cdc.recorders.ddl`) or the non-finite recorder's
  (:mod:`cdc.recorders.nonfinite`), which come inside their transaction, in order with the changes.
* ``numeric`` and floats are bare JSON numbers: they are decoded with a float hook that keeps the
  exact text (a float parse would lose digits); integers of any size stay Python ints. NaN and
  +-Infinity come as null -- unless the plugin knows ``numeric-data-types-as-string`` (wal2json
  2.6+; the reader asks for it when it does), then every numeric/float value is a JSON string of
  its text output; with 2.5 the non-finite recorder's messages carry them. Arrays are text literals either way, so their elements keep NaN/Infinity.

Value encoding (the contract in :mod:`cdc.events`): :func:`converter_for` turns values as wal2json
sends them into event values; :func:`cdc.codec.values.text_converter_for` does it for Postgres'
text output (the snapshot's ``COPY ... TO STDOUT``); both give the same JSON value for the same datum.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from cdc.codec import DDL_PREFIX, HEARTBEAT_PREFIX, NONFINITE_PREFIX, Col, Converter, Message
from cdc.codec.values import FLOAT_SPECIALS, array_converter
from cdc.errors import DecodeError
from cdc.events import commit_ts_ms, lsn_to_int
from cdc.pgtypes import type_kind

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


class _Wire(msgspec.Struct, gc=False):
    """A wal2json v2 message as it is sent: positions and the commit time as text."""

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
    content: str | None = None


_decoder = msgspec.json.Decoder(_Wire, float_hook=str)
_TXN = frozenset("BC")


def _lsn(text: str | None) -> int | None:
    return None if text is None else lsn_to_int(text)


def decode(data: bytes) -> Message:
    """Decode one wal2json message, its LSNs and (of a B or C) commit time parsed into integers.
    Floats/numerics come back as their exact text (``str``). Raises DecodeError (with the raw
    message) if it is not a wal2json message."""
    try:
        w = _decoder.decode(data)
        return Message(
            w.action,
            w.xid,
            # every change repeats its transaction's commit time: read once, from B and C
            commit_ts_ms(w.timestamp) if w.action in _TXN else None,
            _lsn(w.lsn),
            _lsn(w.nextlsn),
            w.schema,
            w.table,
            w.columns,
            w.identity,
            w.transactional,
            w.prefix,
            w.content,
        )
    except (msgspec.DecodeError, ValueError) as exc:
        raise DecodeError(
            f"wal2json sent a message that is not valid JSON or not wal2json's: {exc}",
            fix="check the wal2json version (2.5 with format-version 2 is supported)",
            reason=str(exc),
            raw=data[:200].decode("utf-8", "replace"),
        ) from exc


_ESCAPE = str.maketrans({c: "\\" + c for c in "\\,.* '"})


def escape_name(name: str) -> str:
    """wal2json ``add-tables`` escaping: a backslash makes the next character literal, so escape
    ``\\``, ``,``, ``.``, ``*`` (a wildcard), space and ``'`` (wal2json's documented set)."""
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


# --- values ---------------------------------------------------------------------------------------
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
        return array_converter(pg_type)
    return None


class Wal2Json:
    """The wal2json :class:`~cdc.codec.Decoder`."""

    plugin = "wal2json"

    def decode(self, data: bytes, lsn: int) -> Message | None:
        return decode(data)  # wal2json repeats the change's LSN inside the message

    def source(self, read: Callable[[], Any]) -> Callable[[], Any]:
        return read  # whole transactions only: nothing to spool

    def source_idle(self) -> bool:
        return True

    def close(self) -> None:
        pass

    def replication_options(
        self, tables: Iterable[tuple[str, str]], *, numeric_as_string: bool = False
    ) -> dict[str, str]:
        return replication_options(tables, numeric_as_string=numeric_as_string)

    def converter_for(self, pg_type: str, *, numeric_as_string: bool = False) -> Converter | None:
        return converter_for(pg_type, numeric_as_string=numeric_as_string)


DECODER = Wal2Json()
