"""The apply job (:class:`spark_jobs.apply.ApplyJob`, run once in this process on real Spark, Delta
and, where the table has search columns, tantivy) fed by hand-built records: events written to the
log store by :class:`tests.plugins.changes.ChangeWriter`, not by ``cdc run``, so that they can be
re-delivered, out of order, corrupt or aimed at a failing sink. Not end to end (that is
``tests/apply/test_end_to_end.py``). A test that gives the job its own sinks runs the job's driver
path (the records collected to the driver), not its default work in Spark tasks."""

from __future__ import annotations

import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.config import Settings
from cdc.events import dead_letter_topic
from cdc.logstore import APPLY_CONSUMER
from sinks import ChangeBatch, Sink
from sinks.warehouse import LSN, SEQ, WarehouseSink
from spark_jobs.apply import ledger_path
from tests.plugins.apply import Env, run_job
from tests.plugins.changes import ChangeWriter, make_reg

COLUMNS = [("id", "bigint"), ("name", "text"), ("price", "numeric(20,6)"), ("qty", "integer")]


def _reg(search: tuple[str, ...] = ()) -> Any:
    return make_reg(f"s{uuid.uuid4().hex[:8]}", "items", COLUMNS, search=search)


def _row(i: int, gen: int = 0) -> dict[str, Any]:
    return {"id": i, "name": f"item {i} v{gen}", "price": f"{i}.{gen:06d}", "qty": i * 10 + gen}


def _workload(w: ChangeWriter) -> dict[int, dict[str, Any]]:
    """Inserts, updates, deletes and a key change; returns the expected final rows by id."""
    state: dict[int, dict[str, Any]] = {}
    with w.txn():
        for i in range(1, 41):
            w.insert(_row(i))
            state[i] = _row(i)
    for gen in (1, 2):
        with w.txn():
            for i in range(1, 41, 3):
                w.update(_row(i, gen))
                state[i] = _row(i, gen)
    with w.txn():
        for i in (5, 6, 7):
            w.delete({"id": i})
            del state[i]
    with w.txn():
        new = dict(state.pop(8), id=108)
        w.change_key({"id": 8}, new)
        state[108] = new
    return state


def _current(env: Env, reg: Any) -> dict[int, dict[str, Any]]:
    rows = WarehouseSink(env.state).current_rows(reg, meta=False).to_pylist()
    return {r["id"]: r for r in rows}


