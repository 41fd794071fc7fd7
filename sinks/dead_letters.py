"""The dead-letter topic's record format (``<prefix>.__dead_letter``, not compacted, 7 days).

One record per :class:`sinks.DeadLetter`: the original key as key; headers ``reason``, ``table``,
``source_topic``, ``source_partition``, ``source_offset``; the value a JSON object (what
``cdc topic dump`` shows)::

    {"reason": "...", "table": "public.items" | null,
     "source": {"topic": "cdc.public.items", "partition": 0, "offset": 41},
     "key_json": "{\"id\":7}" | null, "version": {"commit_lsn": 123, "seq": 4} | null,
     "batch_id": 12, "app_id": "cdc-apply-...",
     "key": "<original key text>", "value": "<original value text>" | null}

A key or value that is not UTF-8 is kept as ``key_hex``/``value_hex`` instead. :func:`decode` reads it
back (``cdc deadletters``), with the original record to replay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from cdc.events import Version
from cdc.logstore import Record, StoredRecord, TopicConfig
from sinks import DeadLetter

__all__ = ["TOPIC_CONFIG", "Entry", "decode", "encode"]

TOPIC_CONFIG = TopicConfig(compacted=False, retention_ms=7 * 24 * 3600 * 1000)


def encode(d: DeadLetter, batch_id: int, app_id: str) -> Record:
    """The dead-letter topic's record for ``d`` (see the module docstring)."""
    body: dict[str, Any] = {
        "reason": d.reason,
        "table": d.table,
        "source": {"topic": d.topic, "partition": d.partition, "offset": d.offset},
        "key_json": d.key_json,
        "version": None if d.version is None else {"commit_lsn": d.version.commit_lsn, "seq": d.version.seq},
        "batch_id": batch_id,
        "app_id": app_id,
    }
    for name, raw in (("key", d.key), ("value", d.value)):
        if raw is None:
            body[name] = None
        else:
            try:
                body[name] = raw.decode("utf-8")
            except UnicodeDecodeError:
                body[f"{name}_hex"] = raw.hex()
    headers = (
        ("reason", d.reason.encode()),
        ("table", (d.table or "").encode()),
        ("source_topic", d.topic.encode()),
        ("source_partition", str(d.partition).encode()),
        ("source_offset", str(d.offset).encode()),
    )
    return Record(key=d.key, value=orjson.dumps(body), headers=headers, partition=None)


@dataclass(frozen=True)
class Entry:
    """One record of the dead-letter topic, decoded: where it is (``partition``, ``offset`` in the
    dead-letter topic) and the :class:`sinks.DeadLetter` it holds (with the original key and value)."""

    partition: int
    offset: int
    timestamp_ms: int | None
    letter: DeadLetter
    batch_id: int | None

    @property
    def id(self) -> str:
        """A stable name of this dead letter: ``<partition>:<offset>`` in the dead-letter topic."""
        return f"{self.partition}:{self.offset}"

    def to_dict(self) -> dict[str, Any]:
        d = self.letter
        return {
            "id": self.id,
            "reason": d.reason,
            "table": d.table,
            "source": {"topic": d.topic, "partition": d.partition, "offset": d.offset},
            "key": d.key_json if d.key_json is not None else d.key.decode("utf-8", "backslashreplace"),
            "version": None if d.version is None else [d.version.commit_lsn, d.version.seq],
            "batch_id": self.batch_id,
            "timestamp_ms": self.timestamp_ms,
        }


def decode(rec: StoredRecord) -> Entry:
    """A dead-letter record back as an :class:`Entry`; ValueError when it is not one (the format
    above)."""
    try:
        body = orjson.loads(rec.value or b"")
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"dead letter {rec.partition}:{rec.offset} is not JSON") from exc
    if not isinstance(body, dict) or not isinstance(body.get("source"), dict):
        raise ValueError(f"dead letter {rec.partition}:{rec.offset} has no source")
    src = body["source"]
    raw: dict[str, bytes | None] = {}
    for name in ("key", "value"):
        if body.get(f"{name}_hex") is not None:
            raw[name] = bytes.fromhex(body[f"{name}_hex"])
        else:
            text = body.get(name)
            raw[name] = None if text is None else str(text).encode("utf-8")
    version = body.get("version")
    letter = DeadLetter(
        topic=str(src["topic"]),
        partition=int(src["partition"]),
        offset=int(src["offset"]),
        key=raw["key"] or b"",
        value=raw["value"],
        reason=str(body.get("reason", "")),
        table=body.get("table"),
        key_json=body.get("key_json"),
        version=None
        if not isinstance(version, dict)
        else Version(int(version["commit_lsn"]), int(version["seq"])),
    )
    batch_id = body.get("batch_id")
    return Entry(
        rec.partition, rec.offset, rec.timestamp_ms, letter, None if batch_id is None else int(batch_id)
    )
