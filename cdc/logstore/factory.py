"""Opening the log store the settings name (kept apart from the contract in :mod:`cdc.logstore`, which
the backends import: the contract must not import them back)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cdc import paths
from cdc.logstore import LogStore
from cdc.logstore.embedded import EmbeddedLogStore

if TYPE_CHECKING:
    from cdc.config import Settings
    from cdc.logstore.kafka.options import KafkaOptions


@dataclass(frozen=True)
class StoreAddress:
    """Where a log store is and how to reach it, and nothing else of the settings: the state
    directory (the embedded store under ``state_dir/log``), ``log_url`` (``kafka://HOST:PORT[,...]``:
    the Kafka store) and, for Kafka, the validated ``[kafka]`` section (TLS, SASL with its password
    as a ``SecretStr``, retries; None: the defaults, a plaintext broker).

    Picklable, and unpickled without the configuration loader (pydantic), unless it carries a
    ``[kafka]`` section: Spark's source (:mod:`spark_jobs.source`) sends it to the planner and the
    runner processes of each streaming query, never in the options Spark prints."""

    state_dir: Path
    log_url: str | None = None
    kafka: KafkaOptions | None = None

    @classmethod
    def of(cls, settings: Settings) -> StoreAddress:
        """The address ``settings`` name; ConfigError for a wrong ``[kafka]`` section."""
        kafka = None
        if settings.log_url and settings.log_url.startswith(paths.KAFKA_SCHEME):
            from cdc.logstore.kafka.options import KafkaOptions

            kafka = KafkaOptions.from_settings(settings)
        return cls(settings.state_dir, settings.log_url, kafka)

    def open(self, *, writer: bool = False) -> LogStore:
        """The log store: :func:`open_log_store`."""
        if self.log_url and self.log_url.startswith(paths.KAFKA_SCHEME):
            # deferred: kafka-python (and its protocol classes) load only where the Kafka backend is used
            from cdc.logstore.kafka import KafkaLogStore
            from cdc.logstore.kafka.options import KafkaOptions

            options = self.kafka if self.kafka is not None else KafkaOptions()
            return KafkaLogStore(self.log_url.removeprefix(paths.KAFKA_SCHEME), options=options)
        return EmbeddedLogStore(paths.log_dir(self.state_dir), writer=writer)


def open_log_store(settings: Settings, *, writer: bool = False) -> LogStore:
    """The log store the settings name: embedded under ``state_dir/log`` unless ``log_url`` is
    ``kafka://HOST:PORT[,HOST:PORT]`` (then the ``[kafka]`` section gives its TLS, SASL and retry
    settings: :class:`~cdc.logstore.kafka.options.KafkaOptions`). ``writer=True`` takes the embedded
    store's single-writer lock (WriterLockedError if another process holds it) and starts its
    background compaction (Kafka admits any number of writers). ConfigError for a wrong
    ``[kafka]`` section."""
    return StoreAddress.of(settings).open(writer=writer)
