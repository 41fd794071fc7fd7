"""Writing one shard of a table's index: the index operations of a batch's events (uncommitted, on
the shard's writer) and the side table's commit. Guarantees and layout: ``docs/search.md``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import tantivy

from cdc.errors import ApplyError
from cdc.events import Version
from sinks import ChangeBatch
from sinks.columnar import Columns
from sinks.search.index import DOCUMENT, KEY, LSN, SEQ, Layout, Shard, TableIndex, field_names
from sinks.toast import Chains

_Row = tuple[str, int, int, int, int | None]  # a side-table row: key, commit_lsn, seq, deleted, deleted_at_ms


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


def upserts(
    table: TableIndex,
    shard: Shard,
    batch: ChangeBatch,
    whole: ChangeBatch,
    marker: Version,
    always_delete: bool,
) -> tuple[list[_Row], Version | None]:
    """The index operations (uncommitted) of ``batch``, the rows of ``shard`` of the micro-batch
    ``whole`` (whose other rows complete a key change's unchanged TOAST values): each key's newest
    row and every TRUNCATE, in version order; returns the side-table rows and the applied TRUNCATE's
    version."""
    writer = shard.writer
    fields = field_names(table.reg)
    cols = batch.columns
    latest = cols.latest_rows()
    t = cols.table.take(pa.array(latest, pa.int64()))
    names = ("key_json", "op", "commit_lsn", "seq", "ts_ms")
    rows = list(zip(*(t.column(c).to_pylist() for c in names), cols.afters(latest), strict=True))
    stored = shard.stored(sorted({r[0] for r in rows if r[1] != "t"}))
    own = Chains(cols, table.reg.key)  # the rows of the keys lacking values, and of their old keys
    toast_keys = {own.key_json(r) for r in own.lacking}
    moved = _moved(table, own, cols, whole) if toast_keys else _no_moved
    overlay: dict[str, tuple[Version, bool, int | None]] = {}  # key -> (version, deleted, deleted_at_ms)
    truncate: Version | None = None
    for key, op, lsn, seq, ts_ms, after in rows:
        version = Version(lsn, seq)
        if op == "t":
            if version <= marker:
                continue
            # one delete-by-query (also hits documents added earlier in this batch)
            writer.delete_documents_by_query(_older_than(shard.schema, version))
            for k, (v, dead, _) in list(overlay.items()):
                if not dead and v < version:
                    overlay[k] = (version, True, ts_ms)
            marker = truncate = version
            continue
        prev = overlay.get(key)
        guard = marker
        live = always_delete
        if prev is not None:
            guard = max(guard, prev[0])
            live = True
        else:
            st = stored.get(key)
            if st is not None:
                guard = max(guard, Version(*st[0]))
                live = live or not st[1]
        if version <= guard:
            continue
        if live:  # a key without a live stored version has no document
            writer.delete_documents_by_term(KEY, key)
        if op == "d":
            overlay[key] = (version, True, ts_ms)
            continue
        values = after or {}
        if key in toast_keys:
            chain = [e for e in own.by_key.get(key, ()) if guard < own.version(e) <= version]
            if any(own.unavailable(e) for e in chain):
                values = _resolve(table, own, chain, moved)
        writer.add_document(_document(key, lsn, seq, values, fields))
        overlay[key] = (version, False, None)
    out = [(k, v.commit_lsn, v.seq, int(dead), at) for k, (v, dead, at) in overlay.items()]
    out.sort(key=lambda r: r[0])
    return out, truncate


def _no_moved(_row: int) -> dict[str, Any] | None:
    return None


def _moved(
    table: TableIndex, own: Chains, cols: Columns, whole: ChangeBatch
) -> Callable[[int], dict[str, Any] | None]:
    """A key change's ``c`` (a row of ``cols``) -> the old key's values (:mod:`sinks.toast`, through
    ``whole``: the old key's rows of the micro-batch, else its stored document; None: neither)."""
    chains = own if whole.columns is cols else Chains(whole.columns, table.reg.key)
    at = dict(zip(whole.columns.positions(chains.lacking), chains.lacking, strict=True))

    def values(row: int) -> dict[str, Any] | None:
        mine = at.get(cols.positions([row])[0])
        return None if mine is None else chains.values(mine, lambda k, _v: table.document(k))

    return values


def record(
    shard: Shard,
    app_id: str,
    batch_id: int,
    rows: Iterable[_Row],
    truncate: Version | None,
    *,
    clear_pending: bool,
) -> None:
    """The side table's commit: ``rows`` = (key, commit_lsn, seq, deleted, deleted_at_ms) in key
    order (B-tree pages are then visited once, in order), the truncate marker, the batch id."""
    db = shard.db
    db.execute("BEGIN IMMEDIATE")
    try:
        if clear_pending:
            db.execute("DELETE FROM meta WHERE name = 'pending'")
        if truncate is not None:  # the truncate marker guards the keys it removed
            tv = truncate
            db.execute(
                "DELETE FROM versions WHERE deleted = 0 AND (commit_lsn < ? OR (commit_lsn = ? AND seq < ?))",
                (tv.commit_lsn, tv.commit_lsn, tv.seq),
            )
            db.execute(
                "INSERT OR REPLACE INTO meta VALUES ('truncate', ?)",
                (orjson.dumps([tv.commit_lsn, tv.seq]).decode(),),
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


def _resolve(
    table: TableIndex, own: Chains, chain: list[int], moved: Callable[[int], dict[str, Any] | None]
) -> dict[str, Any]:
    """The full values of the last row of ``chain`` (a key's applied rows of this batch, in version
    order): unavailable (unchanged TOAST) columns come from the previous row of the chain, else from
    the stored document; for a primary-key change's ``c``, from the old key's row (``moved``:
    :mod:`sinks.toast`, its rows of the batch, else its stored document), else from the key's own
    document (a replay after this batch's index commit); ApplyError when there is none (or the key
    was deleted before). :meth:`SearchSink.reject` dead-letters such rows first."""
    base: dict[str, Any] | None = None
    deleted = False
    for e in chain:
        if own.op(e) == "d":
            base, deleted = None, True
            continue
        values = dict(own.after(e) or {})
        if own.is_moved(e):
            got = moved(e)
            base = got if got is not None else table.document(own.key_json(e))
        unavailable = own.unavailable(e)
        if unavailable:
            if base is None and not deleted:
                base = table.document(own.key_json(e))
            if base is None:
                reg = table.reg
                raise ApplyError(
                    f"{reg.qualified}: key {own.key_json(e)} at version {own.version(e)} lacks the unchanged "
                    f"TOAST columns {list(unavailable)} and the search index has no document to take them from",
                    fix=f"re-snapshot the table (`cdc snapshot {reg.qualified}`)",
                    key=own.key_json(e),
                )
            for c in unavailable:
                values[c] = base.get(c)
        base = values
    assert base is not None
    return base


_CHUNK = 8192  # rows per step of the columnar path: its Python objects stay few (fresh memory is slow)


def columnar_upserts(shard: Shard, cols: Columns, marker: Version, always_delete: bool) -> list[_Row]:
    """The index operations (uncommitted) of a columnar batch; returns the side-table rows in key order.

    Same result as :func:`upserts`: a plain batch has no TRUNCATE and no unavailable column, so
    only each key's newest row (:meth:`Columns.latest`) matters, applied when newer than the truncate
    marker and the key's stored version. Per chunk of rows, one delete-by-query of the keys with a live
    stored version (every key while a batch is pending) comes before the chunk's adds: each key occurs
    once, so it removes exactly what the per-key delete by term would."""
    writer = shard.writer
    schema = shard.schema
    fields = field_names(shard.reg)
    mark = (marker.commit_lsn, marker.seq)
    latest = cols.latest()
    applied: list[pa.Table] = []
    for start in range(0, latest.num_rows, _CHUNK):
        chunk = latest.slice(start, _CHUNK)
        keys, lsns, seqs = (chunk.column(c).to_pylist() for c in ("key_json", "commit_lsn", "seq"))
        stored = shard.stored(keys)
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


def slices(batch: ChangeBatch, layout: Layout) -> list[tuple[int, ChangeBatch]]:
    """``batch`` per shard of the index: with ``batch.shard`` None, every shard with its keys' events
    (possibly none) and every TRUNCATE; with ``batch.shard = p``, shard p with the whole batch, after
    checking that every key is in shard p -- ApplyError naming the keys that are not (a bug of the
    caller: nothing is written)."""
    reg = batch.table
    cols = batch.columns
    op = cols.table.column("op")
    keys = cols.table.column("key_json").filter(pc.not_equal(op, "t")).to_pylist()
    shards = layout.shards_of(keys)
    if batch.shard is not None:
        p = batch.shard
        wrong = [(k, s) for k, s in zip(keys, shards, strict=True) if s != p]
        if not 0 <= p < layout.count or wrong:
            what = (
                f"the search index has {layout.count} shard(s), none numbered {p}"
                if not 0 <= p < layout.count
                else f"keys {[k for k, _ in wrong[:5]]} belong to shards {[s for _, s in wrong[:5]]} "
                f"({len(wrong)} of {len(keys)} keys) of its {layout.count}"
            )
            raise ApplyError(
                f"a slice of {reg.qualified} for shard {p} cannot be applied: {what}",
                fix="give a task only the events of its shard (sinks.shard_of(key_json, shards), shards: "
                "SearchSink.shard_count), or apply whole batches (ChangeBatch.shard None) to this table",
                table=reg.qualified,
                shard=p,
                shards=layout.count,
                keys=[k for k, _ in wrong[:5]],
                key_shards=[s for _, s in wrong[:5]],
            )
        return [(p, batch)]
    if layout.count == 1:
        return [(0, batch)]
    is_t = pc.equal(op, "t").to_numpy(zero_copy_only=False)
    of = np.full(len(is_t), -1)
    of[~is_t] = shards  # every shard gets every TRUNCATE
    return [
        (i, ChangeBatch(reg, cols.filter(pa.array((of == i) | is_t)), shard=i)) for i in range(layout.count)
    ]
