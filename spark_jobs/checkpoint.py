"""The apply job's Spark checkpoint, read without Spark: where it is and what a batch's offset log
says. ``cdc status`` reads it on every call, so this module imports neither pyspark nor the sinks.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from cdc import paths

__all__ = ["batch_end_offsets", "batch_ranges", "checkpoint_dir", "offset_key", "parse_offset_key"]


def checkpoint_dir(state_dir: Path) -> Path:
    return paths.spark_checkpoint(state_dir, "apply")


def _source_offsets(ckpt: Path, batch_id: int) -> dict[str, int] | None:
    """The ``cdclog`` source's offsets (``{"<topic>|<partition>": next_offset}``) that Spark's offset
    log holds for ``batch_id`` (written before the batch runs); None if it has no entry, or none for
    the source."""
    try:
        lines = (ckpt / "offsets" / str(batch_id)).read_text().splitlines()
    except FileNotFoundError:
        return None
    # "v1", the batch metadata, then one line per source ("-" when the source had no offset)
    line = lines[2].strip() if len(lines) > 2 else ""
    if not line or line == "-":
        return None
    return {str(k): int(v) for k, v in orjson.loads(line).items()}


def offset_key(topic: str, partition: int) -> str:
    """A partition's key in the source's offsets (``{"<topic>|<partition>": next_offset}``)."""
    return f"{topic}|{partition}"


def parse_offset_key(key: str) -> tuple[str, int]:
    topic, _, part = key.rpartition("|")
    return topic, int(part)


def batch_end_offsets(ckpt: Path, batch_id: int) -> dict[str, dict[int, int]]:
    """The end offsets of ``batch_id`` from Spark's offset log (written before the batch runs):
    ``{topic: {partition: next_offset}}``; empty if the log has no entry."""
    out: dict[str, dict[int, int]] = {}
    for key, off in (_source_offsets(ckpt, batch_id) or {}).items():
        topic, part = parse_offset_key(key)
        out.setdefault(topic, {})[part] = off
    return out


def batch_ranges(ckpt: Path, batch_id: int) -> list[tuple[str, int, int, int]] | None:
    """The offset ranges ``(topic, partition, start, end)`` of micro-batch ``batch_id``, non-empty
    ones in offset-key order, read from Spark's offset log alone: what the ``cdclog`` source with
    ``emit = ranges`` plans for it (``CdcLogStreamReader.partitions``: Spark starts a batch where the
    one before it ended, the offset log's entry ``batch_id - 1``, and ends it at its own entry, both
    logged before the batch runs, and the same on a replay). None when the log cannot tell: no entry
    for the batch or the one before (a query's first batch) or a partition the earlier entry lacks
    or has past the batch's end (a new topic, a recreated one), where the source asks the log store
    for the partition's start; the caller then asks the source (a Spark job)."""
    end = _source_offsets(ckpt, batch_id)
    start = _source_offsets(ckpt, batch_id - 1) if batch_id > 0 else None
    if end is None or start is None:
        return None
    if any(k not in start or start[k] > hi for k, hi in end.items()):
        return None
    return [(*parse_offset_key(k), start[k], end[k]) for k in sorted(end) if end[k] > start[k]]
