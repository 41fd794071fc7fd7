from kafka.partitioner.default import murmur2 as kafka_murmur2

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
