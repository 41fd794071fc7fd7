"""The apply job's watchdog: a micro-batch or a query that shows no sign of progress fails the run,
a main loop that stops checking in ends the process, and a stuck JVM is ended -- never a hang.

:class:`Watchdog` is told the signs of life (a micro-batch body starting or finishing, a Spark task
of the batch finishing, the job's loop checking in) and judges the query's progress between waits
(:meth:`Watchdog.check`). A batch that stalled is retried with a longer timeout (:class:`StallRecord`),
so a batch that is only slow -- a catch-up under load -- ends instead of being killed and replayed
forever. How it decides, and what it dumps: ``docs/apply.md`` ("Failing, never hanging"). No pyspark
import: the query is duck-typed (pyspark's ``_jsq`` where it has one, else ``status`` and
``lastProgress``: :func:`progress_mark`), the tasks' progress is a callable.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from cdc.errors import ApplyError

__all__ = ["MAX_DOUBLINGS", "StallRecord", "StalledError", "Watchdog"]

#: a batch that stalled ``n`` times is given ``2 ** min(n, MAX_DOUBLINGS)`` times the timeout
MAX_DOUBLINGS = 3


class StalledError(ApplyError):
    """The watchdog's verdict: a micro-batch made no progress for ``stall_timeout_s``. The job cannot
    be stopped cleanly any more (a thread is stuck in Spark, py4j or a sink); the process must exit."""


class StallRecord:
    """Which micro-batch stalled, and how many times: ``<checkpoint>/stalls.json``, kept with the
    checkpoint (a new checkpoint starts its batch ids again, and has no record). The same batch
    replayed after a stall -- Spark replays it from its offset log, same ranges -- gets twice the
    timeout per stall (:data:`MAX_DOUBLINGS` at most), so a batch that legitimately takes longer
    than ``--stall-timeout`` (a catch-up under load) finishes on a later attempt; a true hang is
    still caught, later. A record that cannot be read counts as none (it only lengthens a timeout)."""

    def __init__(self, ckpt: Path) -> None:
        self.path = ckpt / "stalls.json"

    def stalls(self, batch_id: int) -> int:
        """How many times ``batch_id`` stalled before."""
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return 0
        if not isinstance(data, dict) or data.get("batch_id") != batch_id:
            return 0
        n = data.get("stalls", 0)
        return n if isinstance(n, int) and n > 0 else 0

    def add(self, batch_id: int) -> int:
        """Record one more stall of ``batch_id`` (written atomically); the new count."""
        n = self.stalls(batch_id) + 1
        tmp = self.path.with_suffix(".tmp")
        with contextlib.suppress(OSError):  # a full disk must not replace the stall's own error
            tmp.write_text(json.dumps({"batch_id": batch_id, "stalls": n}))
            os.replace(tmp, self.path)
        return n


def progress_mark(query: Any) -> Hashable:
    """The query's last progress report as (batch id, timestamp), None before the first. On a query
    of ours (pyspark's ``_jsq``, the JVM's query) three py4j calls read the two fields; pyspark's
    ``lastProgress`` would convert the whole report, each field, map and source a call of its own
    (issue 35: the watchdog reads it every second, in the driver's Python and JVM both)."""
    jsq = getattr(query, "_jsq", None)
    if jsq is not None:
        jprogress = jsq.lastProgress()
        return None if jprogress is None else (jprogress.batchId(), jprogress.timestamp())
    progress = query.lastProgress  # a Spark Connect query (or a test's stand-in)
    return (progress.get("batchId"), progress.get("timestamp")) if progress else None


def trigger_active(query: Any) -> bool:
    """Whether the query is in a trigger (its status's ``isTriggerActive``); as :func:`progress_mark`,
    one field read through py4j instead of the whole status as JSON."""
    jsq = getattr(query, "_jsq", None)
    if jsq is not None:
        return bool(jsq.status().isTriggerActive())
    return bool((query.status or {}).get("isTriggerActive", True))


class Watchdog:
    """``timeout_s``: a trigger with no sign of progress for this long is a stall (0: never); a batch
    that stalled before gets more (:class:`StallRecord`, :meth:`timeout_now`). ``ckpt``: the
    checkpoint the fixes name. ``jvm_pid``: the Spark JVM, when it is ours (set by the job once its
    query started), for the thread dump and the kill after a stall. ``tasks``: a mark of the Spark
    tasks' progress (set by the job; a change is a sign of life: a task finished or failed, a stage
    began or ended), so a batch of many tasks is judged by its slowest task, not by its whole length.
    ``stalled``: set once nothing may wait on the query, the JVM or a sink thread any more."""

    def __init__(self, timeout_s: float, ckpt: Path) -> None:
        self.timeout_s = timeout_s
        self.ckpt = ckpt
        self.jvm_pid: int | None = None
        self.tasks: Callable[[], Hashable] | None = None
        self.stalled = False
        self.record = StallRecord(ckpt)
        self.batch: int | None = None  # the micro-batch whose body runs
        self._batch_stalls = 0  # ... and how many times it stalled before
        self._alive_at = time.monotonic()  # the last sign of life ...
        self._alive_mark: Any = None  # ... and the query's progress report then
        self._tasks_mark: Hashable = None  # ... and the tasks' progress then
        self._loop_at = time.monotonic()  # the main loop's last check-in (for the backstop)

    def alive(self) -> None:
        """A sign of life."""
        self._alive_at = time.monotonic()

    def edge(self, batch_id: int | None) -> None:
        """A micro-batch body starts (its id) or finishes (None): a sign of life."""
        if batch_id is not None and batch_id != self.batch:
            self._batch_stalls = self.record.stalls(batch_id)
        self.batch = batch_id
        self.alive()

    def timeout_now(self) -> float:
        """The timeout for the batch in progress: ``timeout_s``, doubled per earlier stall of it."""
        return self.timeout_s if self.batch is None else self._after(self._batch_stalls)

    def _after(self, stalls: int) -> float:
        """The timeout of a batch that stalled ``stalls`` times before."""
        return self.timeout_s * float(2 ** min(max(stalls, 0), MAX_DOUBLINGS))

    def check_in(self) -> None:
        """The job's main loop is not blocked (for the backstop)."""
        self._loop_at = time.monotonic()

    def check(self, query: Any, in_batch: bool) -> None:
        """Called between waits: a sign of life is a micro-batch body starting or finishing, a Spark
        task finishing, a new progress report of the query, or the query idle between triggers. A
        trigger with none of these for :meth:`timeout_now` raises :class:`StalledError` (after a
        thread dump)."""
        self._loop_at = now = time.monotonic()
        if self.timeout_s <= 0:
            return
        mark = progress_mark(query)
        tasks = self.tasks() if self.tasks is not None else None
        if (
            mark != self._alive_mark
            or tasks != self._tasks_mark
            or (not in_batch and not trigger_active(query))
        ):
            self._alive_mark, self._tasks_mark = mark, tasks
            self._alive_at = now
            return
        if now - self._alive_at >= self.timeout_now():
            message = (query.status or {}).get("message", "?")
            what = "a micro-batch's sinks" if in_batch else f"Spark ({message})"
            self.stall(f"no progress for {now - self._alive_at:.0f} s in {what}")

    def stall(self, what: str) -> NoReturn:
        """Dump every thread (Python's here, the JVM's through SIGQUIT, which it prints to its stdout),
        record the stall of the batch in progress (its retry waits longer) and raise
        :class:`StalledError`; the job's close then does not wait for the stuck threads."""
        self.stalled = True
        self.dump_threads(what)
        timeout, retry = self.timeout_now(), ""
        if self.batch is not None:
            n = self.record.add(self.batch)
            retry = f"; batch {self.batch} has stalled {n} time(s): its retry waits {self._after(n):.0f} s"
        raise StalledError(
            f"the apply job is stuck: {what}",
            fix="restart `cdc apply` (a supervisor does): the batch is retried from the checkpoint "
            f"({self.ckpt}), nothing is skipped{retry}; the thread dump above shows where it hung; "
            "if batches legitimately take longer, raise --stall-timeout",
            checkpoint=str(self.ckpt),
            stall_timeout_s=timeout,
            batch_id=self.batch,
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
        while not done.wait(1.0):
            idle = time.monotonic() - self._loop_at
            if idle > 2 * self.timeout_now() + 180:  # a stop may wait for a batch, the commit, the query
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
