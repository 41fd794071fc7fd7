"""The log-store contract: every test runs against every backend (``log_store``/``log_store_factory``
are parametrised over the embedded store and Kafka on the Tansu broker).

Compaction and retention are shown on the embedded backend only: Tansu stores
``cleanup.policy=compact`` but never compacts or deletes, so those tests skip on the kafka param with
the reason; the contract itself (in :mod:`cdc.logstore`) holds for both.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from cdc.errors import OffsetOutOfRangeError, TopicExistsError, UnknownTopicError
from cdc.logstore import LogStore, Record, StoredRecord, TopicConfig, partition_for
from cdc.logstore.embedded import EmbeddedLogStore
from tests.plugins.postgres import wait_for

COMPACTION_SKIP = "Tansu never compacts; the embedded backend carries this contract"
RETENTION_SKIP = "Tansu never deletes by retention; the embedded backend carries this contract"


def embedded_only(store: LogStore, reason: str) -> None:
    if store.backend != "embedded":
        pytest.skip(reason)


@pytest.fixture
def advance_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Move the clock compaction and retention read (``cdc.logstore.now_ms``) forward by ``ms``, so a
    test shows what happens once a retention time has passed without sleeping through it (appends
    keep stamping the real time)."""
    import cdc.logstore

    real = cdc.logstore.now_ms
    shift = 0

    def advance(ms: int) -> None:
        nonlocal shift
        shift += ms
        monkeypatch.setattr(cdc.logstore, "now_ms", lambda: real() + shift)

    return advance


def read_all(store: LogStore, topic: str, partition: int, from_offset: int = 0) -> list[StoredRecord]:
    return list(store.iter_partition(topic, partition, from_offset))


def all_records(store: LogStore, topic: str) -> list[StoredRecord]:
    out: list[StoredRecord] = []
    for p in sorted(store.end_offsets(topic)):
        out.extend(read_all(store, topic, p, store.start_offsets(topic)[p]))
    return out


# -- topics -----------------------------------------------------------------------------------------
def test_create_list_delete_topic(log_store: LogStore, topic_name: str) -> None:
    other = topic_name + ".b"
    info = log_store.create_topic(topic_name, TopicConfig(partitions=3))
    assert info.name == topic_name
    assert info.partitions == 3
    assert info.start_offsets == {0: 0, 1: 0, 2: 0}
    assert info.end_offsets == {0: 0, 1: 0, 2: 0}
    log_store.create_topic(other, TopicConfig(partitions=1))

    listed = {t.name: t for t in log_store.list_topics()}
    assert listed[topic_name].partitions == 3
    assert listed[other].partitions == 1
    names = [t.name for t in log_store.list_topics()]
    assert names == sorted(names)
    assert log_store.topic(topic_name).config.partitions == 3

    log_store.delete_topic(topic_name)
    assert topic_name not in {t.name for t in log_store.list_topics()}
    with pytest.raises(UnknownTopicError):
        log_store.topic(topic_name)
    assert other in {t.name for t in log_store.list_topics()}


def test_create_existing_topic_is_idempotent(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=2))
    log_store.append(topic_name, [Record(b"k", b"v")])
    info = log_store.create_topic(topic_name, TopicConfig(partitions=2))
    assert info.partitions == 2
    assert sum(info.end_offsets.values()) == 1  # the record is still there


def test_topic_exists_error_on_partition_mismatch(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=2))
    with pytest.raises(TopicExistsError) as exc:
        log_store.create_topic(topic_name, TopicConfig(partitions=5))
    assert exc.value.topic == topic_name
    assert exc.value.partitions == 2
    assert exc.value.fix


def test_unknown_topic(log_store: LogStore, topic_name: str) -> None:
    missing = topic_name + ".missing"
    calls: list[Callable[[], object]] = [
        lambda: log_store.topic(missing),
        lambda: log_store.read(missing, 0, 0),
        lambda: log_store.append(missing, [Record(b"k", b"v")]),
        lambda: log_store.end_offsets(missing),
        lambda: log_store.start_offsets(missing),
        lambda: log_store.delete_topic(missing),
    ]
    for call in calls:
        with pytest.raises(UnknownTopicError) as exc:
            call()
        assert exc.value.topic == missing
        assert missing in str(exc.value)
        assert exc.value.fix


