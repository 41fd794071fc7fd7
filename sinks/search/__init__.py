"""The search sink: one tantivy index per registered table with search columns, in N shards.

One document per key (the key's canonical JSON as a raw term, its version, one text field per search
column, every column as JSON for ``cdc search``), in the shard of its key (:func:`sinks.shard_of`:
the key's log-store partition), kept beside the shard's SQLite side table of versions, tombstones,
the TRUNCATE marker and the applied batch per app id. Modules: :mod:`.index` (the layout, a shard),
:mod:`.write` (a shard's index operations and side-table commit), :mod:`.query` (``cdc search``, the
read-back). The guarantees of :meth:`SearchSink.apply` (version guard, idempotent batches through a
*pending* mark, the columnar path, unavailable TOAST values, shards) and the layout:
``docs/search.md``.
"""

from __future__ import annotations

import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdc import sink_locations
from cdc.config import DEFAULT_PARTITIONS, SearchConfig, Settings, section_options
from cdc.events import Version
from cdc.registry import TableReg
from sinks import ChangeBatch, KeyRanges, Rejection, Sink, StoredTexts
from sinks.search.index import (
    DOCUMENT,
    KEY,
    LSN,
    SEQ,
    Shard,
    TableIndex,
    build_schema,
    field_names,
    find_layout,
    index_path,
    versions_path,
)
from sinks.search.query import HIGHLIGHT_END, HIGHLIGHT_START, Hit, live_texts, search, texts_of
from sinks.search.write import columnar_upserts, record, slices, upserts
from sinks.toast import Chains

__all__ = [
    "DOCUMENT",
    "HIGHLIGHT_END",
    "HIGHLIGHT_START",
    "KEY",
    "LSN",
    "SEQ",
    "Hit",
    "SearchOptions",
    "SearchSink",
    "build_schema",
    "field_names",
    "index_path",
    "search",
    "versions_path",
]


class SearchOptions(SearchConfig):
    """From ``[search]`` in cdc.toml, whose model (:class:`cdc.config.SearchConfig`) holds each key's
    default and bounds. ``heap_size``: the memory budget (bytes) of a shard's index writer (a whole
    batch opens every shard of its table)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> SearchOptions:
        return section_options(cls, settings, "search")


@dataclass
class _Prepared:
    """A shard's batch, its index operations made (uncommitted): what its commit records."""

    shard: Shard
    rows: list[tuple[str, int, int, int, int | None]]
    truncate: Version | None
    pending: tuple[str, int] | None


