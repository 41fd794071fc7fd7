"""The embedded store's files: one SQLite database per topic, its schema, connections and checks.

A topic file holds the topic's config (one ``topic`` row, written once), one ``partitions`` row per
partition (start and end offsets, live records and bytes, compaction bookkeeping) and one table of
record batches per partition (``p0``, ``p1``, ...; one row per append per partition, keyed by the
batch's last offset). :class:`Guard` turns sqlite3 and msgspec failures on a file into the service's
errors (a full disk: :class:`~cdc.logstore.StoreFullError`; corrupt content:
:class:`~cdc.errors.StoreCorruptError` naming the file and the fix).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import sqlite3
import threading
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import msgspec

from cdc.errors import LogStoreError, StoreCorruptError
from cdc.logstore import StoreFullError, TopicConfig

__all__ = [
    "BATCH_TABLE",
    "CONSUMERS_FILE",
    "FORMAT_VERSION",
    "PAGE_SIZE",
    "SCHEMA",
    "TOPIC_NAME",
    "Guard",
    "TopicHandle",
    "check_header",
    "config_from_json",
    "config_to_json",
    "connect",
    "corrupt_error",
    "fsync_dir",
    "store_full_error",
    "tombstone_wait",
    "write_txn",
]

FORMAT_VERSION = 1
PAGE_SIZE = 16384  # batches are ~10-100 KB compressed: small pages waste little in overflow chains
TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
CONSUMERS_FILE = "consumers.sqlite"

FIX_CORRUPT = (
    "restore {path} from a backup, or delete it (with its -wal and -shm files) and rebuild the topic: "
    "`cdc snapshot` re-snapshots the tables whose events it held"
)


def tombstone_wait(config: TopicConfig) -> int:
    """How long after its append a tombstone may be dropped (it must also be past the compaction lag)."""
    return max(config.delete_retention_ms, config.min_compaction_lag_ms)


# -- errors ---------------------------------------------------------------------------------------------
def corrupt_error(path: Path, what: str, exc: BaseException | None = None) -> StoreCorruptError:
    detail = f": {exc}" if exc is not None else ""
    return StoreCorruptError(
        f"log-store file {path} is corrupt or truncated ({what}{detail})",
        fix=FIX_CORRUPT.format(path=path),
        path=str(path),
    )


def check_header(path: Path) -> None:
    """Cheap structural checks of a SQLite file: the magic string and the page count against the size."""
    try:
        with path.open("rb") as fh:
            head = fh.read(100)
        size = path.stat().st_size
    except OSError as exc:
        raise LogStoreError(
            f"cannot read log-store file {path}: {exc}",
            fix="check the file's permissions and that the disk is mounted",
            path=str(path),
        ) from exc
    if len(head) < 100 or not head.startswith(b"SQLite format 3\x00"):
        raise corrupt_error(path, "the SQLite header is missing or overwritten")
    page_size = int.from_bytes(head[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(head[28:32], "big")
    # The in-header page count is valid when the change counter equals "version valid for". A crash
    # in the middle of a checkpoint can leave page 1 (with the new count) written before the pages
    # that extend the file; the WAL still holds those pages and SQLite redoes the checkpoint, so the
    # size only proves truncation when there is no WAL left to recover from.
    wal = path.with_name(path.name + "-wal")
    wal_pending = wal.exists() and wal.stat().st_size > 0
    if not wal_pending and head[24:28] == head[92:96] and pages and size < pages * page_size:
        raise corrupt_error(path, f"the file has {size} bytes but its header says {pages * page_size}")


def _disk_full(exc: BaseException) -> bool:
    """SQLite's SQLITE_FULL (its VFS reports ENOSPC as that), or ENOSPC/EDQUOT from the OS."""
    if isinstance(exc, sqlite3.Error):
        return (getattr(exc, "sqlite_errorcode", 0) & 0xFF) == sqlite3.SQLITE_FULL
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def store_full_error(path: Path, exc: BaseException) -> StoreFullError:
    try:
        free: int | None = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    return StoreFullError(
        f"the disk holding the log store is full: {path} could not be written ({exc}; "
        f"{'unknown' if free is None else f'{free:,}'} bytes free)",
        fix=f"free space on the file system of {path.parent} (or give the state directory a larger disk: "
        "--state / CDC_STATE). Nothing acknowledged was lost and the failed write left nothing behind; "
        "the writer goes on once there is space (a restarted `cdc run` resumes from its slot)",
        path=str(path),
        free_bytes=free,
    )


