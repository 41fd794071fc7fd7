"""The search sink: one tantivy index per registered table with search columns.

One document per key (the key's canonical JSON as a raw term, its version, one text field per search
column, every column as JSON for ``cdc search``), kept beside a SQLite side table of versions,
tombstones, the TRUNCATE marker and the applied batch per app id. The guarantees of
:meth:`SearchSink.apply` (version guard, idempotent batches through a *pending* mark, the columnar
path, unavailable TOAST values) and the layout: ``docs/search.md``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import tantivy

from cdc import paths
from cdc.errors import ApplyError, ConfigError
from cdc.events import Version
from cdc.registry import TableReg
from sinks import ChangeBatch, ChangeEvent, Rejection, Sink, StoredTexts
from sinks.toast import Chains

if TYPE_CHECKING:
    from cdc.config import Settings
    from sinks.columnar import Columns

KEY = "_cdc_key"
LSN = "_cdc_commit_lsn"
SEQ = "_cdc_seq"
DOCUMENT = "_cdc_document"

_Row = tuple[str, int, int, int, int | None]  # a side-table row: key, commit_lsn, seq, deleted, deleted_at_ms


@dataclass(frozen=True)
class SearchOptions:
    """From ``[search]`` in cdc.toml. ``heap_size``: the index writer's memory budget (bytes)."""

    tombstone_retention_hours: float = 7 * 24
    heap_size: int = 64_000_000
    threads: int = 1

    @classmethod
    def from_settings(cls, settings: Settings) -> SearchOptions:
        raw = settings.extra.get("search", {}) or {}
        if not isinstance(raw, dict) or set(raw) - set(cls.__dataclass_fields__):
            raise ConfigError(
                f"invalid [search] settings {raw!r}", fix=f"use only {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**raw)


def index_path(state_dir: Path, reg: TableReg) -> Path:
    """``<state>/search/<topic>`` (:func:`cdc.paths.search_index`)."""
    return paths.search_index(Path(state_dir), reg.topic)


def versions_path(state_dir: Path, reg: TableReg) -> Path:
    """``<state>/search/<topic>.versions.sqlite``, the side table (:func:`cdc.paths.search_versions`)."""
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


def _older_than(schema: tantivy.Schema, v: Version) -> tantivy.Query:
    """Documents whose version is older than ``v``: lsn < L OR (lsn = L AND seq < S)."""
    u64 = tantivy.FieldType.Unsigned

    def below(field: str, bound: int) -> tantivy.Query:
        return tantivy.Query.range_query(
            schema, field, u64, 0, bound, include_lower=True, include_upper=False
        )

    same_lsn = tantivy.Query.range_query(schema, LSN, u64, v.commit_lsn, v.commit_lsn)
    return tantivy.Query.boolean_query(
        [
            (tantivy.Occur.Should, below(LSN, v.commit_lsn)),
            (
                tantivy.Occur.Should,
                tantivy.Query.boolean_query(
                    [(tantivy.Occur.Must, same_lsn), (tantivy.Occur.Must, below(SEQ, v.seq))]
                ),
            ),
        ]
    )


class _Index:
    """One table's open index, writer and side table."""

    def __init__(self, state_dir: Path, reg: TableReg, options: SearchOptions) -> None:
        self.reg = reg
        self.path = index_path(state_dir, reg)
        self.path.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(
            versions_path(state_dir, reg), isolation_level=None, check_same_thread=False
        )
        self.db.execute("PRAGMA journal_mode = WAL")
        self.db.execute("PRAGMA synchronous = FULL")
        # 64 MB of page cache (default 2 MB): with a million keys the version lookups and updates of a
        # batch otherwise miss it (measured: updates of 250k keys into 1M, ~40 -> ~33 us per change)
        self.db.execute("PRAGMA cache_size = -65536")
        self.db.executescript(
            """
            CREATE TABLE IF NOT EXISTS versions (key TEXT PRIMARY KEY, commit_lsn INTEGER NOT NULL,
                seq INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0, deleted_at_ms INTEGER)
                WITHOUT ROWID;
            CREATE INDEX IF NOT EXISTS versions_deleted ON versions (deleted, deleted_at_ms);
            CREATE TABLE IF NOT EXISTS applied (app_id TEXT PRIMARY KEY, batch_id INTEGER NOT NULL);
            CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
            """
        )
        sig = _schema_signature(reg)
        row = self.db.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
        built = (
            list(orjson.loads(row[0])["search"])
            if row is not None
            else [reg.search_field(c) for c in reg.search]
        )
        if row is not None and row[0] != sig and not _only_dropped(reg, built):
            raise ApplyError(
                f"the search index of {reg.qualified} was built for search columns "
                f"{orjson.loads(row[0])['search']}, the registration now says {list(reg.search)}",
                fix=f"remove {self.path} and {versions_path(state_dir, reg)}, then re-snapshot the table "
                "so the index is rebuilt",
                table=reg.qualified,
            )
        # a search column dropped at the source keeps its (empty from now on) field: tantivy cannot
        # remove one; documents written from now on leave it out
        self.schema = build_schema(replace(reg, search=tuple(built), extra={}))
        if tantivy.Index.exists(str(self.path)):
            self.index = tantivy.Index.open(str(self.path))
        else:
            self.index = tantivy.Index(self.schema, path=str(self.path))
        if row is None:
            self.db.execute("INSERT INTO meta VALUES ('schema', ?)", (sig,))
        try:
            self.writer = self.index.writer(heap_size=options.heap_size, num_threads=options.threads)
        except ValueError as exc:  # tantivy: LockBusy when another writer holds the index
            self.db.close()
            raise ApplyError(
                f"cannot open the search index of {reg.qualified} for writing: {exc}",
                fix="another apply job is writing it: stop it first (one apply job per state directory)",
                path=str(self.path),
            ) from exc

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
        # one query: the keys as a JSON array joined through json_each
        q = (
            "SELECT v.key, v.commit_lsn, v.seq, v.deleted FROM json_each(?) AS j "
            "JOIN versions AS v ON v.key = j.value"
        )
        return {
            key: ((lsn, seq), bool(deleted))
            for key, lsn, seq, deleted in self.db.execute(q, (orjson.dumps(list(keys)).decode(),))
        }

    def document(self, key: str) -> dict[str, Any] | None:
        """The stored document (all columns, event encoding) of a key, from the committed index."""
        self.index.reload()
        searcher = self.index.searcher()
        hits = searcher.search(tantivy.Query.term_query(self.schema, KEY, key), 1).hits
        if not hits:
            return None
        raw = searcher.doc(hits[0][1]).get_first(DOCUMENT)
        return dict(orjson.loads(raw)) if raw is not None else None

    def close(self) -> None:
        try:
            self.writer.wait_merging_threads()
        finally:
            self.db.close()


class SearchSink(Sink):
    """tantivy index per table with search columns (see the module docstring). One writer per index:
    the apply job; ``cdc search`` only reads. Not thread-safe: call it from one thread at a time (any
    thread: the SQLite side table is opened with ``check_same_thread=False``)."""

    name = "search"
    unit = "docs"

    def __init__(self, state_dir: Path, options: SearchOptions | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.options = options or SearchOptions()
        self._open: dict[str, _Index] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> SearchSink:
        return cls(Path(settings.state_dir), SearchOptions.from_settings(settings))

    # -- where it lives, what it holds (sinks.Sink) ----------------------------------------------------
    @classmethod
    def locations(cls, state_dir: Path, reg: TableReg) -> dict[str, Path]:
        """A table with search columns: ``index`` (tantivy) and ``versions`` (the SQLite side table)."""
        if not reg.search:
            return {}
        return {"index": index_path(state_dir, reg), "versions": versions_path(state_dir, reg)}

    @classmethod
    def listing(cls, state_dir: Path, reg: TableReg) -> dict[str, Any]:
        """``{"search_index": path}`` (None for a table without search columns)."""
        where = cls.locations(state_dir, reg)
        return {"search_index": str(where["index"]) if where else None}

    def read_back(self, reg: TableReg) -> StoredTexts | None:
        """Every live document: ``_cdc_key`` -> {search column: indexed text} (none before the index
        exists); None for a table without search columns."""
        if not reg.search:
            return None
        path = index_path(self.state_dir, reg)
        if not path.exists():
            return StoredTexts({})
        index = tantivy.Index.open(str(path))
        index.reload()
        searcher = index.searcher()
        total = int(searcher.num_docs)
        docs: dict[str, dict[str, str]] = {}
        if total == 0:
            return StoredTexts(docs)
        for _score, addr in searcher.search(tantivy.Query.all_query(), limit=total).hits:
            body = searcher.doc(addr).to_dict()
            keys = body.get(KEY) or []
            if keys:
                docs[str(keys[0])] = {
                    c: str(body[f][0]) for c in reg.search if body.get(f := reg.search_field(c))
                }
        return StoredTexts(docs)

    def applied_batch(self, reg: TableReg, app_id: str) -> int | None:
        """The side table's applied batch of ``app_id`` (recorded after the index commit)."""
        path = versions_path(self.state_dir, reg)
        if not reg.search or not path.exists():
            return None
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            row = db.execute("SELECT batch_id FROM applied WHERE app_id = ?", (app_id,)).fetchone()
        finally:
            db.close()
        return None if row is None else int(row[0])

    def _index(self, reg: TableReg) -> _Index:
        idx = self._open.get(reg.topic)
        if idx is None or idx.reg.search != reg.search:
            if idx is not None:
                idx.close()
            idx = _Index(self.state_dir, reg, self.options)
            self._open[reg.topic] = idx
        return idx

    def reject(self, batch: ChangeBatch) -> list[Rejection]:
        """The events lacking unchanged TOAST columns that neither the batch nor the index holds a
        document for (:mod:`sinks.toast`; the side table tells which keys have a live document)."""
        reg = batch.table
        if not reg.search or batch.columns is not None:
            return []
        lacking = [ev for ev in batch.events if ev.unavailable and ev.op != "d"]
        if not lacking:
            return []
        chains = Chains(batch.events, reg.key)
        keys = {ev.key_json for ev in lacking} | set(chains.old_keys(lacking))
        idx = self._index(reg)
        stored = idx.stored(sorted(keys))
        live = {k for k, (_v, dead) in stored.items() if not dead}
        mark = idx.marker()
        none = ((-1, -1), False)

        def applied(ev: ChangeEvent) -> bool:  # a replay: the guard skips it, nothing to complete
            v = (ev.version.commit_lsn, ev.version.seq)
            return v <= stored.get(ev.key_json, none)[0] or ev.version <= mark

        return [
            Rejection(
                ev.partition,
                ev.offset,
                f"the unchanged TOAST columns {list(ev.unavailable)} were not sent, and neither the batch "
                "nor the search index holds a document to take them from (fix: re-snapshot the table)",
            )
            for ev in chains.unresolved(lambda k, _v: {} if k in live else None, applied)
        ]

    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        """See :class:`sinks.Sink` and the module docstring; a table without search columns is a no-op."""
        reg = batch.table
        if not reg.search or not len(batch):
            return
        idx = self._index(reg)
        done = idx.applied(app_id)
        if done is not None and done >= batch_id:
            return
        marker = idx.marker()
        pending = idx.pending()
        # while a batch is pending the index may hold documents the side table does not know
        always_delete = pending is not None
        writer = idx.writer
        try:
            if batch.columns is not None:
                rows, truncate = _columnar_upserts(idx, batch.columns, marker, always_delete), None
            else:
                rows, truncate = self._upserts(idx, batch, marker, always_delete)
        except BaseException:
            writer.rollback()  # drop this attempt's uncommitted operations: a retry starts clean
            raise
        if not rows and truncate is None:
            self._record(idx, app_id, batch_id, (), None, clear_pending=pending == (app_id, batch_id))
            return
        if pending is None:  # (another pending batch stays recorded: always-delete mode stays on)
            idx.set_pending(app_id, batch_id)
        writer.commit()
        self._record(
            idx, app_id, batch_id, rows, truncate, clear_pending=pending in (None, (app_id, batch_id))
        )
        if batch_id % 100 == 0:
            self.purge(reg)

    def _upserts(
        self, idx: _Index, batch: ChangeBatch, marker: Version, always_delete: bool
    ) -> tuple[list[_Row], ChangeEvent | None]:
        """The batch's index operations (uncommitted), per event; returns the side-table rows and the
        applied TRUNCATE."""
        reg = idx.reg
        writer = idx.writer
        fields = field_names(reg)
        latest = batch.latest()
        by_key: dict[str, list[ChangeEvent]] = {}
        for e in batch.events:
            if e.op != "t":
                by_key.setdefault(e.key_json, []).append(e)
        stored = idx.stored(sorted({ev.key_json for ev in latest if ev.op != "t"}))
        toast_keys = {e.key_json for e in batch.events if e.unavailable}
        chains = Chains(batch.events, reg.key) if toast_keys else None
        overlay: dict[str, tuple[Version, bool, int | None]] = {}  # key -> (version, deleted, deleted_at_ms)
        truncate: ChangeEvent | None = None
        for ev in latest:
            if ev.op == "t":
                if ev.version <= marker:
                    continue
                # one delete-by-query (also hits documents added earlier in this batch)
                writer.delete_documents_by_query(_older_than(idx.schema, ev.version))
                for k, (v, dead, _) in list(overlay.items()):
                    if not dead and v < ev.version:
                        overlay[k] = (ev.version, True, ev.ts_ms)
                marker = ev.version
                truncate = ev
                continue
            prev = overlay.get(ev.key_json)
            guard = marker
            live = always_delete
            if prev is not None:
                guard = max(guard, prev[0])
                live = True
            else:
                st = stored.get(ev.key_json)
                if st is not None:
                    guard = max(guard, Version(*st[0]))
                    live = live or not st[1]
            if ev.version <= guard:
                continue
            if live:  # a key without a live stored version has no document
                writer.delete_documents_by_term(KEY, ev.key_json)
            if ev.op == "d":
                overlay[ev.key_json] = (ev.version, True, ev.ts_ms)
                continue
            values = ev.after or {}
            if ev.key_json in toast_keys:
                chain = [e for e in by_key.get(ev.key_json, ()) if guard < e.version <= ev.version]
                if any(e.unavailable for e in chain):
                    values = _resolve(idx, reg, chain, chains)
            writer.add_document(_document(ev.key_json, ev.version.commit_lsn, ev.version.seq, values, fields))
            overlay[ev.key_json] = (ev.version, False, None)
        rows = [(k, v.commit_lsn, v.seq, int(dead), at) for k, (v, dead, at) in overlay.items()]
        rows.sort(key=lambda r: r[0])
        return rows, truncate

    def _record(
        self,
        idx: _Index,
        app_id: str,
        batch_id: int,
        rows: Iterable[_Row],
        truncate: ChangeEvent | None,
        *,
        clear_pending: bool,
    ) -> None:
        """The side table's commit: ``rows`` = (key, commit_lsn, seq, deleted, deleted_at_ms) in key
        order (B-tree pages are then visited once, in order), the truncate marker, the batch id."""
        db = idx.db
        db.execute("BEGIN IMMEDIATE")
        try:
            if clear_pending:
                db.execute("DELETE FROM meta WHERE name = 'pending'")
            if truncate is not None:  # the truncate marker guards the keys it removed
                tv = truncate.version
                db.execute(
                    "DELETE FROM versions WHERE deleted = 0 AND (commit_lsn < ? OR (commit_lsn = ? AND seq < ?))",
                    (tv.commit_lsn, tv.commit_lsn, tv.seq),
                )
                db.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('truncate', ?)",
                    (orjson.dumps([truncate.version.commit_lsn, truncate.version.seq]).decode(),),
                )
            db.executemany(
                "INSERT INTO versions (key, commit_lsn, seq, deleted, deleted_at_ms) VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (key) DO UPDATE SET commit_lsn = excluded.commit_lsn, seq = excluded.seq, "
                "deleted = excluded.deleted, deleted_at_ms = excluded.deleted_at_ms",
                rows,
            )
            db.execute("INSERT OR REPLACE INTO applied VALUES (?, ?)", (app_id, batch_id))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def purge(self, reg: TableReg) -> int:
        """Forget tombstones older than the retention; returns how many."""
        idx = self._index(reg)
        cutoff = int((time.time() - self.options.tombstone_retention_hours * 3600) * 1000)
        cur = idx.db.execute("DELETE FROM versions WHERE deleted = 1 AND deleted_at_ms < ?", (cutoff,))
        return int(cur.rowcount)

    def close(self) -> None:
        for idx in self._open.values():
            idx.close()
        self._open.clear()


def _resolve(idx: _Index, reg: TableReg, chain: list[ChangeEvent], chains: Chains | None) -> dict[str, Any]:
    """The full values of the last event of ``chain`` (a key's applied events of this batch, in
    version order): unavailable (unchanged TOAST) columns come from the previous event of the chain,
    else from the stored document; for a primary-key change's ``c``, from the old key's row
    (:mod:`sinks.toast`: its events of the batch, else its stored document), else from the key's own
    document (a replay after this batch's index commit); ApplyError when there is none (or the key
    was deleted before). :meth:`SearchSink.reject` dead-letters such events first."""
    base: dict[str, Any] | None = None
    deleted = False
    for e in chain:
        if e.op == "d":
            base, deleted = None, True
            continue
        values = dict(e.after or {})
        if chains is not None and Chains.is_moved(e):
            moved = chains.values(e, lambda k, _v: idx.document(k))
            base = moved if moved is not None else idx.document(e.key_json)
        if e.unavailable:
            if base is None and not deleted:
                base = idx.document(e.key_json)
            if base is None:
                raise ApplyError(
                    f"{reg.qualified}: key {e.key_json} at version {e.version} lacks the unchanged TOAST "
                    f"columns {list(e.unavailable)} and the search index has no document to take them from",
                    fix=f"re-snapshot the table (`cdc snapshot {reg.qualified}`)",
                    key=e.key_json,
                )
            for c in e.unavailable:
                values[c] = base.get(c)
        base = values
    assert base is not None
    return base


_CHUNK = 8192  # rows per step of the columnar path: its Python objects stay few (fresh memory is slow)


def _columnar_upserts(idx: _Index, cols: Columns, marker: Version, always_delete: bool) -> list[_Row]:
    """The index operations (uncommitted) of a columnar batch; returns the side-table rows in key order.

    Same result as the per-event path: a columnar batch has no TRUNCATE and no unavailable column, so
    only each key's newest row (:meth:`Columns.latest`) matters, applied when newer than the truncate
    marker and the key's stored version. Per chunk of rows, one delete-by-query of the keys with a live
    stored version (every key while a batch is pending) comes before the chunk's adds: each key occurs
    once, so it removes exactly what the per-key delete by term would."""
    writer = idx.writer
    schema = idx.schema
    fields = field_names(idx.reg)
    mark = (marker.commit_lsn, marker.seq)
    latest = cols.latest()
    applied: list[pa.Table] = []
    for start in range(0, latest.num_rows, _CHUNK):
        chunk = latest.slice(start, _CHUNK)
        keys, lsns, seqs = (chunk.column(c).to_pylist() for c in ("key_json", "commit_lsn", "seq"))
        stored = idx.stored(keys)
        keep: list[int] = []
        live: list[str] = []
        for i, (key, lsn, seq) in enumerate(zip(keys, lsns, seqs, strict=True)):
            v = (lsn, seq)
            st = stored.get(key)
            if v <= mark or (st is not None and v <= st[0]):
                continue
            keep.append(i)
            if always_delete or (st is not None and not st[1]):
                live.append(key)
        if not keep:
            continue
        if live:  # a key without a live stored version has no document
            writer.delete_documents_by_query(tantivy.Query.term_set_query(schema, KEY, live))
        chunk = chunk.take(keep)
        applied.append(chunk.select(["key_json", "commit_lsn", "seq", "op", "ts_ms"]))
        names = ("key_json", "commit_lsn", "seq", "op", "after")
        for key, lsn, seq, op, after in zip(*(chunk.column(c).to_pylist() for c in names), strict=True):
            if op != "d":
                writer.add_document(_document(key, lsn, seq, after, fields))
    if not applied:
        return []
    rows = pa.concat_tables(applied)
    rows = rows.take(pc.sort_indices(rows, [("key_json", "ascending")]))
    deleted = pc.equal(rows.column("op"), "d")
    return list(
        zip(
            *(rows.column(c).to_pylist() for c in ("key_json", "commit_lsn", "seq")),
            deleted.cast(pa.int64()).to_pylist(),
            pc.if_else(deleted, rows.column("ts_ms"), None).to_pylist(),
            strict=True,
        )
    )


def _document(
    key_json: str, commit_lsn: int, seq: int, values: dict[str, Any], fields: dict[str, str]
) -> tantivy.Document:
    doc = tantivy.Document()
    doc.add_text(KEY, key_json)
    doc.add_unsigned(LSN, commit_lsn)
    doc.add_unsigned(SEQ, seq)
    for col, field in fields.items():
        v = values.get(col)
        if v is None:
            continue
        doc.add_text(field, v if isinstance(v, str) else orjson.dumps(v).decode())
    doc.add_bytes(DOCUMENT, orjson.dumps(values))
    return doc


# --- reading (cdc search) ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Hit:
    key: Any
    score: float
    snippet: str
    document: dict[str, Any]


HIGHLIGHT_START = "**"
HIGHLIGHT_END = "**"


def search(state_dir: Path, reg: TableReg, query: str, *, limit: int = 10) -> list[Hit]:
    """Ranked hits (BM25) for ``query`` (tantivy query syntax) over the table's search columns.
    Snippets are plain text with matches between ``**`` markers. ApplyError when the table has no
    search columns or no index yet; a query syntax error is an ApplyError naming the query."""
    from cdc.names import quote_table_name

    if not reg.search:
        raise ApplyError(
            f"{reg.qualified} has no search columns",
            fix=f"register them: `cdc tables remove '{quote_table_name(reg.schema, reg.table)}'` then "
            f"`cdc tables add '{quote_table_name(reg.schema, reg.table)}' --search COL`",
            table=reg.qualified,
        )
    path = index_path(state_dir, reg)
    if not path.is_dir() or not tantivy.Index.exists(str(path)):
        raise ApplyError(
            f"{reg.qualified} is not indexed yet (no index at {path})",
            fix="run the apply job (`cdc apply --once`) after the table's snapshot",
            table=reg.qualified,
        )
    index = tantivy.Index.open(str(path))
    fields = list(field_names(reg).values())
    try:
        q = index.parse_query(query, fields)
    except ValueError as exc:
        raise ApplyError(
            f"cannot parse the search query {query!r}: {exc}",
            fix='use tantivy query syntax: words, "a phrase", field:word, +must -mustnot, AND/OR; '
            f"fields: {', '.join(fields)}",
            query=query,
        ) from exc
    searcher = index.searcher()
    schema = index.schema
    generators = [tantivy.SnippetGenerator.create(searcher, q, schema, f) for f in fields]
    hits: list[Hit] = []
    for score, addr in searcher.search(q, limit).hits:
        doc = searcher.doc(addr)
        snippet = ""
        for gen in generators:
            snippet = _marked(gen.snippet_from_doc(doc))
            if snippet:
                break
        if not snippet:  # matched outside the text (e.g. a range query): the start of the first field
            snippet = next((str(doc.get_first(f))[:150] for f in fields if doc.get_first(f) is not None), "")
        raw = doc.get_first(DOCUMENT)
        hits.append(
            Hit(
                key=orjson.loads(str(doc.get_first(KEY))),
                score=float(score),
                snippet=snippet,
                document=orjson.loads(raw) if raw is not None else {},
            )
        )
    return hits


def _marked(snippet: tantivy.Snippet) -> str:
    """The fragment with highlighted ranges (byte offsets) wrapped in markers."""
    text = snippet.fragment().encode()
    ranges = sorted((r.start, r.end) for r in snippet.highlighted())
    if not text:
        return ""
    out = []
    pos = 0
    for start, end in ranges:
        out.append(text[pos:start].decode(errors="replace"))
        out.append(HIGHLIGHT_START + text[start:end].decode(errors="replace") + HIGHLIGHT_END)
        pos = end
    out.append(text[pos:].decode(errors="replace"))
    return "".join(out)
