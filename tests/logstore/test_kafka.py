"""Kafka-specific behaviour of :class:`cdc.logstore.kafka.KafkaLogStore`, against the real Tansu broker.

What every backend must do is in test_contract.py; here: what the topics look like on the broker,
that the producer really is idempotent with acks=all, the end-offset workaround for brokers whose
ListOffsets is short (Tansu), and failures (no broker, broker killed mid-way). Checks go through
independent kafka-python clients where the broker's view matters.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType
from kafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from cdc.devcluster import free_port
from cdc.errors import BrokerUnavailableError, LogStoreError, OffsetOutOfRangeError, UnknownTopicError
from cdc.logstore import Record, TopicConfig, partition_for
from cdc.logstore.kafka import KafkaLogStore
from cdc.logstore.kafka.producer import BulkProducer as _BulkProducer
from cdc.logstore.kafka.record_batch import encode_batch
from tests.logstore.kafka_proxy import HEARTBEAT, JOIN_GROUP, PRODUCE, SYNC_GROUP, Action, KafkaProxy
from tests.plugins.tansu import TansuBroker

OFFSET_COMMIT = 8


PRODUCERS = ["bulk", "kafka-python"]


@pytest.fixture
def topic() -> str:
    return f"cdc.kafka.t_{uuid.uuid4().hex[:8]}"


@pytest.fixture
def admin(tansu_broker: TansuBroker) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=tansu_broker.bootstrap, request_timeout_ms=10_000)
    yield client
    client.close()


@pytest.fixture
def store_factory(tansu_broker: TansuBroker) -> Iterator[Callable[..., KafkaLogStore]]:
    opened: list[KafkaLogStore] = []

    def make(bootstrap: str | None = None, **kwargs: object) -> KafkaLogStore:
        store = KafkaLogStore(bootstrap or tansu_broker.bootstrap, **kwargs)  # type: ignore[arg-type]
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def proxied(tansu_factory: Callable[..., TansuBroker]) -> Iterator[tuple[KafkaProxy, TansuBroker]]:
    """A private broker that clients reach through a :class:`KafkaProxy` (it advertises the proxy)."""
    proxy = KafkaProxy()
    broker = tansu_factory(advertised_port=proxy.port)
    proxy.upstream_port = broker.port
    yield proxy, broker
    proxy.close()


def broker_configs(admin: KafkaAdminClient, topic: str) -> dict[str, str]:
    described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)], config_filter="all")
    return {name: entry["value"] for name, entry in described["topic"][topic].items()}


def raw_records(bootstrap: str, topic: str, partition: int, expected: int) -> list:
    """Records of one partition read by a plain kafka-python consumer (not the store)."""
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=50
    )
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        consumer.seek(tp, 0)
        out: list = []
        deadline = time.monotonic() + 120  # generous: the assertion is on what arrives
        while len(out) < expected and time.monotonic() < deadline:
            out.extend(consumer.poll(timeout_ms=200).get(tp, []))
        return out
    finally:
        consumer.close()


# -- topics ---------------------------------------------------------------------------------------------
def test_topics_created_with_cleanup_policy_and_configs(
    store_factory: Callable[..., KafkaLogStore], admin: KafkaAdminClient, topic: str
) -> None:
    store = store_factory()
    compacted = TopicConfig(partitions=3, min_compaction_lag_ms=5_000, delete_retention_ms=120_000)
    info = store.create_topic(topic, compacted)
    assert broker_configs(admin, topic) == {
        "cleanup.policy": "compact",
        "min.compaction.lag.ms": "5000",
        "delete.retention.ms": "120000",
        "retention.ms": str(7 * 24 * 3600 * 1000),
        "retention.bytes": "-1",
    }
    [described] = admin.describe_topics([topic])
    assert len(described["partitions"]) == 3
    assert info.config == compacted
    # read back by another instance (nothing cached)
    assert store_factory().topic(topic).config == compacted

    dead_letters = TopicConfig(partitions=1, compacted=False, retention_ms=None, retention_bytes=10_000_000)
    store.create_topic(topic + ".dlq", dead_letters)
    configs = broker_configs(admin, topic + ".dlq")
    assert configs["cleanup.policy"] == "delete"
    assert configs["retention.ms"] == "-1"  # None = keep forever
    assert configs["retention.bytes"] == "10000000"
    listed = {t.name: t for t in store_factory().list_topics()}
    assert listed[topic].config == compacted
    assert listed[topic + ".dlq"].config == dead_letters


def test_topic_made_by_another_tool_falls_back_to_defaults(
    store_factory: Callable[..., KafkaLogStore], admin: KafkaAdminClient, topic: str
) -> None:
    """A topic created without configs: Tansu describes none, so each field takes TopicConfig's default."""
    from kafka.admin import NewTopic

    admin.create_topics([NewTopic(topic, 2, 1)])
    assert store_factory().topic(topic).config == TopicConfig(partitions=2)


