"""The warehouse's maintenance after a micro-batch, on a thread of its own, off the batch's path.

After the driver commits a batch, the maintenance of its tables (the disk bound's reclaim, the
periodic vacuum, the compaction of the history's closed rows: :meth:`WarehouseSink.committed`) is
handed to :class:`Maintenance`, which runs it on one thread, one round after another, while the
driver goes on: the views, the positions, Spark's offset commit, the next trigger, the next batch's
plan and its tasks. The next batch's commit waits for the rounds handed over before it
(:meth:`Maintenance.wait`, called by :meth:`WarehouseSink.await_maintenance`). So:

* the tables keep their one writer at a time for what must be serial: no round runs while the
  driver commits a batch, alters a table or runs the periodic ``maintain``; a round commits only
  compactions of partitions no batch removes a file from (:func:`.compact.append_only`), which the
  tasks running meanwhile never read nor rewrite;
* every file a round deletes was superseded by a commit no later than the batch the round follows
  (a round reclaims before it compacts), and the next batch's tasks read a version at least that
  batch's: a round never deletes a file that the tasks running beside it read. A reader outside the
  apply is kept by its lease, as before (:mod:`.leases`);
* the disk bound holds after every round as it held after every batch, one batch later at most;
* a round's error is raised in the driver at the next :meth:`Maintenance.wait` (the next batch's
  commit, or the job's close): the job fails, as it did with the maintenance in line. A process
  killed mid-round leaves what a kill between batches leaves: superseded files (the next start's
  :meth:`WarehouseSink.recover` bounds them again), files no commit references (the orphans it
  deletes) and a compaction committed whole or not at all.

The seconds each step took are summed per name for the batch report (:meth:`Maintenance.phases`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager


class Maintenance:
    """One thread running the rounds handed to it, in order. :meth:`wait` returns once every round
    handed over so far is done, raising the first error one of them raised."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self._phases: dict[str, float] = {}

    def submit(self, round_: Callable[[], None]) -> None:
        """Run ``round_`` on the maintenance thread after the rounds handed over before it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdc-warehouse-maintain")
        self._pending.append(self._pool.submit(self._timed_round, round_))

    def _timed_round(self, round_: Callable[[], None]) -> None:
        with self.timed("round"):
            round_()

    @property
    def busy(self) -> bool:
        """A round handed over is not done yet."""
        return any(not f.done() for f in self._pending)

    def wait(self) -> float:
        """Wait for every round handed over; the seconds waited. Raises the first round's error
        (the others are waited for first: none is left running)."""
        t0 = time.monotonic()
        pending, self._pending = self._pending, []
        error: BaseException | None = None
        for f in pending:
            exc = f.exception()
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error
        return time.monotonic() - t0

    def close(self) -> None:
        """:meth:`wait`, then end the thread."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Add the seconds of the block to the phase ``name`` (any thread)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - t0)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._phases[name] = self._phases.get(name, 0.0) + seconds

    def phases(self) -> dict[str, float]:
        """The seconds per step since the last call (and cleared)."""
        with self._lock:
            out, self._phases = self._phases, {}
        return out
