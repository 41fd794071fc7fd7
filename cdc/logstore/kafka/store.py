"""The Kafka log store (:class:`KafkaLogStore`); its guarantees are in :mod:`cdc.logstore.kafka`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NoReturn

import kafka.errors as kerr
from kafka import (
    KafkaAdminClient,
    KafkaConsumer,
    KafkaProducer,
    OffsetAndMetadata,
    OffsetSpec,
    TopicPartition,
)
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic

from cdc.errors import (
    BrokerUnavailableError,
    LogStoreError,
    OffsetOutOfRangeError,
    TopicExistsError,
    UnknownTopicError,
)
from cdc.logstore import LogStore, Record, StoredRecord, TopicConfig, TopicInfo
from cdc.logstore.kafka.options import KafkaOptions
from cdc.logstore.kafka.producer import BulkProducer, ProducerStateError, TopicRefusedError
from cdc.logstore.kafka.topic_config import config_from_kafka, config_to_kafka
from cdc.logstore.partition_arrays import partitions_for

__all__ = ["DEFAULT_PRODUCER_CONFIG", "KafkaLogStore"]

#: Settings of the ``producer="kafka-python"`` path (a plain ``KafkaProducer``), unless overridden
#: by ``producer_config=``; acks=all and idempotence are not overridable. Large batches and a short
#: linger let it fill whole batches; see bench/logstore_kafka.py for what each path reaches.
DEFAULT_PRODUCER_CONFIG: dict[str, Any] = {
    "linger_ms": 5,
    "batch_size": 1024 * 1024,
    "max_request_size": 8 * 1024 * 1024,
    "compression_type": None,
    "max_in_flight_requests_per_connection": 5,
}

#: Largest record batch the bulk producer builds: below Apache Kafka's default max.message.bytes
#: (1 MiB + 12); a single larger record still goes alone in its own batch.
BATCH_BYTES = 1_000_000

_UNAVAILABLE: tuple[type[BaseException], ...] = tuple(
    cls
    for cls in (
        getattr(kerr, "NoBrokersAvailable", None),
        kerr.KafkaConnectionError,
        kerr.KafkaTimeoutError,
        kerr.RequestTimedOutError,
        kerr.NodeNotReadyError,
        kerr.BrokerNotAvailableError,
    )
    if isinstance(cls, type)
)

_FIX_UNAVAILABLE = (
    "start the Kafka broker or point CDC_LOG at a running one (kafka://HOST:PORT); check that the "
    "address is right and that the broker's advertised listeners are reachable from this host"
)


class KafkaLogStore(LogStore):
    """The log store on a Kafka-protocol broker. See the module docstring for the guarantees.

    ``bootstrap`` is ``HOST:PORT[,HOST:PORT...]``. ``writer`` is accepted for symmetry with the
    embedded backend (which takes a single-writer lock); Kafka admits any number of writers, so
    here it only creates the producer eagerly instead of on the first append. Connecting fails
    with :class:`~cdc.errors.BrokerUnavailableError` after ``connect_timeout_ms``.
    """

    backend = "kafka"

    def __init__(
        self,
        bootstrap: str,
        *,
        writer: bool = False,
        options: KafkaOptions | None = None,
        client_id: str = "cdc",
        request_timeout_ms: int | None = None,
        connect_timeout_ms: int = 10_000,
        retry_max_s: float | None = None,
        replication_factor: int = -1,
        producer: str = "bulk",
        compression: str | None = "lz4",
        producer_config: Mapping[str, Any] | None = None,
        compaction_interval_s: float | None = None,
    ) -> None:
        """``producer``: ``"bulk"`` (default) writes whole record batches through
        :class:`~cdc.logstore.kafka.producer.BulkProducer`; ``"kafka-python"`` uses
        ``KafkaProducer.send()`` per record with :data:`DEFAULT_PRODUCER_CONFIG` updated by
        ``producer_config``. Both are idempotent with acks=all. ``compression`` of the record
        batches: ``"lz4"`` (default: it costs the client less than it saves, and the broker stores
        and serves fewer bytes), None, ``"gzip"``, ``"snappy"`` or ``"zstd"`` (snappy and zstd need
        their Python package installed). ``compaction_interval_s`` is accepted for symmetry with
        the embedded backend and ignored: the broker compacts on its own schedule.

        ``options``: security (TLS, SASL) and retry settings, the ``[kafka]`` section
        (:class:`~cdc.logstore.kafka.options.KafkaOptions`; default: plaintext, no authentication).
        ``request_timeout_ms`` and ``retry_max_s``, when given, override the options' values."""
        if producer not in ("bulk", "kafka-python"):
            raise ValueError(f"producer must be 'bulk' or 'kafka-python', not {producer!r}")
        self.producer_kind = producer
        self.compression = compression
        self.bootstrap = bootstrap
        self.client_id = client_id
        self.options = options if options is not None else KafkaOptions()
        if request_timeout_ms is None:
            request_timeout_ms = self.options.request_timeout_ms
        self.request_timeout_ms = request_timeout_ms
        self.retry_max_s = self.options.retry_max_s if retry_max_s is None else retry_max_s
        self.connect_timeout_ms = connect_timeout_ms
        self.replication_factor = replication_factor
        self.producer_config = {
            **DEFAULT_PRODUCER_CONFIG,
            "compression_type": compression,
            **(producer_config or {}),
        }
        self._producer: Any = None
        self._consumer: Any = None
        self._partitions: dict[str, int] = {}
        self._leaders: dict[str, dict[int, int]] = {}
        #: (partition, offset) the read consumer stands at after the last read(), if it is intact
        self._cursor: tuple[TopicPartition, int] | None = None
        self._closed = False
        self._common: dict[str, Any] = {
            **self.options.client_config(),
            "bootstrap_servers": bootstrap.split(","),
            "client_id": client_id,
            "request_timeout_ms": request_timeout_ms,
            "bootstrap_timeout_ms": connect_timeout_ms,
            "reconnect_backoff_max_ms": 1000,
        }
        with self._broker("connect"):
            self._admin: Any = KafkaAdminClient(**self._common)
        if writer:
            try:
                self._get_producer()
            except BaseException:
                self.close()
                raise

    # -- helpers -------------------------------------------------------------------------------------
    def _unavailable(self, what: str, exc: BaseException) -> BrokerUnavailableError:
        return BrokerUnavailableError(
            f"the Kafka broker at {self.bootstrap} is unavailable ({what}: {type(exc).__name__}: {exc})",
            fix=_FIX_UNAVAILABLE,
            bootstrap=self.bootstrap,
        )

    @contextlib.contextmanager
    def _broker(self, what: str, topic: str | None = None) -> Iterator[None]:
        """Map kafka-python's connection/timeout errors to BrokerUnavailableError and an unknown
        topic to UnknownTopicError; anything else is unexpected and propagates unchanged."""
        if self._closed:
            raise LogStoreError("the Kafka log store is closed", fix="open a new KafkaLogStore")
        try:
            yield
        except kerr.UnknownTopicOrPartitionError as exc:
            if topic is None:
                raise
            self._partitions.pop(topic, None)
            raise self._unknown(topic) from exc
        except _UNAVAILABLE as exc:
            raise self._unavailable(what, exc) from exc

    @staticmethod
    def _unknown(topic: str) -> UnknownTopicError:
        return UnknownTopicError(
            f"topic {topic!r} does not exist",
            fix="create it first (cdc tables add creates a table's topic), or check the name with `cdc topic list`",
            topic=topic,
        )

    def _describe(self, topics: list[str] | None) -> list[dict[str, Any]]:
        """Metadata of the named topics (all non-internal topics for None); UnknownTopicError for
        a named topic that does not exist. Refreshes the partition-count cache."""
        with self._broker("describe topics"):
            described: list[dict[str, Any]] = self._admin.describe_topics(topics)
        out = []
        for t in described:
            if t["error_code"] == kerr.UnknownTopicOrPartitionError.errno:
                self._partitions.pop(t["name"], None)
                raise self._unknown(t["name"])
            if t["error_code"]:
                raise LogStoreError(
                    f"describing topic {t['name']!r} failed: {kerr.for_code(t['error_code']).__name__}",
                    topic=t["name"],
                )
            if t.get("is_internal") or t["name"].startswith("__"):
                continue
            self._partitions[t["name"]] = len(t["partitions"])
            self._leaders[t["name"]] = {p["partition_index"]: p["leader_id"] for p in t["partitions"]}
            out.append(t)
        return out

    def _partition_count(self, topic: str) -> int:
        n = self._partitions.get(topic)
        if n is None:
            self._describe([topic])
            n = self._partitions[topic]
        return n

    def _check_partition(self, topic: str, partition: int) -> None:
        n = self._partition_count(topic)
        if not 0 <= partition < n:
            raise LogStoreError(
                f"topic {topic!r} has {n} partitions (0..{n - 1}); partition {partition} does not exist",
                fix="use a partition number below the topic's partition count",
                topic=topic,
                partition=partition,
            )

    def _configs(self, topics: list[str]) -> dict[str, TopicConfig]:
        if not topics:
            return {}
        resources = [ConfigResource(ConfigResourceType.TOPIC, name) for name in topics]
        with self._broker("describe configs"):
            described = self._admin.describe_configs(resources, config_filter="all")
        per_topic: dict[str, dict[str, Any]] = described.get("topic", {})
        return {name: config_from_kafka(per_topic.get(name, {}), self._partitions[name]) for name in topics}

    def _get_producer(self) -> Any:
        if self._producer is None:
            with self._broker("connect the producer"):
                if self.producer_kind == "bulk":
                    self._producer = BulkProducer(
                        self._common,
                        request_timeout_ms=self.request_timeout_ms,
                        connect_timeout_ms=self.connect_timeout_ms,
                        batch_bytes=BATCH_BYTES,
                        max_request_bytes=8 * BATCH_BYTES,
                        max_in_flight=4,
                        compression=self.compression,
                        retry_max_s=self.retry_max_s,
                    )
                else:
                    cfg = dict(self.producer_config)
                    linger = int(cfg.get("linger_ms") or 0)
                    self._producer = KafkaProducer(
                        **self._common,
                        **cfg,
                        acks="all",
                        enable_idempotence=True,
                        allow_auto_create_topics=False,
                        max_block_ms=self.request_timeout_ms,
                        # kafka-python retries transient errors itself (idempotent) until then
                        delivery_timeout_ms=self.request_timeout_ms
                        + linger
                        + 1000
                        + int(self.retry_max_s * 1000),
                    )
        return self._producer

    def _get_consumer(self) -> Any:
        if self._consumer is None:
            with self._broker("connect the consumer"):
                self._consumer = KafkaConsumer(
                    **self._common,
                    group_id=None,
                    enable_auto_commit=False,
                    auto_offset_reset="none",
                    allow_auto_create_topics=False,
                    fetch_max_wait_ms=100,
                    max_partition_fetch_bytes=4 * 1024 * 1024,
                )
        return self._consumer

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                if isinstance(producer, BulkProducer):
                    producer.close()
                else:
                    producer.close(timeout=0)

    # -- topics --------------------------------------------------------------------------------------
    def create_topic(self, name: str, config: TopicConfig) -> TopicInfo:
        """Create ``name`` with ``config`` as topic configs (see the module docstring). If it exists
        with the same partition count it is returned unchanged (its configs are not altered);
        TopicExistsError if it exists with another partition count."""
        new = NewTopic(
            name,
            config.partitions,
            self.replication_factor,
            topic_configs=config_to_kafka(config),
        )
        try:
            with self._broker("create topic", name):
                self._admin.create_topics([new], timeout_ms=self.request_timeout_ms)
        except kerr.TopicAlreadyExistsError:
            self._partitions.pop(name, None)
            existing = self._partition_count(name)
            if existing != config.partitions:
                raise TopicExistsError(
                    f"topic {name!r} exists with {existing} partitions, not {config.partitions}",
                    fix="use the existing partition count, or delete the topic first (this loses its records)",
                    topic=name,
                    partitions=existing,
                ) from None
            return self.topic(name)
        except kerr.InvalidTopicError as exc:
            raise LogStoreError(
                f"the broker refused the topic name {name!r}: {exc}",
                fix="use at most 249 characters from [A-Za-z0-9._-]",
                topic=name,
            ) from exc
        self._wait_visible(name, config.partitions)
        return self.topic(name)

    def _wait_visible(self, name: str, partitions: int) -> None:
        """CreateTopics may answer before metadata shows the topic with leaders; wait for it."""
        deadline = time.monotonic() + self.request_timeout_ms / 1000
        while True:
            with contextlib.suppress(UnknownTopicError):
                [t] = self._describe([name])
                parts = t["partitions"]
                if len(parts) == partitions and all(p["leader_id"] >= 0 for p in parts):
                    return
            if time.monotonic() > deadline:
                raise LogStoreError(
                    f"topic {name!r} was created but its partitions have no leader after "
                    f"{self.request_timeout_ms} ms",
                    fix="check the broker's health and logs",
                    topic=name,
                )
            time.sleep(0.05)

    def delete_topic(self, name: str) -> None:
        """Delete the topic with its records; the broker drops the consumer positions on it."""
        with self._broker("delete topic", name):
            self._admin.delete_topics([name], timeout_ms=self.request_timeout_ms)
        self._partitions.pop(name, None)
        self._cursor = None

    def list_topics(self) -> list[TopicInfo]:
        described = self._describe(None)
        names = sorted(t["name"] for t in described)
        return self._infos(names)

    def topic(self, name: str) -> TopicInfo:
        self._describe([name])
        return self._infos([name])[0]

    def _infos(self, names: list[str]) -> list[TopicInfo]:
        configs = self._configs(names)
        tps = [TopicPartition(n, p) for n in names for p in range(self._partitions[n])]
        starts, ends = self._bounds(tps)
        return [
            TopicInfo(
                name=n,
                config=configs[n],
                start_offsets={p: starts[TopicPartition(n, p)] for p in range(self._partitions[n])},
                end_offsets={p: ends[TopicPartition(n, p)] for p in range(self._partitions[n])},
            )
            for n in names
        ]

    # -- writing -------------------------------------------------------------------------------------
    def append_many(self, batch: Mapping[str, Sequence[Record]]) -> dict[str, dict[int, int]]:
        """Append, and return only when the broker acknowledged every record (acks=all, idempotent
        producer). Returns the highest offset written per partition, per topic (a topic given no
        records maps to ``{}``). Every record gets an explicit partition: ``Record.partition`` or
        :func:`partition_for` of its key. Records of one partition keep their order.

        On failure raises (BrokerUnavailableError when the broker cannot be reached within
        ``request_timeout_ms``; UnknownTopicError for a missing topic, checked before anything is
        sent -- the partition count is then cached, so a topic another client deletes later is
        reported by the broker's answer, or re-created by a broker that creates topics on first
        use, as Tansu does) and starts a new producer next time; any subset of the batch may have been written,
        nothing acknowledged is ever lost (at least once). A producer id the broker forgot
        (expired after a long idle time) is renewed and the whole batch sent once more.
        """
        counts = {topic: self._partition_count(topic) for topic in batch}
        grouped: dict[TopicPartition, list[Record]] = {}
        for topic, records in batch.items():
            n = counts[topic]
            placed = partitions_for([r.key for r in records], n)
            tps = [TopicPartition(topic, p) for p in range(n)]
            for rec, hashed in zip(records, placed, strict=True):
                part = hashed if rec.partition is None else rec.partition
                if not 0 <= part < n:
                    self._check_partition(topic, part)
                group = grouped.get(tps[part])
                if group is None:
                    group = grouped[tps[part]] = []
                group.append(rec)
        result: dict[str, dict[int, int]] = {topic: {} for topic in batch}
        if not grouped:
            return result
        try:
            with self._broker("append"):
                if self.producer_kind == "bulk":
                    last = self._append_bulk(grouped)
                else:
                    last = self._append_kafka_python(grouped)
        except BaseException:
            self._drop_producer()
            for topic in batch:
                self._partitions.pop(topic, None)
            raise
        for tp, offset in last.items():
            result[tp.topic][tp.partition] = offset
        return result

    def _append_bulk(self, grouped: Mapping[TopicPartition, list[Record]]) -> dict[TopicPartition, int]:
        topics = sorted({tp.topic for tp in grouped})

        def leaders(refresh: bool) -> dict[TopicPartition, int]:
            if refresh:  # after a failure: the leader may have moved
                self._describe(topics)
            return {tp: self._leaders[tp.topic][tp.partition] for tp in grouped}

        producer: BulkProducer = self._get_producer()
        try:
            try:
                last = producer.produce(grouped, leaders)
            except ProducerStateError:
                last = producer.produce(grouped, leaders)
        except TopicRefusedError as exc:  # deleted since this store looked it up
            raise self._unknown(exc.topic) from None
        unknown = [tp for tp, offset in last.items() if offset is None]
        ends = self._bounds(unknown)[1] if unknown else {}
        # a last batch the broker answered as a duplicate (written before a dropped connection):
        # its last offset is the partition's end - 1 (one writer per topic)
        return {tp: ends[tp] - 1 if offset is None else offset for tp, offset in last.items()}

    def _append_kafka_python(
        self, grouped: Mapping[TopicPartition, list[Record]]
    ) -> dict[TopicPartition, int]:
        producer = self._get_producer()
        send = producer.send
        futures = [
            send(
                tp.topic,
                value=rec.value,
                key=rec.key,
                headers=list(rec.headers),
                partition=tp.partition,
                timestamp_ms=rec.timestamp_ms,
            )
            for tp, records in grouped.items()
            for rec in records
        ]
        producer.flush(timeout=(self.request_timeout_ms + 2000) / 1000)
        last: dict[TopicPartition, int] = {}
        for fut in futures:
            meta = fut.get(timeout=0)
            tp = TopicPartition(meta.topic, meta.partition)
            if meta.offset > last.get(tp, -1):
                last[tp] = meta.offset
        return last

    # -- reading -------------------------------------------------------------------------------------
    def read(
        self, topic: str, partition: int, from_offset: int, max_records: int = LogStore.READ_MAX
    ) -> list[StoredRecord]:
        """Records of one partition with ``offset >= from_offset`` in offset order: ``max_records``
        of them, or every record up to (at least) the end offset as of the call if fewer. Empty
        at the end offset; OffsetOutOfRangeError (with ``start`` and ``end``) before the start
        offset or past the end; UnknownTopicError; BrokerUnavailableError when no records arrive
        within ``request_timeout_ms`` although the partition has some."""
        if max_records <= 0:
            return []
        self._check_partition(topic, partition)
        tp = TopicPartition(topic, partition)
        starts, reported = self._list_offsets([tp])
        start, end_lb = starts[tp], reported[tp]
        end: int | None = None
        if from_offset < start or from_offset >= end_lb:
            # At or past the reported end: find the true end (see end_offsets).
            end = self._true_ends([tp], starts, reported)[tp]
            if from_offset < start or from_offset > end:
                self._out_of_range(topic, partition, from_offset, start, end)
            if from_offset == end:
                return []
        consumer = self._get_consumer()
        out: list[StoredRecord] = []
        deadline = time.monotonic() + self.request_timeout_ms / 1000
        with self._broker("read", topic):
            positioned, self._cursor = self._cursor == (tp, from_offset), None
            if not positioned:
                # When positioned, the consumer stands where the previous read stopped, with what
                # it already fetched beyond that: sequential reads keep its fetch pipeline.
                consumer.assign([tp])
                consumer.seek(tp, from_offset)
            # Stop at the highwater of a fetch that reached ListOffsets' answer (``end_lb``): a
            # highwater seen earlier may predate appends (records the consumer fetched in advance).
            target = max(end_lb, end or 0)
            highwater: int | None = None
            while len(out) < max_records:
                if highwater is not None and consumer.position(tp) >= max(highwater, target):
                    break
                if time.monotonic() > deadline:
                    raise kerr.KafkaTimeoutError(
                        f"no records from {topic}[{partition}] at offset {from_offset} "
                        f"within {self.request_timeout_ms} ms although the partition has some"
                    )
                try:
                    got = consumer.poll(timeout_ms=200, max_records=max_records - len(out))
                except kerr.OffsetOutOfRangeError:
                    s, e = self._list_offsets([tp])
                    true_end = self._true_ends([tp], s, e)[tp]
                    self._out_of_range(topic, partition, from_offset, s[tp], true_end)
                recs = got.get(tp, ())
                if not recs:
                    continue
                highwater = consumer.highwater(tp)
                for r in recs:
                    if r.offset >= from_offset:
                        out.append(_stored(r))
            self._cursor = (tp, consumer.position(tp)) if len(out) <= max_records else None
        return out[:max_records]

    def _out_of_range(self, topic: str, partition: int, offset: int, start: int, end: int) -> NoReturn:
        raise OffsetOutOfRangeError(
            f"offset {offset} is outside {topic}[{partition}]'s range [{start}, {end}]",
            fix="read from an offset between the start and the end offset (`cdc topic list` shows them); "
            "a position before the start was removed by retention: restart from the start offset",
            topic=topic,
            partition=partition,
            offset=offset,
            start=start,
            end=end,
        )

    def _list_offsets(
        self, tps: list[TopicPartition]
    ) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
        """(earliest, latest) per partition as the broker reports them through ListOffsets."""
        if not tps:
            return {}, {}
        timeout = self.request_timeout_ms
        topic = tps[0].topic if len({tp.topic for tp in tps}) == 1 else None
        with self._broker("list offsets", topic):
            earliest = self._admin.list_partition_offsets(
                dict.fromkeys(tps, OffsetSpec.EARLIEST), timeout_ms=timeout
            )
            latest = self._admin.list_partition_offsets(
                dict.fromkeys(tps, OffsetSpec.LATEST), timeout_ms=timeout
            )
        return {tp: int(earliest[tp].offset) for tp in tps}, {tp: int(latest[tp].offset) for tp in tps}

    def _bounds(
        self, tps: list[TopicPartition]
    ) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
        starts, reported = self._list_offsets(tps)
        return starts, self._true_ends(tps, starts, reported)

    def _true_ends(
        self,
        tps: list[TopicPartition],
        starts: Mapping[TopicPartition, int],
        reported: Mapping[TopicPartition, int],
    ) -> dict[TopicPartition, int]:
        """The true end offset per partition: the highwater of a fetch from ``reported - 1``.

        ListOffsets LATEST is a lower bound of the end (exact on Apache Kafka; Tansu answers the
        last batch's base offset + 1). A fetch from ``reported - 1`` returns at least the record
        there (the last record on a correct broker, the last batch on Tansu) together with the
        partition's highwater, which is the end. An empty partition (reported == start) needs no
        fetch. If a partition returns nothing within ``request_timeout_ms`` (no record at
        ``reported - 1``, e.g. a transaction marker), the reported value is kept.
        """
        ends = {tp: reported[tp] for tp in tps}
        probe = {tp: reported[tp] - 1 for tp in tps if reported[tp] > starts[tp]}
        if not probe:
            return ends
        consumer = self._get_consumer()
        deadline = time.monotonic() + self.request_timeout_ms / 1000
        pending = set(probe)
        self._cursor = None
        with self._broker("find end offsets", tps[0].topic if len({t.topic for t in tps}) == 1 else None):
            consumer.assign(list(probe))
            for tp, offset in probe.items():
                consumer.seek(tp, offset)
            while pending and time.monotonic() < deadline:
                got = consumer.poll(timeout_ms=200, max_records=100_000)
                for tp, recs in got.items():
                    if tp in pending and recs:
                        highwater = consumer.highwater(tp)
                        ends[tp] = max(
                            ends[tp], recs[-1].offset + 1, highwater if highwater is not None else 0
                        )
                        pending.discard(tp)
                        consumer.pause(tp)
            consumer.assign([])
        return ends

    def start_offsets(self, topic: str) -> dict[int, int]:
        tps = [TopicPartition(topic, p) for p in range(self._partition_count(topic))]
        starts, _ = self._list_offsets(tps)
        return {tp.partition: off for tp, off in starts.items()}

    def end_offsets(self, topic: str) -> dict[int, int]:
        """The offset the next record will get, per partition: exact even on brokers whose
        ListOffsets reports less (see :meth:`_true_ends`)."""
        tps = [TopicPartition(topic, p) for p in range(self._partition_count(topic))]
        _, ends = self._bounds(tps)
        return {tp.partition: off for tp, off in ends.items()}

    # -- consumer positions --------------------------------------------------------------------------
    def commit(self, consumer: str, topic: str, offsets: Mapping[int, int]) -> None:
        """OffsetCommit for group ``consumer`` without joining it (generation -1, no member id).
        Returns once the broker acknowledged every partition; raises otherwise."""
        if not offsets:
            return
        for partition in offsets:
            self._check_partition(topic, partition)
        request = {
            TopicPartition(topic, p): OffsetAndMetadata(int(off), "", -1) for p, off in offsets.items()
        }
        with self._broker("commit offsets", topic):
            result = self._admin.alter_group_offsets(consumer, request)
        failed = {tp.partition: err.__name__ for tp, err in result.items() if err is not kerr.NoError}
        if failed:
            raise LogStoreError(
                f"committing {consumer!r}'s positions in {topic!r} failed: {failed}",
                fix="make sure no other client uses this name as a Kafka consumer group with group membership",
                consumer=consumer,
                topic=topic,
                errors=failed,
            )

    def committed(self, consumer: str, topic: str) -> dict[int, int]:
        self._partition_count(topic)
        with self._broker("fetch committed offsets", topic):
            groups = self._admin.list_group_offsets({consumer: None})
        positions = groups.get(consumer, {})
        return {
            tp.partition: int(om.offset)
            for tp, om in positions.items()
            if tp.topic == topic and om is not None and om.offset is not None and om.offset >= 0
        }

    # -- maintenance ---------------------------------------------------------------------------------
    def compact(self, topic: str) -> int:
        """The broker compacts on its own (``cleanup.policy=compact``); returns 0. Tansu never
        compacts: on Tansu every record of a compacted topic stays readable."""
        return 0

    def enforce_retention(self, topic: str) -> int:
        """The broker applies ``retention.ms``/``retention.bytes`` on its own; returns 0. Tansu
        never deletes by retention."""
        return 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        producer, consumer, admin = self._producer, self._consumer, self._admin
        self._producer = self._consumer = None
        if isinstance(producer, BulkProducer):
            producer.close()
        elif producer is not None:
            with contextlib.suppress(Exception):
                producer.close(timeout=self.request_timeout_ms / 1000)
        for client in (consumer, admin):
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close()


def _stored(r: Any) -> StoredRecord:
    return StoredRecord(
        topic=r.topic,
        partition=r.partition,
        offset=r.offset,
        key=r.key if r.key is not None else b"",
        value=r.value,
        headers=tuple((k, b"" if v is None else v) for k, v in r.headers) if r.headers else (),
        timestamp_ms=r.timestamp,
    )
