"""Kafka's default partitioner for many keys at once: :func:`cdc.logstore.partitioner.partition_for`
of each, vectorised with numpy (the writers of batches: the log stores, the warehouse's and the
search index's layouts). Apart from that module so that placing one key imports no numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cdc.logstore.partitioner import partition_for

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
