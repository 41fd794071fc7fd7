"""The search sink's shards against real tantivy indexes: a sharded index holds what one shard
does, per-shard slices (one task per log-store partition) give the whole batches' index, a replay
after a crash between shards, a slice with another shard's key, search merging the shards' hits,
two processes writing two shards at once, and an index created before shards."""

from __future__ import annotations

import itertools
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pytest

from cdc.errors import ApplyError
from cdc.registry import TableReg
from sinks import ChangeBatch, RawRecord, shard_of
from sinks import search as S
from sinks.parse import Form, parse
from sinks.search import SearchSink
from sinks.search.index import find_layout
from tests.plugins.forks import workers
from tests.sinks.conftest import FeedMaker
from tests.sinks.events import batch_of, events_of
from tests.sinks.feed import Feed, mixed_batches, table
from tests.sinks.search_state import COLS, docs, key_of, row, side_tables

APP = "cdc-apply-test"
SHARDS = 4
UNSHARDED = Path(__file__).parent / "data" / "unsharded_search"


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[SearchSink]:
    """A search sink in ``tmp_path`` creating indexes of :data:`SHARDS` shards. (The tests taking
    ``feed`` run on both batch forms.)"""
    s = SearchSink(tmp_path, shards=SHARDS)
    yield s
    s.close()


class _Feed(Feed):
    """A feed whose TRUNCATE writes one marker per partition of a topic of :data:`SHARDS` partitions
    (as the reader does), so that each partition's task gets its own."""

    def truncate(self, lsn: int, seq: int = 1, partitions: int = SHARDS) -> list[RawRecord]:
        return super().truncate(lsn, seq, partitions)


def slice_of(batch: ChangeBatch, p: int) -> ChangeBatch:
    """What the task of log-store partition ``p`` gets: the events of its keys (``shard_of``) and its
    own TRUNCATE marker, in the batch's form."""
    if batch.columns.plain:
        keys = batch.columns.table.column("key_json").to_pylist()
        mask = pa.array([shard_of(k, SHARDS) == p for k in keys])
        return ChangeBatch(batch.table, batch.columns.filter(mask), shard=p)
    mine = [
        e for e in events_of(batch) if (e.partition if e.op == "t" else shard_of(e.key_json, SHARDS)) == p
    ]
    return batch_of(batch.table, mine, shard=p)


def apply_whole(state: Path, reg: TableReg, batches: list[ChangeBatch], shards: int = SHARDS) -> None:
    """``batches`` as whole batches (ids 1, 2, ...) into an index of ``shards`` shards."""
    sink = SearchSink(state, shards=shards)
    try:
        for batch_id, b in enumerate(batches, 1):
            sink.apply(b, batch_id, APP)
            assert sink.applied_batch(reg, APP) == batch_id
    finally:
        sink.close()


def test_a_sharded_index_holds_what_an_unsharded_one_does(tmp_path: Path, feed: FeedMaker) -> None:
    """Random inserts, updates, deletes, re-inserts, late and repeated events and a TRUNCATE as whole
    batches: 4 shards hold the documents, versions and tombstones 1 shard holds, each key in its
    shard (docs() checks), the TRUNCATE marker in every shard."""
    reg = table("items", search=("name", "note"))
    f = feed(reg)
    batches = [f.batch(recs) for recs in mixed_batches(f, 11)]
    truncated = [v for b in batches if (v := b.truncate_version()) is not None]
    assert truncated
    one, four = tmp_path / "one", tmp_path / "four"
    apply_whole(one, reg, batches, 1)
    apply_whole(four, reg, batches)
    layout = find_layout(four, reg)
    assert layout is not None and layout.count == SHARDS and not layout.legacy
    got = docs(four, reg)
    assert got == docs(one, reg) and len(got) > 10
    assert {layout.shard_of(key_of(i)) for i in got} == set(range(SHARDS))
    sides, (side,) = side_tables(four, reg), side_tables(one, reg)
    assert sorted(r for s in sides for r in s["versions"]) == side["versions"]
    assert any(r[3] for r in side["versions"]), "tombstones are kept"
    assert all(s["meta"] == side["meta"] and s["applied"] == side["applied"] for s in sides)
    mark = max(truncated)
    assert dict(side["meta"])["truncate"] == orjson.dumps([mark.commit_lsn, mark.seq]).decode()


