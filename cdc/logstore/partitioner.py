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
    them), vectorised with numpy over the keys of each length: about 0.25 µs a key instead of
    ~2 µs, which is a third of a Kafka append's CPU otherwise. Lengths shared by fewer than 16 keys
    go through :func:`partition_for` itself."""
    out = [0] * len(keys)
    by_length: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_length.setdefault(len(key), []).append(i)
    for length, idx in by_length.items():
        if length == 0 or len(idx) < 16:
            for i in idx:
                out[i] = partition_for(keys[i], partitions)
            continue
        data = np.frombuffer(b"".join([keys[i] for i in idx]), dtype=np.uint8).reshape(len(idx), length)
        h = np.full(len(idx), (0x9747B28C ^ length) & 0xFFFFFFFF, dtype=np.uint32)
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
        placed: list[int] = ((h & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)).tolist()
        for i, p in zip(idx, placed, strict=True):
            out[i] = p
    return out
