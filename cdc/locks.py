"""One process per role per state directory: ``cdc run`` holds the ``run`` lock, ``cdc apply`` the
``apply`` lock, for their whole life. ``cdc deadletters replay`` writes the same sinks as ``cdc
apply``, so it holds the ``apply`` lock too while it runs (``command`` names it in the lock file and
in the refusal the other one gets).

A lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<state>/locks/<role>.lock``
(:func:`cdc.paths.lock_path`), a file created 0600 that holds the holder's pid, host and start time
as JSON. The kernel releases the lock when the process exits, however it exits (kill -9 included),
so a lock is never stale; the file stays and the next holder overwrites its content. A second
process asking for a held lock gets :class:`~cdc.errors.LockedError` (exit 2) naming the holder's
pid and host, before it has changed anything. Locks are per host: a state directory on a network
filesystem shared by two hosts is not supported.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path
from types import TracebackType

import orjson

from cdc.errors import LockedError
from cdc.paths import ensure_private_dir, lock_path

ROLES = ("run", "apply")


def process_runs(pid: int, started: int | None = None) -> bool:
    """Whether process ``pid`` of this host runs (``os.kill(pid, 0)``; one of another user's: yes).
    With ``started`` (its :func:`process_start` when it wrote its pid down): only if the process
    running as ``pid`` started then -- once a process is gone its pid is given to a later one, which
    is not it."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if started is not None:
        now = process_start(pid)
        return now is None or now == started
    return True


def process_start(pid: int) -> int | None:
    """When process ``pid`` of this host started, in clock ticks since boot (the 22nd field of
    ``/proc/<pid>/stat``): with the pid, it names one process. None where ``/proc`` does not tell
    (another OS, the process gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # field 2, the command, is in parentheses and may hold spaces and ")": count after the last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])  # fields[0] is the 3rd field (state)
    except (IndexError, ValueError):
        return None


class ProcessLock:
    """The lock of ``role`` on ``state_dir``; use as a context manager (or :meth:`acquire` /
    :meth:`release`)."""

    def __init__(self, state_dir: Path, role: str, command: str | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.role = role
        self.command = command or f"cdc {role}"
        self.path = lock_path(self.state_dir, role)
        self._fd: int | None = None

    def holder(self) -> dict[str, object]:
        """What the lock file says about its last holder (empty if nothing readable)."""
        try:
            body = orjson.loads(self.path.read_bytes() or b"{}")
        except (OSError, orjson.JSONDecodeError):
            return {}
        return body if isinstance(body, dict) else {}

    def acquire(self) -> ProcessLock:
        ensure_private_dir(self.path.parent)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            held = self.holder()
            pid, host = held.get("pid", "?"), held.get("host", "?")
            command = held.get("command") or f"cdc {self.role}"
            raise LockedError(
                f"another `{command}` (pid {pid} on host {host}) is running on the state directory "
                f"{self.state_dir}; nothing was changed",
                fix=f"stop that process first (kill {pid} on {host}), or use another --state / CDC_STATE",
                role=self.role,
                path=str(self.path),
                pid=pid,
                host=host,
            ) from None
        except BaseException:
            os.close(fd)
            raise
        body = orjson.dumps(
            {
                "role": self.role,
                "command": self.command,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.time(),
            }
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, body + b"\n", 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ProcessLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
