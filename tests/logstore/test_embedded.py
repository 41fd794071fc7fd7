"""The embedded backend beyond the shared contract: the single-writer lock across processes, a reader
in another process while the writer appends, read-only instances, corrupt and truncated files, and the
vectorised partitioner."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cdc.errors import LogStoreError, StoreCorruptError, UnknownTopicError, WriterLockedError
from cdc.logstore import Record, TopicConfig
from cdc.logstore.embedded import EmbeddedLogStore
from tests.plugins.postgres import wait_for

REPO = Path(__file__).resolve().parents[2]


def spawn(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "log"


HOLD_WRITER = """
import sys
from cdc.logstore import Record, TopicConfig
from cdc.logstore.embedded import EmbeddedLogStore
store = EmbeddedLogStore(sys.argv[1], writer=True, compaction_interval_s=None)
store.create_topic(sys.argv[2], TopicConfig(partitions=2))
store.append(sys.argv[2], [Record(b"k", b"from child")])
print("holding", flush=True)
sys.stdin.readline()
store.close()
print("released", flush=True)
"""


def test_second_writer_process_gets_writer_locked_error(store_dir: Path) -> None:
    child = spawn(HOLD_WRITER, str(store_dir), "dead.letter")
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "holding", child.stderr.read() if child.stderr else ""
        store = EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None)
        with pytest.raises(WriterLockedError) as exc:
            store.append("dead.letter", [Record(b"k", b"from test")])
        err = exc.value
        assert err.path == str(store_dir / "dead.letter.lock")
        assert err.holder == str(child.pid)
        assert str(child.pid) in str(err) and "dead.letter.lock" in str(err)
        assert err.fix and str(child.pid) in err.fix
        with pytest.raises(WriterLockedError):
            store.compact("dead.letter")
        # the lock is per topic: another topic is writable meanwhile, reading this one works
        store.create_topic("changes", TopicConfig(partitions=2))
        assert store.append("changes", [Record(b"k", b"v")])
        assert [r.value for r in store.read("dead.letter", 0, 0) + store.read("dead.letter", 1, 0)] == [
            b"from child"
        ]
        # once the holder is gone the topic is writable, and nothing it acknowledged was lost
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
        store.append("dead.letter", [Record(b"k", b"from test")])
        values = [r.value for p in (0, 1) for r in store.read("dead.letter", p, 0)]
        assert values == [b"from child", b"from test"]
        store.close()
    finally:
        child.kill()
        child.wait()


def test_second_writer_instance_in_same_process_is_refused(store_dir: Path) -> None:
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as first:
        first.create_topic("t", TopicConfig(partitions=1))
        first.append("t", [Record(b"k", b"v")])
        with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as second:
            with pytest.raises(WriterLockedError) as exc:
                second.append("t", [Record(b"k", b"v")])
            assert exc.value.holder == str(os.getpid())
    # closed: the lock is released
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as third:
        assert third.append("t", [Record(b"k", b"v2")]) == {0: 1}


def test_read_only_instance_refuses_writes(store_dir: Path) -> None:
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as writer:
        writer.create_topic("t", TopicConfig(partitions=1))
        writer.append("t", [Record(b"k", b"v")])
        reader = EmbeddedLogStore(store_dir)
        for call in (
            lambda: reader.append("t", [Record(b"k", b"v")]),
            lambda: reader.create_topic("new", TopicConfig()),
            lambda: reader.compact("t"),
            lambda: reader.delete_topic("t"),
        ):
            with pytest.raises(LogStoreError) as exc:
                call()
            assert "writer=False" in str(exc.value)
            assert exc.value.fix and "writer=True" in exc.value.fix
        assert [r.value for r in reader.read("t", 0, 0)] == [b"v"]
        reader.commit("cli", "t", {0: 1})  # consumer positions are allowed to readers
        assert writer.committed("cli", "t") == {0: 1}
        reader.close()
    assert not (store_dir / "new.db").exists()


READER = """
import json, sys, time
from cdc.logstore.embedded import EmbeddedLogStore
store = EmbeddedLogStore(sys.argv[1])
total, batch = int(sys.argv[2]), int(sys.argv[3])
while not (store.path / "t.db").exists():
    time.sleep(0.01)
pos = {0: 0, 1: 0, 2: 0}
values, partial_views = [], 0
while sum(pos.values()) < total:
    ends = store.end_offsets("t")
    if sum(ends.values()) % batch:
        partial_views += 1
    for p in pos:
        for r in store.read("t", p, pos[p], 1000):
            assert r.offset == pos[p], (r.offset, pos[p])
            values.append(r.value.decode())
            pos[p] = r.offset + 1