def test_per_shard_slices_give_the_index_of_whole_batches(tmp_path: Path, feed: FeedMaker) -> None:
    """Each batch applied as the 4 slices of its partitions' tasks (``batch.shard = p``, the last
    shard first, each twice: a retried task) gives the documents and side tables of the whole
    batches. A shard records only the batches it got a slice of: applied_batch is the minimum."""
    reg = table("items", search=("name", "note"))
    f = _Feed(reg, feed(reg).form)
    batches = [f.batch(recs) for recs in mixed_batches(f, 12)]
    whole, sliced = tmp_path / "whole", tmp_path / "sliced"
    apply_whole(whole, reg, batches)
    sink = SearchSink(sliced, shards=SHARDS)
    try:
        for batch_id, b in enumerate(batches, 1):
            for p in reversed(range(SHARDS)):
                part = slice_of(b, p)
                assert len(part), "every shard gets a slice of every batch"
                sink.apply(part, batch_id, APP)
                sink.apply(part, batch_id, APP)
            assert sink.applied_batch(reg, APP) == batch_id
        assert docs(sliced, reg) == docs(whole, reg)
        assert side_tables(sliced, reg) == side_tables(whole, reg)
        # a batch with records of one partition only: its shard records it, the others hold the min
        last = len(batches)
        b = f.batch(f.change("u", {"id": 1, "name": "only one shard", "note": None}, 90_000))
        sink.apply(slice_of(b, shard_of(key_of(1), SHARDS)), last + 1, APP)
        assert sink.applied_batch(reg, APP) == last
        assert sink.read_back(reg).docs[key_of(1)]["name"] == "only one shard"  # type: ignore[union-attr]
    finally:
        sink.close()


def test_a_whole_batch_replayed_after_some_shards_committed_it(tmp_path: Path, feed: FeedMaker) -> None:
    """A crash between the shards' commits of a whole batch: the replay applies it to the shards that
    lack it and changes nothing in the others (idempotency per shard)."""
    reg = table("items", search=("name", "note"))
    f = _Feed(reg, feed(reg).form)
    batches = [f.batch(recs) for recs in mixed_batches(f, 13)[:2]]
    clean, crashed = tmp_path / "clean", tmp_path / "crashed"
    apply_whole(clean, reg, batches)
    sink = SearchSink(crashed, shards=SHARDS)
    try:
        sink.apply(batches[0], 1, APP)
        for p in (2, 0):  # shards 2 and 0 committed batch 2, then the process died
            sink.apply(slice_of(batches[1], p), 2, APP)
        assert sink.applied_batch(reg, APP) == 1
        sink.apply(batches[1], 2, APP)  # the replay
        assert sink.applied_batch(reg, APP) == 2
    finally:
        sink.close()
    assert docs(crashed, reg) == docs(clean, reg)
    assert side_tables(crashed, reg) == side_tables(clean, reg)


def test_a_slice_with_a_key_of_another_shard_is_refused(
    tmp_path: Path, sink: SearchSink, feed: FeedMaker
) -> None:
    """A task's slice holding a key of another shard is the caller's bug: ApplyError with the keys and
    shards, before anything is written; so is a shard the index does not have."""
    reg = table("docs", columns=COLS, search=("title",))
    f = feed(reg)
    sink.apply(f.batch(*(f.change("c", row(i, f"first {i}"), 100 + i) for i in range(8))), 1, APP)
    before = docs(tmp_path, reg), side_tables(tmp_path, reg)
    mine = next(i for i in range(8) if shard_of(key_of(i), SHARDS) == 0)
    other = next(i for i in range(8) if shard_of(key_of(i), SHARDS) != 0)
    bad = f.batch(f.change("u", row(mine, "second"), 200), f.change("u", row(other, "second"), 201))
    with pytest.raises(ApplyError) as err:
        sink.apply(slice_like(bad, 0), 2, APP)
    assert err.value.keys == [key_of(other)] and err.value.key_shards == [shard_of(key_of(other), SHARDS)]
    assert err.value.shard == 0 and err.value.shards == SHARDS and err.value.fix
    assert key_of(other) in err.value.message and "1 of 2 keys" in err.value.message
    with pytest.raises(ApplyError, match=r"has 4 shard\(s\), none numbered 4"):
        sink.apply(slice_like(f.batch(f.change("u", row(mine, "x"), 300)), SHARDS), 2, APP)
    assert (docs(tmp_path, reg), side_tables(tmp_path, reg)) == before
    assert sink.applied_batch(reg, APP) == 1


def slice_like(batch: ChangeBatch, shard: int) -> ChangeBatch:
    """``batch`` as a slice of ``shard``, whatever its keys."""
    if batch.columns.plain:
        return ChangeBatch(batch.table, batch.columns, shard=shard)
    return batch_of(batch.table, events_of(batch), shard=shard)


