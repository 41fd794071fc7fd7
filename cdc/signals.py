"""SIGTERM and SIGINT as a request to stop gracefully (``cdc apply``).

A supervisor stops a service with ``SIGTERM``, often to its whole process group (``kill -TERM
-PGID``); Ctrl-C sends ``SIGINT`` to the terminal's foreground group. Either, while
:class:`StopSignals` is installed, asks the process to stop gracefully: it sets :attr:`requested` and
calls every callback given to :meth:`on_stop` (now, or at once when one is added later -- a signal
that arrives while Spark is still starting is not lost). A second ``SIGINT`` aborts
(``KeyboardInterrupt``), as a user pressing Ctrl-C again expects; a second ``SIGTERM`` changes
nothing (the supervisor's own timeout escalates to ``SIGKILL``).

Handlers can only be installed from the main thread: elsewhere (a job run on a thread by a test)
:class:`StopSignals` installs nothing and only :meth:`request` stops.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

#: the signals that ask for a graceful stop
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Context manager: ``SIGTERM``/``SIGINT`` handlers requesting a graceful stop (module docstring);
    the previous handlers are restored on exit."""

    def __init__(self, name: str, doing: str = "stopping") -> None:
        self.name, self.doing = name, doing
        self.requested = threading.Event()
        self._callbacks: list[Callable[[], None]] = []
        # reentrant: a handler runs on the main thread, possibly while it holds the lock (on_stop)
        self._lock = threading.RLock()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def install(self) -> None:
        """Install the handlers (again): pyspark's SparkContext replaces the SIGINT handler with its
        own when it starts (it cancels every job and raises ``KeyboardInterrupt``, calling into py4j
        from the handler), so ``cdc apply`` takes it back once Spark is up. :meth:`__exit__` restores
        the handlers of before the first install."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._on_signal)
            self._previous.setdefault(sig, previous)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when a stop is requested (at once if one already was)."""
        with self._lock:
            self._callbacks.append(callback)
            now = self.requested.is_set()
        if now:
            callback()

    def request(self, why: str = "stop requested") -> None:
        """Ask for the graceful stop (what the first signal does)."""
        with self._lock:
            first = not self.requested.is_set()
            self.requested.set()
            callbacks = list(self._callbacks)
        if first:
            # os.write: a signal handler may interrupt the main thread inside a write to sys.stderr
            os.write(2, f"{self.name}: {why}\n".encode())
        for callback in callbacks:
            callback()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.requested.is_set():
            raise KeyboardInterrupt  # Ctrl-C again: abort now
        again = " (Ctrl-C again aborts)" if signum == signal.SIGINT else ""
        self.request(f"{name}: {self.doing}{again}")
