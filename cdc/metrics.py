"""Counters a process publishes for on-call: ``<state>/metrics/<role>.json``.

A long-running process (``cdc run``: role ``capture``; ``cdc apply``: role ``apply``) holds one
:class:`Publisher`. It counts (:meth:`Publisher.add`), keeps gauges (:meth:`Publisher.set`), the
newest source commit time per table (:meth:`Publisher.newest`), batch durations
(:meth:`Publisher.batch`) and its last error (:meth:`Publisher.error`), and writes them all as one
JSON object. ``cdc status`` and ``cdc serve`` read them with :func:`read_all` / :func:`read`.

Guarantees
----------
* **Atomic**: a file is written to a temporary name in the same directory, fsync'd, then renamed
  over the old one: a reader sees the previous or the next snapshot, never a torn file. Mode 0600.
* **Heartbeat**: :meth:`Publisher.start` writes the file at once and then every ``interval_s`` from
  a daemon thread (``heartbeat_ms`` moves while the process lives, even when it has nothing to do);
  :meth:`Publisher.close` writes a final snapshot with ``stopped_ms`` set. A process killed with -9
  leaves its file as it was: a reader judges it by ``pid``/``host`` (is the process alive?) and the
  age of ``heartbeat_ms``.
* Publishing never raises into the caller's work: a failed write is kept as ``publish_error`` and
  retried at the next interval (the counters are for on-call, the pipeline's data does not depend
  on them). Counters are per process life (they start at 0); Prometheus' ``rate()`` handles the reset.

File schema (version 1)::

    {"version": 1, "role", "pid", "pid_started" (:func:`cdc.locks.process_start`) | null, "host",
     "started_ms", "heartbeat_ms", "stopped_ms" | null,
     "counters": {name: int}, "gauges": {name: number},
     "tables": {"schema.table": {"newest_commit_ms": int}},
     "batches": {"count", "seconds_sum", "seconds_max", "seconds_last"},
     "last_error": null | {"type", "message", "fix", "at_ms"}}
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from cdc import paths
from cdc.errors import CdcError, ConfigError
from cdc.locks import process_runs, process_start

__all__ = ["ROLES", "Publisher", "metrics_path", "pid_alive", "read", "read_all"]

VERSION = 1
#: the roles the pipeline's processes publish as
ROLES = ("capture", "apply")
_ROLE = re.compile(r"[a-z][a-z0-9_-]{0,40}")


def metrics_path(state_dir: Path, role: str) -> Path:
    """``<state>/metrics/<role>.json``; a role that is not ``[a-z][a-z0-9_-]*`` is a ConfigError
    (so it can never name a path outside the directory)."""
    if not _ROLE.fullmatch(role):
        raise ConfigError(f"metrics role {role!r} is not a valid name", fix="use [a-z][a-z0-9_-]*")
    return paths.metrics_file(state_dir, role)


def now_ms() -> int:
    return int(time.time() * 1000)


class Publisher:
    """One process's counters; see the module docstring. Thread-safe."""

    def __init__(self, state_dir: Path, role: str, *, interval_s: float = 2.0) -> None:
        self.path = metrics_path(state_dir, role)
        self.role = role
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._doc: dict[str, Any] = {
            "version": VERSION,
            "role": role,
            "pid": os.getpid(),
            "pid_started": process_start(os.getpid()),
            "host": socket.gethostname(),
            "started_ms": now_ms(),
            "heartbeat_ms": now_ms(),
            "stopped_ms": None,
            "counters": {},
            "gauges": {},
            "tables": {},
            "batches": {"count": 0, "seconds_sum": 0.0, "seconds_max": 0.0, "seconds_last": 0.0},
            "last_error": None,
        }

    # -- recording ---------------------------------------------------------------------------------
    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            counters = self._doc["counters"]
            counters[name] = int(counters.get(name, 0)) + int(n)

    def total(self, name: str, value: int) -> None:
        """Set a counter to the running total the caller keeps itself (never lowers it)."""
        with self._lock:
            counters = self._doc["counters"]
            counters[name] = max(int(counters.get(name, 0)), int(value))

    def set(self, name: str, value: float | int | None) -> None:
        with self._lock:
            self._doc["gauges"][name] = value

    def newest(self, table: str, commit_ms: int | None) -> None:
        """Record that a change of ``table`` committed at ``commit_ms`` was handled (keeps the max)."""
        if commit_ms is None:
            return
        with self._lock:
            entry = self._doc["tables"].setdefault(table, {"newest_commit_ms": 0})
            entry["newest_commit_ms"] = max(int(entry["newest_commit_ms"] or 0), int(commit_ms))

    def batch(self, seconds: float) -> None:
        with self._lock:
            b = self._doc["batches"]
            b["count"] += 1
            b["seconds_sum"] += seconds
            b["seconds_max"] = max(b["seconds_max"], seconds)
            b["seconds_last"] = seconds

    def error(self, exc: BaseException) -> None:
        """Record ``exc`` as the last error and publish at once."""
        with self._lock:
            self._doc["last_error"] = {
                "type": type(exc).__name__,
                "message": str(exc)[:2000],
                "fix": exc.fix if isinstance(exc, CdcError) else None,
                "at_ms": now_ms(),
            }
        self.publish()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return orjson.loads(orjson.dumps(self._doc))  # type: ignore[no-any-return]

    # -- writing -----------------------------------------------------------------------------------
    def publish(self) -> None:
        """Write the file now (atomically, 0600)."""
        with self._lock:
            self._doc["heartbeat_ms"] = now_ms()
            body = orjson.dumps(self._doc)
        try:
            _write_atomic(self.path, body)
            with self._lock:
                self._doc.pop("publish_error", None)
        except OSError as exc:  # kept and retried: the pipeline's data does not depend on this file
            with self._lock:
                self._doc["publish_error"] = f"{type(exc).__name__}: {exc}"

    def start(self) -> Publisher:
        """Publish now, then every ``interval_s`` until :meth:`close`."""
        self.publish()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"cdc-metrics-{self.role}", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()

    def close(self) -> None:
        """Stop the heartbeat and publish a final snapshot with ``stopped_ms``. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._doc["stopped_ms"] is None:
                self._doc["stopped_ms"] = now_ms()
        self.publish()

    def __enter__(self) -> Publisher:
        return self.start()

    def __exit__(self, exc_type: object, exc: BaseException | None, _tb: object) -> None:
        if exc is not None and not isinstance(exc, KeyboardInterrupt):
            self.error(exc)
        self.close()


def _write_atomic(path: Path, body: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def read(state_dir: Path, role: str) -> dict[str, Any] | None:
    """The role's last published snapshot, or None when it never published (or the file is not a
    metrics file: a half-written one cannot exist, see the module docstring)."""
    try:
        doc = orjson.loads(metrics_path(state_dir, role).read_bytes())
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) and doc.get("version") == VERSION else None


def read_all(state_dir: Path) -> dict[str, dict[str, Any]]:
    """Every role's snapshot under ``<state>/metrics``."""
    out: dict[str, dict[str, Any]] = {}
    base = paths.metrics_dir(state_dir)
    if not base.is_dir():
        return out
    for path in sorted(base.glob("*.json")):
        role = path.stem
        if _ROLE.fullmatch(role):
            doc = read(state_dir, role)
            if doc is not None:
                out[role] = doc
    return out


def pid_alive(doc: Mapping[str, Any]) -> bool | None:
    """Whether the process that wrote ``doc`` still runs: None when it ran on another host (then
    only its heartbeat's age tells)."""
    if doc.get("stopped_ms"):
        return False
    if doc.get("host") != socket.gethostname():
        return None
    started = doc.get("pid_started")
    return process_runs(int(doc.get("pid") or 0), None if started is None else int(started))