def test_search_merges_every_shards_top_hits_by_score(
    tmp_path: Path, sink: SearchSink, feed: FeedMaker
) -> None:
    """Five documents per shard, every shard with the same term statistics (so that the shards' BM25
    scores compare): the hits are the global top ones by score, equal scores in key order."""
    reg = table("docs", columns=COLS, search=("title",))
    f = feed(reg)
    ids: dict[int, list[int]] = {p: [] for p in range(SHARDS)}
    for i in range(1000):
        if len(ids[p := shard_of(key_of(i), SHARDS)]) < 5:
            ids[p].append(i)
    counts = {0: [9, 5, 3, 2, 1], 1: [8, 5, 4, 2, 1], 2: [7, 6, 4, 3, 1], 3: [9, 6, 2, 2, 1]}
    tf = {i: n for p in range(SHARDS) for i, n in zip(ids[p], counts[p], strict=True)}
    title = {i: " ".join(["apple"] * n + ["filler"] * (10 - n)) for i, n in tf.items()}
    sink.apply(
        f.batch(*(f.change("c", row(i, t), 100 + k) for k, (i, t) in enumerate(title.items()))), 1, APP
    )
    expected = sorted(tf, key=lambda i: (-tf[i], key_of(i)))
    for limit in (1, 6, 20, 50):
        hits = S.search(tmp_path, reg, "apple", limit=limit)
        assert [h.key["id"] for h in hits] == expected[:limit]
        assert all(a.score >= b.score for a, b in itertools.pairwise(hits))
        assert all(h.document["title"] == title[h.key["id"]] and "**apple**" in h.snippet for h in hits)
    hits = S.search(tmp_path, reg, "apple", limit=20)
    tied = [h for h in hits if tf[h.key["id"]] == 9]
    assert len(tied) == 2 and tied[0].score == tied[1].score, "equal statistics: equal scores"


def _write_shard(state: str, records: list[RawRecord], form: Form, shard: int, start: Any) -> None:
    """A task of another process: applies the slice of ``shard`` of three batches (``records`` split
    in three), after every task has started."""
    reg = table("items", search=("name", "note"))
    sink = SearchSink(Path(state), shards=SHARDS)
    start.wait(60)
    try:
        third = len(records) // 3
        for batch_id in (1, 2, 3):
            part = parse(reg, records[(batch_id - 1) * third : batch_id * third], form=form).batch
            assert part is not None
            sink.apply(slice_of(part, shard), batch_id, APP)
    finally:
        sink.close()


def test_two_shards_written_at_once_from_two_processes(tmp_path: Path) -> None:
    """Two processes, each the task of one shard, create the index and write their shards at the same
    time (real tantivy writers, real SQLite side tables): both land, the other shards stay absent."""
    reg = table("items", search=("name", "note"))
    f = Feed(reg, "columns")  # (a task's slice takes the columnar form when it can)
    writers = (1, 3)
    keys = [i for i in range(400) if shard_of(key_of(i), SHARDS) in writers][:120]
    records = [f.change("c", {"id": i, "name": f"first {i}", "note": "x"}, 100 + i) for i in keys]
    records += [f.change("u", {"id": i, "name": f"second {i}", "note": None}, 1000 + i) for i in keys]
    records += [r for i in keys[::4] for r in f.delete({"id": i}, 2000 + i)]
    ctx = workers(__name__)
    start = ctx.Barrier(len(writers))
    procs = [
        ctx.Process(target=_write_shard, args=(str(tmp_path), records, f.form, p, start)) for p in writers
    ]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(120)
    finally:
        for proc in procs:  # (a hung one is not left behind)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    assert [proc.exitcode for proc in procs] == [0, 0]
    sink = SearchSink(tmp_path, shards=SHARDS)
    try:
        back = sink.read_back(reg)
        assert back is not None
        live = set(keys) - set(keys[::4])
        assert back.docs == {key_of(i): {"name": f"second {i}"} for i in live}
        assert {shard_of(key_of(i), SHARDS) for i in live} == set(writers)
        assert sink.applied_batch(reg, APP) == 3
        assert sink.shard_count(reg) == SHARDS
    finally:
        sink.close()
    layout = find_layout(tmp_path, reg)
    assert layout is not None
    assert [i for i, (path, _db) in enumerate(layout.shards) if path.exists()] == list(writers)


