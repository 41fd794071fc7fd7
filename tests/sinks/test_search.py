"""The search sink against a real tantivy index: upsert, delete, truncate, version guard, TOAST,
idempotent replay, snippets, errors."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc.errors import ApplyError
from sinks import ChangeBatch
from sinks import search as S
from sinks.parse import parse_batch
from sinks.search import SearchSink
from tests.sinks.conftest import FeedMaker
from tests.sinks.events import events_of
from tests.sinks.feed import Feed, columns_of, table
from tests.sinks.search_state import COLS, docs, row, shard, side_tables

# every test runs on both batch forms (per-event and columnar)
pytestmark = pytest.mark.usefixtures("columnar")

APP = "cdc-apply-test"


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[SearchSink]:
    s = SearchSink(tmp_path)
    yield s
    s.close()


def test_upsert_delete_and_version_guard(tmp_path: Path, sink: SearchSink, feed: FeedMaker) -> None:
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = feed(reg)
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


def test_truncate_removes_older_documents(tmp_path: Path, sink: SearchSink, feed: FeedMaker) -> None:
    reg = table("docs", columns=COLS, search=("title",))
    f = feed(reg)
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


def test_unavailable_toast_keeps_stored_text(tmp_path: Path, sink: SearchSink, feed: FeedMaker) -> None:
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = feed(reg)
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


def test_key_change_takes_unchanged_toast_from_the_old_key(
    tmp_path: Path, sink: SearchSink, feed: FeedMaker
) -> None:
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = feed(reg)

    def moved(old: int, new: int, lsn: int, before: bool = True) -> list[object]:
        c = f.change(
            "c",
            {"id": new, "title": "moved", "price": None},
            lsn,
            unavailable=["body"],
            before={"id": old} if before else None,
        )
        return [*f.delete({"id": old}, lsn), c]

    sink.apply(
        f.batch(f.change("c", row(1, "t", "body one"), 100), f.change("c", row(2, "t", "body two"), 101)),
        1,
        APP,
    )
    # across batches (stored document), within a batch (earlier event), a legacy event without before
    b = f.batch(
        *moved(1, 10, 200),
        f.change("c", row(3, "t", "body three"), 210),
        *moved(3, 30, 220, before=False),
    )
    assert sink.reject(b) == []
    sink.apply(b, 2, APP)
    assert sink.reject(b) == []  # a replay (the old keys' documents are gone): nothing to complete
    d = docs(tmp_path, reg)
    assert {k: v["body"] for k, v in d.items()} == {10: ["body one"], 2: ["body two"], 30: ["body three"]}
    # no document anywhere: rejected (the job dead-letters it), the rest applies
    b = f.batch(*moved(7, 70, 300), *moved(2, 20, 310))
    rejected = sink.reject(b)
    assert [r.offset for r in rejected] == [e.offset for e in events_of(b) if e.key_json == '{"id":70}']
    sink.apply(b.without({(r.partition, r.offset) for r in rejected}), 3, APP)
    assert docs(tmp_path, reg)[20]["body"] == ["body two"] and 70 not in docs(tmp_path, reg)


def test_idempotent_replay(tmp_path: Path, sink: SearchSink, feed: FeedMaker) -> None:
    reg = table("docs", columns=COLS, search=("title",))
    f = feed(reg)
    b = f.batch(f.change("c", row(1, "one"), 100))
    sink.apply(b, 1, APP)
    sink.apply(b, 1, APP)
    # crash between the index commit and the side table: the batch stays pending, its batch id and
    # versions are not recorded; the replay must not add a second document (docs() checks one per key)
    idx = shard(sink, reg, {"id": 1})
    idx.db.execute("DELETE FROM applied")
    idx.db.execute("DELETE FROM versions")
    idx.set_pending(APP, 1)
    sink.apply(b, 1, APP)
    assert set(docs(tmp_path, reg)) == {1}
    assert idx.pending() is None
    # a pending batch that is never replayed keeps every later batch in always-delete mode
    b2 = f.batch(f.change("c", row(2, "two"), 200))
    sink.apply(b2, 2, APP)
    idx = shard(sink, reg, {"id": 2})
    idx.db.execute("DELETE FROM applied")
    idx.db.execute("DELETE FROM versions WHERE key = ?", ('{"id":2}',))
    idx.set_pending(APP, 2)
    sink.apply(f.batch(f.change("c", row(2, "two"), 200)), 7, "other-app")
    assert set(docs(tmp_path, reg)) == {1, 2}
    assert idx.pending() == (APP, 2)


def test_table_without_search_columns_is_ignored_and_search_errors(
    tmp_path: Path, sink: SearchSink, feed: FeedMaker
) -> None:
    reg = table("plain", columns=COLS)
    f = feed(reg)
    sink.apply(f.batch(f.change("c", row(1, "x"), 100)), 1, APP)
    assert not S.index_path(tmp_path, reg).exists()
    with pytest.raises(ApplyError) as err:
        S.search(tmp_path, reg, "x")
    assert "--search" in (err.value.fix or "")
    reg2 = table("docs", columns=COLS, search=("title",))
    with pytest.raises(ApplyError, match="not indexed"):
        S.search(tmp_path, reg2, "x")
    sink.apply(feed(reg2).batch(feed(reg2).change("c", row(1, "x"), 100)), 1, APP)
    with pytest.raises(ApplyError, match="cannot parse"):
        S.search(tmp_path, reg2, "title:(x")


def test_unavailable_toast_from_earlier_event_in_the_same_batch(
    tmp_path: Path, sink: SearchSink, feed: FeedMaker
) -> None:
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = feed(reg)
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


def _both(f: Feed, records: list) -> tuple[ChangeBatch, ChangeBatch]:
    """The same records as a per-event batch and as a columnar batch."""
    batch, dead = parse_batch(f.reg, records)
    assert dead == []
    cols = columns_of(f.reg, records)
    assert cols is not None, "the columnar parse declined the batch"
    return batch, ChangeBatch(f.reg, columns=cols)


def test_columnar_path_gives_the_per_event_result(tmp_path: Path) -> None:
    cols = (*COLS, ("rank", "integer"))
    reg = table("docs", columns=cols, search=("title", "body", "rank"))
    f = Feed(reg)

    def r(i: int, title: str | None, rank: int | None = None) -> dict[str, object]:
        return {
            "id": i,
            "title": title,
            "body": f"body {i}",
            "price": f"{i}.50" if i % 3 else None,
            "rank": rank,
        }

    rng = random.Random(5)
    b1 = [f.change("c", r(i, f"first {i}", i), 100 + i) for i in range(80)]
    b1 += [f.change("u", r(i, f"second {i}", None if i % 2 else -i), 300 + i) for i in range(20)]
    rng.shuffle(b1)  # out of order within the batch (the batch sorts by version)
    b2 = [rec for i in range(5, 15) for rec in f.delete({"id": i}, 400 + i)]
    b2 += [f.change("c", r(5, "deleted then re-inserted in one batch"), 500)]
    b2 += [f.change("u", r(i, f"third {i}", 7), 420 + i) for i in range(30, 90)]
    b3 = b1[:40]  # repeats of older events: nothing changes
    b3 += [f.change("c", r(6, "re-inserted after the delete"), 600)]
    b3 += [f.change("u", r(7, "older than the delete"), 405)]
    b3 += [f.change("u", r(i, None), 700 + i) for i in range(60, 85)]
    b3 += [rec for i in range(90, 95) for rec in f.delete({"id": i}, 800 + i)]  # unknown keys
    steps = [(b1, 1), (b2, 2), (b2, 2), (b3, 3), (b1, 4)]  # a replayed id; an old batch again
    assert max(len(b) for b, _ in steps) >= 64
    dirs = {"events": tmp_path / "events", "columns": tmp_path / "columns"}
    for form, state in dirs.items():
        sink = SearchSink(state)
        try:
            for records, batch_id in steps:
                per_event, columnar = _both(f, records)
                sink.apply(per_event if form == "events" else columnar, batch_id, APP)
        finally:
            sink.close()
    got = {form: (docs(state, reg), side_tables(state, reg)) for form, state in dirs.items()}
    assert got["columns"] == got["events"]
    d = got["events"][0]
    assert set(d) == (set(range(80)) - set(range(7, 15))) | {30 + i for i in range(50, 60)}
    assert d[5]["title"] == ["deleted then re-inserted in one batch"] and d[6][S.LSN] == [600]
    assert d[2]["rank"] == ["-2"] and "rank" not in d[1] and d[40]["rank"] == ["7"] and "title" not in d[70]
    assert json.loads(d[70][S.DOCUMENT][0])["title"] is None


def test_columnar_batch_while_a_batch_is_pending_deletes_before_adding(
    tmp_path: Path, sink: SearchSink, columnar: bool, feed: FeedMaker
) -> None:
    reg = table("docs", columns=COLS, search=("title",))
    f = feed(reg)
    b = f.batch(*(f.change("c", row(i, f"old {i}"), 100 + i) for i in range(3)))
    assert b.columns.plain == (columnar == "columns")
    sink.apply(b, 1, APP)
    # crash between the index commit and the side table: the index holds documents for keys the side
    # table does not know
    for i in range(3):  # every shard holding a key
        idx = shard(sink, reg, {"id": i})
        idx.db.execute("DELETE FROM applied")
        idx.db.execute("DELETE FROM versions")
        idx.set_pending(APP, 1)
    b2 = f.batch(*(f.change("u", row(i, f"new {i}"), 200 + i) for i in range(3)))
    assert b2.columns.plain == (columnar == "columns")
    sink.apply(b2, 2, APP)
    d = docs(tmp_path, reg)  # one document per key: the stale ones were deleted by term
    assert {k: v["title"] for k, v in d.items()} == {i: [f"new {i}"] for i in range(3)}
    assert idx.pending() == (APP, 1)  # batch 1 was never replayed: always-delete mode stays on


def test_special_float_values_are_held_in_the_document(
    tmp_path: Path, sink: SearchSink, feed: FeedMaker
) -> None:
    """NaN/Infinity/-Infinity (JSON strings in events) are kept in the document, never null."""
    reg = table("floats", columns=(*COLS, ("score", "double precision")), search=("title",))
    f = feed(reg)
    specials = ["NaN", "Infinity", "-Infinity"]
    recs = [f.change("c", {**row(i, f"float {i}"), "score": s}, 100 + i) for i, s in enumerate(specials)]
    recs += [f.change("c", {**row(10 + i, f"plain {i}"), "score": 0.5}, 200 + i) for i in range(70)]
    sink.apply(f.batch(recs), 1, APP)
    got = {h.key["id"]: h.document for h in S.search(tmp_path, reg, "float", limit=10)}
    assert {i: d["score"] for i, d in got.items()} == dict(enumerate(specials))
