"""The apply job's streaming query over its life: started, restarted when the registered tables change,
stopped only between micro-batches, its failure turned into an error with a fix, a JVM that went
away reported as such. Guarantees: ``docs/apply.md`` ("Stopping and restarting", "Failing, never
hanging").

* :class:`BatchGate`: the micro-batch bodies pass through it; a stop closes it between batches.
* :class:`QueryLoop`: the job's main loop (start, wait, watch, restart, stop).
* :func:`jvm_gone_is_an_error`, :func:`jvm_pid`: the JVM under the job.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cdc.errors import ApplyError
from cdc.registry import TableReg
from spark_jobs.watchdog import Watchdog

if TYPE_CHECKING:
    from pyspark.sql.streaming.query import StreamingQuery

__all__ = ["STOP_REQUESTED", "BatchGate", "QueryLoop", "first_lines", "jvm_gone_is_an_error", "jvm_pid"]

#: the message of the error a micro-batch raises when it starts after a stop was requested (it has
#: done nothing; Spark replays it on the next run)
STOP_REQUESTED = "cdc apply: stop requested before this micro-batch started"


class BatchGate:
    """Where the micro-batch bodies pass: one at a time, none while the query is being stopped
    (:meth:`halted`). ``on_edge`` is called as a body starts (with its batch id) and finishes (with
    None): the watchdog's sign of life. ``last_batch``: the last batch id whose body finished."""

    def __init__(self, on_edge: Callable[[int | None], None]) -> None:
        self._cond = threading.Condition()
        self._in_batch = False
        self._halt = threading.Event()
        self._on_edge = on_edge
        self.last_batch: int | None = None

    @contextlib.contextmanager
    def batch(self, batch_id: int) -> Iterator[None]:
        """A micro-batch body; while the query is being stopped it fails at once, having done nothing
        (:data:`STOP_REQUESTED`: Spark replays it in the next query)."""
        with self._cond:
            if self._halt.is_set():
                raise ApplyError(STOP_REQUESTED, fix="run `cdc apply` again", batch_id=batch_id)
            self._in_batch = True
            self._on_edge(batch_id)
        done = False
        try:
            yield
            done = True
        finally:
            with self._cond:
                self._in_batch = False
                self._on_edge(None)
                if done:
                    self.last_batch = batch_id
                self._cond.notify_all()

    @property
    def in_batch(self) -> bool:
        with self._cond:
            return self._in_batch

    def halting(self) -> bool:
        """Whether the query is being stopped (no body may start)."""
        return self._halt.is_set()

    def wait_idle(self, timeout: float | None) -> tuple[bool, int | None]:
        """Wait until no body runs: (whether it came to that within ``timeout``, ``last_batch``)."""
        with self._cond:
            idle = self._cond.wait_for(lambda: not self._in_batch, timeout)
            return idle, self.last_batch

    @contextlib.contextmanager
    def halted(self) -> Iterator[None]:
        """No body may start inside the block."""
        self._halt.set()
        try:
            yield
        finally:
            self._halt.clear()


class _Summary(Protocol):
    tables: list[str]


