"""One table's search index on disk: its shards, each a tantivy index with a SQLite side table, and
the index's metadata (how many shards, which fields), ``docs/search.md``::

    <state>/search/<topic>.versions.sqlite               metadata: ``meta.shards`` (N), ``meta.schema``
    <state>/search/<topic>/shard-<i>/                    shard i's tantivy index (0 <= i < N)
    <state>/search/<topic>/shard-<i>.versions.sqlite     shard i's side table

A key's documents live in shard :func:`sinks.shard_of` (key, N): the log-store partition the key
has when its topic has N partitions, so that one Spark task per partition writes one shard. N is
fixed when the index is created. An index created before shards (its tantivy index directly at
``<topic>``, ``meta.json`` there, its side table at ``<topic>.versions.sqlite``) is one shard at
those paths, read and written in place.

The side table of a shard: each key's stored version (``versions``, deletes kept as tombstones),
the last TRUNCATE's version (``meta.truncate``), the applied batch per app id (``applied``) and the
batch whose index commit may lack its side-table record (``meta.pending``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import tantivy

from cdc import paths
from cdc.errors import ApplyError
from cdc.events import Version
from cdc.logstore.partition_arrays import partition_array
from cdc.registry import TableReg
from sinks import shard_of

KEY = "_cdc_key"
LSN = "_cdc_commit_lsn"
SEQ = "_cdc_seq"
DOCUMENT = "_cdc_document"

_SIDE_TABLE = """
    CREATE TABLE IF NOT EXISTS versions (key TEXT PRIMARY KEY, commit_lsn INTEGER NOT NULL,
        seq INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0, deleted_at_ms INTEGER)
        WITHOUT ROWID;
    CREATE INDEX IF NOT EXISTS versions_deleted ON versions (deleted, deleted_at_ms);
    CREATE TABLE IF NOT EXISTS applied (app_id TEXT PRIMARY KEY, batch_id INTEGER NOT NULL);
    CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def index_path(state_dir: Path, reg: TableReg) -> Path:
    """``<state>/search/<topic>``: the directory of the shards (:func:`cdc.paths.search_index`)."""
    return paths.search_index(Path(state_dir), reg.topic)


def versions_path(state_dir: Path, reg: TableReg) -> Path:
    """``<state>/search/<topic>.versions.sqlite``: the index's metadata (and, in an index created
    before shards, its side table) (:func:`cdc.paths.search_versions`)."""
    return paths.search_versions(Path(state_dir), reg.topic)


def field_names(reg: TableReg) -> dict[str, str]:
    """Search column -> tantivy field name (the column name; ``_cdc_`` names are refused)."""
    out: dict[str, str] = {}
    sb = tantivy.SchemaBuilder()
    for col in reg.search:
        if col.startswith("_cdc_") or not sb.is_valid_field_name(col):
            raise ApplyError(
                f"search column {col!r} of {reg.qualified} cannot be a tantivy field name",
                fix="rename the column or pick other search columns",
                column=col,
            )
        out[col] = reg.search_field(col)
    return out


def build_schema(reg: TableReg) -> tantivy.Schema:
    sb = tantivy.SchemaBuilder()
    sb.add_text_field(KEY, stored=True, tokenizer_name="raw")
    sb.add_unsigned_field(LSN, stored=True, indexed=True)
    sb.add_unsigned_field(SEQ, stored=True, indexed=True)
    for name in field_names(reg).values():
        sb.add_text_field(name, stored=True)
    sb.add_bytes_field(DOCUMENT, stored=True)
    return sb.build()


def _only_dropped(reg: TableReg, built: list[str]) -> bool:
    """The index was built for the fields ``built`` and the registration lost only columns dropped
    at the source since (:attr:`TableReg.dropped_columns`): the index goes on without them."""
    fields = [reg.search_field(c) for c in reg.search]
    gone = [c for c in built if c not in fields]
    return set(fields) <= set(built) and all(c in reg.dropped_columns for c in gone)


def _schema_signature(reg: TableReg) -> str:
    """The index's fields (a search column renamed at the source keeps its field)."""
    return orjson.dumps({"version": 2, "search": [reg.search_field(c) for c in reg.search]}).decode()