class Guard:
    """Maps sqlite3/msgspec/OS failures on one file to the service's errors: a full disk to
    StoreFullError, other SQLite operational errors to LogStoreError, unreadable content to
    StoreCorruptError."""

    __slots__ = ("path",)

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, LogStoreError):
            return
        if _disk_full(exc):
            raise store_full_error(self.path, exc) from exc
        if isinstance(exc, sqlite3.OperationalError):
            raise LogStoreError(
                f"log-store file {self.path}: {exc}",
                fix="check free disk space and permissions; if another process holds the file busy, retry",
                path=str(self.path),
            ) from exc
        if isinstance(exc, sqlite3.DatabaseError | msgspec.DecodeError):
            raise corrupt_error(self.path, "unreadable content", exc) from exc


# -- one topic file -------------------------------------------------------------------------------------
SCHEMA = """
CREATE TABLE topic (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    name TEXT NOT NULL,
    format INTEGER NOT NULL,
    partitions INTEGER NOT NULL,
    config TEXT NOT NULL,
    created_ms INTEGER NOT NULL
);
CREATE TABLE partitions (
    partition INTEGER PRIMARY KEY,
    start_offset INTEGER NOT NULL,   -- first readable offset (moves with retention only)
    end_offset INTEGER NOT NULL,     -- the offset the next record gets
    records INTEGER NOT NULL,        -- live records
    bytes INTEGER NOT NULL,          -- live batch bytes
    dirty INTEGER NOT NULL,          -- records appended since the last compaction
    tombstone_due_ms INTEGER         -- earliest time a kept tombstone may be dropped
);
"""

BATCH_TABLE = """
CREATE TABLE p{n} (
    last_offset INTEGER PRIMARY KEY,  -- the batch's last offset when written (never changes)
    base_offset INTEGER NOT NULL,
    count INTEGER NOT NULL,
    append_ms INTEGER NOT NULL,
    tombstones INTEGER NOT NULL,
    data BLOB NOT NULL
)
"""


# SQLite memory per connection. A reading instance keeps a large page cache and maps the file (read
# speed). A writer instance mostly appends (the reader process, whose RSS is bounded) and reads only
# for compaction, so it keeps a small cache and no mapping: its memory does not grow with the topic.
READ_CACHE_KIB = 65536
READ_MMAP_BYTES = 268435456
WRITER_CACHE_KIB = 8192
WRITER_MMAP_BYTES = 0


def connect(path: Path, *, create: bool = False, writer: bool = False) -> sqlite3.Connection:
    uri = f"file:{path}?mode={'rwc' if create else 'rw'}"
    conn = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout=60000")
    if create:
        conn.execute(f"PRAGMA page_size={PAGE_SIZE}")
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute(f"PRAGMA cache_size=-{WRITER_CACHE_KIB if writer else READ_CACHE_KIB}")
    conn.execute(f"PRAGMA mmap_size={WRITER_MMAP_BYTES if writer else READ_MMAP_BYTES}")
    return conn


@contextlib.contextmanager
def write_txn(conn: sqlite3.Connection) -> Iterator[None]:
    """A write transaction on ``conn`` (``BEGIN IMMEDIATE``): committed when the block ends, rolled
    back when it raises (the error goes on)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise


class TopicHandle:
    """A topic file opened by one instance: its immutable config and its connection."""

    def __init__(
        self, name: str, path: Path, config: TopicConfig, conn: sqlite3.Connection, ident: tuple[int, int]
    ) -> None:
        self.name = name
        self.path = path
        self.ident = ident  # (st_dev, st_ino) of the file this instance opened
        self.config = config
        self.conn = conn
        self.guard = Guard(path)
        self.end: dict[int, int] | None = None  # cached end offsets, only while holding the lock
        self.maintenance = threading.Lock()  # one compaction/retention at a time in this instance
        # Write transactions of this instance's threads (appends, background compaction) queue here,
        # handed over at once, instead of polling SQLite's busy handler (which sleeps up to 100 ms).
        self.write_lock = threading.Lock()
        self.bg_conn: sqlite3.Connection | None = None  # the background thread's (under maintenance)
        self.deleted = False  # set by delete_topic under maintenance


def config_to_json(config: TopicConfig) -> str:
    return json.dumps(asdict(config), sort_keys=True)


def config_from_json(text: str) -> TopicConfig:
    return TopicConfig(**json.loads(text))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
