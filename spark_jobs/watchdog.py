"""The apply job's watchdog: a micro-batch or a query that shows no sign of progress fails the run,
a main loop that stops checking in ends the process, and a stuck JVM is ended -- never a hang.

:class:`Watchdog` is told the signs of life (a micro-batch body starting or finishing, the job's
loop checking in) and judges the query's progress between waits (:meth:`Watchdog.check`). How it
decides, and what it dumps: ``docs/apply.md`` ("Failing, never hanging"). No pyspark import: the
query is duck-typed (``status``, ``lastProgress``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from cdc.errors import ApplyError

__all__ = ["StalledError", "Watchdog"]


class StalledError(ApplyError):
    """The watchdog's verdict: a micro-batch made no progress for ``stall_timeout_s``. The job cannot
    be stopped cleanly any more (a thread is stuck in Spark, py4j or a sink); the process must exit."""


class Watchdog:
    """``timeout_s``: a trigger with no sign of progress for this long is a stall (0: never).
    ``ckpt``: the checkpoint the fixes name. ``jvm_pid``: the Spark JVM, when it is ours (set by the
    job once its query started), for the thread dump and the kill after a stall. ``stalled``: set
    once nothing may wait on the query, the JVM or a sink thread any more."""

    def __init__(self, timeout_s: float, ckpt: Path) -> None:
        self.timeout_s = timeout_s
        self.ckpt = ckpt
        self.jvm_pid: int | None = None
        self.stalled = False
        self._alive_at = time.monotonic()  # the last sign of life ...
        self._alive_mark: Any = None  # ... and the query's progress report then
        self._loop_at = time.monotonic()  # the main loop's last check-in (for the backstop)

    def alive(self) -> None:
        """A sign of life: a micro-batch body started or finished."""
        self._alive_at = time.monotonic()

    def check_in(self) -> None:
        """The job's main loop is not blocked (for the backstop)."""
        self._loop_at = time.monotonic()

    def check(self, query: Any, in_batch: bool) -> None:
        """Called between waits: a sign of life is a micro-batch body starting or finishing, a new
        progress report of the query, or the query idle between triggers. A trigger with none of
        these for ``timeout_s`` raises :class:`StalledError` (after a thread dump)."""
        self._loop_at = now = time.monotonic()
        if self.timeout_s <= 0:
            return
        status = query.status or {}
        progress = query.lastProgress
        mark = (progress.get("batchId"), progress.get("timestamp")) if progress else None
        if mark != self._alive_mark or (not in_batch and not status.get("isTriggerActive", True)):
            self._alive_mark = mark
            self._alive_at = now
            return
        if now - self._alive_at >= self.timeout_s:
            what = "a micro-batch's sinks" if in_batch else f"Spark ({status.get('message', '?')})"
            self.stall(f"no progress for {now - self._alive_at:.0f} s in {what}")

    def stall(self, what: str) -> NoReturn:
        """Dump every thread (Python's here, the JVM's through SIGQUIT, which it prints to its stdout)
        and raise :class:`StalledError`; the job's close then does not wait for the stuck threads."""
        self.stalled = True
        self.dump_threads(what)
        raise StalledError(
            f"the apply job is stuck: {what}",
            fix="restart `cdc apply` (a supervisor does): the batch is retried from the checkpoint "
            f"({self.ckpt}), nothing is skipped; the thread dump above shows where it hung; if batches "
            "legitimately take longer, raise --stall-timeout",
            checkpoint=str(self.ckpt),
            stall_timeout_s=self.timeout_s,
        )

    def dump_threads(self, what: str) -> None:
        sys.stderr.write(f"cdc apply: watchdog: {what}; thread dump follows\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        if self.jvm_pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self.jvm_pid, signal.SIGQUIT)  # the JVM prints its thread dump to its stdout
        sys.stderr.flush()

    @contextlib.contextmanager
    def backstop(self, enabled: bool) -> Iterator[None]:
        """While in the block, when ``enabled`` and the watchdog is on: a thread that ends the
        process (:meth:`_backstop`) if the main loop stops checking in."""
        self._loop_at = time.monotonic()
        done = threading.Event()
        if enabled and self.timeout_s > 0:
            threading.Thread(
                target=self._backstop, args=(done,), name="cdc-apply-backstop", daemon=True
            ).start()
        try:
            yield
        finally:
            done.set()

    def _backstop(self, done: threading.Event) -> None:
        """The last line of defence (``ApplyOptions.hard_exit_on_stall``, set by ``cdc apply``): if the
        job's loop itself stops checking in (blocked in py4j), dump the threads and exit the process
        hard -- a process that hangs is never restarted by its supervisor."""
        limit = 2 * self.timeout_s + 180  # a stop may wait for a batch, the commit, the query
        while not done.wait(1.0):
            idle = time.monotonic() - self._loop_at
            if idle > limit:
                self.dump_threads(f"the job's main loop made no progress for {idle:.0f} s")
                sys.stderr.write(
                    "error: the apply job is stuck and exits now (exit code 1)\n  fix: restart `cdc apply`; "
                    f"the batch is retried from the checkpoint ({self.ckpt}), nothing is skipped\n"
                )
                sys.stderr.flush()
                sys.stdout.flush()
                os._exit(1)

    def end_stuck_jvm(self) -> None:
        """After a stall, SIGKILL our JVM: a stuck JVM may not exit on its own (its shutdown hooks wait
        for the stuck query). It gets a moment to print the thread dump it was asked for first."""
        if self.stalled and self.jvm_pid is not None:
            time.sleep(2)
            with contextlib.suppress(OSError):
                os.kill(self.jvm_pid, signal.SIGKILL)
