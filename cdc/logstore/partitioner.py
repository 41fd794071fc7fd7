"""Kafka's default partitioner (murmur2 of the key bytes), so both backends agree on placement.

:func:`partition_for` places one key; :mod:`cdc.logstore.partition_arrays` places many at once (the
same answers, vectorised with numpy, which only the writers of batches import: a ``cdc status``
never does). A stable hash: never Python's ``hash()``.
"""

from __future__ import annotations


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
