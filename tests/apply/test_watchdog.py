"""The watchdog's judgement, without a JVM: a Spark task finishing is a sign of life, a stuck task is
not, and a batch that stalled is retried with a longer timeout (the livelock of a catch-up batch
that takes longer than ``--stall-timeout`` under load, killed and replayed for ever)."""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest

from spark_jobs import watchdog as wd
from spark_jobs.lifecycle import BatchGate
from spark_jobs.watchdog import MAX_DOUBLINGS, StalledError, StallRecord, Watchdog


class _Query:
    """A query in the middle of a trigger: no new progress report, the trigger active."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {"isTriggerActive": True, "message": "Processing new data"}
        self.lastProgress: dict[str, Any] = {"batchId": 6, "timestamp": "2026-11-26T00:00:00"}


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(wd.time, "monotonic", c)
    return c


def _dog(tmp_path: Path, timeout_s: float = 60.0) -> Watchdog:
    dog = Watchdog(timeout_s, tmp_path)
    dog.dump_threads = lambda what: None  # type: ignore[method-assign]
    return dog


def test_a_task_finishing_is_a_sign_of_life_and_a_stuck_task_is_not(tmp_path: Path, clock: _Clock) -> None:
    dog = _dog(tmp_path)
    done = [0]
    dog.tasks = lambda: ((3, 0, done[0], 0),)
    gate = BatchGate(dog.edge)
    q = _Query()
    with gate.batch(7):
        dog.check(q, True)
        for _ in range(5):  # 5 tasks of 50 s each: the batch runs 250 s, past the 60 s timeout
            clock.now += 50
            done[0] += 1
            dog.check(q, True)
        clock.now += 59
        dog.check(q, True)  # the sixth task is at 59 s: not yet a stall
        clock.now += 1
        with pytest.raises(StalledError) as err:
            dog.check(q, True)  # ... and at 60 s with no task finished, it is
    assert "no progress for 60 s in a micro-batch's sinks" in err.value.message
    assert err.value.values["batch_id"] == 7


def test_without_the_tasks_mark_the_same_batch_is_a_stall(tmp_path: Path, clock: _Clock) -> None:
    dog = _dog(tmp_path)
    gate = BatchGate(dog.edge)
    with gate.batch(7):
        dog.check(_Query(), True)
        clock.now += 60
        with pytest.raises(StalledError):
            dog.check(_Query(), True)


def test_a_batch_that_stalled_gets_twice_the_timeout_per_stall(tmp_path: Path, clock: _Clock) -> None:
    timeouts = []
    for attempt in range(MAX_DOUBLINGS + 2):  # each attempt: a new process on the same checkpoint
        dog = _dog(tmp_path)
        gate = BatchGate(dog.edge)
        with pytest.raises(StalledError) as err, gate.batch(12):
            dog.check(_Query(), True)
            started = clock.now
            while True:
                clock.now += 1
                dog.check(_Query(), True)
                assert clock.now - started < 10_000
        timeouts.append(clock.now - started)
        assert err.value.values["stall_timeout_s"] == timeouts[-1]
        n = attempt + 1
        assert f"batch 12 has stalled {n} time(s)" in (err.value.fix or "")
    assert timeouts == [60, 120, 240, 480, 480]  # doubled per stall, at most 2 ** MAX_DOUBLINGS
    # another batch is judged by the plain timeout again
    dog = _dog(tmp_path)
    dog.edge(13)
    assert dog.timeout_now() == 60
    dog.edge(None)
    assert dog.timeout_now() == 60


def test_the_stall_record_is_per_batch_and_survives_bad_content(tmp_path: Path) -> None:
    rec = StallRecord(tmp_path)
    assert rec.stalls(4) == 0
    assert rec.add(4) == 1 and rec.add(4) == 2
    assert rec.stalls(4) == 2 and rec.stalls(5) == 0
    assert rec.add(5) == 1 and rec.stalls(4) == 0  # only the latest batch that stalled counts
    rec.path.write_text("{not json")
    assert rec.stalls(5) == 0  # unreadable: no record (it only ever lengthens a timeout)


def test_between_batches_the_tasks_mark_needs_no_batch(tmp_path: Path, clock: _Clock) -> None:
    """Outside a batch (the planning of a trigger), a changing tasks mark is a sign of life too."""
    dog = _dog(tmp_path)
    marks: list[Hashable] = [(), ((1, 0, 0, 0),), ((1, 0, 1, 0),)]
    dog.tasks = lambda: marks[0]
    for m in marks:
        dog.tasks = lambda m=m: m  # type: ignore[misc]
        clock.now += 59
        dog.check(_Query(), False)
    clock.now += 60
    with pytest.raises(StalledError) as err:
        dog.check(_Query(), False)
    assert "in Spark (Processing new data)" in err.value.message
