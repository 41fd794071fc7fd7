"""Reading a table's search index: ``cdc search`` (:func:`search`: every shard queried, the top hits
merged by score) and ``cdc verify``'s read-back of every live document (:func:`live_texts`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import tantivy

from cdc.errors import ApplyError
from cdc.registry import TableReg
from sinks.search.index import DOCUMENT, KEY, field_names, find_layout, index_path


@dataclass(frozen=True, slots=True)
class Hit:
    key: Any
    score: float
    snippet: str
    document: dict[str, Any]


HIGHLIGHT_START = "**"
HIGHLIGHT_END = "**"


def shard_indexes(state_dir: Path, reg: TableReg) -> list[tantivy.Index] | None:
    """The tantivy index of every shard that exists, in shard order (None: the table has no index)."""
    layout = find_layout(state_dir, reg)
    if layout is None:
        return None
    return [tantivy.Index.open(str(p)) for p, _db in layout.shards if (p / "meta.json").exists()]


def live_texts(state_dir: Path, reg: TableReg) -> dict[str, dict[str, str]]:
    """Every live document of every shard: ``_cdc_key`` -> {search column: indexed text}."""
    docs: dict[str, dict[str, str]] = {}
    for index in shard_indexes(state_dir, reg) or []:
        index.reload()
        searcher = index.searcher()
        total = int(searcher.num_docs)
        if total:
            _collect(reg, searcher, tantivy.Query.all_query(), total, docs)
    return docs


def texts_of(state_dir: Path, reg: TableReg, keys: Iterable[str]) -> tuple[dict[str, dict[str, str]], int]:
    """The live documents of ``keys`` (canonical key JSON; those that have one), each looked up in its
    shard by a term set query on ``_cdc_key``, and the number of live documents of every shard."""
    layout = find_layout(state_dir, reg)
    docs: dict[str, dict[str, str]] = {}
    if layout is None:
        return docs, 0
    wanted = sorted(set(keys))
    per_shard: dict[int, list[str]] = {}
    for key, shard in zip(wanted, layout.shards_of(wanted), strict=True):
        per_shard.setdefault(shard, []).append(key)
    total = 0
    for n, (path, _db) in enumerate(layout.shards):
        if not (path / "meta.json").exists():
            continue
        index = tantivy.Index.open(str(path))
        index.reload()
        searcher = index.searcher()
        total += int(searcher.num_docs)
        mine = per_shard.get(n)
        if mine and searcher.num_docs:
            query = tantivy.Query.term_set_query(index.schema, KEY, mine)
            _collect(reg, searcher, query, len(mine), docs)
    return docs, total


def _collect(
    reg: TableReg,
    searcher: tantivy.Searcher,
    query: tantivy.Query,
    limit: int,
    docs: dict[str, dict[str, str]],
) -> None:
    """The documents ``query`` matches (at most ``limit``) into ``docs``: key -> {column: text}."""
    for _score, addr in searcher.search(query, limit=limit).hits:
        body = searcher.doc(addr).to_dict()
        keys = body.get(KEY) or []
        if keys:
            docs[str(keys[0])] = {
                c: str(body[f][0]) for c in reg.search if body.get(f := reg.search_field(c))
            }


def search(state_dir: Path, reg: TableReg, query: str, *, limit: int = 10) -> list[Hit]:
    """Ranked hits (BM25) for ``query`` (tantivy query syntax) over the table's search columns.
    Every shard is queried for its top ``limit``; the hits are merged by score (each shard's BM25,
    with its own term statistics, as Elasticsearch does by default), ties by the key's canonical JSON.
    Snippets are plain text with matches between ``**`` markers. ApplyError when the table has no
    search columns or no index yet; a query syntax error is an ApplyError naming the query."""
    from cdc.names import cli_table_name

    if not reg.search:
        raise ApplyError(
            f"{reg.qualified} has no search columns",
            fix=f"register them: `cdc tables remove {cli_table_name(reg.schema, reg.table)}` then "
            f"`cdc tables add {cli_table_name(reg.schema, reg.table)} --search COL`",
            table=reg.qualified,
        )
    indexes = shard_indexes(state_dir, reg)
    if not indexes:
        raise ApplyError(
            f"{reg.qualified} is not indexed yet (no index at {index_path(state_dir, reg)})",
            fix="run the apply job (`cdc apply --once`) after the table's snapshot",
            table=reg.qualified,
        )
    fields = list(field_names(reg).values())
    queries = [_parsed(index, query, fields) for index in indexes]
    searchers = [index.searcher() for index in indexes]
    found: list[tuple[float, str, int, tantivy.Document]] = []
    for n, (searcher, q) in enumerate(zip(searchers, queries, strict=True)):
        for score, addr in searcher.search(q, limit).hits:
            doc = searcher.doc(addr)
            found.append((float(score), str(doc.get_first(KEY)), n, doc))
    found.sort(key=lambda h: (-h[0], h[1]))
    generators: dict[int, list[tantivy.SnippetGenerator]] = {}
    hits = []
    for score, key, n, doc in found[:limit]:
        gens = generators.get(n)
        if gens is None:
            schema = indexes[n].schema
            gens = generators[n] = [
                tantivy.SnippetGenerator.create(searchers[n], queries[n], schema, f) for f in fields
            ]
        hits.append(_hit(doc, key, score, gens, fields))
    return hits


def _parsed(index: tantivy.Index, query: str, fields: list[str]) -> tantivy.Query:
    try:
        return index.parse_query(query, fields)
    except ValueError as exc:
        raise ApplyError(
            f"cannot parse the search query {query!r}: {exc}",
            fix='use tantivy query syntax: words, "a phrase", field:word, +must -mustnot, AND/OR; '
            f"fields: {', '.join(fields)}",
            query=query,
        ) from exc


def _hit(
    doc: tantivy.Document,
    key: str,
    score: float,
    generators: list[tantivy.SnippetGenerator],
    fields: list[str],
) -> Hit:
    snippet = ""
    for gen in generators:
        snippet = _marked(gen.snippet_from_doc(doc))
        if snippet:
            break
    if not snippet:  # matched outside the text (e.g. a range query): the start of the first field
        snippet = next((str(doc.get_first(f))[:150] for f in fields if doc.get_first(f) is not None), "")
    raw = doc.get_first(DOCUMENT)
    return Hit(
        key=orjson.loads(key),
        score=score,
        snippet=snippet,
        document=orjson.loads(raw) if raw is not None else {},
    )


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
