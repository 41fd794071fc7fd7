"""The apply job's Spark checkpoint, read without Spark: where it is and what a batch's offset log
says. ``cdc status`` reads it on every call, so this module imports neither pyspark nor the sinks.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from cdc import paths

__all__ = ["batch_end_offsets", "checkpoint_dir"]


def checkpoint_dir(state_dir: Path) -> Path:
    return paths.spark_checkpoint(state_dir, "apply")


def batch_end_offsets(ckpt: Path, batch_id: int) -> dict[str, dict[int, int]]:
    """The end offsets of ``batch_id`` from Spark's offset log (written before the batch runs):
    ``{topic: {partition: next_offset}}``; empty if the log has no entry."""
    path = ckpt / "offsets" / str(batch_id)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    # "v1", the batch metadata, then one line per source ("-" when the source had no offset)
    out: dict[str, dict[int, int]] = {}
    for line in lines[2:3]:
        if not line.strip() or line.strip() == "-":
            continue
        for key, off in orjson.loads(line).items():
            topic, _, part = str(key).rpartition("|")
            out.setdefault(topic, {})[int(part)] = int(off)
    return out
