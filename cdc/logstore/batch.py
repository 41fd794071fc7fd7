"""The log store's write batch: events buffered per topic and appended by a writer thread, with
the highest stream position that is durable (the reader confirms only that: ``docs/architecture.md``,
"Delivery"; the snapshot writes its rows through it too), and the image changes of those events
(:mod:`cdc.logstore.images`), committed once the events are durable."""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, MutableSequence

from cdc import faults
from cdc.logstore import LogStore, Record
from cdc.logstore.images import Sealed, Staging
from cdc.native import load

#: the compiled records' interface version (``cdc.logstore._records.ABI``) this module drives
RECORDS_ABI = 1


def records_form() -> Callable[..., MutableSequence[Record]]:
    """What a batch holds one topic's records in: the compiled :class:`cdc.logstore._records.Records`
    (each record's bytes in one buffer, no object per record: the compiled per-change path writes
    into it, the embedded store's compiled append reads it), or, where it is not there (not built,
    ``CDC_NATIVE=0``), its reference, a ``list``. Both are a ``Sequence[Record]`` to the log stores."""
    module = load("cdc.logstore._records", RECORDS_ABI)[0]
    return list if module is None else module.Records


def _crash_after_append() -> None:
    sys.stderr.write("cdc-fault: reader.after_append\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Batch:
    """Events waiting to be appended to the log store, per topic, and a writer thread that appends
    them while the stream loop goes on decoding.

    :meth:`submit` hands the buffered events, together with the stream position they complete
    (a transaction boundary, or None mid-transaction), to the writer; at most ``depth`` batches are
    in flight (then it blocks: back-pressure, bounded memory). :attr:`durable` is the highest
    boundary whose batch -- and every batch before it -- the log store acknowledged as durable;
    only that may be confirmed to the slot. :meth:`flush` submits and waits. A writer error is
    re-raised in the caller by the next :meth:`submit`/:meth:`flush`/:meth:`check`; nothing after
    it is marked durable.

    Each topic's events are held in :func:`records_form`'s form (the compiled ``Records``: the
    compiled per-change path writes each change's key and value straight into it).

    ``staging``: where the producer stages the image changes of the events it adds
    (:mod:`cdc.logstore.images`); each batch's are sealed with it and committed by the writer right
    after its append, before the batch counts as durable.
    """

    def __init__(
        self,
        store: LogStore,
        lock: threading.Lock | None = None,
        depth: int = 2,
        staging: Staging | None = None,
    ) -> None:
        self.store = store
        self.staging = staging
        self._images = None if staging is None else staging.images
        self.lock = lock or threading.Lock()
        self.form = records_form()
        self.records: dict[str, MutableSequence[Record]] = {}
        self.count = 0
        self.started = 0.0
        self.written = 0
        self.durable = 0
        self.submitted = 0  # highest boundary handed to the writer
        self.inflight = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._queue: queue.Queue[
            tuple[dict[str, MutableSequence[Record]], int, int | None, Sealed | None] | None
        ] = queue.Queue(depth)
        self._thread = threading.Thread(target=self._run, name="cdc-log-writer", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        """Nothing buffered and nothing in flight."""
        return not self.count and not self.inflight

    def add(self, topic: str, records: list[Record]) -> None:
        if not self.count:
            self.started = time.monotonic()
        lst = self.records.get(topic)
        if lst is None:
            self.records[topic] = lst = self.form()
        lst.extend(records)
        self.count += len(records)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            records, count, boundary, sealed = item
            try:
                if self._error is None:
                    with self.lock:
                        self.store.append_many(records)
                    if sealed is not None and self._images is not None:
                        faults.point("reader.after_append", None, _crash_after_append)
                        self._images.commit(sealed)
            except BaseException as exc:
                self._error = exc
            with self._cond:
                if self._error is None:
                    self.written += count
                    if boundary is not None and boundary > self.durable:
                        self.durable = boundary
                self.inflight -= 1
                self._cond.notify_all()

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, boundary: int | None) -> None:
        """Hand the buffered events to the writer; ``boundary``: the position that is safe to
        confirm once they (and everything before) are durable."""
        self.check()
        sealed = None if self.staging is None else self.staging.seal()
        if not self.count and boundary is None and sealed is None:
            return
        with self._cond:
            self.inflight += 1
        if boundary is not None:
            self.submitted = max(self.submitted, boundary)
        self._queue.put((self.records, self.count, boundary, sealed))
        self.records = {}
        self.count = 0

    def flush(self, boundary: int | None = None) -> None:
        """Submit what is buffered and wait until everything submitted is durable."""
        if self.count or boundary is not None or (self.staging is not None and self.staging.changes):
            self.submit(boundary)
        with self._cond:
            while self.inflight and self._error is None:
                self._cond.wait(1.0)
        self.check()

    def close(self) -> None:
        """Stop the writer thread (batches already submitted are still written)."""
        self._queue.put(None)
        self._thread.join()
