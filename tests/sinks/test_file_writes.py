"""The warehouse's file writes (``sinks.warehouse.files``, its only write method): the same tables as
delta-rs' MERGE (the test oracle, ``tests/sinks/merge_oracle.py``) on random workloads, writes deferred to a committer (what a Spark task hands the
driver), and a commit that refuses when a file it replaces left the table meanwhile."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction

from cdc.errors import ApplyError
from cdc.events import TRUNCATE_KEY_FIELD
from sinks import RawRecord, shard_of
from sinks import warehouse as W
from sinks.warehouse import WarehouseOptions, WarehouseSink
from sinks.warehouse.files import TableWrite, WriteConflict, _match, commit, commit_all
from tests.sinks.conftest import FeedMaker
from tests.sinks.feed import mixed_batches, table
from tests.sinks.merge_oracle import MergeWarehouseSink

APP = "cdc-apply-test"


def _tables(sink: WarehouseSink, reg: Any) -> list[list[dict[str, Any]]]:
    return [
        sorted(rows(reg).to_pylist(), key=lambda r: (r.get(W.KEY) or r["key_json"], str(r)))
        for rows in (sink.current_rows, sink.history_rows, sink.tombstone_rows)
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_file_writes_give_the_tables_the_merge_gives(tmp_path: Path, feed: FeedMaker, seed: int) -> None:
    """Inserts, updates, deletes, re-inserts, snapshot reads, late and redelivered events and a
    TRUNCATE, batch after batch: both write methods leave equal tables after every batch."""
    reg = table()
    got: dict[str, list[Any]] = {}
    for write in ("merge", "files"):
        sink = _sink(tmp_path / write, write)
        f = feed(reg)
        got[write] = []
        for batch_id, recs in enumerate(mixed_batches(f, seed)):
            sink.apply(f.batch(recs), batch_id, APP)
            got[write].append(_tables(sink, reg))
    assert all(got["files"][-1])
    for batch_id, (files, merged) in enumerate(zip(got["files"], got["merge"], strict=True)):
        assert files == merged, f"after batch {batch_id}"


def test_ugly_values_round_trip_through_files(tmp_path: Path, feed: FeedMaker) -> None:
    """A 4 MB value with quotes, newlines and backslashes, and an update of it, as the merge stores it."""
    reg = table()
    ugly = ('a "quoted", \\back\\slashed\nline\r\n' * 120_000)[: 4 << 20]
    got = {}
    for write in ("merge", "files"):
        sink = _sink(tmp_path / write, write)
        f = feed(reg)
        sink.apply(f.batch(f.change("c", {"id": 1, "name": ugly, "note": "'"}, 100)), 0, APP)
        sink.apply(f.batch(f.change("u", {"id": 1, "name": ugly[::-1], "note": None}, 200)), 1, APP)
        got[write] = _tables(sink, reg)
    assert got["files"] == got["merge"]
    assert got["files"][0][0]["name"] == ugly[::-1]


def _sink(path: Path, write: str) -> WarehouseSink:
    """The warehouse as the product writes it (``files``), or the MERGE oracle (``merge``)."""
    options = WarehouseOptions(buckets=4, maintain_every=0)
    return MergeWarehouseSink(path, options) if write == "merge" else WarehouseSink(path, options)


def _slices(recs: list[Any], shards: int) -> dict[int, list[RawRecord]]:
    """A batch's records per shard, as the log store's partitions hold them: a key's records in
    :func:`shard_of` of the key, a TRUNCATE's markers one per partition."""
    out: dict[int, list[RawRecord]] = {p: [] for p in range(shards)}
    for r in (x for rec in recs for x in (rec if isinstance(rec, list) else [rec])):
        key = orjson.loads(r.key)
        out[r.partition if TRUNCATE_KEY_FIELD in key else shard_of(r.key.decode(), shards)].append(r)
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_shards_applied_apart_and_committed_together_equal_the_whole_batch(
    tmp_path: Path, feed: FeedMaker, seed: int
) -> None:
    """Each batch applied as 4 shard slices (what 4 Spark tasks do: each reads the tables as they
    were before the batch and writes only its shard's files; a TRUNCATE marker in each), then
    committed in one transaction per table, gives the tables of the whole batch applied at once."""
    reg = table()
    shards = 4
    whole = WarehouseSink(tmp_path / "whole", WarehouseOptions(buckets=4, maintain_every=0, shards=shards))
    sliced, pending = _deferred(tmp_path / "sliced", shards)
    f = feed(reg)
    for batch_id, recs in enumerate(mixed_batches(f, seed, partitions=shards)):
        whole.apply(f.batch(recs), batch_id, APP)
        for p, part in _slices(recs, shards).items():
            if part:
                b = f.batch(part)
                b.shard = p
                sliced.apply(b, batch_id, APP)
        commit_all(pending, _props(batch_id))
        pending.clear()
        assert _tables(sliced, reg) == _tables(whole, reg), f"after batch {batch_id}"
    paths = sliced.paths(reg)
    assert DeltaTable(str(paths[0])).metadata().configuration["cdc.layout"] == "range:65536:4"
    assert len(sliced.tombstone_rows(reg).filter(pc.equal(pc.field("key_json"), "*"))) == shards