def test_unknown_topic_is_not_auto_created(
    store_factory: Callable[..., KafkaLogStore], admin: KafkaAdminClient, topic: str
) -> None:
    """Tansu creates a topic on first produce even when the client forbids it; the store checks first."""
    store = store_factory()
    with pytest.raises(UnknownTopicError) as err:
        store.append(topic, [Record(b"k", b"v")])
    assert err.value.topic == topic
    with pytest.raises(UnknownTopicError):
        store.read(topic, 0, 0)
    with pytest.raises(UnknownTopicError):
        store.end_offsets(topic)
    assert topic not in admin.list_topics()


# -- producing ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("producer", PRODUCERS)
def test_producer_is_idempotent_with_acks_all(
    store_factory: Callable[..., KafkaLogStore], topic: str, producer: str
) -> None:
    store = store_factory(writer=True, producer=producer)
    store.create_topic(topic, TopicConfig(partitions=2))
    store.append(topic, [Record(b"k", b"v")])
    p = store._producer
    if producer == "bulk":
        assert isinstance(p, _BulkProducer)
        assert p.acks == -1
        assert p.producer_id >= 0  # assigned by the broker through InitProducerId
    else:
        assert p.config["acks"] == -1
        assert p.config["enable_idempotence"] is True
        # kafka-python's own record of the broker-assigned producer id (a private attribute)
        assert p._transaction_manager.producer_id_and_epoch.producer_id >= 0


def test_broker_rejects_a_replayed_batch(store_factory: Callable[..., KafkaLogStore], topic: str) -> None:
    """Idempotence is in effect on the broker: a batch sent again with the same producer id and
    sequence is refused as a duplicate, and nothing is appended twice."""
    store = store_factory(writer=True)
    store.create_topic(topic, TopicConfig(partitions=1))
    records = [Record(f"k{i}".encode(), b"v") for i in range(3)]
    assert store.append(topic, records) == {0: 2}
    producer = store._producer
    assert isinstance(producer, _BulkProducer)
    tp = TopicPartition(topic, 0)
    producer._sequence[tp] -= 3  # replay: the same sequence numbers once more
    with pytest.raises(LogStoreError, match="DuplicateSequenceNumber"):
        producer.produce({tp: records}, lambda refresh: {tp: store._leaders[topic][0]})
    assert store.end_offsets(topic) == {0: 3}
    # the store recovers with a fresh producer id
    assert store.append(topic, records) == {0: 5}


def test_forgotten_producer_state_is_renewed(store_factory: Callable[..., KafkaLogStore], topic: str) -> None:
    """A broker that no longer accepts the producer's sequence (e.g. the producer id expired after a
    long idle time) answers OUT_OF_ORDER_SEQUENCE: the append gets a new producer id and goes
    through once more, nothing lost and nothing skipped."""
    store = store_factory(writer=True)
    store.create_topic(topic, TopicConfig(partitions=1))
    store.append(topic, [Record(b"a", b"1")])
    producer = store._producer
    assert isinstance(producer, _BulkProducer)
    old_id = producer.producer_id
    producer._sequence[TopicPartition(topic, 0)] += 5  # a gap the broker refuses
    assert store.append(topic, [Record(b"b", b"2"), Record(b"c", b"3")]) == {0: 2}
    assert producer.producer_id != old_id
    assert [r.key for r in store.iter_partition(topic, 0)] == [b"a", b"b", b"c"]


