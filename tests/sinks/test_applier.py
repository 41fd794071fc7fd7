"""The Spark-free part of a micro-batch (:class:`spark_jobs.applier.BatchApplier`) without a JVM: the
records of a micro-batch as Arrow (the reader's own envelopes, :mod:`tests.sinks.feed`), the real
sinks (Delta warehouse + tantivy index, :func:`spark_jobs.applier.open_sinks`) in a temporary state
directory."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from deltalake import DeltaTable

from cdc.config import Settings
from cdc.events import encode_key
from cdc.registry import TableReg
from sinks import ChangeBatch, DeadLetter, RawRecord, Sink, StoredTexts
from sinks.parse import records_table
from sinks.warehouse import WarehouseSink
from spark_jobs.applier import BatchApplier, open_sinks
from tests.sinks.feed import BASE_TS_MS, Feed, table

APP = "cdc-apply-applier-test"
ITEMS = table("items", columns=(("id", "bigint"), ("name", "text"), ("born", "date")), search=("name",))
PLAIN = table("plain", columns=(("id", "bigint"), ("name", "text")))


@pytest.fixture
def sinks(tmp_path: Path) -> Iterator[list[Sink]]:
    """The job's sinks (every one of ``sinks.all.SINKS``) on the state directory ``tmp_path``."""
    out = open_sinks(Settings(state_dir=tmp_path))
    yield out
    for s in out:
        s.close()


def applier(sinks: Sequence[Sink], *regs: TableReg, **kw: Any) -> BatchApplier:
    by_topic = {r.topic: r for r in regs}
    return BatchApplier(sinks, by_topic.get, APP, **kw)


def warehouse(state: Path, reg: TableReg) -> dict[int, dict[str, Any]]:
    return {r["id"]: r for r in WarehouseSink(state).current_rows(reg, meta=False).to_pylist()}


def indexed(sinks: Sequence[Sink], reg: TableReg) -> dict[int, str]:
    """id -> the name the search index holds for it."""
    (texts,) = [t for s in sinks if isinstance(t := s.read_back(reg), StoredTexts)]
    return {orjson.loads(k)["id"]: v["name"] for k, v in texts.docs.items()}


def corrupt(feed: Feed, key: dict[str, Any], value: bytes) -> RawRecord:
    """A record as-is, at the feed's next offset (corrupt input)."""
    feed.offset += 1
    return RawRecord(feed.reg.topic, 0, feed.offset, encode_key(key), value, BASE_TS_MS)


def item(i: int, name: str | None = None, born: str = "1990-05-17") -> dict[str, Any]:
    return {"id": i, "name": name or f"widget {i}", "born": born}


def test_inserts_updates_and_deletes_reach_both_sinks(tmp_path: Path, sinks: list[Sink]) -> None:
    fi, fp = Feed(ITEMS), Feed(PLAIN)
    app = applier(sinks, ITEMS, PLAIN)
    first = [fi.change("c", item(i), 100 + i) for i in range(1, 101)]
    first += [fp.change("c", {"id": i, "name": f"plain {i}"}, 100 + i) for i in range(1, 4)]
    out = app.run(records_table(first), 0)
    assert (out.records, out.events, out.dead) == (103, 103, [])
    assert {t.table: (t.events, t.columnar) for t in out.tables} == {
        ITEMS.qualified: (100, True),  # 100 plain inserts: parsed in columns
        PLAIN.qualified: (3, False),
    }
    assert out.newest_ts_ms == BASE_TS_MS + 200
    assert set(out.sink_seconds) == {s.name for s in sinks}

    second = [fi.change("u", item(1, "golden widget"), 300), *fi.delete({"id": 2}, 301)]
    second += [fi.change("c", item(101, "new widget"), 302), *fp.delete({"id": 3}, 303)]
    out = app.run(records_table(second), 1)
    assert (out.records, out.events, out.dead) == (6, 4, []), "tombstones are records, not events"
    rows = warehouse(tmp_path, ITEMS)
    assert set(rows) == set(range(1, 102)) - {2}
    assert rows[1]["name"] == "golden widget" and rows[101]["name"] == "new widget"
    assert str(rows[50]["born"]) == "1990-05-17"
    assert set(warehouse(tmp_path, PLAIN)) == {1, 2}
    docs = indexed(sinks, ITEMS)
    assert set(docs) == set(rows) and docs[1] == "golden widget" and docs[101] == "new widget"
    assert all(s.applied_batch(ITEMS, APP) == 1 for s in sinks)


