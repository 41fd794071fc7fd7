"""The apply job's watchdog: a micro-batch stuck in a sink (or in Spark) fails the run with a
StalledError after a thread dump, and closing the job does not wait for the stuck thread."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import pytest

from sinks import ChangeBatch, Sink
from spark_jobs.apply import ApplyJob, ApplyOptions, StalledError
from tests.plugins.apply import Env
from tests.plugins.changes import ChangeWriter, make_reg

COLUMNS = [("id", "bigint"), ("name", "text")]


class _StuckSink(Sink):
    """Never returns from ``apply`` until the test releases it (a write blocked forever). On entry it
    arms the job's watchdog (``arm()``): until then the watchdog is off, so a slow Spark start on a
    loaded machine cannot be taken for the stall, which is then known to be in this sink."""

    name = "stuck"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.arm: Any = None

    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        if self.arm is not None:
            self.arm()
        self.entered.set()
        self.release.wait(600)


@pytest.mark.parametrize("backend", ["embedded"])
def test_a_stuck_batch_fails_the_run_and_close_does_not_wait(
    spark_clean: Any, env: Env, capfd: pytest.CaptureFixture[str]
) -> None:
    reg = env.register(make_reg(f"s{uuid.uuid4().hex[:6]}", "items", COLUMNS))
    w = ChangeWriter(env.store, reg)
    with w.txn():
        for i in range(1, 6):
            w.insert({"id": i, "name": f"n{i}"})
    sink = _StuckSink()
    job = ApplyJob(
        spark_clean,
        env.settings,
        ApplyOptions(once=False, trigger_interval_s=0.2, registry_poll_s=1, stall_timeout_s=0),
        sinks=[sink],
    )

    def arm() -> None:  # the watchdog from the moment the batch is stuck in the sink
        job.watchdog.timeout_s = 5

    sink.arm = arm
    errors: list[BaseException] = []

    def run() -> None:
        try:
            job.run()
        except BaseException as exc:  # asserted below
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    try:
        assert sink.entered.wait(120), "the first batch never reached the sink"
        runner.join(120)
        assert not runner.is_alive(), "run() is still waiting on a stuck micro-batch"
        assert len(errors) == 1 and isinstance(errors[0], StalledError), errors
        err = errors[0]
        assert "no progress for" in err.message and "a micro-batch's sinks" in err.message
        assert err.values["stall_timeout_s"] == 5
        assert err.fix is not None and "restart" in err.fix and "checkpoint" in err.fix
        closer = threading.Thread(target=job.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() waited for the stuck sink thread"
        dumped = capfd.readouterr().err
        assert "cdc apply: watchdog: no progress for" in dumped
        assert "test_stall.py" in dumped, "the Python thread dump names the stuck frame"
    finally:
        sink.release.set()
        job.stop()
        runner.join(60)
