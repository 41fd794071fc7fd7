"""The reader's memory of each key's long values: what makes every event's ``after`` the whole row.

Postgres leaves an unchanged out-of-line (TOASTed) value out of an UPDATE: wal2json omits the column,
pgoutput sends it as ``u``. The reader fills it in from the last value it wrote for that key (for a
key change, the old key's), so a compacted topic -- which keeps only each key's newest record -- is a
complete copy of its table. This module keeps those values: per topic and key, the *image* of the
columns that can be stored out of line (:func:`cdc.codec.values.out_of_line_columns`), each as the
JSON text the event carries.

One store per state directory (``<state>/images.sqlite``), for both log-store backends. Writes are
staged per batch (:class:`Staging`, what :class:`cdc.logstore.batch.Batch` seals with its records)
and made durable by :meth:`Images.commit` once the log store acknowledged that batch's records.

Guarantees
----------
* **Never ahead of the log.** An image is committed (fsync'd) only after the records it comes from
  are durable in the log store, and before the reader confirms their position to the slot. Until
  then lookups see it from memory (the overlay), so the next change of the key is filled from it.
* **Replays are recognised.** With each commit goes the version ``(commit LSN, seq)`` of the last
  stream change of that batch (:attr:`Images.high`): every change up to it is durable in its topic
  and reflected in the images. After a crash the slot may send some of them again; the reader
  skips those (:class:`cdc.codec.envelope.EventBuilder`), since filling them from the images would
  take a later value. A kill -9 between the append and the commit leaves ``high`` before that
  batch, so its changes are decoded again and appended again, filled from the images as they were.
* **A lost store is rebuilt from the topics** (:func:`rebuild`): a topic the store does not follow
  is read from its first record, up to what the slot confirmed, before the reader streams. What
  the topic cannot tell (a value a record listed in ``unavailable``, written before this store
  existed, whose earlier record compaction removed) stays unknown: such a change keeps the column in
  ``unavailable``; it is never written as null or as a guess, and ``cdc snapshot TABLE`` repairs it.
* Deletes and a stream ``TRUNCATE`` drop images; the TRUNCATE markers that end a snapshot do not
  (the snapshot's rows replace the images of the rows it read).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from cdc.errors import LogStoreError
from cdc.logstore import LogStore

__all__ = [
    "FIELD_SEP",
    "NAME_SEP",
    "Image",
    "Images",
    "Sealed",
    "Staging",
    "images_path",
    "pack",
    "rebuild",
    "unpack",
]

#: an image: the JSON-encoded column name -> the column's value as JSON text (``null`` included)
Image = dict[bytes, bytes]

#: the separators of a packed image: JSON text never holds a raw control character
FIELD_SEP, NAME_SEP = b"\x00", b"\x01"


_GET = "SELECT image FROM images WHERE topic = ? AND key = ?"


def images_path(state_dir: Path) -> Path:
    return Path(state_dir) / "images.sqlite"


def pack(image: Image) -> bytes:
    """An image as stored: ``name \\x01 value`` pairs joined by ``\\x00`` (names and values are
    JSON text, which never holds a raw control character)."""
    return FIELD_SEP.join(name + NAME_SEP + value for name, value in image.items())


def unpack(blob: bytes) -> Image:
    out: Image = {}
    if blob:
        for part in blob.split(FIELD_SEP):
            name, _, value = part.partition(NAME_SEP)
            out[name] = value
    return out


#: a change of a topic's columns for its stored images: JSON-encoded name -> new name (a rename), or
#: None (dropped, or retyped so that the stored text is no longer the value's)
Alter = dict[bytes, bytes | None]


def alter_image(image: Image, alter: Alter) -> Image:
    out: Image = {}
    for name, value in image.items():
        new = alter.get(name, name)
        if new is not None:
            out[new] = value
    return out


@dataclass
class Sealed:
    """One batch's image changes, ready to commit, in this order: ``clears`` (topics truncated),
    ``alters`` (topics whose columns changed: applied to the images stored before the batch),
    ``changes`` ({(topic, key): packed image, or None for a key gone}); ``version``: the last
    stream change the batch holds, or None (a snapshot's rows)."""

    gen: int
    clears: list[str]
    changes: dict[tuple[str, bytes], bytes | None]
    version: tuple[int, int] | None
    alters: list[tuple[str, Alter]] = field(default_factory=list)


class Staging:
    """The image changes of the records one producer adds to its batch (one thread). Each change is
    visible to :meth:`Images.get` at once and durable after :meth:`Images.commit` of its sealed batch."""

    def __init__(self, images: Images) -> None:
        self.images = images
        self._overlay = images._overlay
        self._cleared = images._cleared
        self.gen = images._next_gen()
        self.changes: dict[tuple[str, bytes], bytes | None] = {}
        self.clears: list[str] = []
        self.alters: list[tuple[str, Alter]] = []
        self.version: tuple[int, int] | None = None
        self._sealed: list[Sealed] = []  # sealed and not yet pruned from the overlay

    def put(self, topic: str, key: bytes, blob: bytes | None) -> None:
        """The key's image is now ``blob`` (packed; None: the key is gone)."""
        k = (topic, key)
        self.changes[k] = blob
        self._overlay[k] = (self.gen, blob)

    def clear(self, topic: str) -> None:
        """Every key of ``topic`` is gone (a TRUNCATE from the stream)."""
        for k in [k for k in self.changes if k[0] == topic]:
            del self.changes[k]
        self.images._forget_overlay(topic)  # what any batch staged of it: the clear supersedes it
        self.clears.append(topic)
        self._cleared[topic] = self.gen

    def alter(self, topic: str, alter: Alter) -> None:
        """``topic``'s columns changed (renamed, dropped, retyped): every image staged or stored
        before now is read through ``alter`` from now on."""
        if not alter:
            return
        for k, blob in list(self.changes.items()):
            if k[0] == topic and blob is not None:
                self.changes[k] = pack(alter_image(unpack(blob), alter))
        for k, (gen, blob) in list(self._overlay.items()):
            if k[0] == topic and blob is not None:
                self._overlay[k] = (gen, pack(alter_image(unpack(blob), alter)))
        self.alters.append((topic, alter))
        self.images._altered.setdefault(topic, []).append((self.gen, alter))

    def seal(self) -> Sealed | None:
        """The changes staged since the last seal, for the batch about to be appended (None when
        nothing changed), with :attr:`version`: the last stream change staged so far (set by the
        producer for every change, changed images or not)."""
        self._prune()
        if not self.changes and not self.clears and not self.alters:
            return None
        sealed = Sealed(self.gen, self.clears, self.changes, self.version, self.alters)
        self._sealed.append(sealed)
        self.changes, self.clears, self.alters = {}, [], []
        self.gen = self.images._next_gen()
        return sealed

    def _prune(self) -> None:
        """Drop from the overlay what committed batches made durable (unless staged again since)."""
        done = self.images._done
        keep = []
        for s in self._sealed:
            if s.gen not in done:
                keep.append(s)
                continue
            for k in s.changes:
                entry = self._overlay.get(k)
                if entry is not None and entry[0] == s.gen:
                    del self._overlay[k]
            for topic in s.clears:
                if self._cleared.get(topic) == s.gen:
                    del self._cleared[topic]
            altered = self.images._altered
            for topic, _ in s.alters:
                left = [a for a in altered.get(topic, ()) if a[0] != s.gen]
                if left:
                    altered[topic] = left
                else:
                    altered.pop(topic, None)
            done.discard(s.gen)
        self._sealed = keep


class Images:
    """The image store (see the module docstring). ``get`` and :class:`Staging` are called by the
    producing threads, :meth:`commit` by the log writers' threads."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._w = self._open()
            self._r = self._open()
        except sqlite3.Error as exc:
            raise LogStoreError(
                f"cannot open the image store {self.path}: {exc}",
                fix="check the state directory's permissions and free space; if the file is damaged, "
                "move it away: `cdc run` rebuilds it from the topics",
                path=str(self.path),
            ) from exc
        self._lookup = self._r.cursor()
        self._wlock = threading.Lock()
        self._rlock = threading.Lock()
        self._gen_lock = threading.Lock()
        self._gen = 0
        #: staged and not yet durable: (topic, key) -> (generation, packed image or None)
        self._overlay: dict[tuple[str, bytes], tuple[int, bytes | None]] = {}
        #: topics truncated in a batch not yet durable -> that batch's generation
        self._cleared: dict[str, int] = {}
        #: column changes of a topic not yet durable: (generation, alter), in order
        self._altered: dict[str, list[tuple[int, Alter]]] = {}
        self._done: set[int] = set()
        self.high = self._high()

    def _open(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=60)
        db.execute("PRAGMA page_size=16384")  # an image is often a few kB: fewer overflow pages
        db.execute("PRAGMA journal_mode=WAL")
        # no mmap: mapped pages count in the reader's resident set (the store can be the size of the
        # table's long values); SQLite's own page cache, bounded, is what stays in memory
        db.execute("PRAGMA cache_size=-16384")  # 16 MB a connection
        db.execute("PRAGMA synchronous=FULL")  # an image must be durable before its position is confirmed
        db.executescript(
            """
            CREATE TABLE IF NOT EXISTS images (topic TEXT NOT NULL, key BLOB NOT NULL, image BLOB NOT NULL,
                                               PRIMARY KEY (topic, key));
            CREATE TABLE IF NOT EXISTS topics (topic TEXT PRIMARY KEY, followed_at REAL NOT NULL);
            CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
            """
        )
        return db

    def _next_gen(self) -> int:
        with self._gen_lock:
            self._gen += 1
            return self._gen

    def _high(self) -> tuple[int, int]:
        with self._rlock:
            row = self._r.execute("SELECT value FROM meta WHERE name = 'high'").fetchone()
        if row is None:
            return (0, 0)
        lsn, seq = row[0].split(",")
        return (int(lsn), int(seq))

    def _forget_overlay(self, topic: str) -> None:
        for k in [k for k in self._overlay if k[0] == topic]:
            del self._overlay[k]

    # -- the producing side -------------------------------------------------------------------------
    def restart(self) -> tuple[int, int]:
        """A new session: forget what was staged and never committed (its batch failed, and the
        slot sends those changes again); the committed :attr:`high` the session starts from."""
        self._overlay.clear()
        self._cleared.clear()
        self._altered.clear()
        self._done.clear()
        self.high = self._high()
        return self.high

    def staging(self) -> Staging:
        return Staging(self)

    def get(self, topic: str, key: bytes) -> Image | None:
        """The key's image: the newest staged one, else the committed one; None when unknown."""
        entry = self._overlay.get((topic, key))
        if entry is not None:
            return None if entry[1] is None else unpack(entry[1])
        cleared = self._cleared.get(topic)
        if cleared is not None and cleared not in self._done:
            return None  # truncated in a batch not yet durable: what the disk holds is gone
        with self._rlock:
            # fetchall: the statement is done at once, so no read transaction outlives the call
            rows = self._lookup.execute(_GET, (topic, key)).fetchall()
        if not rows:
            return None
        image = unpack(rows[0][0])
        for gen, alter in self._altered.get(topic, ()):
            if gen not in self._done:  # not yet applied to what the disk holds
                image = alter_image(image, alter)
        return image

    def holds_column(self, topic: str, name: bytes) -> bool:
        """Whether any image of ``topic`` (staged or committed) holds the JSON-encoded column ``name``
        (a scan of the topic's images, stopping at the first: asked only when a column is retyped)."""
        field = name + NAME_SEP
        for (t, _), (_, blob) in list(self._overlay.items()):
            if t == topic and blob is not None and (blob.startswith(field) or FIELD_SEP + field in blob):
                return True
        with self._rlock:
            rows = self._lookup.execute(
                "SELECT 1 FROM images WHERE topic = ? AND (substr(image, 1, ?) = ? OR instr(image, ?) > 0) LIMIT 1",
                (topic, len(field), field, FIELD_SEP + field),
            ).fetchall()
        return bool(rows)

    # -- the writing side ---------------------------------------------------------------------------
    def commit(self, sealed: Sealed | None) -> None:
        """Make one batch's image changes durable (call after its records are durable)."""
        if sealed is None:
            return
        puts = [(t, k, b) for (t, k), b in sealed.changes.items() if b is not None]
        gone = [(t, k) for (t, k), b in sealed.changes.items() if b is None]
        with self._wlock:
            db = self._w
            db.execute("BEGIN IMMEDIATE")
            try:
                for topic in sealed.clears:
                    db.execute("DELETE FROM images WHERE topic = ?", (topic,))
                for topic, alter in sealed.alters:
                    self._alter_stored(db, topic, alter)
                db.executemany("DELETE FROM images WHERE topic = ? AND key = ?", gone)
                db.executemany(
                    "INSERT INTO images (topic, key, image) VALUES (?, ?, ?) "
                    "ON CONFLICT (topic, key) DO UPDATE SET image = excluded.image",
                    puts,
                )
                if sealed.version is not None:
                    db.execute(
                        "INSERT INTO meta (name, value) VALUES ('high', ?) "
                        "ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                        (f"{sealed.version[0]},{sealed.version[1]}",),
                    )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        self._done.add(sealed.gen)

    @staticmethod
    def _alter_stored(db: sqlite3.Connection, topic: str, alter: Alter) -> None:
        def fix(blob: bytes) -> bytes:
            return pack(alter_image(unpack(blob), alter))

        db.create_function("cdc_alter_image", 1, fix, deterministic=True)
        db.execute("UPDATE images SET image = cdc_alter_image(image) WHERE topic = ?", (topic,))

    # -- which topics the store follows ---------------------------------------------------------------
    def followed(self) -> set[str]:
        with self._rlock:
            return {r[0] for r in self._r.execute("SELECT topic FROM topics")}

    def follow(self, topic: str, now: float) -> None:
        """The store holds every image of ``topic`` from now on (new and empty, or rebuilt)."""
        with self._wlock:
            self._w.execute(
                "INSERT INTO topics (topic, followed_at) VALUES (?, ?) ON CONFLICT (topic) DO NOTHING",
                (topic, now),
            )

    def reset(self) -> None:
        """Forget every image and the committed version: a new slot (the old one lost, or a new
        initial snapshot) streams changes the images may not reflect, from positions the old
        slot's version does not order. Until a snapshot brings a row again, a change that leaves
        one of its values out keeps it in ``unavailable``."""
        with self._wlock:
            self._w.execute("BEGIN IMMEDIATE")
            self._w.execute("DELETE FROM images")
            self._w.execute("DELETE FROM meta WHERE name = 'high'")
            self._w.execute("COMMIT")
        self.restart()

    def forget(self, topic: str) -> None:
        """Drop a topic's images (its table is no longer registered)."""
        with self._wlock:
            self._w.execute("BEGIN IMMEDIATE")
            self._w.execute("DELETE FROM images WHERE topic = ?", (topic,))
            self._w.execute("DELETE FROM topics WHERE topic = ?", (topic,))
            self._w.execute("COMMIT")
        self._forget_overlay(topic)

    def close(self) -> None:
        for db in (self._r, self._w):
            db.close()


def unknown_values(table: str, raw: str) -> tuple[str, str]:
    """What ``cdc status`` and ``cdc check`` say of a table whose topic holds values the reader could
    not know (the registry's ``values_unknown`` state, JSON): the message and the fix."""
    state = orjson.loads(raw)
    columns = ", ".join(sorted(state.get("columns") or {})) or "its out-of-line columns"
    return (
        f"{table}: {state.get('events', 0)} change(s) in its topic lack values cdc could not know "
        f"({columns}; listed in their `unavailable`): its image store was lost or predates them, "
        "so the topic is not a complete copy of the table",
        f"`cdc snapshot {table}` reads every row again (while streaming) and makes it whole",
    )


# -- rebuilding a topic's images from the topic ----------------------------------------------------------


@dataclass
class RebuildResult:
    records: int = 0
    keys: int = 0
    #: column -> keys whose value stays unknown (their newest record lists it in ``unavailable``)
    unknown: dict[str, int] = field(default_factory=dict)


def rebuild(
    images: Images,
    topic: str,
    records: Iterable[tuple[bytes, bytes | None]],
    confirmed: int,
    image_of: Callable[[dict[str, Any]], Image],
    key_of: Callable[[dict[str, Any]], bytes | None],
    every: int = 5000,
) -> RebuildResult:
    """Rebuild ``topic``'s images from its records (key, value) in offset order, partition after
    partition (a key's records are all in one): each key's image from its newest ``after``, a column
    the record lists in ``unavailable`` from the key's image before it. Only what the slot will not
    send again counts: records of transactions that committed before ``confirmed`` (and snapshot
    rows at it); the changes after it are decoded again on top. ``image_of`` gives the image of an
    ``after`` object, ``key_of`` the key bytes of a ``before`` object (None without the key). Committed every
    ``every`` records; what stays in memory for the whole rebuild is the images of the keys deleted
    in the topic (the old key of a key change) and the names of the values still unknown.

    A key change's ``c`` written before this store existed lists the old key's unchanged values in
    ``unavailable``; they are taken from the old key's image when its partition was read first, else
    they stay unknown (never guessed)."""
    result = RebuildResult()
    unknown: dict[bytes, set[str]] = {}
    staging = images.staging()
    gone: dict[bytes, Image] = {}  # images of keys deleted in this topic (the old key of a key change)
    pending = 0
    for key, value in records:
        if value is None:
            continue
        result.records += 1
        event = orjson.loads(value)
        src = event.get("source") or {}
        lsn, seq = int(src.get("commit_lsn") or 0), int(src.get("seq") or 0)
        if not (lsn < confirmed or (lsn == confirmed and seq == 0)):
            continue
        op = event.get("op")
        if op == "t":
            if src.get("snapshot") == "false":  # a TRUNCATE at the source, not a snapshot's marker
                staging.clear(topic)
                gone.clear()
                unknown.clear()
            continue
        if op == "d":
            old = images.get(topic, key)
            if old is not None:
                gone[key] = old
            staging.put(topic, key, None)
            unknown.pop(key, None)
            continue
        after = event.get("after")
        if after is None:
            continue
        image = image_of(after)
        missing = event.get("unavailable") or ()
        if missing:
            before = event.get("before")
            old = images.get(topic, key)
            if old is None and op == "c" and before:
                old_key = key_of(before)
                old = None if old_key is None else gone.get(old_key)
            lacking: set[str] = set()
            for name in missing:
                enc = orjson.dumps(name)
                if old is not None and enc in old:
                    image[enc] = old[enc]
                else:
                    lacking.add(name)
            if lacking:
                unknown[key] = lacking
            else:
                unknown.pop(key, None)
        else:
            unknown.pop(key, None)
        staging.put(topic, key, pack(image))
        pending += 1
        if pending >= every:
            images.commit(staging.seal())
            pending = 0
    images.commit(staging.seal())
    for names in unknown.values():
        for name in names:
            result.unknown[name] = result.unknown.get(name, 0) + 1
    with images._rlock:
        row = images._r.execute("SELECT count(*) FROM images WHERE topic = ?", (topic,)).fetchone()
    result.keys = int(row[0])
    return result


def iter_topic(store: LogStore, topic: str) -> Iterator[tuple[bytes, bytes | None]]:
    """Every record of ``topic``, partition after partition, in offset order."""
    for partition in sorted(store.end_offsets(topic)):
        for rec in store.iter_partition(topic, partition):
            yield rec.key, rec.value