@pytest.mark.parametrize("producer", PRODUCERS)
def test_placement_headers_and_timestamps_as_the_broker_sees_them(
    store_factory: Callable[..., KafkaLogStore], tansu_broker: TansuBroker, topic: str, producer: str
) -> None:
    store = store_factory(writer=True, producer=producer)
    store.create_topic(topic, TopicConfig(partitions=4))
    keys = [f'{{"id": {i}}}'.encode() for i in range(40)]
    records = [
        Record(k, b"v" + k, headers=(("op", b"c"), ("n", b"")), timestamp_ms=1_700_000_000_000 + i)
        for i, k in enumerate(keys)
    ]
    records.append(Record(b"marker", None, partition=3))  # explicit partition beats the key's hash
    last = store.append(topic, records)
    expected: dict[int, list[bytes]] = {p: [] for p in range(4)}
    for k in keys:
        expected[partition_for(k, 4)].append(k)
    expected[3].append(b"marker")
    assert last == {p: len(ks) - 1 for p, ks in expected.items() if ks}
    for p in range(4):
        raw = raw_records(tansu_broker.bootstrap, topic, p, len(expected[p]))
        assert [r.key for r in raw] == expected[p]
        for r in raw:
            if r.key == b"marker":
                assert r.value is None
                continue
            i = keys.index(r.key)
            assert r.value == b"v" + r.key
            assert r.timestamp == 1_700_000_000_000 + i
            assert [(k, v) for k, v in r.headers] == [("op", b"c"), ("n", b"")]


def test_large_append_spans_many_batches_and_requests(
    store_factory: Callable[..., KafkaLogStore], topic: str
) -> None:
    """More than one 1 MB batch per partition and more than one request in flight: order and
    offsets stay exact."""
    store = store_factory(writer=True)
    store.create_topic(topic, TopicConfig(partitions=2))
    value = b"x" * 2000
    records = [Record(f"{i}".encode(), value + str(i).encode(), partition=i % 2) for i in range(6000)]
    assert store.append(topic, records) == {0: 2999, 1: 2999}
    got = list(store.iter_partition(topic, 1))
    assert [r.value for r in got] == [r.value for r in records if r.partition == 1]
    assert [r.offset for r in got] == list(range(3000))


@pytest.mark.kafka  # no broker, but kept out of make check as before (kafka-python)
@pytest.mark.parametrize("codec", ["none", "gzip"])
def test_encoded_batch_matches_kafka_python(codec: str) -> None:
    """encode_batch writes the bytes kafka-python's DefaultRecordBatchBuilder writes, and its parser
    reads back every field (tombstones, headers, a timestamp older than the first, big values)."""
    records = [
        Record(b"k1", b"v" * 20_000, headers=(("op", b"u"), ("empty", b"")), timestamp_ms=1_700_000_000_500),
        Record(b"", None, timestamp_ms=1_700_000_000_000),  # earlier than the first: negative delta
        Record(b"k3", b"", headers=(("h", b"x" * 300),), timestamp_ms=1_700_000_099_999),
        *[
            Record(f"key{i}".encode(), f"value{i}".encode(), timestamp_ms=1_700_000_000_000 + i)
            for i in range(300)
        ],
    ]
    code = {"none": 0, "gzip": DefaultRecordBatchBuilder.CODEC_GZIP}[codec]
    data, n = encode_batch(records, 0, 1_000_000, 42, 3, 1000, code)
    assert n == len(records)
    builder = DefaultRecordBatchBuilder(2, code, False, 42, 3, 1000, 1_000_000)
    for i, r in enumerate(records):
        builder.append(i, r.timestamp_ms, r.key, r.value, list(r.headers))
    if codec == "none":
        assert data == bytes(builder.build())
    batch = DefaultRecordBatch(data)
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (42, 3, 1000)
    assert batch.validate_crc()
    parsed = list(batch)
    assert [(r.offset, r.key, r.value, r.timestamp, list(r.headers)) for r in parsed] == [
        (i, r.key, r.value, r.timestamp_ms, list(r.headers)) for i, r in enumerate(records)
    ]
    # a size limit cuts the batch, never below one record
    part, m = encode_batch(records, 0, 5_000, 42, 3, 0)
    assert m == 1 and len(DefaultRecordBatch(part)._buffer) == len(part)
    _, m2 = encode_batch(records, 1, 5_000, 42, 3, 0)
    assert 1 < m2 < len(records) - 1


