"""How the embedded store encodes a batch of records (the bytes of one stored batch row).

A stored batch is a msgpack array of records, each a map with :class:`~cdc.logstore.StoredRecord`'s
field names, so that msgspec decodes a batch straight into ``StoredRecord`` objects (one C call per
batch, no Python per record). The blob is framed with one codec byte (:data:`CODEC_NONE` or
:data:`CODEC_LZ4`; lz4 adds the uncompressed size as 4 bytes little-endian) and compressed only when
that makes it smaller. :func:`stored_rows` turns an append's records into the rows to store, grouped
by partition, without Python work per record for the usual batch (the append path is vectorised).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Any

import lz4.frame
import msgspec
import numpy as np

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
    "stored_rows",
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


def stored_rows(
    name: str,
    n: int,
    end: Mapping[int, int],
    parts: Sequence[int] | np.ndarray,
    records: Sequence[Record],
    now: int,
) -> tuple[list[list[StoredRow]], list[int]]:
    """The records as stored, grouped by partition, with their offsets (partition ``p`` continues at
    ``end[p]``), and the tombstones per partition. Checks every record (:func:`check_record`).

    The usual batch (keys bytes, values bytes or None, no headers, timestamps int or None) is built
    without Python work per record (type sets, numpy grouping, ``map`` over the columns); anything
    else takes the per-record loop, which names an offending record."""
    keys = [r.key for r in records]
    values = [r.value for r in records]
    stamps = [r.timestamp_ms for r in records]
    usual = (
        set(map(type, keys)) == {bytes}
        and set(map(type, values)) <= {bytes, type(None)}
        and set(map(type, stamps)) <= {int, type(None)}
        and not any(r.headers for r in records)
    )
    groups: list[list[StoredRow]] = [[] for _ in range(n)]
    tombstones = [0] * n
    if not usual:
        nxt = [end[p] for p in range(n)]
        for i, (p, r) in enumerate(zip(parts, records, strict=True)):
            check_record(name, i, r)
            p = int(p)
            if r.value is None:
                tombstones[p] += 1
            ts = r.timestamp_ms
            groups[p].append(StoredRow(name, p, nxt[p], r.key, r.value, r.headers, now if ts is None else ts))
            nxt[p] += 1
        return groups, tombstones
    if None in stamps:
        stamps = [now if ts is None else ts for ts in stamps]
    placed = np.asarray(parts, dtype=np.int64)
    for p in range(n):
        idx = np.flatnonzero(placed == p).tolist()
        if not idx:
            continue
        vals = list(map(values.__getitem__, idx))
        tombstones[p] = vals.count(None)
        groups[p] = list(
            map(
                StoredRow,
                repeat(name),
                repeat(p),
                range(end[p], end[p] + len(idx)),
                map(keys.__getitem__, idx),
                vals,
                repeat(()),
                map(stamps.__getitem__, idx),
            )
        )
    return groups, tombstones


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