def _expected(state: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {k: {**v, "price": Decimal(v["price"])} for k, v in state.items()}


def test_redelivered_out_of_order_events_leave_the_same_tables(spark_clean: Any, env: Env) -> None:
    reg = env.register(_reg())
    w = ChangeWriter(env.store, reg)
    state = _workload(w)
    # deliver everything again, newest first: duplicates and old versions after new ones
    again = list(reversed(w.written))
    for i in range(0, len(again), 25):
        env.store.append(reg.topic, again[i : i + 25])
    summary = run_job(spark_clean, env, make_sinks=_warehouse_only, max_records=37)
    assert summary.batches >= 5, "maxRecordsPerBatch must split the work into several micro-batches"
    assert summary.dead_letters == 0
    assert _current(env, reg) == _expected(state)
    hist = WarehouseSink(env.state).history_rows(reg).to_pylist()
    versions = [(r["_cdc_key"], r[LSN], r[SEQ]) for r in hist]
    assert len(versions) == len(set(versions)), "a re-delivered event made a second history row"
    # the apply consumer's position reached the end of every partition
    assert env.store.committed(APPLY_CONSUMER, reg.topic) == env.store.end_offsets(reg.topic)


def test_a_lagging_apply_takes_larger_batches_then_the_usual_ones(spark_clean: Any, env: Env) -> None:
    """``max_records_per_batch_behind``: behind by 30x the bound, the first batches take half the
    backlog (fewer rewrites of the tables), the last ones the usual bound; nothing is lost."""
    reg = env.register(_reg())
    w = ChangeWriter(env.store, reg)
    state = _workload(w)
    env.store.append(reg.topic, list(reversed(w.written)))  # delivered again: twice the records
    total = sum(env.store.end_offsets(reg.topic).values())
    sizes: list[int] = []
    summary = run_job(
        spark_clean,
        env,
        max_records=5,
        max_records_per_batch_behind=30,
        on_batch=lambda r: sizes.append(r.records),
    )
    assert sum(sizes) == summary.records == total > 150
    assert sizes[0] == 30 and max(sizes) == 30, sizes  # the cap, while half the backlog is more
    assert sizes[-1] <= 5 and len(sizes) < total // 5, sizes  # caught up: the usual bound
    assert _current(env, reg) == _expected(state)


def test_plain_batches_are_parsed_in_columns_and_unusual_ones_per_record(spark_clean: Any, env: Env) -> None:
    reg = env.register(_reg(search=("name",)))
    w = ChangeWriter(env.store, reg)
    state = _workload(w)  # 100+ plain records: one columnar batch
    summary = run_job(spark_clean, env)
    assert (summary.batches, summary.columnar) == (1, 1)
    assert _current(env, reg) == _expected(state)
    with w.txn():  # a TRUNCATE: that batch is parsed record by record
        w.truncate()
    state = {}
    for i in range(200, 300):
        with w.txn():
            w.insert(_row(i))
        state[i] = _row(i)
    summary = run_job(spark_clean, env)
    assert (summary.batches, summary.columnar) == (1, 0)
    assert _current(env, reg) == _expected(state)


def test_corrupt_records_go_to_the_dead_letter_topic(spark_clean: Any, env: Env) -> None:
    reg = env.register(_reg())
    w = ChangeWriter(env.store, reg)
    with w.txn():
        w.insert(_row(1))
        w.raw(b'{"id": 2}', b"{not json")
        w.insert(_row(3))
        w.raw(b'{"wrong": 3}', w.pending.pop().value)  # the event of row 3 under a key without "id"
        w.insert(_row(4))
    summary = run_job(spark_clean, env, make_sinks=_warehouse_only)
    assert summary.dead_letters == 2
    assert set(_current(env, reg)) == {1, 4}, "the good records of the batch are applied"
    dlq = dead_letter_topic(env.settings.topic_prefix)
    letters = [
        r
        for p in env.store.end_offsets(dlq)
        for r in env.store.iter_partition(dlq, p)
        if dict(r.headers)["source_topic"] == reg.topic.encode()  # the Kafka broker is shared by the tests
    ]
    assert len(letters) == 2
    bodies = sorted((orjson.loads(r.value) for r in letters), key=lambda b: b["source"]["offset"])
    for body, rec in zip(bodies, letters, strict=False):
        assert body["source"]["topic"] == reg.topic
        assert body["reason"]
        assert dict(rec.headers)["source_topic"] == reg.topic.encode()
    assert "not JSON" in bodies[0]["reason"] or "not JSON" in bodies[1]["reason"]
    assert any("key columns" in b["reason"] for b in bodies)
    metrics = orjson.loads(ledger_path(env.state).read_bytes())
    assert metrics["dead_letters"] == 2


def _warehouse_only(settings: Settings) -> list[Sink]:
    return [WarehouseSink(settings.state_dir)]


class _Failing(Sink):
    """A sink that fails every batch (``fail``) or applies it; each call's batch id is appended to
    ``calls`` (a file: the sink runs in the Spark tasks, processes of their own)."""

    name = "failing"

    def __init__(self, calls: Path, fail: bool) -> None:
        self.calls = calls
        self.fail = fail

    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        with self.calls.open("a") as f:
            f.write(f"{batch_id}\n")
        if self.fail:
            raise RuntimeError("sink down (test)")


def _calls(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_a_failing_sink_fails_the_batch_and_a_rerun_retries_it(spark_clean: Any, env: Env) -> None:
    from cdc.errors import ApplyError

    reg = env.register(_reg())
    w = ChangeWriter(env.store, reg)
    with w.txn():
        for i in range(1, 11):
            w.insert(_row(i))
        w.raw(b'{"id": 99}', b"garbage")
    failing = env.state / "failing-calls"
    with pytest.raises(ApplyError, match="sink down"):
        run_job(
            spark_clean,
            env,
            make_sinks=lambda s: [WarehouseSink(s.state_dir), _Failing(failing, fail=True)],
            shard_min_records=1 << 30,  # one slice: the failing sink is called once
        )
    assert _calls(failing) == [0]
    # the job's position stays where it started (committed at its start, so compaction keeps what it
    # has not read): a failed batch must not be marked applied
    assert (
        env.store.committed(APPLY_CONSUMER, reg.topic)
        == env.store.start_offsets(reg.topic)
        == {p: 0 for p in range(4)}
    )
    healed = env.state / "healed-calls"
    summary = run_job(
        spark_clean,
        env,
        make_sinks=lambda s: [WarehouseSink(s.state_dir), _Failing(healed, fail=False)],
        shard_min_records=1 << 30,
    )
    assert _calls(healed) == [0], "the rerun retries the same batch id"
    assert summary.events == 10
    dlq = dead_letter_topic(env.settings.topic_prefix)
    letters = [
        r
        for p in env.store.end_offsets(dlq)
        for r in env.store.iter_partition(dlq, p)
        if dict(r.headers)["source_topic"] == reg.topic.encode()  # the Kafka broker is shared by the tests
    ]
    assert len(letters) == 1, "the replayed batch must not write its dead letters again"
    assert summary.dead_letters_total == 1
    assert set(_current(env, reg)) == set(range(1, 11))