# --- the layout -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Where a table's index lives: ``shards[i]`` = (tantivy directory, side table) of shard i.
    ``legacy``: an index created before shards (one shard: ``root`` and ``meta`` themselves)."""

    root: Path
    meta: Path
    shards: tuple[tuple[Path, Path], ...]
    legacy: bool

    @property
    def count(self) -> int:
        return len(self.shards)

    def shard_of(self, key_json: str) -> int:
        """The shard holding ``key_json``'s document and version."""
        return 0 if self.count == 1 else shard_of(key_json, self.count)

    def shards_of(self, keys: list[str]) -> list[int]:
        """:meth:`shard_of` of many keys (vectorised murmur2)."""
        if self.count == 1:
            return [0] * len(keys)
        return partition_array([k.encode() for k in keys], self.count).tolist()  # type: ignore[no-any-return]


def _layout(state_dir: Path, reg: TableReg, shards: int | None) -> Layout:
    """The layout of ``shards`` shards (None: the index created before shards)."""
    root, meta = index_path(state_dir, reg), versions_path(state_dir, reg)
    if shards is None:
        return Layout(root, meta, ((root, meta),), legacy=True)
    where = tuple(paths.search_shard(Path(state_dir), reg.topic, i) for i in range(shards))
    return Layout(root, meta, where, legacy=False)


def _has_index(path: Path) -> bool:
    """A tantivy index in ``path``; directly in the index's root: one created before shards (a sharded
    index has its shards' indexes in subdirectories)."""
    return (path / "meta.json").exists()


def find_layout(state_dir: Path, reg: TableReg) -> Layout | None:
    """The layout of ``reg``'s index as it exists, None when it has none yet. Reads only."""
    root, meta = index_path(state_dir, reg), versions_path(state_dir, reg)
    if _has_index(root):
        return _layout(state_dir, reg, None)
    if not meta.exists():
        return None
    db = sqlite3.connect(f"{meta.resolve().as_uri()}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT value FROM meta WHERE name = 'shards'").fetchone()
    except sqlite3.OperationalError:  # created, its meta table not yet
        row = None
    finally:
        db.close()
    return None if row is None else _layout(state_dir, reg, int(row[0]))


def open_layout(state_dir: Path, reg: TableReg, shards: int) -> tuple[Layout, list[str]]:
    """The layout of ``reg``'s index, recorded with ``shards`` shards if it has none yet (one SQLite
    transaction: of processes creating it at once, the first one's count holds), and the fields it
    was built for. ApplyError when the registration's search columns changed since."""
    root, meta = index_path(state_dir, reg), versions_path(state_dir, reg)
    root.mkdir(parents=True, exist_ok=True)
    legacy = _has_index(root)
    sig = _schema_signature(reg)
    db = sqlite3.connect(meta, isolation_level=None, timeout=60)
    try:
        db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("BEGIN IMMEDIATE")
        try:
            if not legacy:
                db.execute("INSERT OR IGNORE INTO meta VALUES ('shards', ?)", (str(shards),))
            db.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (sig,))
            got = dict(db.execute("SELECT name, value FROM meta WHERE name IN ('shards', 'schema')"))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    finally:
        db.close()
    built = list(orjson.loads(got["schema"])["search"])
    if got["schema"] != sig and not _only_dropped(reg, built):
        raise ApplyError(
            f"the search index of {reg.qualified} was built for search columns {built}, the "
            f"registration now says {list(reg.search)}",
            fix=f"remove {root} and {meta}, then re-snapshot the table so the index is rebuilt",
            table=reg.qualified,
        )
    return _layout(state_dir, reg, None if legacy else int(got["shards"])), built