def test_compressed_appends_read_back(store_factory: Callable[..., KafkaLogStore], topic: str) -> None:
    store = store_factory(writer=True, compression="gzip")
    store.create_topic(topic, TopicConfig(partitions=1))
    records = [Record(f"{i}".encode(), b'{"same": "text"}' * 20) for i in range(500)]
    assert store.append(topic, records) == {0: 499}
    assert [r.value for r in store_factory().iter_partition(topic, 0)] == [r.value for r in records]


# -- end offsets ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("producer", PRODUCERS)
def test_end_offsets_exact_after_many_batches(
    store_factory: Callable[..., KafkaLogStore], tansu_broker: TansuBroker, topic: str, producer: str
) -> None:
    """Tansu's ListOffsets LATEST answers the last batch's base offset + 1; the store's end offsets
    must still be exact, however the appends were batched (including a last batch of one record)."""
    store = store_factory(writer=True, producer=producer)
    store.create_topic(topic, TopicConfig(partitions=2))
    sizes = [5, 17, 1, 30, 8]
    for n in sizes:
        store.append(topic, [Record(f"k{i}".encode(), b"v", partition=0) for i in range(n)])
    store.append(topic, [Record(b"only", b"v", partition=1)])
    total = sum(sizes)
    reader = store_factory()
    assert reader.end_offsets(topic) == {0: total, 1: 1}
    assert reader.topic(topic).end_offsets == {0: total, 1: 1}
    assert {t.name: t.end_offsets for t in reader.list_topics()}[topic] == {0: total, 1: 1}

    # what a plain client is told (documents the quirk; never more than the truth)
    consumer = KafkaConsumer(bootstrap_servers=tansu_broker.bootstrap, group_id=None)
    try:
        reported = consumer.end_offsets([TopicPartition(topic, 0)])[TopicPartition(topic, 0)]
    finally:
        consumer.close()
    assert reported <= total

    assert reader.read(topic, 0, total) == []
    with pytest.raises(OffsetOutOfRangeError) as err:
        reader.read(topic, 0, total + 1)
    assert (err.value.start, err.value.end) == (0, total)  # type: ignore[attr-defined]
    assert [r.offset for r in reader.iter_partition(topic, 0)] == list(range(total))
    assert [r.offset for r in reader.read(topic, 0, total - 1)] == [total - 1]


def test_interleaved_reads_and_appends(store_factory: Callable[..., KafkaLogStore], topic: str) -> None:
    """Sequential reads reuse the consumer's position; jumps, other partitions, end-offset probes and
    appends in between must not disturb what each read returns."""
    store = store_factory(writer=True)
    store.create_topic(topic, TopicConfig(partitions=2))
    log: dict[int, list[bytes]] = {0: [], 1: []}

    def append(n: int) -> None:
        recs = [
            Record(f"{p}-{len(log[p]) + i}".encode(), b"v", partition=p) for p in (0, 1) for i in range(n)
        ]
        store.append(topic, recs)
        for p in (0, 1):
            log[p].extend(r.key for r in recs if r.partition == p)

    def check(p: int, start: int, n: int) -> None:
        assert [r.key for r in store.read(topic, p, start, n)] == log[p][start : start + n]

    append(50)
    check(0, 0, 10)
    check(0, 10, 10)  # continues where the last read stopped
    append(5)
    check(0, 20, 100)  # up to the new end
    check(1, 3, 4)
    check(0, 5, 3)  # jump back
    store.end_offsets(topic)
    check(0, 8, 2)
    check(0, 10, 1000)
    assert store.read(topic, 0, 55) == []
    append(1)
    check(0, 55, 10)


