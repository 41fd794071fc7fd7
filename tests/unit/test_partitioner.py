import random

from kafka.partitioner.default import murmur2 as kafka_murmur2

from cdc.logstore.partition_arrays import partitions_for
from cdc.logstore.partitioner import murmur2, partition_for


def test_murmur2_matches_kafka_python() -> None:
    for key in [b"", b"a", b"ab", b"abc", b"abcd", b'{"id": 42}', bytes(range(256)), "é✓".encode()]:
        assert murmur2(key) & 0xFFFFFFFF == kafka_murmur2(key) & 0xFFFFFFFF


def test_partition_is_stable_and_in_range() -> None:
    # Values from Kafka's own DefaultPartitioner for these keys with 4 partitions.
    keys = [f'{{"id": {i}}}'.encode() for i in range(1000)]
    parts = [partition_for(k, 4) for k in keys]
    assert set(parts) == {0, 1, 2, 3}
    assert parts == [partition_for(k, 4) for k in keys]
    assert partition_for(b"abc", 4) == (479470107 & 0x7FFFFFFF) % 4


def test_vectorised_placement_equals_partition_for() -> None:
    """partitions_for (numpy, one gather per key length) places every key as partition_for does:
    one shared length, mixed lengths, empty keys, high bytes, fewer than 16 keys."""
    rng = random.Random(5)
    ids = [f'{{"id": {i}}}'.encode() for i in range(3000)]
    mixed = ids + [rng.randbytes(rng.randint(0, 40)) for _ in range(3000)]
    mixed += [bytes([255] * 13)] * 20 + [b""] * 20
    for keys in (ids[1000:2000], mixed, [b""] * 20, [b"ab"] * 30, mixed[:7]):
        for n in (1, 3, 4, 7, 64, 1000):
            assert partitions_for(keys, n) == [partition_for(k, n) for k in keys]
