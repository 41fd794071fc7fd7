"""The log store: durable, partitioned, compacted topics (one per registered table).

One interface (:class:`LogStore`), two backends beside it: :mod:`cdc.logstore.embedded` (the default,
SQLite on local disk, no server) and :mod:`cdc.logstore.kafka` (kafka-python against any
Kafka-protocol broker). :func:`cdc.logstore.factory.open_log_store` picks one from the settings. The contract test suite
(``tests/logstore/test_contract.py``) runs against both.

Guarantees every backend gives
------------------------------
* A topic has a fixed number of partitions. A record's partition is Kafka's default murmur2
  partitioner of its key (:func:`partition_for`), so both backends place a key in the same partition.
* Each partition assigns monotonically increasing offsets, starting at 0; an offset never changes,
  not even after compaction (compaction leaves gaps, it never renumbers).
* :meth:`LogStore.append` returns only when the whole batch is durable (embedded: fsync'd; Kafka:
  acks=all with the idempotent producer). If it raises, any subset of the batch may have been
  written (at least once: the caller retries the whole batch); nothing it acknowledged is ever lost.
* :meth:`LogStore.read` returns records of one partition with ``offset >= from_offset`` in offset
  order. Reading at the end offset returns an empty list; before the start offset (after retention)
  or past the end raises :class:`~cdc.errors.OffsetOutOfRangeError`.
* Consumer positions: :meth:`commit` stores, per consumer name, the next offset to read per
  partition; :meth:`committed` returns them (missing partitions are absent, not 0).
* Compacted topics keep at least the newest record of every key; a tombstone (``value is None``)
  is kept for ``delete_retention_ms`` after it was written, then dropped; records younger than
  ``min_compaction_lag_ms`` are never compacted away, so a reader that keeps up never misses one.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from cdc.errors import LogStoreError
from cdc.logstore.partitioner import murmur2, partition_for

__all__ = [
    "APPLY_CONSUMER",
    "LogStore",
    "Record",
    "StoreFullError",
    "StoredRecord",
    "TopicConfig",
    "TopicInfo",
    "murmur2",
    "partition_for",
]

Headers = tuple[tuple[str, bytes], ...]

#: the apply job's consumer: its committed positions are how far the derived tables have applied a
#: topic (``cdc status``, ``cdc verify``), and the embedded store compacts nothing at or past them. The
#: reader commits the start offsets for it in every topic it creates, so the apply job is a consumer
#: from the topic's first record even if it has not started yet.
APPLY_CONSUMER = "apply"


def now_ms() -> int:
    return int(time.time() * 1000)


class StoreFullError(LogStoreError):
    """The disk (or quota) holding the log store is full (``path``, ``free_bytes``). The write that
    hit it is not acknowledged and not visible; everything acknowledged before stays; once space is
    freed, the same writer (or a restarted one) goes on. (Defined here until ``cdc.errors`` holds it.)"""

    exit_code = 2


class Record(msgspec.Struct, frozen=True, gc=False):
    """A record to append. ``value=None`` is a tombstone. ``timestamp_ms=None`` means now.
    ``partition=None`` places it by :func:`partition_for` of the key; an explicit partition is for
    records that must reach every partition (a TRUNCATE marker). (An immutable msgspec Struct, not
    tracked by the cyclic GC: the reader builds one per change, ~10x cheaper than a frozen dataclass.)"""

    key: bytes
    value: bytes | None
    headers: Headers = ()
    timestamp_ms: int | None = None
    partition: int | None = None


class StoredRecord(msgspec.Struct, frozen=True, gc=False):
    """A record as read back, with its position. (An immutable msgspec Struct rather than a
    dataclass: backends build millions of them, and msgspec decodes them ~2.5x faster.)"""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes | None
    headers: Headers
    timestamp_ms: int


@dataclass(frozen=True, slots=True)
class TopicConfig:
    """How a topic is kept.

    ``compacted``: keep the newest record per key (change topics). Otherwise records are deleted by
    ``retention_ms``/``retention_bytes`` (per partition), oldest first (the dead-letter topic).
    """

    partitions: int = 4
    compacted: bool = True
    min_compaction_lag_ms: int = 60_000
    delete_retention_ms: int = 24 * 3600 * 1000
    retention_ms: int | None = 7 * 24 * 3600 * 1000
    retention_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class TopicInfo:
    name: str
    config: TopicConfig
    start_offsets: Mapping[int, int] = field(default_factory=dict)
    end_offsets: Mapping[int, int] = field(default_factory=dict)

    @property
    def partitions(self) -> int:
        return self.config.partitions


class LogStore(abc.ABC):
    """A set of partitioned topics. Safe to use from one thread at a time per instance; open one
    instance per process (the embedded backend admits one writing process and any number of readers).

    Who calls what: the reader (``cdc run``) creates topics and appends; the apply job reads and
    commits its positions; the CLI lists, reads and deletes. Every failure is a
    :class:`~cdc.errors.LogStoreError` subclass carrying the values involved and a fix; a failed call
    leaves the store usable (open a new instance after :class:`~cdc.errors.BrokerUnavailableError` if
    the broker stays away). Nothing acknowledged is ever lost by a failure of a later call.
    Resume: a process that crashed opens a new instance and goes on from its own checkpoint (the
    reader from the slot's confirmed LSN, re-appending what was not acknowledged; the apply job from
    its committed or checkpointed offsets); the store needs no recovery call.
    """

    #: "embedded" or "kafka"
    backend: str
    #: records one :meth:`read` (and one step of :meth:`iter_partition`) returns at most by default
    READ_MAX = 10_000

    # -- topics --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def create_topic(self, name: str, config: TopicConfig) -> TopicInfo:
        """Create ``name``; if it exists with the same partition count, return it unchanged
        (idempotent: a reader that crashed while registering a table calls it again on restart).
        Raises TopicExistsError if it exists with another partition count; LogStoreError for a name
        outside ``[A-Za-z0-9._-]``. A failure creates nothing half-way (the embedded store creates
        the file under a temporary name and links it into place)."""

    @abc.abstractmethod
    def delete_topic(self, name: str) -> None:
        """Delete a topic and all its records and consumer positions (``cdc tables remove``).
        UnknownTopicError if absent. Not undoable; readers of the topic get UnknownTopicError next."""

    @abc.abstractmethod
    def list_topics(self) -> list[TopicInfo]:
        """All topics, sorted by name, with their start and end offsets (a snapshot: topics created
        or deleted meanwhile may or may not appear)."""

    @abc.abstractmethod
    def topic(self, name: str) -> TopicInfo:
        """One topic with its start and end offsets. UnknownTopicError if absent."""

    # -- writing -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def append_many(self, batch: Mapping[str, Sequence[Record]]) -> dict[str, dict[int, int]]:
        """Append records to several topics; return, per topic, the last offset written per partition.

        Called by the one writer of the topics (the reader) after a batch of changes, before it
        confirms their LSN to Postgres. Returns only when every record of the batch is durable.
        Records of one key keep their order, also across calls. The embedded backend commits each
        topic's part of the batch atomically (topic by topic); Kafka does not.

        On failure it raises and any subset of the batch may have been written (at least once): the
        caller retries the whole batch, or crashes and re-reads the changes from its checkpoint;
        records acknowledged by earlier calls are never lost or reordered. A record the store cannot
        hold (wrong types, a partition out of range) raises LogStoreError (the embedded store before
        anything is written).
        """

    def append(self, topic: str, records: Sequence[Record]) -> dict[int, int]:
        """Append to one topic; see :meth:`append_many`."""
        return self.append_many({topic: records}).get(topic, {})

    # -- reading -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def read(
        self, topic: str, partition: int, from_offset: int, max_records: int = READ_MAX
    ) -> list[StoredRecord]:
        """Records of one partition with ``offset >= from_offset``, in offset order, at most
        ``max_records`` (compaction may leave gaps in the offsets, never a reordering).

        Empty at the end offset (a reader polls again later). OffsetOutOfRangeError (with ``start``
        and ``end``) before the start offset (removed by retention) or past the end; UnknownTopicError;
        LogStoreError for a partition the topic does not have. Only whole acknowledged appends are
        visible. Resume: a reader keeps the offset after the last record it processed and calls
        ``read`` from there; nothing else is needed."""

    def iter_partition(
        self,
        topic: str,
        partition: int,
        from_offset: int = 0,
        until_offset: int | None = None,
        batch: int = READ_MAX,
    ) -> Iterator[StoredRecord]:
        """Every record of a partition from ``from_offset`` up to (excluding) ``until_offset``
        (default: the end offset when the call starts)."""
        end = self.end_offsets(topic)[partition] if until_offset is None else until_offset
        pos = max(from_offset, self.start_offsets(topic)[partition])
        while pos < end:
            records = self.read(topic, partition, pos, min(batch, end - pos))
            if not records:
                return
            for rec in records:
                if rec.offset >= end:
                    return
                yield rec
            pos = records[-1].offset + 1

    @abc.abstractmethod
    def start_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the first offset still readable (moves on with retention, not compaction)."""

    @abc.abstractmethod
    def end_offsets(self, topic: str) -> dict[int, int]:
        """Per partition, the offset the next appended record will get."""

    # -- consumer positions --------------------------------------------------------------------------
    @abc.abstractmethod
    def commit(self, consumer: str, topic: str, offsets: Mapping[int, int]) -> None:
        """Durably store ``consumer``'s next offset to read, per partition of ``topic``. Called by a
        consumer after it processed the records before those offsets; after a crash it resumes from
        :meth:`committed` (records after the commit are read again: at least once). Raises on failure,
        and then the previous positions stand."""

    @abc.abstractmethod
    def committed(self, consumer: str, topic: str) -> dict[int, int]:
        """``consumer``'s committed positions in ``topic`` (partitions never committed are absent)."""

    def hold(self, consumer: str, topic: str) -> None:
        """Make ``consumer`` a consumer of ``topic`` from its start offsets, unless it has a position
        there: the embedded store compacts nothing a consumer has not read. Its later commits move
        the position on."""
        if not self.committed(consumer, topic):
            self.commit(consumer, topic, self.start_offsets(topic))

    # -- maintenance ---------------------------------------------------------------------------------
    def compact(self, topic: str) -> int:
        """Compact a compacted topic now; return how many records were removed. A backend whose
        broker compacts on its own (Kafka) returns 0."""
        return 0

    def enforce_retention(self, topic: str) -> int:
        """Apply time/size retention to a non-compacted topic now; return records removed."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Release files, locks and connections. Idempotent."""

    def __enter__(self) -> LogStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