# -- append and read ---------------------------------------------------------------------------------
def test_append_and_read_back_exact(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=1))
    records = [
        Record(b'{"id": 1}', b'{"v": 1}', (("h1", b"x"), ("h2", b"\x00\xff")), 1_700_000_000_001),
        Record(b'{"id": 2}', None, (), 1_700_000_000_002),  # tombstone
        Record(b"\x00binary\xff", bytes(range(256)), (("empty", b""),), 1_700_000_000_003),
        Record(b'{"id": 1}', b"", (), 1_700_000_000_004),  # empty value is not a tombstone
    ]
    last = log_store.append(topic_name, records)
    assert last == {0: 3}
    got = log_store.read(topic_name, 0, 0)
    assert [(r.topic, r.partition, r.offset) for r in got] == [(topic_name, 0, i) for i in range(4)]
    for rec, back in zip(records, got, strict=True):
        assert back.key == rec.key
        assert back.value == rec.value
        assert tuple(back.headers) == rec.headers
        assert back.timestamp_ms == rec.timestamp_ms
    assert got[1].value is None
    assert got[3].value == b""


def test_timestamp_defaults_to_now(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=1))
    before = int(time.time() * 1000)
    log_store.append(topic_name, [Record(b"k", b"v")])
    after = int(time.time() * 1000)
    (rec,) = log_store.read(topic_name, 0, 0)
    assert before - 1000 <= rec.timestamp_ms <= after + 1000


def test_offsets_start_at_zero_and_increase_per_partition(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=3))
    returned: list[dict[int, int]] = []
    for batch in range(4):
        recs = [Record(f'{{"id": {i}}}'.encode(), f"{batch}:{i}".encode()) for i in range(30)]
        returned.append(log_store.append(topic_name, recs))
    ends = log_store.end_offsets(topic_name)
    total = 0
    for p in range(3):
        offsets = [r.offset for r in read_all(log_store, topic_name, p)]
        assert offsets == list(range(len(offsets)))
        assert ends[p] == len(offsets)
        total += len(offsets)
        assert returned[-1][p] == ends[p] - 1  # append returns the last offset written
    assert total == 120
    # per-key order is append order
    for p in range(3):
        by_key: dict[bytes, list[bytes]] = {}
        for r in read_all(log_store, topic_name, p):
            by_key.setdefault(r.key, []).append(r.value or b"")
        for values in by_key.values():
            assert [int(v.split(b":")[0]) for v in values] == sorted(int(v.split(b":")[0]) for v in values)


def test_key_placement_is_partition_for(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=4))
    keys = [f'{{"id": {i}}}'.encode() for i in range(200)] + [b"", b"a", b"\xff" * 17]
    log_store.append(topic_name, [Record(k, b"v") for k in keys])
    placed: dict[bytes, int] = {}
    for p in range(4):
        for r in read_all(log_store, topic_name, p):
            placed[r.key] = p
    assert placed == {k: partition_for(k, 4) for k in keys}
    assert set(placed.values()) == {0, 1, 2, 3}


def test_explicit_partition(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=3))
    key = b'{"id": 7}'
    natural = partition_for(key, 3)
    others = [p for p in range(3) if p != natural]
    last = log_store.append(topic_name, [Record(key, b"marker", partition=p) for p in range(3)])
    assert last == {0: 0, 1: 0, 2: 0}
    for p in [*others, natural]:
        (rec,) = log_store.read(topic_name, p, 0)
        assert (rec.key, rec.value, rec.partition) == (key, b"marker", p)


def test_read_at_end_is_empty_and_past_end_raises(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=1))
    assert log_store.read(topic_name, 0, 0) == []
    log_store.append(topic_name, [Record(b"k", str(i).encode()) for i in range(5)])
    assert log_store.end_offsets(topic_name) == {0: 5}
    assert log_store.read(topic_name, 0, 5) == []
    with pytest.raises(OffsetOutOfRangeError) as exc:
        log_store.read(topic_name, 0, 6)
    err = exc.value
    assert (err.topic, err.partition, err.offset, err.start, err.end) == (topic_name, 0, 6, 0, 5)
    assert err.fix


