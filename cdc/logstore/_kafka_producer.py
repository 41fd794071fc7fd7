"""The Kafka backend's bulk idempotent producer and its record-batch encoder.

:class:`BulkProducer` writes whole Kafka v2 record batches (KIP-98: producer id, epoch and sequence
numbers) with acks=all as pipelined ProduceRequests, through kafka-python 3.x's network client and
protocol classes; :func:`encode_batch` builds those batches. Only
:class:`~cdc.logstore.kafka.KafkaLogStore` uses it (``producer="bulk"``, the default): the store
places the records, looks up the partition leaders, maps connection errors, retries once after
:class:`ProducerStateError` and gives the log store's guarantees.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import kafka.codec as kcodec
import kafka.errors as kerr
from kafka import TopicPartition
from kafka.net.compat import KafkaNetClient
from kafka.protocol.producer import InitProducerIdRequest, ProduceRequest
from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.util import calc_crc32c

from cdc.errors import LogStoreError
from cdc.logstore import Record, now_ms

__all__ = ["BulkProducer", "ProducerStateError", "TopicRefusedError", "encode_batch"]

_CODECS = {
    None: DefaultRecordBatchBuilder.CODEC_NONE,
    "none": DefaultRecordBatchBuilder.CODEC_NONE,
    "gzip": DefaultRecordBatchBuilder.CODEC_GZIP,
    "snappy": DefaultRecordBatchBuilder.CODEC_SNAPPY,
    "lz4": DefaultRecordBatchBuilder.CODEC_LZ4,
    "zstd": DefaultRecordBatchBuilder.CODEC_ZSTD,
}

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
    writes whole record batches with acks=all.

    kafka-python's ``KafkaProducer.send()`` costs about 15 µs per record in Python (a future, an
    accumulator lookup and a lock per record), which caps it at ~65k records/s on this machine
    whatever the batching. Here the records of an append are already known, so each partition's
    records are encoded straight into v2 record batches (:func:`encode_batch`) and sent as
    ProduceRequests (kafka-python's protocol classes and network client), up to
    ``max_in_flight`` requests per broker in flight. One request carries at most one batch per
    partition (the broker's rule for idempotent batches); a partition's batches go out in sequence
    order on one connection, so the broker appends them in order and rejects a gap or a duplicate.

    Any error fails the whole call (nothing is retried here: the log store's contract is at least
    once, the caller retries the batch) and discards the producer id, so the next call starts a
    fresh one with sequence 0.
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
    ) -> None:
        if compression not in _CODECS:
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
        self.batch_bytes = batch_bytes
        self.max_request_bytes = max_request_bytes
        self.max_in_flight = max(1, max_in_flight)
        self.codec = _CODECS[compression]
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
        leaders: Mapping[TopicPartition, int],
    ) -> dict[TopicPartition, int]:
        """Write every record, in order per partition; return the last offset per partition.
        Returns only when the broker acknowledged every batch (acks=all); raises otherwise."""
        if self.producer_id < 0:
            self._init_producer_id()
        by_node: dict[int, list[TopicPartition]] = {}
        for tp, recs in records.items():
            if recs:
                by_node.setdefault(leaders[tp], []).append(tp)
        for node in by_node:
            self._ready(node)
        pending = {node: self._requests(tps, records) for node, tps in by_node.items()}
        inflight: deque[tuple[int, dict[TopicPartition, int], Any]] = deque()
        per_node = dict.fromkeys(by_node, 0)
        last: dict[TopicPartition, int] = {}
        errors: dict[TopicPartition, str] = {}
        state_error = False
        try:
            while pending or inflight:
                for node in list(pending):
                    while per_node[node] < self.max_in_flight:
                        item = next(pending[node], None)
                        if item is None:
                            del pending[node]
                            break
                        request, counts = item
                        inflight.append((node, counts, self._send(node, request)))
                        per_node[node] += 1
                if not inflight:
                    continue
                node, counts, future = inflight.popleft()
                per_node[node] -= 1
                response = self._wait(future)
                for topic_response in response.responses:
                    for pr in topic_response.partition_responses:
                        tp = TopicPartition(topic_response.name, pr.index)
                        if pr.error_code:
                            err = kerr.for_code(pr.error_code)
                            errors[tp] = (
                                f"{err.__name__}{': ' + pr.error_message if pr.error_message else ''}"
                            )
                            state_error = state_error or pr.error_code in _PRODUCER_STATE_ERRORS
                        else:
                            last[tp] = max(last.get(tp, -1), pr.base_offset + counts[tp] - 1)
                if errors:
                    break
        except BaseException:
            self.reset()
            raise
        if errors:
            self.reset()
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
        return last

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

    def _requests(
        self, tps: list[TopicPartition], records: Mapping[TopicPartition, Sequence[Record]]
    ) -> Iterator[tuple[Any, dict[TopicPartition, int]]]:
        """ProduceRequests for one broker: each carries at most one batch per partition and at
        most ``max_request_bytes`` (but always at least one batch)."""
        position = dict.fromkeys(tps, 0)
        topic_cls = ProduceRequest.TopicProduceData
        partition_cls = topic_cls.PartitionProduceData
        while True:
            topics: dict[str, list[Any]] = {}
            counts: dict[TopicPartition, int] = {}
            size = 0
            for tp in tps:
                recs = records[tp]
                if position[tp] >= len(recs) or (counts and size + self.batch_bytes > self.max_request_bytes):
                    continue
                data, n = self._batch(tp, recs, position[tp])
                position[tp] += n
                counts[tp] = n
                size += len(data)
                topics.setdefault(tp.topic, []).append(partition_cls(index=tp.partition, records=data))
            if not counts:
                return
            yield (
                ProduceRequest(
                    transactional_id=None,
                    acks=self.acks,
                    timeout_ms=self.request_timeout_ms,
                    topic_data=[topic_cls(name=t, partition_data=parts) for t, parts in topics.items()],
                    min_version=3,
                    max_version=9,
                ),
                counts,
            )

    def _batch(self, tp: TopicPartition, recs: Sequence[Record], start: int) -> tuple[bytes, int]:
        """Encode records from ``start`` into one batch of at most ``batch_bytes`` (at least one
        record); advance the partition's sequence number."""
        sequence = self._sequence.get(tp, 0)
        data, n = encode_batch(
            recs, start, self.batch_bytes, self.producer_id, self.producer_epoch, sequence, self.codec
        )
        self._sequence[tp] = (sequence + n) & 0x7FFFFFFF
        return data, n


