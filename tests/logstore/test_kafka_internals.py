"""Pins the kafka-python internals the bulk producer relies on (cdc/logstore/kafka/producer.py and
record_batch.py list them): each name imported exactly as the producer does, with the signature,
constants and message fields it uses. A kafka-python upgrade that moves or changes one fails here,
by name, rather than deep in a produce call."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import kafka.codec as kcodec
import pytest
from kafka.net.compat import KafkaNetClient
from kafka.protocol.producer import (
    InitProducerIdRequest,
    InitProducerIdResponse,
    ProduceRequest,
    ProduceResponse,
)
from kafka.record.default_records import DefaultRecordBatchBuilder
from kafka.record.util import calc_crc32c


def params(fn: Callable[..., Any]) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        ("__init__", ["net", "manager", "configs"]),
        ("check_version", ["node_id", "timeout_ms"]),
        ("least_loaded_node", ["bootstrap_fallback"]),
        ("await_ready", ["node_id", "timeout_ms"]),
        ("send", ["node_id", "request", "kwargs"]),
        ("send_and_receive", ["node_id", "request", "timeout_ms"]),
        ("poll", ["timeout_ms", "future"]),
        ("close", ["node_id"]),
    ],
)
def test_network_client_methods(method: str, expected: list[str]) -> None:
    assert params(getattr(KafkaNetClient, method)) == expected


def test_produce_request_and_response_fields() -> None:
    partition = ProduceRequest.TopicProduceData.PartitionProduceData(index=0, records=b"")
    topic = ProduceRequest.TopicProduceData(name="t", partition_data=[partition])
    request = ProduceRequest(
        transactional_id=None, acks=-1, timeout_ms=1000, topic_data=[topic], min_version=3, max_version=9
    )
    assert request.API_KEY == 0
    assert (request.acks, request.timeout_ms) == (-1, 1000)
    assert {"responses"} <= set(ProduceResponse.fields)
    topic_response = ProduceResponse.TopicProduceResponse
    assert {"name", "partition_responses"} <= set(topic_response.fields)
    assert {"index", "error_code", "base_offset", "error_message"} <= set(
        topic_response.PartitionProduceResponse.fields
    )


def test_init_producer_id_request_and_response_fields() -> None:
    request = InitProducerIdRequest(
        transactional_id=None, transaction_timeout_ms=60_000, producer_id=-1, producer_epoch=-1
    )
    assert request.API_KEY == 22
    assert {"error_code", "producer_id", "producer_epoch"} <= set(InitProducerIdResponse.fields)


def test_codecs_and_batch_constants() -> None:
    for name in ("gzip", "snappy", "lz4", "zstd"):
        assert callable(getattr(kcodec, f"has_{name}"))
        assert callable(getattr(kcodec, f"{name}_encode"))
    assert (
        DefaultRecordBatchBuilder.CODEC_NONE,
        DefaultRecordBatchBuilder.CODEC_GZIP,
        DefaultRecordBatchBuilder.CODEC_SNAPPY,
        DefaultRecordBatchBuilder.CODEC_LZ4,
        DefaultRecordBatchBuilder.CODEC_ZSTD,
    ) == (0, 1, 2, 3, 4)
    assert calc_crc32c(b"123456789") == 0xE3069283  # CRC-32C check value
