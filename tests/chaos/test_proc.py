"""The chaos harness's own bookkeeping of a supervised process (:class:`tests.chaos.harness.Proc`):
an exit the harness asked for is the harness's however late it is seen, and an exit before the
harness asked is the process's own. Real child processes (``sleep``, ``true``), no pipeline."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.chaos.harness import Exit, Proc


def _proc(tmp_path: Path, *args: str) -> Proc:
    return Proc("p", list(args), {}, tmp_path / "p.log")


def _exited(proc: Proc, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while proc.alive():
        assert time.monotonic() < deadline, "the process did not exit"
        time.sleep(0.02)


def test_an_exit_the_harness_asked_for_is_the_harness_s_when_seen_later(tmp_path: Path) -> None:
    proc = _proc(tmp_path, sys.executable, "-c", "import time; time.sleep(60)")
    proc.start()
    proc.ask_stop()
    _exited(proc)
    # seen by a plain reap (the supervisor's, or stop()'s first look) after the process went
    seen = proc.reap()
    assert isinstance(seen, Exit) and seen.by_harness
    proc.stop()  # nothing more to record
    assert [e.by_harness for e in proc.exits] == [True]


def test_an_exit_before_the_harness_asked_is_the_process_s_own(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "true")
    proc.start()
    _exited(proc)
    proc.ask_stop()  # too late: the exit is recorded as the process's own
    proc.stop()
    assert [(e.code, e.by_harness) for e in proc.exits] == [(0, False)]


def test_a_restarted_process_is_not_stopping(tmp_path: Path) -> None:
    proc = _proc(tmp_path, sys.executable, "-c", "import time; time.sleep(60)")
    proc.start()
    proc.stop()
    proc.start()  # records nothing new; the new process was not asked to stop
    assert proc.signal(9)
    _exited(proc)
    proc.reap()
    assert [e.by_harness for e in proc.exits] == [True, False]