def test_poison_records_are_dead_letters_and_the_rest_applies(tmp_path: Path, sinks: list[Sink]) -> None:
    fi = Feed(ITEMS)
    gone = Feed(table("gone"))  # a real envelope of a topic the applier does not know
    records = [fi.change("c", item(i), 100 + i) for i in range(1, 6)]
    records.append(fi.change("c", item(6, born="0044-03-15 BC"), 106))  # a BC date: Delta cannot hold it
    records.append(corrupt(fi, {"id": 7}, b'{"op": "c", "after": {"id": 7,'))  # bad JSON
    records.append(fi.change("c", item(8), 108))
    # an update lacking its unchanged TOAST value, whose row is only in the rejected insert: rejected too
    records.append(fi.change("u", {"id": 6, "name": "renamed"}, 109, unavailable=("born",)))
    records.append(gone.change("c", {"id": 1, "name": "x", "note": None}, 100))
    handed: list[DeadLetter] = []

    def dead_letters(dead: Sequence[DeadLetter]) -> None:  # before any sink applies
        assert all(s.applied_batch(ITEMS, APP) is None for s in sinks)
        handed.extend(dead)

    out = applier(sinks, ITEMS).run(records_table(records), 0, dead_letters=dead_letters)
    assert handed == out.dead
    assert pickle.loads(pickle.dumps(out)) == out, "plain values: an outcome can leave a Spark task"
    by_pos = {(d.topic, d.offset): d for d in out.dead}
    assert set(by_pos) == {(ITEMS.topic, 6), (ITEMS.topic, 7), (ITEMS.topic, 9), ("cdc.public.gone", 1)}
    bc = by_pos[(ITEMS.topic, 6)]
    assert bc.reason.startswith("warehouse: column born") and bc.table == ITEMS.qualified
    assert bc.value == records[5].value and orjson.loads(bc.key_json or "") == {"id": 6}
    assert by_pos[(ITEMS.topic, 7)].value == records[6].value
    assert "unchanged TOAST" in by_pos[(ITEMS.topic, 9)].reason, by_pos[(ITEMS.topic, 9)].reason
    assert "no longer registered" in by_pos[("cdc.public.gone", 1)].reason
    assert (out.records, out.events) == (10, 6)
    assert set(warehouse(tmp_path, ITEMS)) == {1, 2, 3, 4, 5, 8}
    assert set(indexed(sinks, ITEMS)) == {1, 2, 3, 4, 5, 8}, "a poison record is in no sink"


def _versions(state: Path, reg: TableReg) -> list[int]:
    return [DeltaTable(str(p)).version() for p in WarehouseSink.locations(state, reg).values()]


def test_replaying_a_batch_id_changes_nothing(tmp_path: Path, sinks: list[Sink]) -> None:
    fi = Feed(ITEMS)
    app = applier(sinks, ITEMS)
    app.run(records_table([fi.change("c", item(i), 100 + i) for i in range(1, 4)]), 0)
    batch = [fi.change("u", item(1, "golden widget"), 200), *fi.delete({"id": 2}, 201)]
    batch.append(fi.change("c", item(9, born="0044-03-15 BC"), 202))
    records = records_table(batch)
    first = app.run(records, 1)
    versions, rows, docs = _versions(tmp_path, ITEMS), warehouse(tmp_path, ITEMS), indexed(sinks, ITEMS)
    history = DeltaTable(str(WarehouseSink.locations(tmp_path, ITEMS)["history"])).to_pyarrow_table().num_rows
    again = app.run(records, 1)  # Spark's replay of a failed batch: same records, same batch id
    assert again.dead == first.dead and len(again.dead) == 1, "the same dead letters"
    assert _versions(tmp_path, ITEMS) == versions, "no new Delta commit"
    assert warehouse(tmp_path, ITEMS) == rows and indexed(sinks, ITEMS) == docs
    assert (
        DeltaTable(str(WarehouseSink.locations(tmp_path, ITEMS)["history"])).to_pyarrow_table().num_rows
        == history
    )
    assert rows[1]["name"] == "golden widget" and set(rows) == {1, 3}


class _Recorder(Sink):
    """Records the thread of every call; ``fail``: raises from ``apply`` after ``delay`` seconds."""

    def __init__(self, name: str, fail: bool = False, delay: float = 0.0) -> None:
        self.name = name
        self.fail = fail
        self.delay = delay
        self.threads: set[int] = set()
        self.applied: list[tuple[str, int]] = []
        self.done = threading.Event()

    def reject(self, batch: ChangeBatch) -> list[Any]:
        return []

    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        self.threads.add(threading.get_ident())
        threading.Event().wait(self.delay)
        if self.fail:
            raise RuntimeError(f"{self.name} failed")
        self.applied.append((batch.table.qualified, batch_id))
        self.done.set()


def test_each_sink_on_its_own_thread_and_a_failure_after_every_sink() -> None:
    fi, fp = Feed(ITEMS), Feed(PLAIN)
    a, b = _Recorder("a"), _Recorder("b")
    app = applier([a, b], ITEMS, PLAIN)
    try:
        for batch_id in range(3):
            records = [
                fi.change("c", item(batch_id), 100 + batch_id),
                fp.change("c", {"id": 1}, 100 + batch_id),
            ]
            app.run(records_table(records), batch_id)
        assert len(a.threads) == 1 and len(b.threads) == 1 and a.threads != b.threads
        assert threading.get_ident() not in a.threads | b.threads
        assert a.applied == [(t, i) for i in range(3) for t in (ITEMS.qualified, PLAIN.qualified)]
    finally:
        app.close(close_sinks=True, timeout=10)
    bad, slow = _Recorder("bad", fail=True), _Recorder("slow", delay=0.5)
    app = applier([bad, slow], ITEMS)
    try:
        with pytest.raises(RuntimeError, match="bad failed"):
            app.run(records_table([fi.change("c", item(1), 500)]), 7)
        assert slow.done.is_set(), "the batch fails only once every sink finished"
    finally:
        app.close(close_sinks=True, timeout=10)
