"""The non-finite recorder's messages, the stream side (the recorder itself, its triggers and
their installation: :mod:`cdc.recorders.nonfinite`, whose docstring describes the message).

:func:`parse_nonfinite` decodes a ``cdc.nonfinite`` message; :meth:`cdc.codec.envelope.EventBuilder.nonfinite`
holds it for the table's next change, whose key it must match (:func:`key_comparable`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from cdc.codec import NONFINITE_PREFIX
from cdc.codec.values import FLOAT_SPECIALS
from cdc.errors import DecodeError
from cdc.pgtypes import type_kind

#: the message's format (``"v"``), the one the recorder's function writes
FORMAT_VERSION = 1

#: key column types whose text in the message (``to_jsonb(row) ->> col``) is the stream's text
_COMPARABLE_KEY_TYPES = frozenset(
    {"text", "character varying", "varchar", "uuid", "date", "character", "bpchar", "char"}
)


def key_comparable(key: Sequence[str], types: Mapping[str, str]) -> bool:
    """Whether a message's key can be compared with a change's (both print it alike); ``types``:
    column name -> ``format_type()``."""
    for k in key:
        t = types.get(k, "").strip().lower()
        base = t.split("(", 1)[0].strip()
        if type_kind(t) not in ("int", "numeric") and base not in _COMPARABLE_KEY_TYPES:
            return False
    return True


class NonFinite(msgspec.Struct, frozen=True):
    """One recorder message (see the module docstring)."""

    v: int
    image: str
    schema: str
    table: str
    key: list[str | None]
    values: dict[str, str]


_decoder = msgspec.json.Decoder(NonFinite)


def parse_nonfinite(content: str | None, lsn: str | None = None) -> NonFinite:
    """Decode a recorder message; DecodeError (with the fix) when it is not one this reader knows."""
    try:
        msg = _decoder.decode(content or "")
        if msg.v != FORMAT_VERSION:
            raise ValueError(f"format version {msg.v!r}, this reader knows {FORMAT_VERSION}")
        if msg.image not in ("new", "old") or not set(msg.values.values()) <= FLOAT_SPECIALS:
            raise ValueError(f"image {msg.image!r}, values {msg.values!r}")
    except (msgspec.DecodeError, ValueError) as exc:
        raise DecodeError(
            f"a {NONFINITE_PREFIX} message at LSN {lsn} is not one this cdc understands: {exc}",
            fix="bring the recorder up to this cdc version: `cdc check --fix` as the tables' owner",
            lsn=lsn,
            reason="bad non-finite message",
        ) from exc
    return msg