# --- one shard -------------------------------------------------------------------------------------
class Shard:
    """One shard's tantivy index and side table, created when missing; its writer is opened on first
    use (:attr:`writer`), so that reading or recording in a shard never takes its writer lock."""

    def __init__(self, reg: TableReg, number: int, where: tuple[Path, Path], schema: tantivy.Schema) -> None:
        self.reg = reg
        self.number = number
        self.path, db_path = where
        self.path.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False, timeout=60)
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = FULL")
        # 64 MB of page cache (default 2 MB): with a million keys the version lookups and updates of a
        # batch otherwise miss it (measured: updates of 250k keys into 1M, ~40 -> ~33 us per change)
        self.db.execute("PRAGMA cache_size = -65536")
        self.db.executescript(_SIDE_TABLE)
        self.schema = schema
        if _has_index(self.path):
            self.index = tantivy.Index.open(str(self.path))
        else:
            self.index = tantivy.Index(schema, path=str(self.path))
        self._writer: tantivy.IndexWriter | None = None

    def open_writer(self, heap_size: int, threads: int) -> tantivy.IndexWriter:
        """The shard's index writer (opened once): ApplyError when another process holds it."""
        if self._writer is None:
            try:
                self._writer = self.index.writer(heap_size=heap_size, num_threads=threads)
            except ValueError as exc:  # tantivy: LockBusy when another writer holds the index
                raise ApplyError(
                    f"cannot open the search index of {self.reg.qualified} for writing: {exc}",
                    fix="another apply job is writing it: stop it first (one apply job per state "
                    "directory, one task per shard)",
                    path=str(self.path),
                    shard=self.number,
                ) from exc
        return self._writer

    @property
    def has_writer(self) -> bool:
        return self._writer is not None

    @property
    def writer(self) -> tantivy.IndexWriter:
        assert self._writer is not None, "open_writer first"
        return self._writer

    def applied(self, app_id: str) -> int | None:
        row = self.db.execute("SELECT batch_id FROM applied WHERE app_id = ?", (app_id,)).fetchone()
        return None if row is None else int(row[0])

    def marker(self) -> Version:
        row = self.db.execute("SELECT value FROM meta WHERE name = 'truncate'").fetchone()
        if row is None:
            return Version(-1, -1)
        lsn, seq = orjson.loads(row[0])
        return Version(lsn, seq)

    def pending(self) -> tuple[str, int] | None:
        """The (app_id, batch_id) whose index commit may lack its side-table record, if any."""
        row = self.db.execute("SELECT value FROM meta WHERE name = 'pending'").fetchone()
        if row is None:
            return None
        app_id, batch_id = orjson.loads(row[0])
        return str(app_id), int(batch_id)

    def set_pending(self, app_id: str, batch_id: int) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO meta VALUES ('pending', ?)", (orjson.dumps([app_id, batch_id]).decode(),)
        )

    def stored(self, keys: Iterable[str]) -> dict[str, tuple[tuple[int, int], bool]]:
        """key -> ((commit_lsn, seq), deleted) for the keys the side table holds (plain ints: cheap)."""
        return _stored(self.db, keys)

    def document(self, key: str) -> dict[str, Any] | None:
        """The stored document (all columns, event encoding) of a key, from the committed index."""
        self.index.reload()
        return _document_of(self.index, self.schema, key)

    def close(self) -> None:
        try:
            if self._writer is not None:
                self._writer.wait_merging_threads()
        finally:
            self._writer = None
            self.db.close()


def _stored(db: sqlite3.Connection, keys: Iterable[str]) -> dict[str, tuple[tuple[int, int], bool]]:
    # one query: the keys as a JSON array joined through json_each
    q = (
        "SELECT v.key, v.commit_lsn, v.seq, v.deleted FROM json_each(?) AS j "
        "JOIN versions AS v ON v.key = j.value"
    )
    return {
        key: ((lsn, seq), bool(deleted))
        for key, lsn, seq, deleted in db.execute(q, (orjson.dumps(list(keys)).decode(),))
    }


def _document_of(index: tantivy.Index, schema: tantivy.Schema, key: str) -> dict[str, Any] | None:
    searcher = index.searcher()
    hits = searcher.search(tantivy.Query.term_query(schema, KEY, key), 1).hits
    if not hits:
        return None
    raw = searcher.doc(hits[0][1]).get_first(DOCUMENT)
    return dict(orjson.loads(raw)) if raw is not None else None


