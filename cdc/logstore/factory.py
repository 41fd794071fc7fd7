"""Opening the log store the settings name (kept apart from the contract in :mod:`cdc.logstore`, which
the backends import: the contract must not import them back)."""

from __future__ import annotations

from cdc import paths
from cdc.config import Settings
from cdc.logstore import LogStore
from cdc.logstore.embedded import EmbeddedLogStore


def open_log_store(settings: Settings, *, writer: bool = False) -> LogStore:
    """The log store the settings name: embedded under ``state_dir/log`` unless ``log_url`` is
    ``kafka://HOST:PORT[,HOST:PORT]`` (then the ``[kafka]`` section gives its TLS, SASL and retry
    settings: :class:`~cdc.logstore.kafka.options.KafkaOptions`). ``writer=True`` takes the embedded
    store's single-writer lock (WriterLockedError if another process holds it) and starts its
    background compaction (Kafka admits any number of writers). ConfigError for a wrong
    ``[kafka]`` section."""
    if settings.log_url and settings.log_url.startswith("kafka://"):
        # deferred: kafka-python (and its protocol classes) load only where the Kafka backend is used
        from cdc.logstore.kafka import KafkaLogStore
        from cdc.logstore.kafka.options import KafkaOptions

        return KafkaLogStore(
            settings.log_url.removeprefix("kafka://"),
            options=KafkaOptions.from_settings(settings),
        )
    return EmbeddedLogStore(paths.log_dir(settings.state_dir), writer=writer)
