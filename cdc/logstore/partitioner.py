"""Kafka's default partitioner (murmur2 of the key bytes), so both backends agree on placement.

:func:`partition_for` places one key; :func:`partitions_for` places many at once (the same answers,
vectorised with numpy). A stable hash: never Python's ``hash()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (``org.apache.kafka.common.utils.Utils.murmur2``), as a signed 32-bit int."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = data[i4] | (data[i4 + 1] << 8) | (data[i4 + 2] << 16) | (data[i4 + 3] << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    base = length & ~3
    if extra >= 3:
        h ^= data[base + 2] << 16
    if extra >= 2:
        h ^= data[base + 1] << 8
    if extra >= 1:
        h ^= data[base]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner picks for ``key`` (``toPositive(murmur2) % n``)."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


_M32 = np.uint32(0x5BD1E995)


def partitions_for(keys: Sequence[bytes], partitions: int) -> list[int]:
    """:func:`partition_for` of every key (the same murmur2, the same result; the tests compare
    them), vectorised with numpy: the keys are joined into one buffer once and hashed per key length
    (one gather per length, no Python work per key). About 0.1 µs a key instead of ~2 µs."""
    return partition_array(keys, partitions).tolist()  # type: ignore[no-any-return]


def partition_array(keys: Sequence[bytes], partitions: int) -> np.ndarray:
    """:func:`partitions_for` as a numpy ``int64`` array (for callers that group by partition)."""
    n = len(keys)
    if n < 16:
        return np.array([partition_for(k, partitions) for k in keys], dtype=np.int64)
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=n)
    buf = np.frombuffer(b"".join(keys), dtype=np.uint8)
    hashes = np.empty(n, dtype=np.uint32)
    shortest, longest = int(lengths.min()), int(lengths.max())
    if shortest == longest:  # the usual case: one key length, the buffer is already a matrix
        hashes[:] = _murmur2_rows(buf.reshape(n, shortest), shortest)
    else:
        starts = np.zeros(n, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        for length in np.unique(lengths).tolist():
            idx = np.flatnonzero(lengths == length)
            rows = buf[starts[idx, None] + np.arange(length, dtype=np.int64)]
            hashes[idx] = _murmur2_rows(rows, length)
    return ((hashes & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)).astype(np.int64)


def _murmur2_rows(data: np.ndarray, length: int) -> np.ndarray:
    """murmur2 (unsigned) of every row of a ``(keys, length)`` uint8 matrix."""
    h = np.full(data.shape[0], (0x9747B28C ^ length) & 0xFFFFFFFF, dtype=np.uint32)
    words = length >> 2
    if words:  # uint32 arithmetic wraps modulo 2**32, as murmur2's masks do
        table = np.ascontiguousarray(data[:, : words * 4]).view("<u4")
        for j in range(words):
            k = table[:, j] * _M32
            k ^= k >> np.uint32(24)
            k *= _M32
            h *= _M32
            h ^= k
    extra, base = length & 3, words * 4
    if extra >= 3:
        h ^= data[:, base + 2].astype(np.uint32) << np.uint32(16)
    if extra >= 2:
        h ^= data[:, base + 1].astype(np.uint32) << np.uint32(8)
    if extra >= 1:
        h ^= data[:, base].astype(np.uint32)
        h *= _M32
    h ^= h >> np.uint32(13)
    h *= _M32
    h ^= h >> np.uint32(15)
    return h