class _View:
    """Another process's shard, read only (the committed index and side table; nothing while it does
    not exist, each opened once it does): where a key change's old key lives when a task owns
    another shard."""

    def __init__(self, where: tuple[Path, Path], schema: tantivy.Schema) -> None:
        self.path, self.db_path = where
        self.schema = schema
        self._index: tantivy.Index | None = None
        self._db: sqlite3.Connection | None = None

    def _side_table(self) -> sqlite3.Connection | None:
        if self._db is None and self.db_path.exists():
            uri = f"{self.db_path.resolve().as_uri()}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
        return self._db

    def marker(self) -> Version:
        db = self._side_table()
        try:
            row = (
                None
                if db is None
                else db.execute("SELECT value FROM meta WHERE name = 'truncate'").fetchone()
            )
        except sqlite3.OperationalError:  # created, its tables not yet
            row = None
        return Version(-1, -1) if row is None else Version(*orjson.loads(row[0]))

    def stored(self, keys: Iterable[str]) -> dict[str, tuple[tuple[int, int], bool]]:
        db = self._side_table()
        try:
            return {} if db is None else _stored(db, keys)
        except sqlite3.OperationalError:  # created, its tables not yet
            return {}

    def document(self, key: str) -> dict[str, Any] | None:
        if self._index is None and _has_index(self.path):
            self._index = tantivy.Index.open(str(self.path))
        if self._index is None:
            return None
        self._index.reload()
        return _document_of(self._index, self.schema, key)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


class TableIndex:
    """One table's index as the apply opened it: its layout and schema, the shards it writes (opened
    on first use by :meth:`shard`) and read-only views of the others (:meth:`lookup`)."""

    def __init__(self, state_dir: Path, reg: TableReg, shards: int) -> None:
        self.reg = reg
        self.layout, built = open_layout(state_dir, reg, shards)
        # a search column dropped at the source keeps its (empty from now on) field: tantivy cannot
        # remove one; documents written from now on leave it out
        self.schema = build_schema(replace(reg, search=tuple(built), extra={}))
        self._shards: dict[int, Shard] = {}
        self._views: dict[int, _View] = {}

    @property
    def count(self) -> int:
        return self.layout.count

    def shard(self, i: int) -> Shard:
        """Shard ``i``, opened (created when missing) for this process to write."""
        got = self._shards.get(i)
        if got is None:
            view = self._views.pop(i, None)
            if view is not None:
                view.close()
            got = self._shards[i] = Shard(self.reg, i, self.layout.shards[i], self.schema)
        return got

    def opened(self) -> Iterator[Shard]:
        """The shards this process opened."""
        return iter(list(self._shards.values()))

    def existing(self) -> list[int]:
        """The shards that exist on disk."""
        return [i for i, (_path, db) in enumerate(self.layout.shards) if db.exists()]

    def lookup(self, i: int) -> Shard | _View:
        """Shard ``i`` for reading: the opened shard, else a read-only view of what another process
        committed there."""
        got = self._shards.get(i)
        if got is not None:
            return got
        view = self._views.get(i)
        if view is None:
            view = self._views[i] = _View(self.layout.shards[i], self.schema)
        return view

    def stored(self, keys: Iterable[str]) -> dict[str, tuple[tuple[int, int], bool]]:
        """:meth:`Shard.stored` of keys of any shard."""
        keys = list(keys)
        by_shard: dict[int, list[str]] = {}
        for key, i in zip(keys, self.layout.shards_of(keys), strict=True):
            by_shard.setdefault(i, []).append(key)
        out: dict[str, tuple[tuple[int, int], bool]] = {}
        for i, group in by_shard.items():
            out.update(self.lookup(i).stored(group))
        return out

    def document(self, key: str) -> dict[str, Any] | None:
        """:meth:`Shard.document` of a key of any shard."""
        return self.lookup(self.layout.shard_of(key)).document(key)

    def marker(self, key: str) -> Version:
        """The TRUNCATE marker of the shard of ``key``."""
        return self.lookup(self.layout.shard_of(key)).marker()

    def close(self) -> None:
        try:
            for shard in self._shards.values():
                shard.close()
        finally:
            for view in self._views.values():
                view.close()
            self._shards.clear()
            self._views.clear()