def test_read_from_middle_and_max_records(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=1))
    for batch in range(3):
        log_store.append(topic_name, [Record(b"k", f"{batch}.{i}".encode()) for i in range(10)])
    got = log_store.read(topic_name, 0, 7, max_records=5)
    assert [r.offset for r in got] == [7, 8, 9, 10, 11]
    assert [r.value for r in got] == [b"0.7", b"0.8", b"0.9", b"1.0", b"1.1"]
    assert [r.offset for r in log_store.read(topic_name, 0, 25)] == [25, 26, 27, 28, 29]


def test_iter_partition(log_store: LogStore, topic_name: str) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=1))
    for batch in range(5):
        log_store.append(topic_name, [Record(b"k", f"{batch}.{i}".encode()) for i in range(7)])
    assert [r.offset for r in log_store.iter_partition(topic_name, 0, batch=4)] == list(range(35))
    assert [r.offset for r in log_store.iter_partition(topic_name, 0, 10, 20, batch=3)] == list(range(10, 20))
    assert list(log_store.iter_partition(topic_name, 0, 35)) == []


def test_append_takes_the_batchs_form(log_store: LogStore, topic_name: str) -> None:
    """What the reader's batch holds a topic's records in (the compiled ``Records`` where built,
    else a list: :func:`cdc.logstore.batch.records_form`) is appended as the same records as a list,
    the usual and the unusual kind (a timestamp, headers) alike."""
    from cdc.logstore.batch import records_form

    log_store.create_topic(topic_name, TopicConfig(partitions=3))
    given = [Record(b'{"id":%d}' % i, None if i % 5 == 4 else b'{"v":"a\\"\\n"}' * i) for i in range(40)]
    given.append(Record(b'{"id":1}', b"x" * 2_000_000))
    form = records_form()
    log_store.append_many({topic_name: form(given)})
    odd = [Record(b'{"id":"odd"}', b"h", (("h", b"\x00"),), 1_700_000_000_001), Record(b'{"id":8}', b"")]
    log_store.append_many({topic_name: form(odd)})
    got = sorted(all_records(log_store, topic_name), key=lambda r: (r.partition, r.offset))
    want = given + odd
    by_partition = {p: [r for r in want if partition_for(r.key, 3) == p] for p in range(3)}
    assert [(r.key, r.value) for r in got] == [(r.key, r.value) for p in range(3) for r in by_partition[p]]
    stamped = next(r for r in got if r.key == b'{"id":"odd"}')
    assert tuple(stamped.headers) == (("h", b"\x00"),) and stamped.timestamp_ms == 1_700_000_000_001


def test_append_many_several_topics(log_store: LogStore, topic_name: str) -> None:
    a, b = topic_name + ".a", topic_name + ".b"
    log_store.create_topic(a, TopicConfig(partitions=1))
    log_store.create_topic(b, TopicConfig(partitions=1))
    result = log_store.append_many({a: [Record(b"k", b"1"), Record(b"k", b"2")], b: [Record(b"k", b"3")]})
    assert result == {a: {0: 1}, b: {0: 0}}
    assert [r.value for r in log_store.read(a, 0, 0)] == [b"1", b"2"]
    assert [r.value for r in log_store.read(b, 0, 0)] == [b"3"]


def test_second_instance_sees_appends(
    log_store: LogStore, log_store_factory: Callable[..., LogStore], topic_name: str
) -> None:
    log_store.create_topic(topic_name, TopicConfig(partitions=2))
    reader = log_store_factory()
    log_store.append(topic_name, [Record(f"k{i}".encode(), f"v{i}".encode()) for i in range(20)])
    assert reader.end_offsets(topic_name) == log_store.end_offsets(topic_name)
    assert topic_name in {t.name for t in reader.list_topics()}
    values = sorted(r.value or b"" for r in all_records(reader, topic_name))
    assert values == sorted(f"v{i}".encode() for i in range(20))
    log_store.append(topic_name, [Record(b"k0", b"again")])
    assert sum(reader.end_offsets(topic_name).values()) == 21