class SearchSink(Sink):
    """tantivy index per table with search columns (see the module docstring). One writer per shard:
    the apply job, or the task that owns the shard; ``cdc search`` only reads. Not thread-safe: call
    it from one thread at a time (any thread: the SQLite side tables are opened with
    ``check_same_thread=False``). ``shards`` (:attr:`new_shards`): the shard count of an index created from now on (the
    log store's partition count, :attr:`cdc.config.Settings.partitions`); an existing index keeps its
    own."""

    name = "search"
    unit = "docs"

    def __init__(
        self, state_dir: Path, options: SearchOptions | None = None, *, shards: int = DEFAULT_PARTITIONS
    ) -> None:
        if shards < 1:
            raise ValueError(f"shards must be at least 1, got {shards}")
        self.state_dir = Path(state_dir)
        self.options = options or SearchOptions()
        self.new_shards = shards
        self._open: dict[str, TableIndex] = {}

    @classmethod
    def from_settings(cls, settings: Settings) -> SearchSink:
        return cls(
            Path(settings.state_dir), SearchOptions.from_settings(settings), shards=settings.partitions
        )

    # -- where it lives, what it holds (sinks.Sink) ----------------------------------------------------
    @classmethod
    def locations(cls, state_dir: Path, reg: TableReg) -> dict[str, Path]:
        """A table with search columns: ``index`` (the directory of its shards, each a tantivy index
        with its side table) and ``versions`` (the index's metadata) (:func:`cdc.sink_locations.search`)."""
        return sink_locations.search(state_dir, reg)

    @classmethod
    def listing(cls, state_dir: Path, reg: TableReg) -> dict[str, Any]:
        """``{"search_index": path, "search_shards": N}`` (None for a table without search columns;
        the shard count None before the index exists)."""
        where = cls.locations(state_dir, reg)
        layout = find_layout(state_dir, reg) if where else None
        return {
            "search_index": str(where["index"]) if where else None,
            "search_shards": layout.count if layout is not None else None,
        }

    def read_back(self, reg: TableReg, only: KeyRanges | None = None) -> StoredTexts | None:
        """Every live document of every shard: ``_cdc_key`` -> {search column: indexed text} (none
        before the index exists); None for a table without search columns. With ``only``: the
        documents of ``only.keys`` (each looked up in its shard by a term set query on the key:
        the index keeps no key order to read a range by) and the index's document count."""
        if not reg.search:
            return None
        if only is None:
            return StoredTexts(live_texts(self.state_dir, reg))
        docs, total = texts_of(self.state_dir, reg, only.keys)
        return StoredTexts(docs, total)

    def applied_batch(self, reg: TableReg, app_id: str) -> int | None:
        """The newest batch of ``app_id`` every shard has committed: the minimum over the shards that
        recorded one (each records it in its side table after its index commit). A whole batch is
        recorded in every shard; a task's slice only in its own, so a shard whose partition had no
        records in the latest batches holds the minimum back: every batch at or below it is applied
        in every shard."""
        layout = find_layout(self.state_dir, reg) if reg.search else None
        if layout is None:
            return None
        done = []
        for _path, db_path in layout.shards:
            if not db_path.exists():
                continue
            db = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
            try:
                row = db.execute("SELECT batch_id FROM applied WHERE app_id = ?", (app_id,)).fetchone()
            except sqlite3.OperationalError:  # created, its tables not yet
                row = None
            finally:
                db.close()
            if row is not None:
                done.append(int(row[0]))
        return min(done) if done else None

    def shards(self, reg: TableReg) -> int | None:
        """See :meth:`sinks.Sink.shards`: the index's shard count (a new index's too: tasks may create
        their shards at once, the first count recorded holds); None without search columns."""
        return self.shard_count(reg) if reg.search else None

    def shard_count(self, reg: TableReg) -> int:
        """The shards of ``reg``'s index: those it was created with, or that a new one gets."""
        layout = find_layout(self.state_dir, reg)
        return self.new_shards if layout is None else layout.count

    def _table(self, reg: TableReg) -> TableIndex:
        idx = self._open.get(reg.topic)
        if idx is None or idx.reg.search != reg.search:
            if idx is not None:
                idx.close()
            idx = TableIndex(self.state_dir, reg, self.new_shards)
            self._open[reg.topic] = idx
        return idx

    def reject(self, batch: ChangeBatch) -> list[Rejection]:
        """The events lacking unchanged TOAST columns that neither the batch nor the index holds a
        document for (:mod:`sinks.toast`; the side tables tell which keys have a live document, a
        key change's old key in its own shard)."""
        reg = batch.table
        if not reg.search or not batch.columns.lacks_values():
            return []
        chains = Chains(batch.columns, reg.key)
        if not chains.lacking:
            return []
        keys = {chains.key_json(r) for r in chains.lacking} | set(chains.old_keys(chains.lacking))
        table = self._table(reg)
        stored = table.stored(sorted(keys))
        live = {k for k, (_v, dead) in stored.items() if not dead}
        none = ((-1, -1), False)

        def applied(row: int) -> bool:  # a replay: the guard skips it, nothing to complete
            key, v = chains.key_json(row), chains.version(row)
            return (v.commit_lsn, v.seq) <= stored.get(key, none)[0] or v <= table.marker(key)

        rows = chains.unresolved(lambda k, _v: {} if k in live else None, applied)
        return [
            Rejection(
                *pos,
                f"the unchanged TOAST columns {list(chains.unavailable(r))} were not sent, and neither the "
                "batch nor the search index holds a document to take them from (fix: re-snapshot the table)",
            )
            for r, pos in zip(rows, batch.columns.positions(rows), strict=True)
        ]

    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        """See :class:`sinks.Sink` and the module docstring; a table without search columns is a no-op.
        ``batch.shard`` None: every shard of the index gets its keys' events (and the batch id, also
        a shard without any); an int p: only shard p, which must hold every key of the batch
        (ApplyError before anything is written otherwise). Every shard's operations are made before
        any shard commits, so a key change's old key is read as it was before the batch."""
        reg = batch.table
        if not reg.search or not len(batch):
            return
        table = self._table(reg)
        parts = slices(batch, table.layout)
        prepared: list[_Prepared] = []
        try:
            for i, part in parts:
                got = self._prepare(table, table.shard(i), part, batch, batch_id, app_id)
                if got is not None:
                    prepared.append(got)
        except BaseException:
            for shard in table.opened():  # drop this attempt's uncommitted operations: a retry starts clean
                if shard.has_writer:
                    shard.writer.rollback()
            raise
        if len(prepared) > 1:  # the shards' commits wait on fsync mostly: at once
            with ThreadPoolExecutor(len(prepared)) as pool:
                list(pool.map(lambda p: self._commit(p, app_id, batch_id), prepared))
        else:
            for p in prepared:
                self._commit(p, app_id, batch_id)
        if batch_id % 100 == 0:
            for p in prepared:
                self._purge(p.shard)

    def _prepare(
        self,
        table: TableIndex,
        shard: Shard,
        part: ChangeBatch,
        whole: ChangeBatch,
        batch_id: int,
        app_id: str,
    ) -> _Prepared | None:
        """Shard ``shard``'s index operations for its ``part`` of the batch ``whole`` (uncommitted);
        None when the shard applied the batch already."""
        done = shard.applied(app_id)
        if done is not None and done >= batch_id:
            return None
        shard.open_writer(self.options.heap_size, self.options.threads)
        marker = shard.marker()
        pending = shard.pending()
        # while a batch is pending the index may hold documents the side table does not know
        always_delete = pending is not None
        if not len(part):
            return _Prepared(shard, [], None, pending)
        if part.columns.plain:
            return _Prepared(
                shard, columnar_upserts(shard, part.columns, marker, always_delete), None, pending
            )
        rows, truncate = upserts(table, shard, part, whole, marker, always_delete)
        return _Prepared(shard, rows, truncate, pending)

    @staticmethod
    def _commit(p: _Prepared, app_id: str, batch_id: int) -> None:
        """The shard's index commit, then its side table's (the batch pending in between)."""
        if not p.rows and p.truncate is None:
            record(p.shard, app_id, batch_id, (), None, clear_pending=p.pending == (app_id, batch_id))
            return
        if p.pending is None:  # (another pending batch stays recorded: always-delete mode stays on)
            p.shard.set_pending(app_id, batch_id)
        p.shard.writer.commit()
        record(
            p.shard,
            app_id,
            batch_id,
            p.rows,
            p.truncate,
            clear_pending=p.pending in (None, (app_id, batch_id)),
        )

    def _purge(self, shard: Shard) -> int:
        cutoff = int((time.time() - self.options.tombstone_retention_hours * 3600) * 1000)
        cur = shard.db.execute("DELETE FROM versions WHERE deleted = 1 AND deleted_at_ms < ?", (cutoff,))
        return int(cur.rowcount)

    def close(self) -> None:
        for idx in self._open.values():
            idx.close()
        self._open.clear()