def test_a_slice_holding_another_shards_key_is_refused(tmp_path: Path, feed: FeedMaker) -> None:
    reg = table()
    sink, pending = _deferred(tmp_path, 4)
    f = feed(reg)
    key = '{"id":1}'
    b = f.batch(f.change("c", {"id": 1, "name": "a", "note": None}, 100))
    b.shard = (shard_of(key, 4) + 1) % 4
    with pytest.raises(ApplyError, match="holds keys of buckets"):
        sink.apply(b, 0, APP)
    assert pending == []


def _deferred(tmp_path: Path, shards: int = 1) -> tuple[WarehouseSink, list[TableWrite]]:
    sink = WarehouseSink(tmp_path, WarehouseOptions(buckets=4, maintain_every=0, shards=shards))
    pending: list[TableWrite] = []
    sink.defer_commits(pending)
    return sink, pending


def _props(batch_id: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(APP, version=batch_id)])


def test_deferred_writes_are_invisible_until_committed_once_per_table(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """With the writes deferred (a Spark task's sink), a batch
    changes no table; the committer then commits each table's writes in one transaction carrying the
    batch's application transaction."""
    reg = table()
    f = feed(reg)
    direct = WarehouseSink(tmp_path, WarehouseOptions(buckets=4, maintain_every=0))
    direct.apply(
        f.batch(*(f.change("c", {"id": i, "name": "a", "note": None}, 100 + i) for i in range(50))), 0, APP
    )
    sink, pending = _deferred(tmp_path)
    paths = sink.paths(reg)
    versions = [DeltaTable(str(p)).version() for p in paths]
    batch = f.batch(
        *(f.change("u", {"id": i, "name": "b", "note": None}, 300 + i) for i in range(0, 50, 2)),
        f.delete({"id": 1}, 400),
    )
    sink.apply(batch, 1, APP)
    assert [DeltaTable(str(p)).version() for p in paths] == versions, "a deferred write committed"
    assert {w.uri for w in pending} == {DeltaTable(str(p)).table_uri for p in paths}
    commit_all(pending, _props(1))
    assert [DeltaTable(str(p)).version() for p in paths] == [v + 1 for v in versions]
    assert all(DeltaTable(str(p)).transaction_version(APP) == 1 for p in paths)
    rows = {r["id"]: r["name"] for r in direct.current_rows(reg).to_pylist()}
    assert len(rows) == 49 and 1 not in rows
    assert [rows[i] for i in (0, 2, 3)] == ["b", "b", "a"]
    # the replay of an applied batch writes nothing
    pending.clear()
    sink.apply(batch, 1, APP)
    assert pending == []


def _files_to_compact(sink: WarehouseSink, f: Any) -> None:
    """Three batches of 10 new rows committed at once: several files per bucket, for a compaction
    to merge."""
    for b in range(3):
        sink.defer_commits(None)
        sink.apply(
            f.batch(
                *(
                    f.change("c", {"id": i, "name": "a", "note": None}, 100 * b + i)
                    for i in range(b * 10, b * 10 + 10)
                )
            ),
            b,
            APP,
        )


def test_a_compaction_between_write_and_commit_is_refused_and_loses_nothing(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """A compaction that replaced files the write read: the commit refuses and commits nothing (no
    row doubled, none lost); the batch computed again from the new version commits."""
    reg = table()
    f = feed(reg)
    sink, pending = _deferred(tmp_path)
    _files_to_compact(sink, f)
    cur = sink.paths(reg)[0]
    sink.defer_commits(pending)
    batch = f.batch(*(f.change("u", {"id": i, "name": "b", "note": None}, 1_000 + i) for i in range(30)))
    sink.apply(batch, 3, APP)
    write = next(w for w in pending if w.uri == DeltaTable(str(cur)).table_uri)
    assert write.removes, "the update rewrites stored files"
    assert DeltaTable(str(cur)).optimize.compact()["numFilesRemoved"] > 0
    before = pa.table(DeltaTable(str(cur)).to_pyarrow_table()).num_rows
    with pytest.raises(WriteConflict, match="replaced before the commit"):
        commit(DeltaTable(str(cur)), write, _props(3))
    assert pa.table(DeltaTable(str(cur)).to_pyarrow_table()).num_rows == before == 30
    pending.clear()
    sink.apply(batch, 3, APP)
    commit_all(pending, _props(3))
    rows = sink.current_rows(reg).to_pylist()
    assert len(rows) == 30 and {r["name"] for r in rows} == {"b"}


def _thirty_updates_written(
    sink: WarehouseSink, pending: list[TableWrite], reg: Any, f: Any
) -> tuple[DeltaTable, DeltaTable, Any]:
    """Batch 3, 30 updates of the rows of :func:`_files_to_compact`, written but not committed:
    the current table, the history and the batch."""
    _files_to_compact(sink, f)
    cur, hist = (DeltaTable(str(p)) for p in sink.paths(reg)[:2])
    sink.defer_commits(pending)
    batch = f.batch(*(f.change("u", {"id": i, "name": "b", "note": None}, 1_000 + i) for i in range(30)))
    sink.apply(batch, 3, APP)
    assert {w.uri for w in pending} >= {cur.table_uri, hist.table_uri}
    return cur, hist, batch


def test_one_table_refused_fails_the_batch_after_the_others_commit_and_the_replay_completes_it(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """The tables commit side by side: when one refuses (a compaction replaced its files), the
    others' commits still end, committed, and the batch fails with the refusal; applied again, the
    committed tables recognise the batch and write nothing twice, the refused one commits."""
    reg = table()
    f = feed(reg)
    sink, pending = _deferred(tmp_path)
    cur, hist, batch = _thirty_updates_written(sink, pending, reg, f)
    assert DeltaTable(cur.table_uri).optimize.compact()["numFilesRemoved"] > 0
    compacted = DeltaTable(cur.table_uri).version()
    with pytest.raises(WriteConflict, match="replaced before the commit"):
        commit_all(pending, _props(3))
    assert DeltaTable(hist.table_uri).transaction_version(APP) == 3, "the history committed meanwhile"
    assert DeltaTable(cur.table_uri).version() == compacted, "the refused table committed nothing"
    pending.clear()
    sink.apply(batch, 3, APP)
    assert {w.uri for w in pending if not w.empty} == {cur.table_uri}
    commit_all(pending, _props(3))
    rows = sink.current_rows(reg).to_pylist()
    assert len(rows) == 30 and {r["name"] for r in rows} == {"b"}
    assert sorted(r["name"] for r in sink.history_rows(reg).to_pylist()).count("b") == 30


def test_a_refused_history_commits_no_current_table_and_the_replay_keeps_every_version(
    tmp_path: Path, feed: FeedMaker
) -> None:
    """The history is computed from the current table as it was before the batch: when its commit
    refuses (a compaction of its open rows), the current table must not commit the batch, or the
    replay would find the batch's versions already applied and leave them out of the history."""
    reg = table()
    f = feed(reg)
    sink, pending = _deferred(tmp_path)
    cur, hist, batch = _thirty_updates_written(sink, pending, reg, f)
    assert DeltaTable(hist.table_uri).optimize.compact()["numFilesRemoved"] > 0
    with pytest.raises(WriteConflict, match="replaced before the commit"):
        commit_all(pending, _props(3))
    assert DeltaTable(cur.table_uri).transaction_version(APP) == 2, "the current table waited"
    pending.clear()
    sink.apply(batch, 3, APP)
    commit_all(pending, _props(3))
    versions = sorted((r["id"], r["name"], r["is_current"]) for r in sink.history_rows(reg).to_pylist())
    assert versions == sorted([(i, "a", False) for i in range(30)] + [(i, "b", True) for i in range(30)])
    assert {r["name"] for r in sink.current_rows(reg).to_pylist()} == {"b"}


def test_match_finds_both_ways_with_duplicates_nulls_and_chunks() -> None:
    """:func:`_match` against its definition: a stored key's first source position, a source key's
    first stored position (among ``among``), a key held twice found at its first; one probe pass."""
    stored_keys = ["a", "b", None, "a", "c'", "d"]
    source_keys = ["c'", "a", "x", "a", None, "c'"]
    among = np.array([True, True, True, False, True, True])
    stored = pa.chunked_array([pa.array(stored_keys[:2]), pa.array(stored_keys[2:])])
    source = pa.chunked_array(
        [pa.array(source_keys[:3], pa.large_string()), pa.array(source_keys[3:], pa.large_string())]
    )
    t_found, t_at, s_found, s_at = _match(stored, source, among)
    first = {k: source_keys.index(k) for k in source_keys}
    assert t_found.tolist() == [k in first for k in stored_keys]
    assert t_at.tolist() == [first.get(k, 0) for k in stored_keys]
    hit = {k: i for i, k in reversed(list(enumerate(stored_keys))) if among[i]}
    assert s_found.tolist() == [k in hit for k in source_keys]
    assert s_at.tolist() == [hit.get(k, 0) for k in source_keys]
