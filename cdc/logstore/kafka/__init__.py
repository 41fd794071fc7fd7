"""The Kafka log store: any Kafka-protocol broker (Apache Kafka, Redpanda, Tansu) through kafka-python.

How the :class:`~cdc.logstore.LogStore` contract maps onto Kafka (the full page: ``docs/logstore.md``):

* Topics are created through the admin API with every :class:`~cdc.logstore.TopicConfig` field as a
  topic config (:mod:`~cdc.logstore.kafka.topic_config`).
* Appends are idempotent with acks=all, every record with an explicit partition (Kafka's murmur2 of
  the key, or ``Record.partition``), so placement is identical to the embedded backend.
  :meth:`KafkaLogStore.append_many` returns only when the broker acknowledged every record;
  transient errors are retried for ``retry_max_s`` without losing, reordering or duplicating a
  partition's records (the same batches and sequence numbers sent again).
* TLS and SASL (PLAIN, SCRAM): the ``[kafka]`` settings, :mod:`~cdc.logstore.kafka.options`.
  The default producer (:mod:`~cdc.logstore.kafka.producer`) writes whole v2 record batches
  (:mod:`~cdc.logstore.kafka.record_batch`) with the producer id, epoch and sequence numbers.
* Reads use a consumer without group membership; consumer positions are committed with
  OffsetCommit under the group id = consumer name, without joining the group.
* End offsets are exact even on brokers whose ListOffsets reports less (Tansu).
* Compaction and retention are the broker's job (``compact()`` returns 0).
* A broker that is down raises :class:`~cdc.errors.BrokerUnavailableError` naming the bootstrap
  address within about ``request_timeout_ms``; an unknown topic raises
  :class:`~cdc.errors.UnknownTopicError` (checked first: some brokers create topics on first use).
"""

from cdc.logstore.kafka.store import DEFAULT_PRODUCER_CONFIG, KafkaLogStore

__all__ = ["DEFAULT_PRODUCER_CONFIG", "KafkaLogStore"]