def test_an_index_created_before_shards_goes_on_as_one_shard(tmp_path: Path, feed: FeedMaker) -> None:
    """The index the sink wrote before shards (tests/sinks/data: tantivy at search/<topic>, live ids
    1, 2, 4, 5, id 3 deleted at LSN 310, a TRUNCATE at 200, batch 3 applied) is read, searched and
    written in place as one shard: versions, tombstone and TRUNCATE marker still guard it."""
    state = tmp_path / "state"
    shutil.copytree(UNSHARDED, state)
    reg = table("docs", columns=COLS, search=("title", "body"))
    f = feed(reg)
    sink = SearchSink(state, shards=SHARDS)
    try:
        assert sink.shard_count(reg) == 1 and SearchSink.listing(state, reg)["search_shards"] == 1
        assert sink.applied_batch(reg, APP) == 3
        back = sink.read_back(reg)
        assert back is not None and sorted(back.docs) == sorted(key_of(i) for i in (1, 2, 4, 5))
        assert [h.key for h in S.search(state, reg, "plum")] == [{"id": 2}]
        sink.apply(f.batch(f.change("u", row(1, "fourth fig"), 400)), 3, APP)  # a replay: skipped
        b = f.batch(
            f.change("u", row(1, "fourth fig", "b"), 400),
            *f.delete({"id": 2}, 410),
            f.change("u", row(3, "after its delete: stale"), 305),
            f.change("c", row(7, "before the truncate: stale"), 150),
            f.change("c", row(9, "new kiwi"), 420),
        )
        sink.apply(b, 4, APP)
        sink.apply(slice_like(f.batch(f.change("u", row(4, "fifth lime"), 500)), 0), 5, APP)
        with pytest.raises(ApplyError, match=r"has 1 shard\(s\), none numbered 1"):
            sink.apply(slice_like(f.batch(f.change("u", row(4, "x"), 600)), 1), 6, APP)
        assert sink.applied_batch(reg, APP) == 5
    finally:
        sink.close()
    assert {h.key["id"] for h in S.search(state, reg, "fig OR kiwi OR lime OR pear")} == {1, 4, 5, 9}
    assert not S.search(state, reg, "stale OR plum")
    root = S.index_path(state, reg)
    assert (root / "meta.json").exists() and not list(root.glob("shard-*")), "left in place"
    db = sqlite3.connect(S.versions_path(state, reg))
    try:
        assert db.execute("SELECT name FROM meta WHERE name = 'shards'").fetchall() == []
        assert db.execute(
            "SELECT commit_lsn, deleted FROM versions WHERE key = ?", (key_of(2),)
        ).fetchone() == (
            410,
            1,
        )
    finally:
        db.close()


def test_a_task_takes_a_moved_keys_toast_values_from_the_old_keys_shard(tmp_path: Path) -> None:
    """A primary-key change 3 -> 30 lacking its unchanged TOAST value, the keys in different shards,
    applied as slices: the task of the new key's shard reads the old key's document in the other
    shard (committed, read only). If that shard's task committed the old key's delete first, the
    value is gone: the ``c`` is rejected (the gap in docs/search.md), never applied without it."""
    reg = table("docs", columns=COLS, search=("title", "body"))
    old, new = key_of(3), key_of(30)
    assert shard_of(old, SHARDS) != shard_of(new, SHARDS)
    for order, state in (("new first", tmp_path / "a"), ("old first", tmp_path / "b")):
        f = Feed(reg)
        apply_whole(state, reg, [f.batch(f.change("c", row(3, "t", "the long body"), 100))])
        moved = f.change(
            "c", {"id": 30, "title": "moved", "price": None}, 200, unavailable=["body"], before={"id": 3}
        )
        b = f.batch(*f.delete({"id": 3}, 200), moved)
        parts = [slice_of(b, shard_of(new, SHARDS)), slice_of(b, shard_of(old, SHARDS))]
        for part in parts if order == "new first" else parts[::-1]:
            task = SearchSink(state, shards=SHARDS)  # each slice in a task of its own
            try:
                rejected = task.reject(part)
                task.apply(part.without({(r.partition, r.offset) for r in rejected}), 2, APP)
            finally:
                task.close()
        back = SearchSink(state).read_back(reg)
        assert back is not None
        if order == "new first":
            assert rejected == [] and back.docs == {new: {"title": "moved", "body": "the long body"}}
        else:
            assert [r.offset for r in rejected] == [e.offset for e in events_of(b) if e.op == "c"]
            assert back.docs == {}


def test_a_task_sees_another_shard_created_after_it_first_looked(tmp_path: Path) -> None:
    """A task's read-only look at another shard that does not exist yet finds nothing; once that
    shard's task has created and written it, the same task (a reused worker) finds its documents."""
    reg = table("docs", columns=COLS, search=("title", "body"))
    old, new = key_of(3), key_of(30)
    f = Feed(reg)
    moved = f.change(
        "c", {"id": 30, "title": "moved", "price": None}, 200, unavailable=["body"], before={"id": 3}
    )
    part = slice_of(f.batch(moved), shard_of(new, SHARDS))
    task = SearchSink(tmp_path, shards=SHARDS)
    try:
        assert [r.offset for r in task.reject(part)] == [moved.offset]  # no shard of the old key yet
        other = SearchSink(tmp_path, shards=SHARDS)
        try:
            other.apply(
                slice_of(f.batch(f.change("c", row(3, "t", "the long body"), 100)), shard_of(old, SHARDS)),
                1,
                APP,
            )
        finally:
            other.close()
        assert task.reject(part) == []
        task.apply(part, 2, APP)
    finally:
        task.close()
    back = SearchSink(tmp_path).read_back(reg)
    assert back is not None and back.docs[new] == {"title": "moved", "body": "the long body"}