# -- consumer positions ---------------------------------------------------------------------------------
def test_consumer_positions(
    log_store: LogStore, log_store_factory: Callable[..., LogStore], topic_name: str
) -> None:
    other_topic = topic_name + ".other"
    log_store.create_topic(topic_name, TopicConfig(partitions=3))
    log_store.create_topic(other_topic, TopicConfig(partitions=3))
    log_store.append(topic_name, [Record(f"k{i}".encode(), b"v") for i in range(30)])
    assert log_store.committed("apply", topic_name) == {}

    log_store.commit("apply", topic_name, {0: 3, 2: 5})
    assert log_store.committed("apply", topic_name) == {0: 3, 2: 5}  # partition 1 absent, not 0
    log_store.commit("apply", topic_name, {0: 4})
    assert log_store.committed("apply", topic_name) == {0: 4, 2: 5}
    assert log_store.committed("search", topic_name) == {}
    assert log_store.committed("apply", other_topic) == {}
    log_store.commit("search", topic_name, {1: 1})
    assert log_store.committed("search", topic_name) == {1: 1}
    assert log_store.committed("apply", topic_name) == {0: 4, 2: 5}

    reader = log_store_factory()
    assert reader.committed("apply", topic_name) == {0: 4, 2: 5}


# -- compaction (embedded only: Tansu never compacts) ---------------------------------------------------
def _compaction_topic(store: LogStore, name: str, **config: int) -> None:
    store.create_topic(name, TopicConfig(partitions=2, compacted=True, **config))


def test_compaction_keeps_final_state_in_offset_order(log_store: LogStore, topic_name: str) -> None:
    embedded_only(log_store, COMPACTION_SKIP)
    _compaction_topic(log_store, topic_name, min_compaction_lag_ms=0, delete_retention_ms=3_600_000)
    expected: dict[bytes, tuple[int, int, bytes | None]] = {}  # key -> (partition, offset, value)
    for round_ in range(5):
        recs = [Record(f'{{"id": {k}}}'.encode(), f"{round_}/{k}".encode()) for k in range(40)]
        if round_ == 4:  # delete keys 0..9: tombstones
            recs = [Record(f'{{"id": {k}}}'.encode(), None) for k in range(10)]
        log_store.append(topic_name, recs)
    before = all_records(log_store, topic_name)
    for r in before:
        expected[r.key] = (r.partition, r.offset, r.value)
    ends = log_store.end_offsets(topic_name)

    removed = log_store.compact(topic_name)

    after = all_records(log_store, topic_name)
    assert removed == len(before) - len(after) == 160 + 10 - 40 - 0
    assert {r.key: (r.partition, r.offset, r.value) for r in after} == expected  # offsets unchanged
    assert len(after) == len(expected)  # one record per key
    for p in range(2):
        offsets = [r.offset for r in after if r.partition == p]
        assert offsets == sorted(offsets)
    assert sum(1 for r in after if r.value is None) == 10  # tombstones kept (retention not over)
    assert log_store.end_offsets(topic_name) == ends
    assert log_store.start_offsets(topic_name) == {0: 0, 1: 0}
    assert log_store.compact(topic_name) == 0  # nothing more to do


def test_compaction_drops_tombstones_after_delete_retention(
    log_store: LogStore, topic_name: str, advance_clock: Callable[[int], None]
) -> None:
    embedded_only(log_store, COMPACTION_SKIP)
    _compaction_topic(log_store, topic_name, min_compaction_lag_ms=0, delete_retention_ms=60_000)
    log_store.append(topic_name, [Record(b"gone", b"1"), Record(b"kept", b"1"), Record(b"gone", None)])
    log_store.compact(topic_name)
    assert {r.key: r.value for r in all_records(log_store, topic_name)} == {b"gone": None, b"kept": b"1"}
    advance_clock(30_000)  # not yet
    log_store.compact(topic_name)
    assert {r.key: r.value for r in all_records(log_store, topic_name)} == {b"gone": None, b"kept": b"1"}
    advance_clock(31_000)  # delete_retention_ms has passed
    log_store.compact(topic_name)
    assert {r.key: r.value for r in all_records(log_store, topic_name)} == {b"kept": b"1"}
    assert sum(log_store.end_offsets(topic_name).values()) == 3  # offsets never move back


def test_min_compaction_lag_protects_young_records(log_store: LogStore, topic_name: str) -> None:
    embedded_only(log_store, COMPACTION_SKIP)
    _compaction_topic(log_store, topic_name, min_compaction_lag_ms=3_600_000, delete_retention_ms=0)
    recs = [Record(b"k", str(i).encode()) for i in range(10)] + [Record(b"d", None)]
    log_store.append(topic_name, recs)
    assert log_store.compact(topic_name) == 0
    assert len(all_records(log_store, topic_name)) == 11


