"""The change event: Debezium-style envelope, key, topic name and version. Full contract, with the
value encoding per column type: ``docs/events.md``.

* Key: the key columns as a JSON object in key-column order (``{"id": 42}``); value:
  ``{"before", "after", "source", "op", "ts_ms", "unavailable"}``, ``op`` one of ``r c u d t``.
* **Version** = ``(source.commit_lsn, source.seq)``: every sink keeps, per key, the version it
  stored and ignores an event whose version is not newer.
* ``unavailable``: columns the source did not send (unchanged out-of-line TOAST); a sink keeps the
  stored value, never writes null.
* A delete is followed by a tombstone (same key, value ``null``); ``op=t`` (TRUNCATE) goes to every
  partition of the table's topic with key ``{"__truncate__": <partition>}``.
* Values: integers as JSON integers, ``numeric`` as a string with every digit, floats as JSON
  numbers, float/numeric NaN, Infinity, -Infinity as the strings ``"NaN"``, ``"Infinity"``,
  ``"-Infinity"`` (never null; past wal2json 2.5, which streams a scalar one as null, through
  :mod:`cdc.recorders.nonfinite`), ``bool`` as
  JSON booleans, json/jsonb as their text, ``bytea`` as hex, arrays as JSON lists, everything else
  as Postgres' text output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

CONNECTOR_VERSION = "cdc-0.1.0"
TRUNCATE_KEY_FIELD = "__truncate__"

_TOPIC_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def topic_name(prefix: str, schema: str, table: str) -> str:
    """``<prefix>.<schema>.<table>``, characters outside ``[A-Za-z0-9._-]`` replaced by ``_``
    (``"Mixed Case"."tab le"`` -> ``cdc.Mixed_Case.tab_le``)."""
    return ".".join(_TOPIC_UNSAFE.sub("_", part) for part in (prefix, schema, table))


def dead_letter_topic(prefix: str) -> str:
    return f"{prefix}.__dead_letter"


@dataclass(frozen=True, order=True, slots=True)
class Version:
    """The order of a change: (commit LSN, position within the transaction)."""

    commit_lsn: int
    seq: int

    @classmethod
    def of(cls, value: dict[str, Any]) -> Version:
        src = value["source"]
        return cls(int(src["commit_lsn"]), int(src["seq"]))


def encode_key(key: dict[str, Any]) -> bytes:
    """Key bytes: the JSON object of key columns in key-column order (stable bytes for partitioning)."""
    return orjson.dumps(key)


def lsn_to_int(lsn: str) -> int:
    """``'16/B374D848'`` -> int."""
    hi, _, lo = lsn.partition("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def int_to_lsn(value: int) -> str:
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


_UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: PostgreSQL's epoch (2000-01-01 UTC) in Unix epoch milliseconds
PG_EPOCH_MS = 946_684_800_000


def pg_time_ms(us: int) -> int:
    """A Postgres timestamp as the protocol sends it (µs since 2000-01-01 UTC) in epoch
    milliseconds (floored, as :func:`commit_ts_ms` reads the same instant's text)."""
    return us // 1000 + PG_EPOCH_MS


def commit_ts_ms(ts: str | None) -> int | None:
    """wal2json's ``timestamp`` (``2026-11-22 02:28:58.744379+00``) in epoch milliseconds, exact
    (integer arithmetic, floored: no float rounding)."""
    if not ts:
        return None
    t = datetime.fromisoformat(ts)
    d = (t if t.tzinfo is not None else t.replace(tzinfo=UTC)) - _UNIX_EPOCH
    return (d.days * 86_400 + d.seconds) * 1000 + d.microseconds // 1000