# -- consumer positions ---------------------------------------------------------------------------------
def test_commit_uses_group_id_without_membership(
    store_factory: Callable[..., KafkaLogStore],
    proxied: tuple[KafkaProxy, TansuBroker],
    topic: str,
) -> None:
    """Positions are committed with OffsetCommit alone: no JoinGroup, SyncGroup or Heartbeat goes to
    the broker (seen on the wire by the proxy), so a commit never waits for a group rebalance
    (Tansu answers JoinGroup only after session_timeout/2)."""
    proxy, _ = proxied
    bootstrap = f"127.0.0.1:{proxy.port}"
    store = store_factory(bootstrap)
    store.create_topic(topic, TopicConfig(partitions=2))
    store.commit("spark-apply", topic, {0: 7, 1: 0})
    assert OFFSET_COMMIT in proxy.api_keys
    assert not {JOIN_GROUP, SYNC_GROUP, HEARTBEAT} & set(proxy.api_keys)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    try:
        offsets = admin.list_group_offsets({"spark-apply": None})["spark-apply"]
    finally:
        admin.close()
    assert {tp.partition: om.offset for tp, om in offsets.items() if tp.topic == topic} == {0: 7, 1: 0}
    assert store_factory(bootstrap).committed("spark-apply", topic) == {0: 7, 1: 0}
    assert store.committed("nobody", topic) == {}


def test_compact_and_retention_are_the_brokers_job(
    store_factory: Callable[..., KafkaLogStore], topic: str
) -> None:
    store = store_factory(writer=True)
    store.create_topic(topic, TopicConfig(partitions=1, min_compaction_lag_ms=0, delete_retention_ms=0))
    store.append(topic, [Record(b"k", str(i).encode()) for i in range(5)])
    assert store.compact(topic) == 0
    assert store.enforce_retention(topic) == 0
    # Tansu never compacts: every superseded record is still there
    assert len(list(store.iter_partition(topic, 0))) == 5


# -- failures -------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)  # the behaviour: an error, never a hang
def test_no_broker_fails_with_the_address(store_factory: Callable[..., KafkaLogStore]) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(BrokerUnavailableError) as err:
        store_factory(address, connect_timeout_ms=3_000, request_timeout_ms=3_000)
    assert address in str(err.value)
    assert err.value.bootstrap == address  # type: ignore[attr-defined]
    assert err.value.fix and "kafka://" in err.value.fix