# -- record batch encoding (Kafka message format v2, KIP-98) ----------------------------------------
_BATCH_HEADER = struct.Struct(">qiibIhiqqqhii")  # the same layout as kafka-python's DefaultRecordBase
_CRC_OFFSET = struct.calcsize(">qiib")  # the CRC covers everything after it, from the attributes on
_ATTRIBUTES_OFFSET = struct.calcsize(">qiibI")
_LENGTH_OFFSET = struct.calcsize(">qi")  # the batch length counts from the partition leader epoch on


def _varint(value: int) -> bytes:
    """Kafka's signed varint: zigzag, then 7 bits per byte, low bits first."""
    zz = ((value << 1) ^ (value >> 63)) & 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while zz > 0x7F:
        out.append((zz & 0x7F) | 0x80)
        zz >>= 7
    out.append(zz)
    return bytes(out)


_VARINTS = [_varint(i) for i in range(1 << 14)]
_NULL = _varint(-1)


def _vi(value: int) -> bytes:
    return _VARINTS[value] if 0 <= value < 16384 else _varint(value)


def _encode_headers(headers: Sequence[tuple[str, bytes]]) -> bytes:
    parts = [_vi(len(headers))]
    for name, value in headers:
        raw = name.encode()
        parts += (_vi(len(raw)), raw)
        parts += (_NULL,) if value is None else (_vi(len(value)), value)
    return b"".join(parts)


def encode_batch(
    records: Sequence[Record],
    start: int,
    max_bytes: int,
    producer_id: int,
    producer_epoch: int,
    base_sequence: int,
    codec: int = 0,
) -> tuple[bytes, int]:
    """One v2 record batch of ``records[start:]`` (as many as fit in ``max_bytes``, at least one)
    carrying the idempotent producer's id, epoch and base sequence; returns (bytes, record count).

    The same bytes kafka-python's ``DefaultRecordBatchBuilder`` writes (its tests read them back
    through kafka-python's parser), at about a third of its per-record cost: varints of small
    numbers come from a table and each record is one ``bytes.join``.
    """
    now = now_ms()
    first = records[start].timestamp_ms
    first_ts = now if first is None else first
    max_ts = first_ts
    table, limit, slow, null = _VARINTS, 16384, _varint, _NULL
    parts: list[bytes] = []
    size = 0
    i, end, delta = start, len(records), 0
    while i < end:
        rec = records[i]
        ts = now if rec.timestamp_ms is None else rec.timestamp_ms
        key, value = rec.key, rec.value
        td = ts - first_ts
        klen = len(key)
        body = b"".join(
            (
                b"\x00",  # attributes (unused)
                table[td] if 0 <= td < limit else slow(td),
                table[delta] if delta < limit else slow(delta),
                table[klen] if klen < limit else slow(klen),
                key,
                null if value is None else (table[len(value)] if len(value) < limit else slow(len(value))),
                b"" if value is None else value,
                _encode_headers(rec.headers) if rec.headers else b"\x00",
            )
        )
        blen = len(body)
        head = table[blen] if blen < limit else slow(blen)
        size += len(head) + blen
        if size > max_bytes and delta:
            break
        parts += (head, body)
        if ts > max_ts:
            max_ts = ts
        delta += 1
        i += 1
    payload = b"".join(parts)
    attributes = 0
    if codec:
        compressed = _compress(codec, payload)
        if len(compressed) < len(payload):
            payload, attributes = compressed, codec
    total = _BATCH_HEADER.size + len(payload)
    buf = bytearray(_BATCH_HEADER.size)
    _BATCH_HEADER.pack_into(
        buf,
        0,
        0,  # base offset: the broker assigns it
        total - _LENGTH_OFFSET,
        0,  # partition leader epoch: the broker sets it
        2,  # magic
        0,  # CRC, below
        attributes,
        delta - 1,  # last offset delta
        first_ts,
        max_ts,
        producer_id,
        producer_epoch,
        base_sequence,
        delta,
    )
    buf += payload
    struct.pack_into(">I", buf, _CRC_OFFSET, calc_crc32c(memoryview(buf)[_ATTRIBUTES_OFFSET:]))
    return bytes(buf), delta


def _compress(codec: int, payload: bytes) -> bytes:
    if codec == DefaultRecordBatchBuilder.CODEC_GZIP:
        return bytes(kcodec.gzip_encode(payload))
    if codec == DefaultRecordBatchBuilder.CODEC_SNAPPY:
        return bytes(kcodec.snappy_encode(payload))
    if codec == DefaultRecordBatchBuilder.CODEC_LZ4:
        return bytes(kcodec.lz4_encode(payload))
    if codec == DefaultRecordBatchBuilder.CODEC_ZSTD:
        return bytes(kcodec.zstd_encode(payload))
    raise ValueError(f"unknown codec {codec}")
