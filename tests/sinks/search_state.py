"""What a search index holds, read straight from its files (every shard's documents and side
table), and the rows the search sink's tests write."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import orjson
import tantivy

from cdc.registry import TableReg
from sinks import search as S
from sinks.search import SearchSink
from sinks.search.index import Shard, find_layout

COLS = (("id", "bigint"), ("title", "text"), ("body", "text"), ("price", "numeric(10,2)"))


def docs(tmp_path: Path, reg: TableReg) -> dict[int, dict[str, object]]:
    """Every document of every shard, by id (each in the shard of its key, one per key)."""
    layout = find_layout(tmp_path, reg)
    assert layout is not None
    out = {}
    for n, (path, _db) in enumerate(layout.shards):
        searcher = tantivy.Index.open(str(path)).searcher()
        for _score, addr in searcher.search(tantivy.Query.all_query(), 1000).hits:
            d = searcher.doc(addr)
            key = d.get_first(S.KEY)
            assert layout.shard_of(key) == n and json.loads(key)["id"] not in out, (key, n)
            out[json.loads(key)["id"]] = d.to_dict()
    assert len(out) == sum(tantivy.Index.open(str(p)).searcher().num_docs for p, _ in layout.shards), (
        "one document per key"
    )
    return out


def shard(sink: SearchSink, reg: TableReg, key: dict[str, object]) -> Shard:
    """The shard holding ``key``, as ``sink`` opened it."""
    table = sink._table(reg)
    return table.shard(table.layout.shard_of(orjson.dumps(key).decode()))


def row(i: int, title: str, body: str = "", price: str | None = None) -> dict[str, object]:
    return {"id": i, "title": title, "body": body, "price": price}


def side_tables(tmp_path: Path, reg: TableReg) -> list[dict[str, list[tuple[object, ...]]]]:
    """Every shard's side table."""
    layout = find_layout(tmp_path, reg)
    assert layout is not None
    out = []
    for _path, db_path in layout.shards:
        db = sqlite3.connect(db_path)
        try:
            out.append(
                {
                    t: db.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall()
                    for t in ("versions", "applied", "meta")
                }
            )
        finally:
            db.close()
    return out


def key_of(i: int) -> str:
    """The canonical key JSON of ``{"id": i}``."""
    return orjson.dumps({"id": i}).decode()
