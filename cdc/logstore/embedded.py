"""The embedded log store: one SQLite file per topic on local disk, no server.

Layout under the store directory (the service passes ``<state>/log``)::

    <topic>.db          the topic: its config, per-partition offsets and its record batches (SQLite, WAL)
    <topic>.db-wal/-shm SQLite's write-ahead log and shared-memory index (part of the topic)
    <topic>.lock        the topic's single-writer lock (``fcntl.flock``; holds the writer's pid)
    consumers.sqlite    named consumer positions of every topic

Guarantees (beyond those of :class:`cdc.logstore.LogStore`)
-----------------------------------------------------------
* Durability: every write transaction is committed with ``synchronous=FULL`` in WAL mode, so
  :meth:`EmbeddedLogStore.append_many` returns only after the WAL is fsync'd. A crash (kill -9, power
  loss) keeps every acknowledged batch and shows no part of an unacknowledged one: the records an
  append writes to one topic are one SQLite transaction (atomic per topic; a batch spanning several
  topics is committed topic by topic, in sorted topic order).
* One writing process per topic: a ``writer=True`` instance takes ``<topic>.lock`` on the first
  append, compaction or deletion of that topic and holds it until :meth:`close`. Another process that
  tries gets :class:`~cdc.errors.WriterLockedError` naming the lock file and the holder's pid. Any number
  of ``writer=False`` instances (other processes: Spark executors, the CLI) read concurrently; they see
  whole committed batches only. A ``writer=False`` instance refuses to append, compact or create.
* Offsets are assigned per partition from 0 and never change. Records are stored in batches (one row
  per partition per append, keyed by the batch's last offset; a msgpack array of records, LZ4-compressed
  when that is smaller), so reads and appends cost one SQLite row per batch, not per record, and
  :meth:`EmbeddedLogStore.read` decodes a batch into ``StoredRecord`` objects in one C call (it pauses
  Python's cyclic GC for the duration of the call, which would otherwise dominate the cost).
* Readers and the writer must share one machine and a local file system (SQLite WAL uses shared
  memory next to the file; not over NFS).
* Compaction (compacted topics) keeps the newest record of every key, drops a tombstone once it is
  older than ``delete_retention_ms`` and never removes a record younger than ``min_compaction_lag_ms``.
  Ages are measured from the time the record was appended to this store (not from its
  ``timestamp_ms``, which the producer may set to the source's commit time). It runs in a background
  thread of a writer instance (for the topics that instance writes) every ``compaction_interval_s``,
  when a partition has enough new records or a tombstone is due, and on demand by :meth:`compact`. It
  rewrites a few batches per transaction, so appends and reads wait at most for one small transaction.
* Retention (non-compacted topics): whole batches are dropped once they were appended more than
  ``retention_ms`` ago, or oldest-first while a partition holds more than ``retention_bytes`` of stored
  (compressed) batch data; the start offset moves to the first batch kept, and reading before it raises
  :class:`~cdc.errors.OffsetOutOfRangeError` with the start offset and a fix. It runs in the background
  thread like compaction, and on demand by :meth:`enforce_retention`. Compacted topics ignore time/size retention (as
  Kafka does with ``cleanup.policy=compact``).
* A file that is not a SQLite database, is truncated, or holds an undecodable batch raises
  :class:`~cdc.errors.StoreCorruptError` with its path and a fix; nothing is rewritten or dropped.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import gc
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict
from itertools import repeat
from pathlib import Path
from typing import Any

import lz4.frame
import msgspec
import numpy as np

from cdc.errors import (
    LogStoreError,
    OffsetOutOfRangeError,
    StoreCorruptError,
    TopicExistsError,
    UnknownTopicError,
    WriterLockedError,
)
from cdc.logstore import LogStore, Record, StoredRecord, TopicConfig, TopicInfo, partition_for
from cdc.logstore.partitioner import partition_array

__all__ = ["EmbeddedLogStore"]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
PAGE_SIZE = 16384  # batches are ~10-100 KB compressed: small pages waste little in overflow chains
TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")
CONSUMERS_FILE = "consumers.sqlite"
#: background compaction of a partition starts when the records appended since its last compaction
#: reach this fraction of its live records (Kafka's min.cleanable.dirty.ratio), or a tombstone is due
DIRTY_RATIO = 0.5
#: batches rewritten per compaction transaction (keeps each write transaction short)
BATCHES_PER_TXN = 16

_FIX_CORRUPT = (
    "restore {path} from a backup, or delete it (with its -wal and -shm files) and rebuild the topic: "
    "`cdc snapshot` re-snapshots the tables whose events it held"
)

# A stored batch is a msgpack array of records, each a map with StoredRecord's field names, so that
# msgspec decodes a batch straight into StoredRecord objects (one C call per batch, no per-record Python).
_HeadersT = tuple[tuple[str, bytes], ...]


class _Out(msgspec.Struct, gc=False):
    """A record as written (encodes as a map with StoredRecord's field names, in its order)."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes | None
    headers: _HeadersT
    timestamp_ms: int


class _RawRec(msgspec.Struct, gc=False):
    """A stored record as compaction sees it: value and headers left encoded (copied through as-is)."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: msgspec.Raw
    headers: msgspec.Raw
    timestamp_ms: int


_ENCODER = msgspec.msgpack.Encoder()
_RECORD_DECODER = msgspec.msgpack.Decoder(list[StoredRecord])
_RAW_DECODER = msgspec.msgpack.Decoder(list[_RawRec])
_MSGPACK_NIL = msgspec.Raw(b"\xc0")

# Batch blob framing: one codec byte, then (lz4) the uncompressed size as 4 bytes little-endian.
_CODEC_NONE = 0
_CODEC_LZ4 = 1


def _pack(rows: Sequence[Any], compress: bool) -> bytes:
    data = _ENCODER.encode(rows)
    if compress:
        packed: bytes = lz4.frame.compress(data)
        if len(packed) < len(data):
            return bytes((_CODEC_LZ4,)) + len(data).to_bytes(4, "little") + packed
    return bytes((_CODEC_NONE,)) + data


def _unpack(blob: bytes) -> bytes | memoryview:
    codec = blob[0]
    if codec == _CODEC_NONE:
        return memoryview(blob)[1:]
    if codec == _CODEC_LZ4:
        size = int.from_bytes(blob[1:5], "little")
        data: bytes = lz4.frame.decompress(memoryview(blob)[5:])
        if len(data) != size:
            raise msgspec.DecodeError(f"lz4 batch decompressed to {len(data)} bytes, its header says {size}")
        return data
    raise msgspec.DecodeError(f"unknown batch codec {codec}")


def now_ms() -> int:
    return int(time.time() * 1000)


def _yield_gil() -> None:
    """Let a waiting thread (the writer's appends) take the GIL now rather than after the switch
    interval: maintenance runs beside appends in the same process and must not hold them up."""
    time.sleep(0)


def _tombstone_wait(config: TopicConfig) -> int:
    """How long after its append a tombstone may be dropped (it must also be past the compaction lag)."""
    return max(config.delete_retention_ms, config.min_compaction_lag_ms)


# -- errors ---------------------------------------------------------------------------------------------
def _corrupt(path: Path, what: str, exc: BaseException | None = None) -> StoreCorruptError:
    detail = f": {exc}" if exc is not None else ""
    return StoreCorruptError(
        f"log-store file {path} is corrupt or truncated ({what}{detail})",
        fix=_FIX_CORRUPT.format(path=path),
        path=str(path),
    )


def _check_header(path: Path) -> None:
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
        raise _corrupt(path, "the SQLite header is missing or overwritten")
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
        raise _corrupt(path, f"the file has {size} bytes but its header says {pages * page_size}")


class _Guard:
    """Maps sqlite3/msgspec failures on one file to the service's errors."""

    __slots__ = ("path",)

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is None or isinstance(exc, LogStoreError):
            return
        if isinstance(exc, sqlite3.OperationalError):
            raise LogStoreError(
                f"log-store file {self.path}: {exc}",
                fix="check free disk space and permissions; if another process holds the file busy, retry",
                path=str(self.path),
            ) from exc
        if isinstance(exc, sqlite3.DatabaseError | msgspec.DecodeError):
            raise _corrupt(self.path, "unreadable content", exc) from exc


# -- one topic file -------------------------------------------------------------------------------------
_SCHEMA = """
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

_BATCH_TABLE = """
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


def _connect(path: Path, *, create: bool = False, writer: bool = False) -> sqlite3.Connection:
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


class _Topic:
    """A topic file opened by one instance: its immutable config and its connection."""

    def __init__(
        self, name: str, path: Path, config: TopicConfig, conn: sqlite3.Connection, ident: tuple[int, int]
    ) -> None:
        self.name = name
        self.path = path
        self.ident = ident  # (st_dev, st_ino) of the file this instance opened
        self.config = config
        self.conn = conn
        self.guard = _Guard(path)
        self.end: dict[int, int] | None = None  # cached end offsets, only while holding the lock
        self.maintenance = threading.Lock()  # one compaction/retention at a time in this instance
        # Write transactions of this instance's threads (appends, background compaction) queue here,
        # handed over at once, instead of polling SQLite's busy handler (which sleeps up to 100 ms).
        self.write_lock = threading.Lock()
        self.bg_conn: sqlite3.Connection | None = None  # the background thread's (under maintenance)
        self.deleted = False  # set by delete_topic under maintenance


def _config_to_json(config: TopicConfig) -> str:
    return json.dumps(asdict(config), sort_keys=True)


def _config_from_json(text: str) -> TopicConfig:
    return TopicConfig(**json.loads(text))


class EmbeddedLogStore(LogStore):
    """The embedded backend (see the module docstring for its guarantees).

    ``EmbeddedLogStore(path)`` reads (any number of processes); ``EmbeddedLogStore(path, writer=True)``
    may also create, append, compact and delete, taking each topic's single-writer lock on first use.
    ``compaction_interval_s`` (writer only; ``None`` or 0 disables it) is how often the background
    thread compacts the compacted topics, and applies retention to the others, that this instance writes.
    ``compress`` (writer only): store batches LZ4-compressed when that makes them smaller (readers handle
    both forms). A writer instance's SQLite connections keep a small page cache (``WRITER_CACHE_KIB``)
    and do not memory-map the topic files, so a process that appends (``cdc run``) stays small
    however large its topics grow; reading instances keep a 64 MiB cache and a 256 MiB mapping.
    """

    backend = "embedded"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        writer: bool = False,
        compaction_interval_s: float | None = 30.0,
        compress: bool = True,
    ) -> None:
        self.path = Path(path)
        self.writer = writer
        self.compress = compress
        self._lock = threading.RLock()
        self._topics: dict[str, _Topic] = {}
        self._locks: dict[str, int] = {}  # topic -> fd of its held lock file
        self._consumers: sqlite3.Connection | None = None
        self._closed = False
        self._bg_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if writer:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise LogStoreError(
                    f"cannot create the log-store directory {self.path}: {exc}",
                    fix="point the state directory (--state / CDC_STATE) at a writable local directory",
                    path=str(self.path),
                ) from exc
            if compaction_interval_s:
                self._thread = threading.Thread(
                    target=self._background,
                    args=(float(compaction_interval_s),),
                    name=f"cdc-logstore-compaction:{self.path}",
                    daemon=True,
                )
                self._thread.start()

    # -- helpers -----------------------------------------------------------------------------------
    def _topic_path(self, name: str) -> Path:
        if not TOPIC_NAME.fullmatch(name):
            raise LogStoreError(
                f"{name!r} is not a valid topic name",
                fix="use 1-200 characters from [A-Za-z0-9._-] (cdc.catalog builds topic names this way)",
                topic=name,
            )
        return self.path / f"{name}.db"

    def _check_open(self) -> None:
        if self._closed:
            raise LogStoreError(
                f"the log store at {self.path} is closed",
                fix="open a new EmbeddedLogStore",
                path=str(self.path),
            )
        if self._bg_error is not None:
            err = self._bg_error
            raise LogStoreError(
                f"background compaction of {self.path} failed: {err}",
                fix="see the error above; restart the process (it resumes from its checkpoint)",
                path=str(self.path),
            ) from err

    def _require_writer(self, what: str) -> None:
        if not self.writer:
            raise LogStoreError(
                f"cannot {what}: the log store at {self.path} was opened read-only (writer=False)",
                fix="open it with EmbeddedLogStore(path, writer=True) (open_log_store(settings, writer=True)) "
                "in the one process that writes this topic",
                path=str(self.path),
            )

    def _unknown(self, name: str) -> UnknownTopicError:
        return UnknownTopicError(
            f"topic {name!r} does not exist in the log store at {self.path}",
            fix="check the name with `cdc topic list`; topics are created when a table is registered "
            "(`cdc tables add`)",
            topic=name,
            path=str(self.path),
        )

    def _open_topic(self, name: str) -> _Topic:
        with self._lock:
            self._check_open()
            path = self._topic_path(name)
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None
            topic = self._topics.get(name)
            if topic is not None:
                if st is not None and (st.st_dev, st.st_ino) == topic.ident:
                    return topic
                self._forget(topic)  # deleted (and maybe re-created) by another process
            if st is None:
                raise self._unknown(name)
            _check_header(path)
            guard = _Guard(path)
            with guard:
                conn = _connect(path, writer=self.writer)
                try:
                    row = conn.execute("SELECT name, format, config FROM topic WHERE id = 0").fetchone()
                except BaseException:
                    conn.close()
                    raise
            if row is None or row[0] != name:
                conn.close()
                raise _corrupt(path, f"its topic row names {row[0] if row else None!r}, expected {name!r}")
            if row[1] != FORMAT_VERSION:
                conn.close()
                raise LogStoreError(
                    f"{path} has log-store format {row[1]}, this version reads format {FORMAT_VERSION}",
                    fix="run the cdc version that wrote it, or re-snapshot into a fresh state directory",
                    path=str(path),
                )
            topic = _Topic(name, path, _config_from_json(row[2]), conn, (st.st_dev, st.st_ino))
            self._topics[name] = topic
            return topic

    def _forget(self, topic: _Topic) -> None:
        """Drop this instance's handle on a topic file another process deleted."""
        with topic.maintenance:
            topic.deleted = True
            with contextlib.suppress(sqlite3.Error):
                topic.conn.close()
                if topic.bg_conn is not None:
                    topic.bg_conn.close()
            topic.bg_conn = None
        self._topics.pop(topic.name, None)
        fd = self._locks.pop(topic.name, None)
        if fd is not None:
            os.close(fd)

    def _take_lock(self, topic: _Topic) -> None:
        """Take ``<topic>.lock`` for this instance (once; held until close)."""
        self._require_writer(f"write topic {topic.name!r}")
        if topic.name in self._locks:
            return
        lock_path = self.path / f"{topic.name}.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise WriterLockedError(
                f"topic {topic.name!r} is being written by another process (pid {holder}): "
                f"{lock_path} is locked",
                fix=f"stop the process with pid {holder} (or let it finish) before writing this topic; "
                "only one process may write a topic, any number may read it (writer=False)",
                path=str(lock_path),
                holder=holder,
                topic=topic.name,
            ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._locks[topic.name] = fd
        topic.end = None  # re-read under the lock

    def _end_offsets(self, topic: _Topic, conn: sqlite3.Connection) -> dict[int, int]:
        with topic.guard:
            return dict(conn.execute("SELECT partition, end_offset FROM partitions").fetchall())

    # -- topics ------------------------------------------------------------------------------------
    def create_topic(self, name: str, config: TopicConfig) -> TopicInfo:
        path = self._topic_path(name)
        with self._lock:
            self._check_open()
            if path.exists():
                return self._existing(name, config)
            self._require_writer(f"create topic {name!r}")
            if config.partitions < 1:
                raise LogStoreError(
                    f"topic {name!r} needs at least one partition, got {config.partitions}",
                    fix="pass TopicConfig(partitions=N) with N >= 1",
                    topic=name,
                )
            tmp = self.path / f".{name}.db.tmp-{os.getpid()}-{threading.get_ident()}"
            for suffix in ("", "-wal", "-shm", "-journal"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{tmp}{suffix}")
            with _Guard(tmp):
                conn = _connect(tmp, create=True)
                try:
                    conn.executescript(_SCHEMA)
                    conn.execute("BEGIN")
                    conn.execute(
                        "INSERT INTO topic VALUES (0, ?, ?, ?, ?, ?)",
                        (name, FORMAT_VERSION, config.partitions, _config_to_json(config), now_ms()),
                    )
                    for p in range(config.partitions):
                        conn.execute(_BATCH_TABLE.format(n=p))
                        conn.execute("INSERT INTO partitions VALUES (?, 0, 0, 0, 0, 0, NULL)", (p,))
                    conn.execute("COMMIT")
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                finally:
                    conn.close()
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # atomic: fails if another process created the topic meanwhile
            except FileExistsError:
                return self._existing(name, config)
            finally:
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{tmp}{suffix}")
            _fsync_dir(self.path)
            return self.topic(name)

    def _existing(self, name: str, config: TopicConfig) -> TopicInfo:
        info = self.topic(name)
        if info.config.partitions != config.partitions:
            raise TopicExistsError(
                f"topic {name!r} exists with {info.config.partitions} partitions, not {config.partitions}",
                fix=f"use {info.config.partitions} partitions, or delete the topic first "
                f"(its records are lost) and create it again",
                topic=name,
                partitions=info.config.partitions,
                requested=config.partitions,
            )
        return info

    def delete_topic(self, name: str) -> None:
        with self._lock:
            topic = self._open_topic(name)
            self._take_lock(topic)
            with topic.maintenance:
                topic.deleted = True
                topic.conn.close()
                if topic.bg_conn is not None:
                    topic.bg_conn.close()
                    topic.bg_conn = None
                for suffix in (".db", ".db-wal", ".db-shm"):
                    with contextlib.suppress(FileNotFoundError):
                        (self.path / f"{name}{suffix}").unlink()
                _fsync_dir(self.path)
                del self._topics[name]
                fd = self._locks.pop(name)
                with contextlib.suppress(FileNotFoundError):
                    (self.path / f"{name}.lock").unlink()
                os.close(fd)
            consumers = self._consumer_conn(create=False)
            if consumers is not None:
                with _Guard(self.path / CONSUMERS_FILE):
                    consumers.execute("DELETE FROM positions WHERE topic = ?", (name,))

    def list_topics(self) -> list[TopicInfo]:
        if not self.path.is_dir():
            return []
        names = sorted(p.name[:-3] for p in self.path.glob("*.db") if TOPIC_NAME.fullmatch(p.name[:-3]))
        out = []
        for name in names:
            try:
                out.append(self.topic(name))
            except UnknownTopicError:  # deleted between the listing and now
                continue
        return out

    def topic(self, name: str) -> TopicInfo:
        topic = self._open_topic(name)
        with self._lock, topic.guard:
            rows = topic.conn.execute("SELECT partition, start_offset, end_offset FROM partitions").fetchall()
        return TopicInfo(
            name=name,
            config=topic.config,
            start_offsets={p: s for p, s, _ in rows},
            end_offsets={p: e for p, _, e in rows},
        )

    def record_counts(self, name: str) -> dict[int, int]:
        """Live records per partition (after compaction and retention); cheap (kept as a counter)."""
        topic = self._open_topic(name)
        with self._lock, topic.guard:
            return dict(topic.conn.execute("SELECT partition, records FROM partitions").fetchall())

    # -- writing -----------------------------------------------------------------------------------
    def append_many(self, batch: Mapping[str, Sequence[Record]]) -> dict[str, dict[int, int]]:
        self._require_writer("append")
        result: dict[str, dict[int, int]] = {}
        with self._lock:
            for name in sorted(batch):
                records = batch[name]
                if records:
                    result[name] = self._append(self._open_topic(name), records)
        return result

    def _append(self, topic: _Topic, records: Sequence[Record]) -> dict[int, int]:
        self._check_open()
        self._take_lock(topic)
        n = topic.config.partitions
        try:
            parts = self._partitions(topic, records)
        except (TypeError, ValueError, AttributeError):
            for i, r in enumerate(records):  # name the offending record
                _check_record(topic.name, i, r)
            raise
        now = now_ms()
        conn = topic.conn
        with topic.guard:
            if topic.end is None:
                topic.end = self._end_offsets(topic, conn)
            end = topic.end
            groups, tombstones = _stored_rows(topic.name, n, end, parts, records, now)
            packed = [(p, len(rows), _pack(rows, self.compress)) for p, rows in enumerate(groups) if rows]
            last: dict[int, int] = {}
            with topic.write_lock:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    for p, count, data in packed:
                        base = end[p]
                        lo = base + count - 1
                        conn.execute(
                            f"INSERT INTO p{p} VALUES (?, ?, ?, ?, ?, ?)",
                            (lo, base, count, now, tombstones[p], data),
                        )
                        due = now + _tombstone_wait(topic.config) if tombstones[p] else None
                        conn.execute(
                            "UPDATE partitions SET end_offset = ?, records = records + ?, bytes = bytes + ?, "
                            "dirty = dirty + ?, tombstone_due_ms = CASE WHEN ? IS NULL THEN tombstone_due_ms "
                            "ELSE min(coalesce(tombstone_due_ms, ?), ?) END WHERE partition = ?",
                            (lo + 1, count, len(data), count, due, due, due, p),
                        )
                        last[p] = lo
                    conn.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    topic.end = None
                    raise
            for p, lo in last.items():
                end[p] = lo + 1
        return last

    def _partitions(self, topic: _Topic, records: Sequence[Record]) -> Sequence[int] | np.ndarray:
        n = topic.config.partitions
        explicit = [r.partition for r in records]
        if explicit.count(None) != len(explicit):  # some record names its partition
            parts = [
                p if p is not None else partition_for(r.key, n)
                for p, r in zip(explicit, records, strict=True)
            ]
            for p in set(parts):
                if not 0 <= p < n:
                    raise LogStoreError(
                        f"record for topic {topic.name!r} names partition {p}, the topic has {n} (0..{n - 1})",
                        fix=f"leave Record.partition None or use a partition in 0..{n - 1}",
                        topic=topic.name,
                        partition=p,
                    )
        else:
            return partition_array([r.key for r in records], n)
        return parts

    # -- reading -----------------------------------------------------------------------------------
    def read(
        self, topic: str, partition: int, from_offset: int, max_records: int = 10_000
    ) -> list[StoredRecord]:
        """See :meth:`LogStore.read`. Reads one consistent snapshot (whole committed batches only)."""
        t = self._open_topic(topic)
        self._check_partition(t, partition)
        # Building thousands of (acyclic) records would trigger the cyclic GC over and over, which
        # costs more than the building itself; pause it for this call only.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with self._lock, t.guard:
                result = self._read_locked(t, partition, from_offset, max_records)
        finally:
            if gc_was_enabled:
                gc.enable()
        return result

    def _read_locked(
        self, t: _Topic, partition: int, from_offset: int, max_records: int
    ) -> list[StoredRecord]:
        conn = t.conn
        conn.execute("BEGIN")
        try:
            start, end = conn.execute(
                "SELECT start_offset, end_offset FROM partitions WHERE partition = ?", (partition,)
            ).fetchone()
            if not start <= from_offset <= end:
                raise self._out_of_range(t, partition, from_offset, start, end)
            if from_offset == end or max_records <= 0:
                return []
            dec = _RECORD_DECODER
            out: list[StoredRecord] = []
            cur = conn.execute(
                f"SELECT data FROM p{partition} WHERE last_offset >= ? ORDER BY last_offset", (from_offset,)
            )
            for (data,) in cur:
                recs = dec.decode(_unpack(data))
                if recs and recs[0].offset < from_offset:
                    i = 0
                    while i < len(recs) and recs[i].offset < from_offset:
                        i += 1
                    recs = recs[i:]
                out.extend(recs)
                if len(out) >= max_records:
                    break
            cur.close()
        finally:
            conn.execute("COMMIT")
        if len(out) > max_records:
            del out[max_records:]
        return out

    def iter_partition(
        self,
        topic: str,
        partition: int,
        from_offset: int = 0,
        until_offset: int | None = None,
        batch: int = 10_000,
    ) -> Iterator[StoredRecord]:
        """As :meth:`LogStore.iter_partition` (same records), with less work per record."""
        info = self.topic(topic)
        self._check_partition(self._open_topic(topic), partition)
        end = info.end_offsets[partition] if until_offset is None else until_offset
        pos = max(from_offset, info.start_offsets[partition])
        while pos < end:
            records = self.read(topic, partition, pos, min(batch, end - pos))
            if not records:
                return
            if records[-1].offset < end:
                yield from records
            else:
                for rec in records:
                    if rec.offset >= end:
                        return
                    yield rec
            pos = records[-1].offset + 1

    def _check_partition(self, topic: _Topic, partition: int) -> None:
        if not 0 <= partition < topic.config.partitions:
            raise LogStoreError(
                f"topic {topic.name!r} has no partition {partition} (it has {topic.config.partitions})",
                fix=f"use a partition in 0..{topic.config.partitions - 1}",
                topic=topic.name,
                partition=partition,
            )

    def _out_of_range(
        self, t: _Topic, partition: int, offset: int, start: int, end: int
    ) -> OffsetOutOfRangeError:
        if offset < start:
            why = f"before the start offset {start} (older records were removed by retention)"
            fix = f"read from offset {start} (the earliest kept); a consumer that fell behind lost those records"
        else:
            why = f"past the end offset {end}"
            fix = f"read from an offset in {start}..{end}; the end offset is where the next record goes"
        return OffsetOutOfRangeError(
            f"offset {offset} of {t.name!r} partition {partition} is {why}",
            fix=fix,
            topic=t.name,
            partition=partition,
            offset=offset,
            start=start,
            end=end,
        )

    def start_offsets(self, topic: str) -> dict[int, int]:
        return dict(self.topic(topic).start_offsets)

    def end_offsets(self, topic: str) -> dict[int, int]:
        return dict(self.topic(topic).end_offsets)

    # -- consumer positions ------------------------------------------------------------------------
    def _consumer_conn(self, *, create: bool) -> sqlite3.Connection | None:
        if self._consumers is not None:
            return self._consumers
        path = self.path / CONSUMERS_FILE
        if not path.exists():
            if not create:
                return None
            self.path.mkdir(parents=True, exist_ok=True)
        else:
            _check_header(path)
        with _Guard(path):
            conn = _connect(path, create=not path.exists())
            conn.execute(
                "CREATE TABLE IF NOT EXISTS positions (consumer TEXT NOT NULL, topic TEXT NOT NULL, "
                "partition INTEGER NOT NULL, next_offset INTEGER NOT NULL, committed_ms INTEGER NOT NULL, "
                "PRIMARY KEY (consumer, topic, partition)) WITHOUT ROWID"
            )
        self._consumers = conn
        return conn

    def commit(self, consumer: str, topic: str, offsets: Mapping[int, int]) -> None:
        """Durably store ``consumer``'s next offsets (any instance may commit, readers too)."""
        t = self._open_topic(topic)
        for p in offsets:
            self._check_partition(t, p)
        with self._lock:
            conn = self._consumer_conn(create=True)
            assert conn is not None
            now = now_ms()
            with _Guard(self.path / CONSUMERS_FILE):
                conn.execute("BEGIN IMMEDIATE")
                try:
                    conn.executemany(
                        "INSERT OR REPLACE INTO positions VALUES (?, ?, ?, ?, ?)",
                        [(consumer, topic, int(p), int(o), now) for p, o in offsets.items()],
                    )
                    conn.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    raise

    def committed(self, consumer: str, topic: str) -> dict[int, int]:
        self._open_topic(topic)
        with self._lock:
            conn = self._consumer_conn(create=False)
            if conn is None:
                return {}
            with _Guard(self.path / CONSUMERS_FILE):
                rows = conn.execute(
                    "SELECT partition, next_offset FROM positions WHERE consumer = ? AND topic = ?",
                    (consumer, topic),
                ).fetchall()
        return dict(rows)

    # -- maintenance -------------------------------------------------------------------------------
    def compact(self, topic: str) -> int:
        """Compact ``topic`` now (writer only; takes its lock); return how many records were removed.
        A non-compacted topic is left alone (0)."""
        t = self._open_topic(topic)
        with self._lock:
            self._take_lock(t)
        if not t.config.compacted:
            return 0
        return self._compact(t, t.conn)

    def enforce_retention(self, topic: str) -> int:
        """Apply ``retention_ms``/``retention_bytes`` to a non-compacted topic now (writer only; takes
        its lock); return how many records were removed. Compacted topics are left alone (0)."""
        t = self._open_topic(topic)
        with self._lock:
            self._take_lock(t)
        if t.config.compacted:
            return 0
        return self._retention(t, t.conn)

    def _maintenance_conn(self, t: _Topic, conn: sqlite3.Connection | None) -> sqlite3.Connection:
        """``conn``, or the background thread's own connection to ``t`` (call under ``t.maintenance``)."""
        if conn is not None:
            return conn
        if t.bg_conn is None:
            with t.guard:
                t.bg_conn = _connect(t.path, writer=True)
        return t.bg_conn

    def _compact(self, t: _Topic, conn: sqlite3.Connection | None, *, only_if_due: bool = False) -> int:
        removed = 0
        with t.maintenance:
            if t.deleted:
                return 0
            c = self._maintenance_conn(t, conn)
            for p in range(t.config.partitions):
                removed += self._compact_partition(t, c, p, only_if_due=only_if_due)
        return removed

    def _compact_partition(self, t: _Topic, conn: sqlite3.Connection, p: int, *, only_if_due: bool) -> int:
        cfg = t.config
        now = now_ms()
        guard = t.guard
        lock = self._lock if conn is t.conn else contextlib.nullcontext()
        with guard:
            with lock:
                records, dirty, due = conn.execute(
                    "SELECT records, dirty, tombstone_due_ms FROM partitions WHERE partition = ?", (p,)
                ).fetchone()
            if only_if_due and not (
                (dirty > 0 and dirty >= DIRTY_RATIO * records) or (due is not None and due <= now)
            ):
                return 0
            horizon = now - cfg.min_compaction_lag_ms  # batches appended at or before it are cleanable
            tomb_horizon = now - cfg.delete_retention_ms
            # Pass 1 (one read snapshot): the newest offset of every key, and which batches are cleanable.
            # Only keys and offsets are kept, so memory is bounded by the number of keys.
            newest: dict[bytes, int] = {}
            cleanable: list[int] = []
            with lock:
                conn.execute("BEGIN")
                try:
                    cur = conn.execute(f"SELECT last_offset, append_ms, data FROM p{p} ORDER BY last_offset")
                    for last, append_ms, data in cur:
                        for row in _RAW_DECODER.decode(_unpack(data)):
                            newest[row.key] = row.offset
                        if append_ms <= horizon:
                            cleanable.append(last)
                        _yield_gil()
                finally:
                    conn.execute("COMMIT")
            # Pass 2, a few batches at a time: rewrite the cleanable batches that hold superseded records
            # or expired tombstones (only this instance writes the topic, so they are as pass 1 saw them).
            removed = 0
            for i in range(0, len(cleanable), BATCHES_PER_TXN):
                chunk = cleanable[i : i + BATCHES_PER_TXN]
                with lock:
                    rows_of = conn.execute(
                        f"SELECT last_offset, append_ms, data FROM p{p} "
                        f"WHERE last_offset IN ({','.join('?' * len(chunk))})",
                        chunk,
                    ).fetchall()
                changes: list[tuple[int, int, int, list[_RawRec]]] = []
                for last, append_ms, data in rows_of:
                    rows = _RAW_DECODER.decode(_unpack(data))
                    expired = append_ms <= tomb_horizon
                    keep = [
                        r
                        for r in rows
                        if newest[r.key] == r.offset and not (expired and r.value == _MSGPACK_NIL)
                    ]
                    if len(keep) != len(rows):
                        changes.append((last, len(data), len(rows) - len(keep), keep))
                    _yield_gil()
                if not changes:
                    continue
                with lock, t.write_lock:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        delta_bytes = 0
                        delta_records = 0
                        for last, nbytes, gone, keep in changes:
                            if keep:
                                data = _pack(keep, self.compress)
                                tombs = sum(1 for r in keep if r.value == _MSGPACK_NIL)
                                conn.execute(
                                    f"UPDATE p{p} SET count = ?, tombstones = ?, data = ? WHERE last_offset = ?",
                                    (len(keep), tombs, data, last),
                                )
                                delta_bytes += nbytes - len(data)
                            else:
                                conn.execute(f"DELETE FROM p{p} WHERE last_offset = ?", (last,))
                                delta_bytes += nbytes
                            delta_records += gone
                        conn.execute(
                            "UPDATE partitions SET records = records - ?, bytes = bytes - ? WHERE partition = ?",
                            (delta_records, delta_bytes, p),
                        )
                        conn.execute("COMMIT")
                    except BaseException:
                        with contextlib.suppress(sqlite3.Error):
                            conn.execute("ROLLBACK")
                        raise
                removed += delta_records
            # Bookkeeping: what is left dirty (young batches) and when the next kept tombstone is due.
            with lock, t.write_lock:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    young, oldest_tomb = conn.execute(
                        f"SELECT coalesce(sum(CASE WHEN append_ms > ? THEN count END), 0), "
                        f"min(CASE WHEN tombstones > 0 THEN append_ms END) FROM p{p}",
                        (horizon,),
                    ).fetchone()
                    conn.execute(
                        "UPDATE partitions SET dirty = ?, tombstone_due_ms = ? WHERE partition = ?",
                        (young, None if oldest_tomb is None else oldest_tomb + _tombstone_wait(cfg), p),
                    )
                    conn.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):
                        conn.execute("ROLLBACK")
                    raise
                if removed:
                    with contextlib.suppress(sqlite3.OperationalError):
                        conn.execute("PRAGMA incremental_vacuum(256)").fetchall()
        return removed

    def _retention(self, t: _Topic, conn_or_none: sqlite3.Connection | None) -> int:
        cfg = t.config
        removed = 0
        with t.maintenance, t.guard:
            if t.deleted:
                return 0
            conn = self._maintenance_conn(t, conn_or_none)
            lock = self._lock if conn is t.conn else contextlib.nullcontext()
            for p in range(cfg.partitions):
                cutoff = None if cfg.retention_ms is None else now_ms() - cfg.retention_ms
                while True:
                    with lock, t.write_lock:
                        conn.execute("BEGIN IMMEDIATE")
                        try:
                            total, end = conn.execute(
                                "SELECT bytes, end_offset FROM partitions WHERE partition = ?", (p,)
                            ).fetchone()
                            rows = conn.execute(
                                f"SELECT last_offset, count, append_ms, length(data) FROM p{p} "
                                f"ORDER BY last_offset LIMIT {BATCHES_PER_TXN}"
                            ).fetchall()
                            drop: list[tuple[int, int, int]] = []
                            for last, count, append_ms, nbytes in rows:
                                too_old = cutoff is not None and append_ms <= cutoff
                                too_big = cfg.retention_bytes is not None and total > cfg.retention_bytes
                                if not (too_old or too_big):
                                    break
                                drop.append((last, count, nbytes))
                                total -= nbytes
                            if not drop:
                                conn.execute("COMMIT")
                                break
                            conn.executemany(
                                f"DELETE FROM p{p} WHERE last_offset = ?", [(d[0],) for d in drop]
                            )
                            nxt = conn.execute(f"SELECT min(base_offset) FROM p{p}").fetchone()[0]
                            conn.execute(
                                "UPDATE partitions SET start_offset = ?, records = records - ?, bytes = bytes - ? "
                                "WHERE partition = ?",
                                (
                                    end if nxt is None else nxt,
                                    sum(d[1] for d in drop),
                                    sum(d[2] for d in drop),
                                    p,
                                ),
                            )
                            conn.execute("COMMIT")
                        except BaseException:
                            with contextlib.suppress(sqlite3.Error):
                                conn.execute("ROLLBACK")
                            raise
                    removed += sum(d[1] for d in drop)
            if removed:
                with lock, t.write_lock, contextlib.suppress(sqlite3.OperationalError):
                    conn.execute("PRAGMA incremental_vacuum(256)").fetchall()
        return removed

    def _background(self, interval: float) -> None:
        """Every ``interval`` s: compact (when due) or apply retention to the topics this instance writes.
        An error stops the thread and is raised to the writer by its next call (no log-and-skip)."""
        try:
            while not self._stop.wait(interval):
                with self._lock:
                    held = [self._topics[n] for n in self._locks if n in self._topics]
                for t in held:
                    if self._stop.is_set():
                        break
                    if t.config.compacted:
                        n = self._compact(t, None, only_if_due=True)
                    else:
                        n = self._retention(t, None)
                    if n:
                        log.info("log store: removed %d records from %s", n, t.name)
        except BaseException as exc:  # surfaced to the writer on its next call
            log.exception("background compaction of %s failed", self.path)
            self._bg_error = exc

    def close(self) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._closed = True
            for t in self._topics.values():
                with contextlib.suppress(sqlite3.Error):
                    t.conn.close()
                    if t.bg_conn is not None:
                        t.bg_conn.close()
            self._topics.clear()
            if self._consumers is not None:
                self._consumers.close()
                self._consumers = None
            for fd in self._locks.values():
                os.close(fd)
            self._locks.clear()


def _stored_rows(
    name: str,
    n: int,
    end: Mapping[int, int],
    parts: Sequence[int] | np.ndarray,
    records: Sequence[Record],
    now: int,
) -> tuple[list[list[_Out]], list[int]]:
    """The records as stored, grouped by partition, with their offsets (partition ``p`` continues at
    ``end[p]``), and the tombstones per partition. Checks every record (:func:`_check_record`).

    The usual batch (keys bytes, values bytes or None, no headers, timestamps int or None) is built
    without Python work per record (type sets, numpy grouping, ``map`` over the columns); anything
    else takes the per-record loop, which names an offending record."""
    keys = [r.key for r in records]
    values = [r.value for r in records]
    stamps = [r.timestamp_ms for r in records]
    usual = (
        set(map(type, keys)) == {bytes}
        and set(map(type, values)) <= {bytes, type(None)}
        and set(map(type, stamps)) <= {int, type(None)}
        and not any(r.headers for r in records)
    )
    groups: list[list[_Out]] = [[] for _ in range(n)]
    tombstones = [0] * n
    if not usual:
        nxt = [end[p] for p in range(n)]
        for i, (p, r) in enumerate(zip(parts, records, strict=True)):
            _check_record(name, i, r)
            p = int(p)
            if r.value is None:
                tombstones[p] += 1
            ts = r.timestamp_ms
            groups[p].append(_Out(name, p, nxt[p], r.key, r.value, r.headers, now if ts is None else ts))
            nxt[p] += 1
        return groups, tombstones
    if None in stamps:
        stamps = [now if ts is None else ts for ts in stamps]
    placed = np.asarray(parts, dtype=np.int64)
    for p in range(n):
        idx = np.flatnonzero(placed == p).tolist()
        if not idx:
            continue
        vals = list(map(values.__getitem__, idx))
        tombstones[p] = vals.count(None)
        groups[p] = list(
            map(
                _Out,
                repeat(name),
                repeat(p),
                range(end[p], end[p] + len(idx)),
                map(keys.__getitem__, idx),
                vals,
                repeat(()),
                map(stamps.__getitem__, idx),
            )
        )
    return groups, tombstones


def _check_record(topic: str, index: int, r: Record) -> None:
    """Refuse a record the store could write but not read back as a StoredRecord."""
    problem = None
    if type(r.key) is not bytes:
        problem = f"its key is {type(r.key).__name__}, not bytes"
    elif r.value is not None and type(r.value) is not bytes:
        problem = f"its value is {type(r.value).__name__}, not bytes or None"
    elif r.partition is not None and type(r.partition) is not int:
        problem = f"its partition is {type(r.partition).__name__}, not int or None"
    elif r.timestamp_ms is not None and type(r.timestamp_ms) is not int:
        problem = f"its timestamp_ms is {type(r.timestamp_ms).__name__}, not int or None"
    elif not isinstance(r.headers, tuple) or not all(
        isinstance(h, tuple) and len(h) == 2 and type(h[0]) is str and type(h[1]) is bytes for h in r.headers
    ):
        problem = "its headers are not a tuple of (str, bytes) pairs"
    if problem:
        raise LogStoreError(
            f"record {index} of the batch for topic {topic!r} cannot be stored: {problem}",
            fix="build Record(key=bytes, value=bytes | None, headers=((str, bytes), ...), timestamp_ms=int | None); "
            "nothing of this batch was written",
            topic=topic,
            index=index,
        )


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def iter_topic(store: LogStore, topic: str, from_offset: int = 0) -> Iterator[StoredRecord]:
    """Every record of every partition of ``topic``, partition by partition, each in offset order."""
    for p in sorted(store.end_offsets(topic)):
        start = store.start_offsets(topic)[p]
        yield from store.iter_partition(topic, p, max(from_offset, start))