print(json.dumps({"values": values, "partial_views": partial_views}), flush=True)
"""


def test_reader_in_another_process_while_writer_appends(store_dir: Path) -> None:
    batches, size = 200, 50
    child = spawn(READER, str(store_dir), str(batches * size), str(size))
    try:
        with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as writer:
            writer.create_topic("t", TopicConfig(partitions=3))
            for b in range(batches):
                writer.append("t", [Record(f"k{b}.{i}".encode(), f"{b}.{i}".encode()) for i in range(size)])
            out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        seen = json.loads(out)
        assert sorted(seen["values"]) == sorted(f"{b}.{i}" for b in range(batches) for i in range(size))
        assert seen["partial_views"] == 0  # a reader only ever sees whole batches
    finally:
        child.kill()
        child.wait()


# -- corruption ---------------------------------------------------------------------------------------
def _filled(store_dir: Path) -> Path:
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as store:
        store.create_topic("t", TopicConfig(partitions=1))
        for _b in range(20):
            store.append("t", [Record(b"k", os.urandom(2000)) for _ in range(20)])
    path = store_dir / "t.db"
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    return path


def _assert_corrupt(exc: pytest.ExceptionInfo[StoreCorruptError], path: Path) -> None:
    assert exc.value.path == str(path)
    assert str(path) in str(exc.value)
    assert exc.value.fix and str(path) in exc.value.fix


def test_garbage_over_header_is_store_corrupt(store_dir: Path) -> None:
    path = _filled(store_dir)
    with path.open("r+b") as fh:
        fh.write(os.urandom(100))
    store = EmbeddedLogStore(store_dir)
    with pytest.raises(StoreCorruptError) as exc:
        store.read("t", 0, 0)
    _assert_corrupt(exc, path)
    with pytest.raises(StoreCorruptError):
        store.list_topics()
    store.close()


def test_truncated_file_is_store_corrupt(store_dir: Path) -> None:
    path = _filled(store_dir)
    size = path.stat().st_size
    with path.open("r+b") as fh:
        fh.truncate(size // 2)
    with EmbeddedLogStore(store_dir) as store, pytest.raises(StoreCorruptError) as exc:
        store.topic("t")
    _assert_corrupt(exc, path)
    assert "truncated" in str(exc.value)


def test_undecodable_batch_is_store_corrupt(store_dir: Path) -> None:
    path = _filled(store_dir)
    conn = sqlite3.connect(path)
    conn.execute("UPDATE p0 SET data = x'00ffffffff' WHERE last_offset = (SELECT min(last_offset) FROM p0)")
    conn.commit()
    conn.close()
    with EmbeddedLogStore(store_dir) as store:
        with pytest.raises(StoreCorruptError) as exc:
            store.read("t", 0, 0)
        _assert_corrupt(exc, path)
        assert len(store.read("t", 0, 20)) == 380  # the other batches are intact


def test_errors_name_what_and_how(store_dir: Path) -> None:
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as store:
        with pytest.raises(UnknownTopicError) as unknown:
            store.read("nope", 0, 0)
        assert "cdc topic list" in (unknown.value.fix or "")
        with pytest.raises(LogStoreError) as bad_name:
            store.create_topic("bad/name", TopicConfig())
        assert "[A-Za-z0-9._-]" in (bad_name.value.fix or "")
        store.create_topic("t", TopicConfig(partitions=2))
        with pytest.raises(LogStoreError) as bad_partition:
            store.append("t", [Record(b"k", b"v", partition=2)])
        assert bad_partition.value.partition == 2
        assert store.end_offsets("t") == {0: 0, 1: 0}  # nothing of the refused batch was written
        with pytest.raises(LogStoreError):
            store.read("t", 5, 0)


def test_reopen_keeps_records_offsets_and_positions(store_dir: Path) -> None:
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as store:
        store.create_topic("t", TopicConfig(partitions=1, min_compaction_lag_ms=0, delete_retention_ms=0))
        store.append("t", [Record(b"a", b"1"), Record(b"a", None)])
        store.commit("c", "t", {0: 2})
        assert store.compact("t") == 2  # the tombstone and what it deleted are gone
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as store:
        assert store.end_offsets("t") == {0: 2}  # the end does not move back
        assert store.read("t", 0, 0) == []
        assert store.append("t", [Record(b"b", b"2")]) == {0: 2}
        assert store.committed("c", "t") == {0: 2}
        store.delete_topic("t")
        assert not (store_dir / "t.db").exists()
        store.create_topic("t", TopicConfig(partitions=1))
        assert store.committed("c", "t") == {}  # positions went with the topic
        assert store.end_offsets("t") == {0: 0}


def test_delete_and_recreate_while_background_compaction_runs(store_dir: Path) -> None:
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=0.005) as store:
        config = TopicConfig(partitions=1, min_compaction_lag_ms=0, delete_retention_ms=0)
        for round_ in range(20):
            store.create_topic("t", config)
            store.append("t", [Record(b"k", str(i).encode()) for i in range(50)])
            wait_for(lambda: store.record_counts("t") == {0: 1}, timeout=120, what="background compaction")
            assert [r.value for r in store.read("t", 0, 0)] == [b"49"]
            store.delete_topic("t")
            del round_
        store.create_topic("t", config)
        assert store.append("t", [Record(b"k", b"after")]) == {0: 0}  # no error left by the thread


def test_records_it_could_not_read_back_are_refused(store_dir: Path) -> None:
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as store:
        store.create_topic("t", TopicConfig(partitions=1))
        bad = [
            Record("str key", b"v"),  # type: ignore[arg-type]
            Record(b"k", "str value"),  # type: ignore[arg-type]
            Record(b"k", b"v", (("h", "str"),)),  # type: ignore[arg-type]
            Record(b"k", b"v", timestamp_ms=1.5),  # type: ignore[arg-type]
        ]
        for record in bad:
            with pytest.raises(LogStoreError) as exc:
                store.append("t", [Record(b"ok", b"ok"), record])
            assert exc.value.index == 1 and exc.value.fix
        assert store.end_offsets("t") == {0: 0}  # nothing of a refused batch is written
        assert store.append("t", [Record(b"k", b"v", (("h", b"x"),), 5)]) == {0: 0}


def test_reader_follows_a_topic_deleted_and_recreated_by_the_writer(store_dir: Path) -> None:
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as writer:
        writer.create_topic("t", TopicConfig(partitions=1))
        writer.append("t", [Record(b"k", b"old")])
        reader = EmbeddedLogStore(store_dir)
        assert [r.value for r in reader.read("t", 0, 0)] == [b"old"]
        writer.delete_topic("t")
        with pytest.raises(UnknownTopicError):
            reader.read("t", 0, 0)
        writer.create_topic("t", TopicConfig(partitions=1))
        writer.append("t", [Record(b"k", b"new")])
        assert [r.value for r in reader.read("t", 0, 0)] == [b"new"]
        reader.close()


def test_a_writers_topic_cannot_be_deleted_under_it(store_dir: Path) -> None:
    """A writer's appends go to the topic file it opened without looking it up again: what makes
    that safe is that deleting a topic takes its writer lock, so no other instance (or process) can
    delete it while the writer holds it. The writer deletes and re-creates it itself and goes on."""
    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as writer:
        writer.create_topic("t", TopicConfig(partitions=1))
        writer.append("t", [Record(b"k", b"v1")])
        with (
            EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as other,
            pytest.raises(WriterLockedError),
        ):
            other.delete_topic("t")
        assert writer.append("t", [Record(b"k", b"v2")]) == {0: 1}
        writer.delete_topic("t")
        with pytest.raises(UnknownTopicError):
            writer.append("t", [Record(b"k", b"gone")])
        writer.create_topic("t", TopicConfig(partitions=1))
        assert writer.append("t", [Record(b"k", b"v3")]) == {0: 0}
        with EmbeddedLogStore(store_dir) as reader:
            assert [r.value for r in reader.read("t", 0, 0)] == [b"v3"]


def test_background_compaction_waits_until_its_dirt_is_cleanable(
    store_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hot key's updates (or a snapshot just written) are dirt no compaction may clean before
    ``min_compaction_lag_ms``: the background pass, which reads every batch, is not run while the
    dirt is all younger than that, and runs once it has aged; what it leaves is still every key's
    newest record."""
    import cdc.logstore
    from cdc.logstore.embedded import maintenance
    from cdc.logstore.embedded import store as store_module

    passes: list[int] = []
    real_pass = maintenance._newest_offsets

    def counted(*args: object, **kwargs: object) -> object:
        passes.append(1)
        return real_pass(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(maintenance, "_newest_offsets", counted)
    real_now = cdc.logstore.now_ms

    def clock(shift_ms: int) -> None:  # what appends stamp and what compaction reads
        monkeypatch.setattr(cdc.logstore, "now_ms", lambda: real_now() + shift_ms)
        monkeypatch.setattr(store_module, "now_ms", lambda: real_now() + shift_ms)

    def background(store: EmbeddedLogStore, shift_ms: int) -> int:
        clock(shift_ms)
        t = store._open_topic("t")
        return maintenance.compact_topic(t, None, store_lock=store._lock, compress=True, only_if_due=True)

    def updates(store: EmbeddedLogStore, round_: int) -> None:
        for b in range(10):  # 10 appends of 10 updates to 5 hot keys
            store.append("t", [Record(b"k%d" % (i % 5), b"r%d-%d-%d" % (round_, b, i)) for i in range(10)])

    with EmbeddedLogStore(store_dir, writer=True, compaction_interval_s=None) as store:
        store.create_topic("t", TopicConfig(partitions=1, min_compaction_lag_ms=60_000))
        updates(store, 0)
        assert background(store, 0) == 0 and passes == []  # all of it younger than the lag
        assert background(store, 61_000) == 95 and passes == [1]
        clock(61_000)
        updates(store, 1)  # 100 young records against 5 compacted: dirty, but not cleanable
        assert background(store, 61_000) == 0 and passes == [1]
        assert background(store, 122_000) == 100 and passes == [1, 1]
        newest = {r.key: r.value for r in store.iter_partition("t", 0)}
        assert newest == {b"k%d" % k: b"r1-9-%d" % (5 + k) for k in range(5)}
        assert store.record_counts("t") == {0: 5}
