"""The search sink against a real tantivy index: upsert, delete, truncate, version guard, TOAST,
idempotent replay, snippets, errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import tantivy

from cdc.errors import ApplyError
from sinks import search as S
from sinks.search import SearchSink
from tests.sinks.feed import Feed, table

# every test runs on both batch forms (per-event and columnar)
pytestmark = pytest.mark.usefixtures("columnar")

APP = "cdc-apply-test"
COLS = (("id", "bigint"), ("title", "text"), ("body", "text"), ("price", "numeric(10,2)"))


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[SearchSink]:
    s = SearchSink(tmp_path)
    yield s
    s.close()


def docs(tmp_path: Path, reg: object) -> dict[int, dict[str, object]]:
    index = tantivy.Index.open(str(S.index_path(tmp_path, reg)))  # type: ignore[arg-type]
    searcher = index.searcher()
    out = {}
    for _score, addr in searcher.search(tantivy.Query.all_query(), 1000).hits:
        d = searcher.doc(addr)
        out[json.loads(d.get_first(S.KEY))["id"]] = d.to_dict()
    assert len(out) == searcher.num_docs, "one document per key"
    return out


def row(i: int, title: str, body: str = "", price: str | None = None) -> dict[str, object]:
    return {"id": i, "title": title, "body": body, "price": price}


def test_upsert_delete_and_version_guard(tmp_path: Path, sink: SearchSink) -> None:
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = Feed(reg)
    sink.apply(
        f.batch(f.change("c", row(1, "red apple"), 100), f.change("c", row(2, "green pear"), 110)), 1, APP
    )
    sink.apply(f.batch(f.change("u", row(1, "yellow banana"), 200)), 2, APP)
    d = docs(tmp_path, reg)
    assert d[1]["title"] == ["yellow banana"] and d[1][S.LSN] == [200] and set(d) == {1, 2}
    # older and repeated events change nothing
    sink.apply(f.batch(f.change("u", row(1, "stale"), 150), f.change("u", row(2, "green pear"), 110)), 3, APP)
    assert docs(tmp_path, reg)[1]["title"] == ["yellow banana"]
    # delete, then a late older event does not resurrect
    sink.apply(f.batch(f.delete({"id": 2}, 300)), 4, APP)
    sink.apply(f.batch(f.change("u", row(2, "zombie"), 250)), 5, APP)
    assert set(docs(tmp_path, reg)) == {1}
    hits = S.search(tmp_path, reg, "banana")
    assert [h.key for h in hits] == [{"id": 1}] and "**banana**" in hits[0].snippet
    assert hits[0].document == row(1, "yellow banana")
    assert S.search(tmp_path, reg, "zombie") == []


def test_truncate_removes_older_documents(tmp_path: Path, sink: SearchSink) -> None:
    reg = table("docs", columns=COLS, search=("title",))
    f = Feed(reg)
    sink.apply(f.batch(*(f.change("c", row(i, f"doc {i}"), 100 + i) for i in range(5))), 1, APP)
    sink.apply(
        f.batch(
            f.change("c", row(7, "in batch, before"), 150),
            f.truncate(200, 3),
            f.change("c", row(8, "same lsn, after"), 200, 4),
            f.change("c", row(9, "after"), 210),
        ),
        2,
        APP,
    )
    assert set(docs(tmp_path, reg)) == {8, 9}
    assert S.search(tmp_path, reg, "before") == []
    sink.apply(f.batch(f.change("c", row(3, "late"), 150)), 3, APP)
    assert set(docs(tmp_path, reg)) == {8, 9}


def test_unavailable_toast_keeps_stored_text(tmp_path: Path, sink: SearchSink) -> None:
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = Feed(reg)
    sink.apply(f.batch(f.change("c", row(1, "t", "long searchable body"), 100)), 1, APP)
    sink.apply(
        f.batch(f.change("u", {"id": 1, "title": "t2", "price": "1.00"}, 200, unavailable=["body"])), 2, APP
    )
    d = docs(tmp_path, reg)[1]
    assert d["body"] == ["long searchable body"] and d["title"] == ["t2"]
    with pytest.raises(ApplyError):
        sink.apply(
            f.batch(f.change("u", {"id": 5, "title": "x", "price": None}, 300, unavailable=["body"])), 3, APP
        )


def test_idempotent_replay(tmp_path: Path, sink: SearchSink) -> None:
    reg = table("docs", columns=COLS, search=("title",))
    f = Feed(reg)
    b = f.batch(f.change("c", row(1, "one"), 100))
    sink.apply(b, 1, APP)
    sink.apply(b, 1, APP)
    # crash between the index commit and the side table: the batch stays pending, its batch id and
    # versions are not recorded; the replay must not add a second document (docs() checks one per key)
    idx = sink._index(reg)
    idx.db.execute("DELETE FROM applied")
    idx.db.execute("DELETE FROM versions")
    idx.set_pending(APP, 1)
    sink.apply(b, 1, APP)
    assert set(docs(tmp_path, reg)) == {1}
    assert idx.pending() is None
    # a pending batch that is never replayed keeps every later batch in always-delete mode
    b2 = f.batch(f.change("c", row(2, "two"), 200))
    sink.apply(b2, 2, APP)
    idx.db.execute("DELETE FROM applied")
    idx.db.execute("DELETE FROM versions WHERE key = ?", ('{"id":2}',))
    idx.set_pending(APP, 2)
    sink.apply(f.batch(f.change("c", row(2, "two"), 200)), 7, "other-app")
    assert set(docs(tmp_path, reg)) == {1, 2}
    assert idx.pending() == (APP, 2)


def test_table_without_search_columns_is_ignored_and_search_errors(tmp_path: Path, sink: SearchSink) -> None:
    reg = table("plain", columns=COLS)
    f = Feed(reg)
    sink.apply(f.batch(f.change("c", row(1, "x"), 100)), 1, APP)
    assert not S.index_path(tmp_path, reg).exists()
    with pytest.raises(ApplyError) as err:
        S.search(tmp_path, reg, "x")
    assert "--search" in (err.value.fix or "")
    reg2 = table("docs", columns=COLS, search=("title",))
    with pytest.raises(ApplyError, match="not indexed"):
        S.search(tmp_path, reg2, "x")
    sink.apply(Feed(reg2).batch(Feed(reg2).change("c", row(1, "x"), 100)), 1, APP)
    with pytest.raises(ApplyError, match="cannot parse"):
        S.search(tmp_path, reg2, "title:(x")


def test_unavailable_toast_from_earlier_event_in_the_same_batch(tmp_path: Path, sink: SearchSink) -> None:
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = Feed(reg)
    b = f.batch(
        f.change("c", row(1, "t", "the body text"), 100),
        f.change("u", {"id": 1, "title": "t2", "price": None}, 110, unavailable=["body"]),
        f.change("u", {"id": 1, "title": "t3", "price": "2.00"}, 120, unavailable=["body"]),
    )
    sink.apply(b, 1, APP)
    d = docs(tmp_path, reg)[1]
    assert d["body"] == ["the body text"] and d["title"] == ["t3"]
    # a delete in between: the later update cannot take the value from before the delete
    b2 = f.batch(
        f.delete({"id": 1}, 200),
        f.change("u", {"id": 1, "title": "x", "price": None}, 210, unavailable=["body"]),
    )
    with pytest.raises(ApplyError):
        sink.apply(b2, 2, APP)
