"""Topic configs: :class:`~cdc.logstore.TopicConfig` to and from Kafka topic configs.

Every field is always set at creation (``cleanup.policy``, ``min.compaction.lag.ms``,
``delete.retention.ms``, ``retention.ms``, ``retention.bytes``; ``-1`` for None), so the same
config reads back; a field the broker does not report takes :class:`TopicConfig`'s default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cdc.logstore import TopicConfig

__all__ = ["config_from_kafka", "config_to_kafka"]


def config_to_kafka(config: TopicConfig) -> dict[str, str]:
    return {
        "cleanup.policy": "compact" if config.compacted else "delete",
        "min.compaction.lag.ms": str(config.min_compaction_lag_ms),
        "delete.retention.ms": str(config.delete_retention_ms),
        "retention.ms": str(-1 if config.retention_ms is None else config.retention_ms),
        "retention.bytes": str(-1 if config.retention_bytes is None else config.retention_bytes),
    }


def config_from_kafka(entries: Mapping[str, Any], partitions: int) -> TopicConfig:
    """Read TopicConfig back from DescribeConfigs entries; a missing entry takes the default."""
    default = TopicConfig()

    def value(name: str) -> str | None:
        entry = entries.get(name)
        if entry is None:
            return None
        v = entry.get("value") if isinstance(entry, Mapping) else entry
        return None if v is None else str(v)

    def integer(name: str, fallback: int) -> int:
        v = value(name)
        return fallback if v is None else int(v)

    def optional(name: str, fallback: int | None) -> int | None:
        v = value(name)
        if v is None:
            return fallback
        n = int(v)
        return None if n < 0 else n

    policy = value("cleanup.policy")
    return TopicConfig(
        partitions=partitions,
        compacted=default.compacted if policy is None else "compact" in policy.split(","),
        min_compaction_lag_ms=integer("min.compaction.lag.ms", default.min_compaction_lag_ms),
        delete_retention_ms=integer("delete.retention.ms", default.delete_retention_ms),
        retention_ms=optional("retention.ms", default.retention_ms),
        retention_bytes=optional("retention.bytes", default.retention_bytes),
    )