@pytest.mark.timeout(300)  # the behaviour: an error, never a hang
def test_broker_killed_mid_way(
    store_factory: Callable[..., KafkaLogStore],
    tansu_factory: Callable[[], TansuBroker],
    topic: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Append, kill the broker, append again: a clear BrokerUnavailableError (not a hang: the
    test's timeout), for writes and reads, once the retries (``retry_max_s``) are spent. (That nothing acknowledged is lost cannot be checked here: this Tansu
    build keeps everything in memory, so a restarted broker is empty.)"""
    broker = tansu_factory()
    store = store_factory(
        broker.bootstrap, writer=True, request_timeout_ms=3_000, connect_timeout_ms=3_000, retry_max_s=2
    )
    store.create_topic(topic, TopicConfig(partitions=2))
    assert store.append(topic, [Record(b"a", b"1"), Record(b"b", b"2")])
    broker.stop()
    for attempt in (store.append, store.append):  # the second goes through a fresh producer
        with pytest.raises(BrokerUnavailableError) as err:
            attempt(topic, [Record(b"c", b"3")])
        assert broker.bootstrap in str(err.value)
    # the first append retried (each retry logged) before giving up after retry_max_s
    assert any("retry 1 in" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    with pytest.raises(BrokerUnavailableError):
        store.end_offsets(topic)
    with pytest.raises(BrokerUnavailableError):
        store.read(topic, 0, 0)


# -- transient produce errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("fault", ["drop_before", "drop_after", "refuse", "not_leader"])
def test_transient_produce_errors_lose_duplicate_and_reorder_nothing(
    store_factory: Callable[..., KafkaLogStore],
    proxied: tuple[KafkaProxy, TansuBroker],
    topic: str,
    fault: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Transient failures under the producer (made by a proxy between it and the broker) while
    appends of several batches per partition are in flight: the connection cut before the broker
    saw a ProduceRequest (lost), or after the broker applied it but before its answer came back
    (the batch is on the broker, the producer does not know), the broker unreachable for a while
    (connections refused), or a ProduceRequest answered NOT_LEADER_OR_FOLLOWER (a leader change:
    the broker never sees it, and refuses the partition's next batches as out of sequence). The
    producer retries with the same producer id and sequence numbers: every partition holds each
    record exactly once, in append order, and every append returned the right last offsets."""
    proxy, _ = proxied
    faults: list[int] = []

    def decide(api_key: int, seen: int) -> Action:
        if api_key != PRODUCE or seen % 4 != 2:
            return "pass"
        faults.append(seen)
        if fault == "refuse":
            proxy.refuse = True  # for 0.5 s: the retries after 0.1 and 0.3 s are refused too
            threading.Timer(0.5, lambda: setattr(proxy, "refuse", False)).start()
            return "drop_before"
        return fault  # type: ignore[return-value]

    bootstrap = f"127.0.0.1:{proxy.port}"
    store = store_factory(bootstrap, writer=True, request_timeout_ms=5_000, retry_max_s=120)
    store.create_topic(topic, TopicConfig(partitions=3))
    proxy.decide = decide
    expected: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    filler = b"x" * 2000  # ~1 MB per partition per append: several batches and requests in flight
    for n in range(12):
        records = [Record(f"k{n}-{i}".encode(), b"%d-%d|" % (n, i) + filler) for i in range(1500)]
        last = store.append(topic, records)
        for r in records:
            expected[partition_for(r.key, 3)].append(r.value or b"")
        assert last == {p: len(values) - 1 for p, values in expected.items()}
    proxy.decide = lambda api_key, seen: "pass"
    assert len(faults) >= 3, faults
    producer = store._producer
    assert isinstance(producer, _BulkProducer) and producer.retries >= 3
    if fault == "drop_after":
        assert proxy.responses_dropped >= 3  # the broker had applied those requests...
        assert producer.duplicates >= 3  # ...and recognised them when they came again
    if fault == "not_leader":
        assert proxy.made_answers >= 3
    assert any("retry 1 in" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    reader = store_factory(bootstrap)
    for p, values in expected.items():
        got = [r.value for r in reader.iter_partition(topic, p)]
        assert len(got) == len(values), f"partition {p}: {len(got)} records, {len(values)} appended"
        assert got == values, f"partition {p}: records lost, duplicated or reordered"


def test_transient_errors_that_outlast_retry_max_s_fail_clearly(
    store_factory: Callable[..., KafkaLogStore], proxied: tuple[KafkaProxy, TansuBroker], topic: str
) -> None:
    """A leader that never comes back: the append retries for retry_max_s, then fails with a
    LogStoreError naming the error and the setting (not a kafka-python exception); nothing written."""
    proxy, _ = proxied
    bootstrap = f"127.0.0.1:{proxy.port}"
    store = store_factory(bootstrap, writer=True, request_timeout_ms=5_000, retry_max_s=1)
    store.create_topic(topic, TopicConfig(partitions=2))
    proxy.decide = lambda api_key, seen: "not_leader" if api_key == PRODUCE else "pass"
    with pytest.raises(LogStoreError) as err:
        store.append(topic, [Record(b"k", b"v")])
    assert not isinstance(err.value, BrokerUnavailableError)
    assert "NotLeaderForPartitionError" in str(err.value) and "retry_max_s" in str(err.value)
    assert err.value.fix
    assert proxy.made_answers >= 2  # retried before giving up
    proxy.decide = lambda api_key, seen: "pass"
    assert store_factory(bootstrap).end_offsets(topic) == {0: 0, 1: 0}