class QueryLoop:
    """The job's main loop. ``tables()``: (registry generation, tables), generation -1 for a fixed
    list; ``start(tables)``: the query over their topics; ``once``: until caught up, else until
    :meth:`stop`. ``summary.tables`` is kept to the tables of the current query."""

    def __init__(
        self,
        *,
        once: bool,
        registry_poll_s: float,
        ckpt: Path,
        state_dir: Path,
        tables: Callable[[], tuple[int, list[TableReg]]],
        start: Callable[[Sequence[TableReg]], StreamingQuery],
        gate: BatchGate,
        watchdog: Watchdog,
        summary: _Summary,
    ) -> None:
        self.once = once
        self.registry_poll_s = registry_poll_s
        self.ckpt = ckpt
        self.state_dir = state_dir
        self.tables = tables
        self.start = start
        self.gate = gate
        self.watchdog = watchdog
        self.summary = summary
        self.query: StreamingQuery | None = None
        self._stop = threading.Event()

    def stop(self) -> None:
        """Ask :meth:`run` to finish (from another thread or a signal handler)."""
        self._stop.set()

    def run(self) -> None:
        """Run the queries until caught up (``once``) or :meth:`stop`; raise :class:`ApplyError` when
        one fails, :class:`~spark_jobs.watchdog.StalledError` when it stalls."""
        failed = True
        try:
            while not self._stop.is_set():
                gen, tables = self.tables()
                self.summary.tables = [t.qualified for t in tables]
                if not tables:
                    if self.once:
                        break
                    self._stop.wait(self.registry_poll_s)
                    continue
                self.query = query = self.start(tables)
                restart = self._watch(query, gen, tables)
                if self._stop.is_set() and query.isActive:
                    self.stop_between_batches(query)
                self.raise_if_failed(query)
                if restart:
                    continue
                if self.once or self._stop.is_set():
                    break
            failed = False
        finally:
            self._stop_query(failed)

    def _watch(self, query: StreamingQuery, gen: int, tables: Sequence[TableReg]) -> bool:
        """Wait for ``query`` to end or :meth:`stop`, checking for stalls and for a change of the
        registered topics; True when the query was stopped for a restart on new topics."""
        from pyspark.errors import StreamingQueryException  # deferred with pyspark (heavy)

        while not self._stop.is_set():
            wait_s = 1 if self.once else max(1, round(self.registry_poll_s))
            try:
                if query.awaitTermination(wait_s):
                    return False
            except StreamingQueryException:
                return False
            self.watchdog.check(query, self.gate.in_batch)
            if gen >= 0:
                new_gen, new_tables = self.tables()
                if new_gen != gen and {t.topic for t in new_tables} != {t.topic for t in tables}:
                    self.stop_between_batches(query)
                    return True
                gen = new_gen
        return False

    def _stop_query(self, failed: bool) -> None:
        """The last query stopped when the loop ends (interrupted, e.g. Ctrl-C: no batch may run after
        the job is closed); a stalled query would not stop, so it is left."""
        q = self.query
        if q is None or self.watchdog.stalled:
            return
        try:
            if q.isActive:
                q.stop()
        except Exception:
            if not failed:
                raise
            # the run already failed with its own error, which is the one to report (a JVM that
            # died, a query that does not stop): this cleanup must not replace it

    def stop_between_batches(self, query: StreamingQuery) -> None:
        """Stop ``query`` once no micro-batch is in progress (for :meth:`stop` and for a restart on a
        registry change). A batch that would start meanwhile fails at once, having done nothing
        (:data:`STOP_REQUESTED`), and is replayed by the next query on the same checkpoint. Bounded: a
        batch still running after the watchdog's timeout is a stall, and a query that does not stop
        is an error, never a hang."""
        timeout = self.watchdog.timeout_now() if self.watchdog.timeout_s > 0 else None
        with self.gate.halted():
            idle, last = self.gate.wait_idle(timeout)
            if not idle:
                self.watchdog.stall(
                    f"the micro-batch in progress did not finish within {timeout:.0f} s of a stop"
                )
            if last is not None:  # Spark writes the batch's commit log entry right after the body returns
                commit = self.ckpt / "commits" / str(last)
                deadline = time.monotonic() + 60
                while not commit.exists() and query.isActive and time.monotonic() < deadline:
                    self.watchdog.check_in()
                    time.sleep(0.05)
            try:
                query.stop()
            except (
                Exception
            ) as exc:  # py4j: the query's thread did not stop (spark.sql.streaming.stopTimeout)
                self.watchdog.stalled = True
                raise ApplyError(
                    f"the streaming query did not stop: {first_lines(str(exc))}",
                    fix="the process must exit and be restarted; the batch in progress is retried from the "
                    f"checkpoint ({self.ckpt}), nothing is skipped",
                    checkpoint=str(self.ckpt),
                ) from exc

    def raise_if_failed(self, query: StreamingQuery) -> None:
        exc = query.exception()
        if exc is None:
            return
        text = str(exc)
        if STOP_REQUESTED in text:
            return  # a batch that started while the query was being stopped did nothing; it is replayed
        # the whole failure, stack traces included (Spark's own log of it is off: session.py)
        print(f"cdc apply: the streaming query failed:\n{text}", file=sys.stderr, flush=True)
        cause = "fix the cause"
        if "No space left on device" in text or "ENOSPC" in text:
            cause = f"free space on the filesystem of the state directory ({self.state_dir})"
        raise ApplyError(
            f"micro-batch failed, the apply job stopped: {first_lines(text)}",
            fix=f"{cause} and run `cdc apply` again: the failed batch is retried from the checkpoint "
            f"({self.ckpt}), nothing was skipped",
            checkpoint=str(self.ckpt),
        )


@contextlib.contextmanager
def jvm_gone_is_an_error(ckpt: Path, watchdog: Watchdog) -> Iterator[None]:
    """A JVM that exited or was killed under the block is an :class:`ApplyError` saying so: the
    gateway's socket fails (Py4JNetworkError), or pyspark's conversion of the query's error finds no
    JVM to ask ("... does not exist in the JVM", seen when a full disk ended the JVM); a Java error
    is not this case. Nothing may wait on the JVM afterwards (``watchdog.stalled``)."""
    from py4j.protocol import Py4JError, Py4JJavaError  # deferred with pyspark (heavy)

    try:
        yield
    except (ConnectionError, Py4JError) as exc:
        if isinstance(exc, Py4JJavaError):
            raise
        watchdog.stalled = True
        raise ApplyError(
            f"the Spark JVM of the apply job went away ({exc}); its log above says why",
            fix="restart `cdc apply`: the batch is retried from the checkpoint "
            f"({ckpt}), nothing is skipped; check the free space and memory of this host",
            checkpoint=str(ckpt),
        ) from exc


def jvm_pid(spark: Any) -> int | None:
    """The pid of the session's JVM, None for a remote/Connect session (no JVM of ours)."""
    try:
        return int(spark.sparkContext._jvm.ProcessHandle.current().pid())
    except Exception:
        return None


def task_progress(spark: Any) -> Callable[[], Hashable]:
    """A mark of the Spark tasks' progress for the watchdog: per active stage, its attempt and how many
    of its tasks finished or failed. It changes whenever a task ends or a stage begins or ends, and
    stays the same while every running task is stuck. Read every second (the watchdog): the stage's
    three fields are asked of the JVM's tracker directly, where pyspark's ``getStageInfo`` would ask
    for all seven, a py4j call each (issue 35)."""
    tracker = spark.sparkContext.statusTracker()
    jtracker = tracker._jtracker

    def mark() -> Hashable:
        stages = []
        for stage_id in tracker.getActiveStageIds():
            info = jtracker.getStageInfo(stage_id)  # the stage's SparkStageInfo, or null once gone
            if info is not None:
                stages.append(
                    (stage_id, info.currentAttemptId(), info.numCompletedTasks(), info.numFailedTasks())
                )
        return tuple(sorted(stages))

    return mark


def first_lines(text: str, limit: int = 1500) -> str:
    """The useful part of a StreamingQueryException: the Python error, not the JVM stack."""
    head = text.split("=== Streaming Query ===")[0]
    lines = [ln.strip() for ln in head.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Warning)\b.*:", ln)]
    out = errors[-1] if errors else " | ".join(lines[:3])
    return out[:limit]
