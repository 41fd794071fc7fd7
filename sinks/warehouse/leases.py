"""Reader leases on the warehouse's Delta tables: what :mod:`.reclaim` never deletes
(``docs/warehouse.md``, The readers).

A reader of a Delta table outside the apply job (``cdc sql``, ``cdc verify``, ``cdc rebuild``, a view
built at ``cdc views add``) takes a lease on the table's directory with :func:`lease` *before* it
opens the table, and keeps it until its read is done. The lease is a small JSON file,
``<table>/_cdc_leases/<pid>-<random>.json``, holding ``pid``, ``started`` (when that process started,
:func:`cdc.locks.process_start`; null where the OS does not tell), ``host``, ``since`` (``time.time()``
when taken), ``expires`` (``since`` plus the lease's maximum length) and ``version``: the table's
latest committed version when the lease was taken (-1: none yet), read before the lease was
written.

The guarantee, with the reclaim of :mod:`.reclaim`: a file of any version the reader opens while
it holds the lease is not deleted before the lease ends (is released, expires, or its process
dies). The reader opens a version ``v >= version`` (it opens the latest, after the lease is
written), so every file of it that a later commit removes is removed by a commit past ``version``;
the reclaim keeps every file removed by the commits past the oldest live lease's ``version``. A
reclaim that listed the leases before this one was written deleted only files that the current
version did not reference -- and the reader opens the current version or a later one (the apply
job, the one writer, does not commit while it reclaims). Versions, not ``since``: a commit's file
time is when it was written, not when it became visible, and readers and the writer may not share a
clock.

A lease is stale, and ignored (and deleted by the reclaim that finds it), once ``expires`` has
passed or, on the same host, its process is gone (``os.kill(pid, 0)``, and a process of that pid
that started at another time is another one, its pid reused): a killed reader protects nothing for
long. A lease written before ``started`` was (none in the file) is judged by its pid alone. Hidden
from Delta: delta-rs's vacuum, lite and full, skips directories whose name starts with ``_`` (but
for partition directories; no partition column is named ``_cdc_leases``), and Delta readers read
only the files the log names.

The apply job's own reads of a table during a batch take no lease: the reclaim runs in the same
process after the batch commits (on its maintenance thread, :mod:`.background`, which deletes only
files that a commit of that batch or an earlier one superseded), so nothing is deleted under them;
nor do its Spark tasks, which read their buckets' files at a version at least the previous batch's:
the round reclaiming beside them deletes none of those files.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from cdc.errors import CdcError
from cdc.locks import process_runs, process_start
from sinks.warehouse.handles import COMMIT, LOG_DIR

#: the leases' directory inside a Delta table's (hidden from Delta: it starts with ``_``)
LEASE_DIR = "_cdc_leases"
#: the default longest lease, in seconds: a read longer than this may lose a file it reads
MAX_AGE_S = 3600.0


class LeaseError(CdcError):
    """A lease could not be taken, or a lease file is not one (``path``)."""


@dataclass(frozen=True)
class Lease:
    """A reader's lease (see the module docstring); ``path`` its file."""

    path: Path
    pid: int
    host: str
    since: float
    expires: float
    version: int
    #: when process ``pid`` started (:func:`cdc.locks.process_start`); None: not known
    started: int | None = None

    def live(self, now: float, host: str) -> bool:
        """Not expired at ``now``, and its process runs (when it is of ``host``, this one)."""
        return self.expires > now and (self.host != host or process_runs(self.pid, self.started))


def latest_version(table: Path) -> int:
    """The table's latest committed version by its log's commit files (-1: none)."""
    try:
        with os.scandir(table / LOG_DIR) as entries:
            versions = [int(m.group(1)) for e in entries if (m := COMMIT.match(e.name))]
    except FileNotFoundError:
        return -1
    return max(versions, default=-1)


@contextlib.contextmanager
def lease(table: Path, max_age_s: float = MAX_AGE_S) -> Iterator[Lease | None]:
    """Hold a lease on the Delta table at ``table`` for the ``with`` block: take it before opening
    the table, read inside. A read that lasts longer than ``max_age_s`` may lose files. None when
    ``table``'s directory does not exist: there is no file to keep (a table created meanwhile is
    read at its first versions, which an apply's reclaim sees as the current ones). The lease file
    is written atomically (a temporary name, then renamed; mode 0600 in a 0700 directory) and
    deleted at the end; LeaseError when it cannot be written."""
    if not table.is_dir():
        yield None
        return
    if max_age_s <= 0:
        raise LeaseError(
            f"a lease's maximum length must be positive, not {max_age_s}",
            fix="set [warehouse] lease_max_age_s > 0",
            max_age_s=max_age_s,
        )
    version = latest_version(table)
    since = time.time()
    folder = table / LEASE_DIR
    pid = os.getpid()
    name = f"{pid}-{secrets.token_hex(8)}.json"
    held = Lease(
        folder / name, pid, socket.gethostname(), since, since + max_age_s, version, process_start(pid)
    )
    body = {
        "pid": pid,
        "started": held.started,
        "host": held.host,
        "since": since,
        "expires": held.expires,
        "version": version,
    }
    tmp = folder / f".{name}.tmp"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(body))
        os.replace(tmp, held.path)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise LeaseError(
            f"cannot take a read lease on {table}: {exc}",
            fix=f"the reader needs write access to {folder} (a read without one may lose files to the apply's reclaim)",
            path=str(held.path),
        ) from exc
    try:
        yield held
    finally:
        with contextlib.suppress(FileNotFoundError):  # stale, and deleted by a reclaim meanwhile
            held.path.unlink()


def read_lease(path: Path) -> Lease | None:
    """The lease in file ``path`` (None: gone meanwhile, released). LeaseError when it is not a
    lease: a file of another program in ``_cdc_leases``, which must not be taken for none."""
    try:
        doc = orjson.loads(path.read_bytes())
        return Lease(
            path,
            int(doc["pid"]),
            str(doc["host"]),
            float(doc["since"]),
            float(doc["expires"]),
            int(doc["version"]),
            None if doc.get("started") is None else int(doc["started"]),
        )
    except FileNotFoundError:
        return None
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise LeaseError(
            f"{path} is not a read lease ({exc})",
            fix=f"delete {path}: only cdc's readers write in {path.parent}",
            path=str(path),
        ) from exc


def live_leases(table: Path, now: float | None = None) -> list[Lease]:
    """The live leases on the table at ``table`` (see :class:`Lease`); the stale ones found are
    deleted, and the temporary files of lease writes killed before their rename once older than
    :data:`MAX_AGE_S`."""
    now = time.time() if now is None else now
    host = socket.gethostname()
    try:
        with os.scandir(table / LEASE_DIR) as entries:
            names = [(e.name, e.path) for e in entries]
    except FileNotFoundError:
        return []
    out: list[Lease] = []
    for name, path in names:
        if name.startswith("."):  # a write in flight, or one killed before its rename
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_mtime < now - MAX_AGE_S:
                    os.unlink(path)
            continue
        held = read_lease(Path(path))
        if held is None:
            continue
        if held.live(now, host):
            out.append(held)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return out
