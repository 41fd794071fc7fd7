"""Snapshot progress on stderr: a rich progress bar per table (stderr is a TTY, not ``--json``),
one JSON line per table about every second (``--json``), or nothing."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import orjson


class NullProgress:
    def start(self, table: str, estimate: int) -> None:
        pass

    def advance(self, table: str, rows: int) -> None:
        pass

    def finish(self, table: str, rows: int) -> None:
        pass

    def close(self) -> None:
        pass


class JsonProgress:
    """``{"event": "snapshot_progress", "table", "rows", "estimate", "rate", "done"}`` lines on
    stderr, per table at most every ``interval_s`` and once when the table is done."""

    def __init__(self, interval_s: float = 1.0, stream: Any = None) -> None:
        self.interval_s = interval_s
        self.stream = stream or sys.stderr
        self.lock = threading.Lock()
        self.tables: dict[str, list[float]] = {}  # table -> [rows, estimate, started, last_print]

    def _emit(self, table: str, done: bool) -> None:
        rows, estimate, started, _ = self.tables[table]
        rate = rows / max(time.monotonic() - started, 1e-6)
        line = {
            "event": "snapshot_progress",
            "table": table,
            "rows": int(rows),
            "estimate": int(estimate),
            "rate": round(rate, 1),
            "done": done,
        }
        self.stream.write(orjson.dumps(line).decode() + "\n")
        self.stream.flush()

    def start(self, table: str, estimate: int) -> None:
        with self.lock:
            now = time.monotonic()
            self.tables[table] = [0, estimate, now, now]
            self._emit(table, False)

    def advance(self, table: str, rows: int) -> None:
        with self.lock:
            entry = self.tables[table]
            entry[0] += rows
            now = time.monotonic()
            if now - entry[3] >= self.interval_s:
                entry[3] = now
                self._emit(table, False)

    def finish(self, table: str, rows: int) -> None:
        with self.lock:
            self.tables[table][0] = rows
            self._emit(table, True)

    def close(self) -> None:
        pass


class RichProgress:
    """A rich progress bar per table (rows done of the estimate, rate) on stderr."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]:>10,.0f} rows/s"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.progress.start()
        self.lock = threading.Lock()
        self.tasks: dict[str, tuple[Any, float]] = {}

    def start(self, table: str, estimate: int) -> None:
        with self.lock:
            task = self.progress.add_task(table, total=max(estimate, 1), rate=0.0)
            self.tasks[table] = (task, time.monotonic())

    def advance(self, table: str, rows: int) -> None:
        with self.lock:
            task, started = self.tasks[table]
            self.progress.advance(task, rows)
            done = self.progress.tasks[task].completed
            total = self.progress.tasks[task].total or 0
            self.progress.update(
                task, rate=done / max(time.monotonic() - started, 1e-6), total=max(total, done)
            )

    def finish(self, table: str, rows: int) -> None:
        with self.lock:
            task, _ = self.tasks[table]
            self.progress.update(task, completed=rows, total=max(rows, 1))

    def close(self) -> None:
        self.progress.stop()


def make_progress(as_json: bool, tty: bool | None = None) -> NullProgress | JsonProgress | RichProgress:
    if as_json:
        return JsonProgress()
    if tty if tty is not None else sys.stderr.isatty():
        return RichProgress()
    return NullProgress()