def test_compaction_keeps_what_a_consumer_has_not_read(
    log_store: LogStore, topic_name: str, advance_clock: Callable[[int], None]
) -> None:
    """A record at or past a consumer's committed position is never compacted away, however old: an
    event may need the one before it (an update without its unchanged TOAST columns needs the key's
    insert), and the apply job may be down for longer than ``min_compaction_lag_ms``. Found by the
    fault suite: the apply job restarted for over a minute after ``disk_full``, the insert of a key was
    compacted away under its later TOAST update, and every restart failed that batch for want of it."""
    embedded_only(log_store, COMPACTION_SKIP)
    log_store.create_topic(
        topic_name,
        TopicConfig(partitions=1, compacted=True, min_compaction_lag_ms=60_000, delete_retention_ms=60_000),
    )
    log_store.append(topic_name, [Record(b"a", b"a1"), Record(b"b", b"b1")])  # 0, 1: read
    log_store.commit("apply", topic_name, {0: 2})
    log_store.append(topic_name, [Record(b"c", b"insert"), Record(b"a", b"a2"), Record(b"d", None)])  # 2-4
    log_store.append(topic_name, [Record(b"c", b"update"), Record(b"b", b"b2")])  # 5, 6
    advance_clock(120_000)  # past min_compaction_lag_ms and delete_retention_ms

    assert log_store.compact(topic_name) == 2  # a1 and b1: read, and superseded
    kept = [(r.offset, r.value) for r in all_records(log_store, topic_name)]
    assert kept == [(2, b"insert"), (3, b"a2"), (4, None), (5, b"update"), (6, b"b2")]

    log_store.commit("apply", topic_name, {0: 5})  # the insert and the tombstone were read
    assert log_store.compact(topic_name) == 2
    assert [(r.offset, r.value) for r in all_records(log_store, topic_name)] == [
        (3, b"a2"),
        (5, b"update"),
        (6, b"b2"),
    ]


def test_a_consumer_silent_for_a_week_no_longer_holds_compaction_back(
    log_store: LogStore, topic_name: str, advance_clock: Callable[[int], None]
) -> None:
    """As Kafka forgets a group's offsets after ``offsets.retention.minutes`` (7 days), a consumer that
    has committed nothing in the topic for 7 days no longer keeps its records."""
    embedded_only(log_store, COMPACTION_SKIP)
    log_store.create_topic(
        topic_name, TopicConfig(partitions=1, compacted=True, min_compaction_lag_ms=60_000)
    )
    log_store.commit("gone", topic_name, {0: 0})
    log_store.append(topic_name, [Record(b"k", b"1"), Record(b"k", b"2")])
    advance_clock(120_000)
    assert log_store.compact(topic_name) == 0
    advance_clock(7 * 24 * 3600 * 1000)
    assert log_store.compact(topic_name) == 1
    assert [(r.offset, r.value) for r in all_records(log_store, topic_name)] == [(1, b"2")]


def test_background_compaction_while_appending_and_reading(
    log_store_factory: Callable[..., LogStore], topic_name: str
) -> None:
    """A writer appends updates of 20 keys while its background thread compacts every 20 ms and a
    reader (another instance) keeps up: the caught-up reader sees every offset (the lag protects what
    it has not read yet), compaction really removes records while appends go on, and reading from 0
    afterwards gives the final state of every key in offset order.

    The writer waits for the reader after each append, so the reader is never more than one append
    behind whatever the machine's load; the appends go on until the background thread has removed
    records (behaviour, not a duration)."""
    writer = log_store_factory(writer=True, compaction_interval_s=0.02)
    embedded_only(writer, COMPACTION_SKIP)
    assert isinstance(writer, EmbeddedLogStore)
    _compaction_topic(writer, topic_name, min_compaction_lag_ms=3_000, delete_retention_ms=0)
    reader = log_store_factory()
    stop = threading.Event()
    seen: dict[int, list[int]] = {0: [], 1: []}
    pos = {0: 0, 1: 0}
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            while not stop.is_set() or any(pos[p] < reader.end_offsets(topic_name)[p] for p in pos):
                for p in pos:
                    for r in reader.read(topic_name, p, pos[p], 500):
                        seen[p].append(r.offset)
                        pos[p] = r.offset + 1
                time.sleep(0.005)
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    thread = threading.Thread(target=follow)
    thread.start()
    last: dict[bytes, bytes] = {}
    appended = 0
    try:
        while True:
            recs = [Record(f'{{"id": {k}}}'.encode(), f"{appended}/{k}".encode()) for k in range(20)]
            ends = writer.append(topic_name, recs)
            for r in recs:
                last[r.key] = r.value or b""
            appended += len(recs)
            wait_for(
                lambda ends=ends: errors or all(pos[p] > off for p, off in ends.items()),
                timeout=120,
                what="the reader to catch up",
            )
            assert not errors, errors
            if sum(writer.record_counts(topic_name).values()) < appended - 200:
                break  # the background thread compacted while appends and reads went on
            assert appended < 1_000_000, "background compaction never ran"
            time.sleep(0.01)  # pace the appends (a few thousand updates per key at most)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not errors, errors
    ends = writer.end_offsets(topic_name)
    for p in (0, 1):
        assert seen[p] == list(range(ends[p])), f"the caught-up reader missed records of partition {p}"

    def compacted() -> bool:
        state = all_records(reader, topic_name)
        return len(state) == len(last)

    # records older than the lag get compacted by the background thread, not by this test
    wait_for(compacted, timeout=120, what="background compaction down to one record per key")
    state = all_records(reader, topic_name)
    assert {r.key: r.value for r in state} == last
    for p in (0, 1):
        offsets = [r.offset for r in state if r.partition == p]
        assert offsets == sorted(offsets)
    assert reader.end_offsets(topic_name) == ends


