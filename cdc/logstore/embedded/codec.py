"""How the embedded store encodes a batch of records (the bytes of one stored batch row).

A stored batch is a msgpack array of records, each a map with :class:`~cdc.logstore.StoredRecord`'s
field names, so that msgspec decodes a batch straight into ``StoredRecord`` objects (one C call per
batch, no Python per record). The blob is framed with one codec byte (:data:`CODEC_NONE` or
:data:`CODEC_LZ4`; lz4 adds the uncompressed size as 4 bytes little-endian) and compressed only when
that makes it smaller. The reference path of an append (its records as the rows to store, grouped by
partition) is :mod:`cdc.logstore.embedded.placing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lz4.frame
import msgspec

from cdc.errors import LogStoreError
from cdc.logstore import Record, StoredRecord

__all__ = [
    "MSGPACK_NIL",
    "RAW_DECODER",
    "RECORD_DECODER",
    "RawRecord",
    "StoredRow",
    "check_record",
    "frame",
    "pack",
    "unpack",
]

_HeadersT = tuple[tuple[str, bytes], ...]


class StoredRow(msgspec.Struct, gc=False):
    """A record as written (encodes as a map with StoredRecord's field names, in its order)."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes | None
    headers: _HeadersT
    timestamp_ms: int


class RawRecord(msgspec.Struct, gc=False):
    """A stored record as compaction sees it: value and headers left encoded (copied through as-is)."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: msgspec.Raw
    headers: msgspec.Raw
    timestamp_ms: int


ENCODER = msgspec.msgpack.Encoder()
RECORD_DECODER = msgspec.msgpack.Decoder(list[StoredRecord])
RAW_DECODER = msgspec.msgpack.Decoder(list[RawRecord])
MSGPACK_NIL = msgspec.Raw(b"\xc0")

# Batch blob framing: one codec byte, then (lz4) the uncompressed size as 4 bytes little-endian.
CODEC_NONE = 0
CODEC_LZ4 = 1


def pack(rows: Sequence[Any], compress: bool) -> bytes:
    """A stored batch's blob of ``rows`` (:func:`frame` of their msgpack)."""
    return frame(ENCODER.encode(rows), compress)


def frame(data: bytes, compress: bool) -> bytes:
    """A stored batch's blob of its msgpack ``data``: lz4-compressed when ``compress`` and smaller."""
    if compress:
        packed: bytes = lz4.frame.compress(data)
        if len(packed) < len(data):
            return bytes((CODEC_LZ4,)) + len(data).to_bytes(4, "little") + packed
    return bytes((CODEC_NONE,)) + data


def unpack(blob: bytes) -> bytes | memoryview:
    codec = blob[0]
    if codec == CODEC_NONE:
        return memoryview(blob)[1:]
    if codec == CODEC_LZ4:
        size = int.from_bytes(blob[1:5], "little")
        data: bytes = lz4.frame.decompress(memoryview(blob)[5:])
        if len(data) != size:
            raise msgspec.DecodeError(f"lz4 batch decompressed to {len(data)} bytes, its header says {size}")
        return data
    raise msgspec.DecodeError(f"unknown batch codec {codec}")


def check_record(topic: str, index: int, r: Record) -> None:
    """Refuse a record the store could write but not read back as a StoredRecord."""
    problem = None
    if type(r.key) is not bytes:
        problem = f"its key is {type(r.key).__name__}, not bytes"
    elif r.value is not None and type(r.value) is not bytes:
        problem = f"its value is {type(r.value).__name__}, not bytes or None"
    elif r.partition is not None and type(r.partition) is not int:
        problem = f"its partition is {type(r.partition).__name__}, not int or None"
    elif r.timestamp_ms is not None and type(r.timestamp_ms) is not int:
        problem = f"its timestamp_ms is {type(r.timestamp_ms).__name__}, not int or None"
    elif not isinstance(r.headers, tuple) or not all(
        isinstance(h, tuple) and len(h) == 2 and type(h[0]) is str and type(h[1]) is bytes for h in r.headers
    ):
        problem = "its headers are not a tuple of (str, bytes) pairs"
    if problem:
        raise LogStoreError(
            f"record {index} of the batch for topic {topic!r} cannot be stored: {problem}",
            fix="build Record(key=bytes, value=bytes | None, headers=((str, bytes), ...), timestamp_ms=int | None); "
            "nothing of this batch was written",
            topic=topic,
            index=index,
        )
