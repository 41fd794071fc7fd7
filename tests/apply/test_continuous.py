"""`cdc apply` running continuously: changes arriving later are applied, and a table registered while
the job runs is picked up (the job restarts its query on the same checkpoint)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.plugins.apply import Env, GateSink, continuous_job, run_job, start_job, warehouse_ids
from tests.plugins.changes import ChangeWriter, make_reg
from tests.plugins.postgres import wait_for

COLUMNS = [("id", "bigint"), ("name", "text")]


@pytest.mark.parametrize("backend", ["embedded"])
def test_continuous_job_applies_new_changes_and_new_tables(spark_clean: Any, env: Env) -> None:
    schema = f"c{uuid.uuid4().hex[:6]}"
    first = env.register(make_reg(schema, "first", COLUMNS))
    w1 = ChangeWriter(env.store, first)
    with w1.txn():
        for i in range(1, 6):
            w1.insert({"id": i, "name": f"n{i}"})
    job = continuous_job(spark_clean, env)
    runner, errors = start_job(job)
    try:
        wait_for(
            lambda: warehouse_ids(env, first) == set(range(1, 6)), timeout=120, what="the first rows applied"
        )
        with w1.txn():
            w1.insert({"id": 6, "name": "later"})
            w1.delete({"id": 1})
        wait_for(
            lambda: warehouse_ids(env, first) == set(range(2, 7)), timeout=60, what="later changes applied"
        )
        # a table registered while the job runs
        second = env.register(make_reg(schema, "second", COLUMNS))
        w2 = ChangeWriter(env.store, second)
        with w2.txn():
            w2.insert({"id": 42, "name": "new table"})
        wait_for(lambda: warehouse_ids(env, second) == {42}, timeout=90, what="the new table picked up")
        assert not errors
    finally:
        job.stop()
        runner.join(60)
        job.close()
    assert not runner.is_alive()
    assert not errors, errors


@pytest.mark.parametrize("backend", ["embedded"])
def test_stop_lets_the_batch_in_progress_finish_and_commit(spark_clean: Any, env: Env) -> None:
    """stop() (what SIGTERM calls) during a micro-batch: the batch completes -- sinks and checkpoint --
    run() returns normally, and a later run on the same checkpoint has nothing to replay."""
    reg = env.register(make_reg(f"g{uuid.uuid4().hex[:6]}", "items", COLUMNS))
    w = ChangeWriter(env.store, reg)
    with w.txn():
        for i in range(1, 6):
            w.insert({"id": i, "name": f"n{i}"})
    gate = GateSink(env.state / "gate")
    job = continuous_job(spark_clean, env, make_sinks=lambda s: [gate])
    runner, errors = start_job(job)
    try:
        wait_for(gate.entered, timeout=120, what="the first batch reaching the sink")
        job.stop()
        wait_for(job.gate.halting, timeout=30, what="run() waiting for the batch in progress")
        assert runner.is_alive() and not gate.applied()
        gate.release()
        runner.join(120)
        assert not runner.is_alive(), "run() did not return after the batch finished"
    finally:
        gate.release()
        job.stop()
        runner.join(60)
        job.close()
    assert not errors, errors
    assert gate.applied() == [(0, 5)]
    assert job.summary.batches == 1 and job.summary.records == 5
    assert (job.ckpt / "commits" / "0").exists(), "the batch's checkpoint commit was written"
    again = GateSink(env.state / "again")
    again.release()
    summary = run_job(spark_clean, env, make_sinks=lambda s: [again])
    assert again.applied() == [] and summary.records == 0, "nothing left to replay"