# -- retention (embedded only) -------------------------------------------------------------------------
def test_retention_by_size_moves_start_offset(log_store: LogStore, topic_name: str) -> None:
    # retention_bytes counts stored bytes (after compression), so the values are incompressible
    embedded_only(log_store, RETENTION_SKIP)
    log_store.create_topic(
        topic_name, TopicConfig(partitions=1, compacted=False, retention_ms=None, retention_bytes=20_000)
    )
    for _batch in range(10):
        log_store.append(topic_name, [Record(b"k", os.urandom(1000)) for _ in range(10)])
    removed = log_store.enforce_retention(topic_name)
    assert removed > 0
    start = log_store.start_offsets(topic_name)[0]
    assert start == removed  # whole batches from the oldest on
    assert log_store.end_offsets(topic_name) == {0: 100}
    with pytest.raises(OffsetOutOfRangeError) as exc:
        log_store.read(topic_name, 0, 0)
    assert (exc.value.start, exc.value.end, exc.value.offset) == (start, 100, 0)
    assert str(start) in (exc.value.fix or "")
    kept = read_all(log_store, topic_name, 0, start)
    assert [r.offset for r in kept] == list(range(start, 100))
    assert [r.offset for r in log_store.iter_partition(topic_name, 0)] == list(range(start, 100))


def test_retention_by_time(
    log_store: LogStore, topic_name: str, advance_clock: Callable[[int], None]
) -> None:
    embedded_only(log_store, RETENTION_SKIP)
    log_store.create_topic(topic_name, TopicConfig(partitions=1, compacted=False, retention_ms=60_000))
    log_store.append(topic_name, [Record(b"k", str(i).encode()) for i in range(10)])
    assert log_store.enforce_retention(topic_name) == 0  # not old enough yet
    advance_clock(30_000)
    assert log_store.enforce_retention(topic_name) == 0
    assert log_store.start_offsets(topic_name) == {0: 0}
    advance_clock(31_000)
    assert log_store.enforce_retention(topic_name) == 10
    assert log_store.start_offsets(topic_name) == {0: 10}
    assert log_store.end_offsets(topic_name) == {0: 10}
    assert log_store.read(topic_name, 0, 10) == []
    log_store.append(topic_name, [Record(b"k", b"new")])
    assert [r.offset for r in log_store.read(topic_name, 0, 10)] == [10]


def test_compacted_topic_ignores_time_retention(
    log_store: LogStore, topic_name: str, advance_clock: Callable[[int], None]
) -> None:
    embedded_only(log_store, RETENTION_SKIP)
    log_store.create_topic(topic_name, TopicConfig(partitions=1, compacted=True, retention_ms=1))
    log_store.append(topic_name, [Record(b"k", b"v")])
    advance_clock(60_000)  # retention_ms has passed: the assertion is that nothing happens
    assert log_store.enforce_retention(topic_name) == 0
    assert len(log_store.read(topic_name, 0, 0)) == 1
