"""The driver reads a micro-batch's offset ranges from Spark's offset log (``batch_ranges``) instead of
running a Spark job over the ``cdclog`` source: they must be exactly the ranges the source plans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cdc.config import Settings
from cdc.logstore import Record, TopicConfig
from cdc.logstore.embedded import EmbeddedLogStore
from spark_jobs.checkpoint import batch_ranges
from spark_jobs.source import register


def _run(spark: Any, fmt: str, state: Path, ckpt: Path, seen: list[tuple[int, Any, Any]]) -> None:
    def each(df: Any, batch_id: int) -> None:
        planned = sorted((r.topic, r.partition, r.start, r.end) for r in df.collect())
        seen.append((batch_id, batch_ranges(ckpt, batch_id), planned))

    query = (
        spark.readStream.format(fmt)
        .option("state", str(state))
        .option("topics", "cdc.t,cdc.u")
        .option("maxRecordsPerBatch", "23")
        .load()
        .writeStream.foreachBatch(each)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    assert query.exception() is None


def test_offset_log_ranges_are_the_sources(spark_clean: Any, tmp_path: Path) -> None:
    state, ckpt = tmp_path / "state", tmp_path / "ckpt"
    store = EmbeddedLogStore(state / "log", writer=True)
    store.create_topic("cdc.t", TopicConfig(partitions=3))
    store.create_topic("cdc.u", TopicConfig(partitions=1))

    def write(n: int, start: int) -> None:
        store.append("cdc.t", [Record(f"k{i}".encode(), b"v") for i in range(start, start + n)])
        store.append("cdc.u", [Record(f"u{i}".encode(), b"v") for i in range(start, start + n // 3)])

    fmt = register(spark_clean, Settings(state_dir=state))
    seen: list[tuple[int, Any, Any]] = []
    try:
        write(60, 0)
        _run(spark_clean, fmt, state, ckpt, seen)
        write(45, 60)  # the restarted query resumes from the checkpoint
        _run(spark_clean, fmt, state, ckpt, seen)
    finally:
        store.close()

    assert seen[0][1] is None  # the query's first batch: its start is the log store's
    compared = [(b, ours, theirs) for b, ours, theirs in seen[1:]]
    assert len(compared) >= 4, seen
    for batch_id, ours, theirs in compared:
        assert ours == theirs, f"batch {batch_id}: offset log {ours} != source {theirs}"
    assert sum(end - start for _, _, start, end in (r for _, _, rs in seen for r in rs)) == 60 + 20 + 45 + 15
