"""The apply job's watchdog: a micro-batch stuck in a sink (in its Spark task) or in Spark fails the
run with a StalledError after a thread dump, and closing the job does not wait for the stuck batch."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from spark_jobs.apply import ApplyJob, ApplyOptions, StalledError
from tests.plugins.apply import Env, GateSink
from tests.plugins.changes import ChangeWriter, make_reg
from tests.plugins.postgres import wait_for

COLUMNS = [("id", "bigint"), ("name", "text")]


@pytest.mark.parametrize("backend", ["embedded"])
def test_a_stuck_batch_fails_the_run_and_close_does_not_wait(
    spark_clean: Any, env: Env, capfd: pytest.CaptureFixture[str]
) -> None:
    reg = env.register(make_reg(f"s{uuid.uuid4().hex[:6]}", "items", COLUMNS))
    w = ChangeWriter(env.store, reg)
    with w.txn():
        for i in range(1, 6):
            w.insert({"id": i, "name": f"n{i}"})
    # a write blocked (until the test ends) in the Spark task that applies the batch
    stuck = GateSink(env.state / "stuck", limit_s=600)
    job = ApplyJob(
        spark_clean,
        env.settings,
        ApplyOptions(once=False, trigger_interval_s=0.2, registry_poll_s=1, stall_timeout_s=0),
        make_sinks=lambda s: [stuck],
    )
    errors: list[BaseException] = []

    def run() -> None:
        try:
            job.run()
        except BaseException as exc:  # asserted below
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        wait_for(stuck.entered, timeout=120, what="the first batch reaching the sink")
        # the watchdog from the moment the batch is stuck in the sink (until then it is off, so a
        # slow Spark start on a loaded machine cannot be taken for the stall)
        job.watchdog.timeout_s = 2
        runner.join(120)
        assert not runner.is_alive(), "run() is still waiting on a stuck micro-batch"
        assert len(errors) == 1 and isinstance(errors[0], StalledError), errors
        err = errors[0]
        assert "no progress for" in err.message and "a micro-batch's sinks" in err.message
        assert err.values["stall_timeout_s"] == 2
        assert err.fix is not None and "restart" in err.fix and "checkpoint" in err.fix
        closer = threading.Thread(target=job.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() waited for the stuck batch"
        dumped = capfd.readouterr().err
        assert "cdc apply: watchdog: no progress for" in dumped
        assert "spark_jobs/apply.py" in dumped, "the driver's thread dump names the batch it waits for"
    finally:
        stuck.release()
        job.stop()
        runner.join(60)
