"""The race of a graceful stop, made deterministic on the shared Spark session: a micro-batch that
Spark starts while the job is being stopped is refused by the gate, having done nothing
(:data:`spark_jobs.lifecycle.STOP_REQUESTED`). The query then ends with that error, which is not a
failure: the job stops cleanly and the refused batch is replayed by the next query on the same
checkpoint. Another error in a batch still is one. ``test_stop_signals`` covers the whole job, where
the race happens only when the timing hits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cdc.errors import ApplyError
from cdc.registry import TableReg
from spark_jobs.lifecycle import STOP_REQUESTED, BatchGate, QueryLoop, task_progress
from spark_jobs.watchdog import Watchdog, progress_mark, trigger_active
from tests.plugins.postgres import wait_for


def _rate_query(spark: Any, ckpt: Path, body: Callable[[Any, int], None]) -> Any:
    """A streaming query of Spark's built-in ``rate`` source whose micro-batch bodies are ``body``."""
    return (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 20)
        .load()
        .writeStream.foreachBatch(body)
        .option("checkpointLocation", str(ckpt))
        .trigger(processingTime="100 milliseconds")
        .start()
    )


def _loop(tmp_path: Path, gate: BatchGate, start: Callable[[Sequence[TableReg]], Any]) -> QueryLoop:
    tables: list[TableReg] = [SimpleNamespace(qualified="public.t", topic="t")]  # type: ignore[list-item]
    return QueryLoop(
        once=False,
        registry_poll_s=0.2,
        ckpt=tmp_path / "ckpt",
        state_dir=tmp_path,
        tables=lambda: (-1, tables),
        start=start,
        gate=gate,
        watchdog=Watchdog(0, tmp_path / "ckpt"),
        summary=SimpleNamespace(tables=[]),
    )


def test_a_batch_refused_during_a_stop_ends_the_job_cleanly_and_is_replayed(
    spark_clean: Any, tmp_path: Path
) -> None:
    gate = BatchGate(lambda _batch: None)
    done: list[int] = []
    queries: list[Any] = []

    def body(_df: Any, batch_id: int) -> None:
        with gate.batch(batch_id):
            done.append(batch_id)

    def start(_tables: Sequence[TableReg]) -> Any:
        queries.append(_rate_query(spark_clean, tmp_path / "ckpt", body))
        return queries[-1]

    loop = _loop(tmp_path, gate, start)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as exc:
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    try:
        wait_for(lambda: len(done) >= 2 or errors, timeout=120, what="two batches")
        assert errors == []
        with gate.halted():  # what stop_between_batches holds while it waits for the batch in progress
            first = queries[0]
            wait_for(
                lambda: not first.isActive, timeout=60, what="the refusal"
            )  # the next batch: the query ended
            refused = first.exception()
            assert refused is not None and STOP_REQUESTED in str(refused)
            loop.raise_if_failed(first)  # not a failure
            loop.stop()
            runner.join(60)
    finally:
        loop.stop()
        runner.join(60)
    assert not runner.is_alive() and errors == []
    # the next query on the checkpoint replays the refused batch: every batch done once, none skipped
    before = len(done)
    replay = _rate_query(spark_clean, tmp_path / "ckpt", body)
    try:
        wait_for(lambda: len(done) > before, timeout=60, what="a batch of the next query")
    finally:
        replay.stop()
    assert done == list(range(done[-1] + 1)), done


def test_another_error_in_a_batch_is_a_failure_with_its_message(spark_clean: Any, tmp_path: Path) -> None:
    def body(_df: Any, batch_id: int) -> None:
        raise RuntimeError(f"bad batch {batch_id}: the sink said no")

    gate = BatchGate(lambda _batch: None)
    loop = _loop(tmp_path, gate, lambda _tables: None)
    query = _rate_query(spark_clean, tmp_path / "ckpt", body)
    wait_for(lambda: not query.isActive, timeout=120)
    with pytest.raises(ApplyError, match="bad batch 0: the sink said no"):
        loop.raise_if_failed(query)


def test_the_watchdogs_py4j_reads_agree_with_pysparks(spark_clean: Any, tmp_path: Path) -> None:
    """The watchdog reads a query's last progress, its trigger state and the active stages every
    second through a few py4j calls (issue 35), where pyspark converts whole objects: the same values,
    on a real query and a real running stage."""
    query = _rate_query(spark_clean, tmp_path / "ckpt", lambda _df, _batch: None)
    try:
        wait_for(lambda: query.lastProgress is not None, timeout=120, what="a progress report")
    finally:
        query.stop()  # its last report and status no longer change under the comparison
    progress, status = query.lastProgress, query.status
    assert progress_mark(query) == (progress["batchId"], progress["timestamp"])
    assert progress_mark(SimpleNamespace(lastProgress=progress)) == progress_mark(query)
    assert trigger_active(query) is status["isTriggerActive"] is False

    release = tmp_path / "release"

    def held(_rows: Any) -> Any:  # a task that runs until the test releases it (bounded)
        deadline = time.monotonic() + 120
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield 1

    job = threading.Thread(
        target=lambda: spark_clean.sparkContext.parallelize([0], 1).mapPartitions(held).collect()
    )
    job.start()
    try:
        mark, tracker = task_progress(spark_clean), spark_clean.sparkContext.statusTracker()
        wait_for(lambda: mark() != (), timeout=60, what="the held task's stage")
        expected = tuple(
            sorted(
                (s, info.currentAttemptId, info.numCompletedTasks, info.numFailedTasks)
                for s in tracker.getActiveStageIds()
                if (info := tracker.getStageInfo(s)) is not None
            )
        )
        assert mark() == expected and len(expected) == 1 and expected[0][2:] == (0, 0)
    finally:
        release.touch()
        job.join(120)
    assert not job.is_alive()
