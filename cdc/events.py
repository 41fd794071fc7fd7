"""The change event: Debezium-style envelope, key, topic name and version (DESIGN.md "The event").

Key: the key columns as a JSON object, keys in key-column order, e.g. ``{"id": 42}``.
Value (JSON)::

    {"before": {...} | null, "after": {...} | null,
     "source": {"version", "connector": "postgresql", "name", "ts_ms", "snapshot": "true"|"last"|"false",
                "db", "schema", "table", "txId", "lsn", "sequence", "commit_lsn", "seq"},
     "op": "r"|"c"|"u"|"d"|"t", "ts_ms", "unavailable": [col, ...]}

* ``source.lsn``: the change's own LSN (int); ``source.commit_lsn``: its transaction's commit LSN
  (the snapshot's consistent point for ``op=r``); ``source.seq``: position within the transaction,
  from 1 (0 for snapshot rows). **Version** = ``(commit_lsn, seq)``: every sink keeps, per key, the
  version it stored and ignores an event whose version is not newer.
* ``unavailable``: columns whose value the source did not send (an unchanged out-of-line TOASTed
  value). They are absent from ``after``; a sink must keep the stored value, never write null.
* A delete is followed by a tombstone (same key, value ``null``). A primary-key change is emitted as
  ``d`` of the old key + tombstone + ``c`` of the new key. ``op=t`` (TRUNCATE) is written to every
  partition of the table's topic (explicit partition) with key ``{"__truncate__": <partition>}``,
  so each partition's reader sees it in order with that partition's other events; a sink removes
  every row whose version is older than the truncate's.

Details fixed by the reader (:mod:`cdc.reader.envelope`): ``unavailable`` is always present (``[]``
when complete); ``source.sequence`` is ``'["<commit_lsn>","<lsn>"]'`` with decimal LSNs; the events
derived from one change (``d`` + tombstone + ``c`` of a key change, the ``t`` markers) share its
``seq``; snapshot rows have ``txId`` null, ``source.ts_ms`` the snapshot's start, and
``source.snapshot`` ``"last"`` on the last row *of each table*; ``ts_ms`` is processing time.

Value encoding (the JSON value of a column): integers (any size) as JSON integers, ``numeric`` as a
string with every digit (``null`` for NaN/Infinity, which wal2json sends as null), ``float``/``double``
as JSON numbers, ``bool`` as JSON booleans, ``json``/``jsonb`` as the JSON text in a string, ``bytea``
as lower-case hex without ``\\x``, arrays as JSON lists of encoded elements, everything else (dates,
timestamps with or without zone, uuid, text, intervals, ...) as Postgres' text output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
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
