"""The Kafka backend's bulk idempotent producer (:class:`BulkProducer`).

It writes whole Kafka v2 record batches (KIP-98: producer id, epoch and per-partition sequence
numbers) with acks=all as pipelined ProduceRequests, and retries transient errors without
reordering or duplicating a partition's records. Only :class:`~cdc.logstore.kafka.KafkaLogStore`
uses it (``producer="bulk"``, the default): the store places the records, looks up the partition
leaders, maps connection errors and gives the log store's guarantees.

kafka-python internals it relies on (not kafka-python's public API; pinned by
``tests/logstore/test_kafka_internals.py``, which imports exactly these and checks their signatures):
``kafka.net.compat.KafkaNetClient`` (``check_version``, ``least_loaded_node``, ``await_ready``,
``send``, ``send_and_receive``, ``poll``, ``close``), ``kafka.protocol.producer.ProduceRequest``
(with ``TopicProduceData`` and ``PartitionProduceData``) and ``InitProducerIdRequest``,
``kafka.codec`` (``has_*`` and ``*_encode``), ``kafka.record.default_records.DefaultRecordBatchBuilder``
(its ``CODEC_*`` constants) and ``kafka.record.util.calc_crc32c`` (the last two in
:mod:`~cdc.logstore.kafka.record_batch`). The benchmark keeping it (against ``confluent-kafka``):
``docs/benchmarks/logstore_kafka.md``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import kafka.codec as kcodec
import kafka.errors as kerr
from kafka import TopicPartition
from kafka.net.compat import KafkaNetClient
from kafka.protocol.producer import InitProducerIdRequest, ProduceRequest

from cdc.errors import BrokerUnavailableError, LogStoreError
from cdc.logstore import Record
from cdc.logstore.kafka.record_batch import CODECS, encode_batch

__all__ = ["BulkProducer", "ProducerStateError", "TopicRefusedError", "is_transient"]

log = logging.getLogger(__name__)

#: first pause before a retry; doubled after each failed attempt up to RETRY_BACKOFF_MAX_S
RETRY_BACKOFF_S = 0.1
RETRY_BACKOFF_MAX_S = 2.0

#: errors after which the producer id / sequence state is no longer usable: start a new producer id.
_PRODUCER_STATE_ERRORS: frozenset[int] = frozenset(
    int(getattr(kerr, name).errno)
    for name in (
        "UnknownProducerIdError",
        "OutOfOrderSequenceNumberError",
        "InvalidProducerEpochError",
        "ProducerFencedError",
    )
    if hasattr(kerr, name)
)


#: produce error codes that are not transient here although Kafka calls them retriable:
#: UNKNOWN_TOPIC_OR_PARTITION means the topic was deleted (TopicRefusedError)
_NOT_TRANSIENT: frozenset[int] = frozenset({int(kerr.UnknownTopicOrPartitionError.errno)})


def is_transient(error: BaseException | type[BaseException]) -> bool:
    """A failure that may go away by itself: a dropped connection, a timeout, a leader change, a
    broker that is not ready (kafka-python's ``retriable`` errors, but not an unknown topic)."""
    cls = error if isinstance(error, type) else type(error)
    if not issubclass(cls, kerr.KafkaError):
        return False
    if getattr(cls, "errno", None) in _NOT_TRANSIENT:
        return False
    return bool(getattr(cls, "retriable", False)) or issubclass(
        cls, kerr.KafkaConnectionError | kerr.KafkaTimeoutError | kerr.NodeNotReadyError
    )


class _Transient(Exception):
    """An attempt failed with a transient error (carried as the cause); retry from the last ack."""


@dataclass(slots=True)
class _Partition:
    """One partition's records during a produce() call: the batches encoded so far (kept until
    acknowledged, to be sent again unchanged after a transient failure) and how far each got."""

    records: Sequence[Record]
    encoded: int = 0  # records encoded into batches
    batches: list[tuple[bytes, int]] = field(default_factory=list)  # (bytes, record count)
    acked: int = 0  # batches the broker acknowledged
    sent: int = 0  # batches sent in the current attempt
    sent_before: int = 0  # batches sent in an earlier attempt (a duplicate answer means written)
    last: int | None = None  # last offset acknowledged (None: only known as the partition's end)


class ProducerStateError(LogStoreError):
    """The broker no longer knows this producer id's sequence (expired or fenced); a new producer
    id fixes it. Raised internally, and retried once by
    :meth:`~cdc.logstore.kafka.KafkaLogStore.append_many`."""


class TopicRefusedError(LogStoreError):
    """The broker does not know ``topic`` (UNKNOWN_TOPIC_OR_PARTITION: deleted since the caller
    looked it up). Raised internally; :class:`~cdc.logstore.kafka.KafkaLogStore` raises
    :class:`~cdc.errors.UnknownTopicError` for it."""

    topic: str

    def __init__(self, topic: str) -> None:
        super().__init__(f"the broker does not know topic {topic!r}", topic=topic)


class BulkProducer:
    """An idempotent producer (KIP-98 producer id + epoch + per-partition sequence numbers) that
    writes whole record batches with acks=all, retrying transient errors.

    The records of an append are already known, so each partition's records are encoded straight
    into v2 record batches and sent as ProduceRequests, up to ``max_in_flight`` requests per broker
    in flight (``KafkaProducer.send()`` costs a future, an accumulator lookup and a lock per record
    instead). One request carries at most one batch per partition (the broker's rule for idempotent
    batches); a partition's batches go out in sequence order on one connection, so the broker
    appends them in order and rejects a gap (OUT_OF_ORDER_SEQUENCE) or a duplicate.

    Retries: a transient failure (:func:`is_transient`: dropped connection, request timeout, leader
    change, not enough replicas) closes the connections, waits (0.1 s doubling up to 2 s), looks the
    leaders up again and sends every batch not yet acknowledged once more, *unchanged* (same
    producer id, epoch and sequence numbers), in order, for up to ``retry_max_s`` from the first
    failure; each retry is logged. The broker appends a batch it has not seen and answers
    DUPLICATE_SEQUENCE_NUMBER (or success with the original offset) for one it already has, so a
    partition's records are neither lost, reordered nor duplicated. Anything else, or a transient
    failure that outlasts ``retry_max_s``, fails the call and discards the producer id (the next call
    starts a fresh one with sequence 0; the caller's retry of the whole batch is then at least once).
    """

    def __init__(
        self,
        client_config: Mapping[str, Any],
        *,
        request_timeout_ms: int,
        connect_timeout_ms: int,
        batch_bytes: int,
        max_request_bytes: int,
        max_in_flight: int,
        compression: str | None,
        retry_max_s: float = 0.0,
    ) -> None:
        if compression not in CODECS:
            raise LogStoreError(
                f"unknown compression {compression!r}",
                fix="use one of none, gzip, snappy, lz4, zstd",
                compression=compression,
            )
        available = {
            "gzip": kcodec.has_gzip,
            "snappy": kcodec.has_snappy,
            "lz4": kcodec.has_lz4,
            "zstd": kcodec.has_zstd,
        }
        if compression in available and not available[compression]():
            package = {"snappy": "python-snappy", "zstd": "zstandard"}.get(compression, compression)
            raise LogStoreError(
                f"compression {compression!r} needs a Python package that is not installed",
                fix=f"pip install {package}, or use another compression (none, gzip)",
                compression=compression,
            )
        self.request_timeout_ms = request_timeout_ms
        self.retry_max_s = retry_max_s
        #: retries done by this producer (all calls), and batches resent after a failure that the
        #: broker already had (answered as duplicates): for tests and logs
        self.retries = 0
        self.duplicates = 0
        self._nodes: set[int] = set()  # the brokers of the current produce() attempt
        self.batch_bytes = batch_bytes
        self.max_request_bytes = max_request_bytes
        self.max_in_flight = max(1, max_in_flight)
        self.codec = CODECS[compression]
        self.compression = compression
        #: acks=all: the leader answers once every in-sync replica has the batch.
        self.acks = -1
        self.producer_id = -1
        self.producer_epoch = -1
        self._sequence: dict[TopicPartition, int] = {}
        self._client: Any = KafkaNetClient(
            **client_config, max_in_flight_requests_per_connection=self.max_in_flight + 1
        )
        self._client.check_version(timeout_ms=connect_timeout_ms)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()

    def reset(self) -> None:
        """Forget the producer id: the next produce() asks for a new one (sequences restart at 0)."""
        self.producer_id = self.producer_epoch = -1
        self._sequence.clear()

    def _ready(self, node: int) -> None:
        self._client.await_ready(node, timeout_ms=self.request_timeout_ms)

    def _init_producer_id(self) -> None:
        node = self._client.least_loaded_node(bootstrap_fallback=True)
        self._ready(node)
        request = InitProducerIdRequest(
            transactional_id=None,
            transaction_timeout_ms=60_000,
            producer_id=-1,
            producer_epoch=-1,
        )
        response = self._client.send_and_receive(node, request, timeout_ms=self.request_timeout_ms)
        if response.error_code:
            raise kerr.for_code(response.error_code)(f"InitProducerId failed on node {node}")
        self.producer_id, self.producer_epoch = response.producer_id, response.producer_epoch
        self._sequence.clear()

    def produce(
        self,
        records: Mapping[TopicPartition, Sequence[Record]],
        leaders: Callable[[bool], Mapping[TopicPartition, int]],
    ) -> dict[TopicPartition, int | None]:
        """Write every record, in order per partition; return the last offset per partition (None
        where the broker answered the last batch as a duplicate of one it already had: the caller
        takes the partition's end offset). ``leaders(refresh)`` gives each partition's leader
        (``refresh`` after a failure: look them up again). Returns only when the broker acknowledged
        every batch (acks=all); raises otherwise (see the class docstring for the retries)."""
        parts = {tp: _Partition(recs) for tp, recs in records.items() if recs}
        deadline: float | None = None
        backoff = RETRY_BACKOFF_S
        attempt = 0
        try:
            while True:
                try:
                    if self.producer_id < 0:
                        self._init_producer_id()
                    self._attempt(parts, leaders(attempt > 0))
                    return {tp: part.last for tp, part in parts.items()}
                except (_Transient, kerr.KafkaError, BrokerUnavailableError) as exc:
                    cause = exc.__cause__ if isinstance(exc, _Transient) and exc.__cause__ else exc
                    if not (isinstance(exc, _Transient | BrokerUnavailableError) or is_transient(exc)):
                        raise
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + self.retry_max_s
                    if now + backoff > deadline:
                        raise self._gave_up(cause) from None
                    attempt += 1
                    self.retries += 1
                    log.warning(
                        "Kafka produce failed (%s: %s); retry %d in %.1f s, giving up %.0f s after the first "
                        "failure (retry_max_s)",
                        type(cause).__name__,
                        cause,
                        attempt,
                        backoff,
                        self.retry_max_s,
                    )
                    for node in self._nodes:  # abandon what is in flight; reconnect afresh
                        with contextlib.suppress(Exception):
                            self._client.close(node)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_BACKOFF_MAX_S)
                    for part in parts.values():
                        part.sent_before = max(part.sent_before, part.sent)
                        part.sent = part.acked
        except BaseException:
            self.reset()
            raise

    def _gave_up(self, cause: BaseException) -> BaseException:
        """What to raise once transient errors outlast ``retry_max_s``: a connection failure or
        timeout as it is (the store reports the broker unavailable), an error answer as a
        LogStoreError that names it."""
        if isinstance(
            cause,
            BrokerUnavailableError
            | kerr.KafkaConnectionError
            | kerr.KafkaTimeoutError
            | kerr.NodeNotReadyError
            | kerr.RequestTimedOutError,
        ):
            return cause
        return LogStoreError(
            f"the broker kept refusing records with transient errors for {self.retry_max_s:g} s "
            f"(retry_max_s); the last: {type(cause).__name__}: {cause}",
            fix="check the cluster's health (leader elections, in-sync replicas, broker logs); a larger "
            "[kafka] retry_max_s rides out longer disturbances. Nothing acknowledged was lost: the "
            "append is retried from the last confirmed position",
            error=type(cause).__name__,
        )

    def _attempt(
        self, parts: Mapping[TopicPartition, _Partition], leaders: Mapping[TopicPartition, int]
    ) -> None:
        """Send every batch not yet acknowledged (encoding new ones as it goes), pipelined; return
        when all are acknowledged. A transient failure raises _Transient (the caller retries)."""
        by_node: dict[int, list[TopicPartition]] = {}
        for tp, part in parts.items():
            if part.acked < len(part.batches) or part.encoded < len(part.records):
                by_node.setdefault(leaders[tp], []).append(tp)
        self._nodes = set(by_node)
        try:
            for node in by_node:
                self._ready(node)
        except kerr.KafkaError as exc:
            if is_transient(exc):
                raise _Transient() from exc
            raise
        inflight: deque[tuple[int, dict[TopicPartition, int], Any]] = deque()
        per_node = dict.fromkeys(by_node, 0)
        pending = set(by_node)
        errors: dict[TopicPartition, str] = {}
        state_error = False
        transient: BaseException | None = None
        while pending or inflight:
            for node in list(pending):
                while per_node[node] < self.max_in_flight:
                    request = self._next_request(node, by_node[node], parts)
                    if request is None:
                        pending.discard(node)
                        break
                    try:
                        future = self._send(node, request[0])
                    except kerr.KafkaError as exc:
                        if is_transient(exc):
                            raise _Transient() from exc
                        raise
                    inflight.append((node, request[1], future))
                    per_node[node] += 1
            if not inflight:
                continue
            node, sent, future = inflight.popleft()
            per_node[node] -= 1
            try:
                response = self._wait(future)
            except kerr.KafkaError as exc:
                if is_transient(exc):
                    raise _Transient() from exc
                raise
            for topic_response in response.responses:
                for pr in topic_response.partition_responses:
                    tp = TopicPartition(topic_response.name, pr.index)
                    part, index = parts[tp], sent[tp]
                    n = part.batches[index][1]
                    code = pr.error_code
                    if not code or (
                        code == kerr.DuplicateSequenceNumberError.errno and index < part.sent_before
                    ):
                        # acknowledged (a duplicate of a batch sent before a failure was written then)
                        part.acked = index + 1
                        self.duplicates += bool(code)
                        part.last = pr.base_offset + n - 1 if not code and pr.base_offset >= 0 else None
                        continue
                    err = kerr.for_code(code)
                    if is_transient(err):
                        transient = transient or err(pr.error_message or f"{tp.topic}[{tp.partition}]")
                        continue
                    errors[tp] = f"{err.__name__}{': ' + pr.error_message if pr.error_message else ''}"
                    state_error = state_error or code in _PRODUCER_STATE_ERRORS
            if errors:
                break
            if transient is not None:
                raise _Transient() from transient
        if errors:
            unknown = kerr.UnknownTopicOrPartitionError.__name__
            for tp, error in errors.items():
                if error.startswith(unknown):  # deleted since the caller looked it up
                    raise TopicRefusedError(tp.topic)
            cls = ProducerStateError if state_error else LogStoreError
            raise cls(
                f"the broker refused records: {', '.join(f'{tp.topic}[{tp.partition}]: {e}' for tp, e in errors.items())}",
                fix="retry the append; if it keeps failing, check the broker's log and the topic's limits "
                "(max.message.bytes)",
                errors={f"{tp.topic}[{tp.partition}]": e for tp, e in errors.items()},
            )

    def _send(self, node: int, request: Any) -> Any:
        deadline = time.monotonic() + self.request_timeout_ms / 1000
        while True:
            future = self._client.send(node, request)
            if not (
                future.is_done and future.failed() and isinstance(future.exception, kerr.NodeNotReadyError)
            ):
                return future
            if time.monotonic() > deadline:
                raise future.exception
            # The connection is busy (another request of the client's own, e.g. metadata): let it finish.
            self._client.poll(timeout_ms=10)

    def _wait(self, future: Any) -> Any:
        deadline = time.monotonic() + self.request_timeout_ms / 1000
        while not future.is_done:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise kerr.KafkaTimeoutError(
                    f"no answer to a produce request within {self.request_timeout_ms} ms"
                )
            self._client.poll(timeout_ms=min(remaining * 1000, 1000), future=future)
        if future.failed():
            raise future.exception
        return future.value

    def _next_request(
        self, node: int, tps: list[TopicPartition], parts: Mapping[TopicPartition, _Partition]
    ) -> tuple[Any, dict[TopicPartition, int]] | None:
        """The next ProduceRequest for one broker: the next batch of each of its partitions (an
        unacknowledged one again after a failure, else a newly encoded one), at most
        ``max_request_bytes`` (but always at least one batch); None when nothing is left to send."""
        topic_cls = ProduceRequest.TopicProduceData
        partition_cls = topic_cls.PartitionProduceData
        topics: dict[str, list[Any]] = {}
        sent: dict[TopicPartition, int] = {}
        size = 0
        for tp in tps:
            part = parts[tp]
            if sent and size + self.batch_bytes > self.max_request_bytes:
                break
            if part.sent == len(part.batches):
                if part.encoded >= len(part.records):
                    continue
                part.batches.append(self._batch(tp, part.records, part.encoded))
                part.encoded += part.batches[-1][1]
            data = part.batches[part.sent][0]
            sent[tp] = part.sent
            part.sent += 1
            size += len(data)
            topics.setdefault(tp.topic, []).append(partition_cls(index=tp.partition, records=data))
        if not sent:
            return None
        request = ProduceRequest(
            transactional_id=None,
            acks=self.acks,
            timeout_ms=self.request_timeout_ms,
            topic_data=[topic_cls(name=t, partition_data=p) for t, p in topics.items()],
            min_version=3,
            max_version=9,
        )
        return request, sent

    def _batch(self, tp: TopicPartition, recs: Sequence[Record], start: int) -> tuple[bytes, int]:
        """Encode records from ``start`` into one batch of at most ``batch_bytes`` (at least one
        record); advance the partition's sequence number."""
        sequence = self._sequence.get(tp, 0)
        data, n = encode_batch(
            recs, start, self.batch_bytes, self.producer_id, self.producer_epoch, sequence, self.codec
        )
        self._sequence[tp] = (sequence + n) & 0x7FFFFFFF
        return data, n
