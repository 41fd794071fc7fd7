"""The apply's task path without a JVM (``spark_jobs.tasks``): the records in a real embedded log
store, placed by key in 4 partitions as the reader places them; each slice applied in its own process
at the same time (as Spark's Python workers do), the driver committing; the sinks' tables equal what
the whole micro-batch applied at once (:class:`spark_jobs.applier.BatchApplier`) gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from cdc.config import Settings
from cdc.logstore import Record, TopicConfig
from cdc.logstore.factory import open_log_store
from cdc.logstore.partition_arrays import partition_array
from cdc.logstore.records import RECORDS, read_records
from cdc.registry import TableReg
from sinks import RawRecord, StoredTexts
from sinks.warehouse import Layout, WarehouseOptions, WarehouseSink
from sinks.warehouse.delta import layout_of
from spark_jobs import tasks
from spark_jobs.applier import BatchApplier, open_sinks
from spark_jobs.tasks import (
    Planner,
    Slice,
    SliceResult,
    commit_slices,
    group_slices,
    outcome_of,
    plan_slices,
    run_slices,
    sample_ranges,
    slice_phases,
)
from tests.plugins.forks import workers
from tests.sinks.feed import Feed, mixed_batches, table

APP = "cdc-apply-tasks-test"
PARTITIONS = 4
ITEMS = table("items", search=("name",))
PLAIN = table("plain")


def test_group_slices_balances_records_over_the_tasks() -> None:
    """At most one group per task, the largest slice first into the least loaded group; every slice
    once."""
    sizes = {0: 50, 1: 40, 2: 30, 3: 20, 4: 10}
    slices = [Slice("a", ((p, 100, 100 + n),), p) for p, n in sizes.items()]
    groups = group_slices(slices, 2)
    assert [[sl.shard for sl in g] for g in groups] == [[0, 3, 4], [1, 2]]  # 80 and 70 records
    assert group_slices(slices, 9) == [[sl] for sl in slices]
    assert group_slices(slices[:1], 0) == [slices[:1]] and group_slices([], 4) == []


def test_plan_slices() -> None:
    """A partition per task where the table is sharded like its topic, else the topic in one task;
    empty ranges left out."""
    ranges = [("a", 1, 5, 9), ("a", 0, 0, 3), ("a", 2, 4, 4), ("b", 0, 0, 2), ("b", 1, 3, 7)]
    got = plan_slices(ranges, {"a": 4, "b": 1}.__getitem__, lambda t: 4)
    # each shard's slice knows the topic's other ranges of the batch (read for key changes only)
    assert got == [
        Slice("a", ((0, 0, 3),), 0, ((1, 5, 9),)),
        Slice("a", ((1, 5, 9),), 1, ((0, 0, 3),)),
        Slice("b", ((0, 0, 2), (1, 3, 7))),
    ]
    # shards that differ from the topic's partitions: one task
    assert plan_slices(ranges[:2], lambda t: 4, lambda t: 8) == [Slice("a", ((0, 0, 3), (1, 5, 9)))]
    # a table the planner says to apply whole is one slice, sharded or not; it is asked with the
    # table's records in the batch
    asked: list[tuple[str, int]] = []
    small = plan_slices(
        ranges, {"a": 4, "b": 1}.__getitem__, lambda t: 4, lambda t, n: asked.append((t, n)) or t == "a"
    )
    assert [sl.shard for sl in small if sl.topic == "a"] == [None]
    assert sorted(asked) == [("a", 7), ("b", 6)]


def test_slice_phases_tell_spark_s_time_from_the_tasks() -> None:
    """Two tasks (told apart by their start), three slices: the job's start to the first task,
    the slowest task (its start to its last slice's end), the last end to the job's return, and
    the longest slice of each table."""
    results = [
        SliceResult(topic="a", seconds=1.0, open_seconds=0.2, task_started=10.5, ended=11.7),
        SliceResult(topic="b", seconds=0.5, task_started=10.5, ended=12.2),
        SliceResult(topic="a", seconds=2.0, task_started=10.8, ended=12.9),
    ]
    got = slice_phases(results, submitted=10.0, returned=13.0)
    expected = {
        "task start": 0.5,
        "slowest task": 2.1,
        "task results": 0.1,
        "task open": 0.2,
        "slice a": 2.0,
        "slice b": 0.5,
        "slowest slice": 2.0,
    }
    assert got == pytest.approx(expected)
    assert slice_phases([], 10.0, 11.0) == {"task open": 0.0, "slowest slice": 0.0}


def _run(args: tuple[Settings, int, dict[str, TableReg], Slice | list[Slice]]) -> list[SliceResult]:
    """One task: a slice, or a group of them applied in turn with the same sinks and store."""
    settings, batch_id, tables, sl = args
    return list(run_slices(settings, APP, batch_id, tables, sl if isinstance(sl, list) else [sl]))


def _append(store: Any, recs: list[RawRecord]) -> None:
    """The records as the reader appends them: a key's records in its partition, a TRUNCATE's
    markers one per partition."""
    by_topic: dict[str, list[Record]] = {}
    for r in recs:
        marker = r.partition if b"__truncate" in r.key else None
        by_topic.setdefault(r.topic, []).append(Record(r.key, r.value, partition=marker))
    store.append_many(by_topic)


def _flat(recs: list[Any]) -> list[RawRecord]:
    return [x for r in recs for x in (r if isinstance(r, list) else [r])]


def _state(settings: Settings, regs: list[TableReg]) -> list[Any]:
    sinks = open_sinks(settings)
    try:
        out: list[Any] = []
        for reg in regs:
            wh = WarehouseSink(settings.state_dir)
            for rows in (wh.current_rows, wh.history_rows, wh.tombstone_rows):
                out.append(sorted(rows(reg).to_pylist(), key=str))
            texts = [t for s in sinks if isinstance(t := s.read_back(reg), StoredTexts)]
            out.append({k: v for t in texts for k, v in sorted(t.docs.items())})
        return out
    finally:
        for s in sinks:
            s.close()


@pytest.mark.parametrize(("seed", "min_shard"), [(1, 0), (2, 0), (3, 10**9)])
def test_slices_applied_in_parallel_processes_equal_the_whole_batch(
    tmp_path: Path, seed: int, min_shard: int
) -> None:
    """Two tables (one indexed), a random workload per table (inserts, updates, deletes, snapshot
    reads, late and redelivered events, a TRUNCATE), six micro-batches: after each, the tables
    applied by concurrent task processes and committed by the driver equal the driver path's.
    ``min_shard``: a batch of fewer records of a table is one whole-table slice of its sharded
    tables (:data:`spark_jobs.tasks.SHARD_MIN_RECORDS`), else one slice per partition."""
    # the warehouse in as many shards as the topics have partitions: one task per partition
    sharded = {"warehouse": {"shards": PARTITIONS}}
    tasks_settings = Settings(state_dir=tmp_path / "tasks", partitions=PARTITIONS, extra=sharded)
    driver_settings = Settings(state_dir=tmp_path / "driver", partitions=PARTITIONS, extra=sharded)
    regs = [ITEMS, PLAIN]
    by_topic = {r.topic: r for r in regs}
    feeds = [Feed(r) for r in regs]
    workloads = [mixed_batches(f, seed + i, partitions=PARTITIONS) for i, f in enumerate(feeds)]
    store = open_log_store(tasks_settings, writer=True)
    for reg in regs:
        store.create_topic(reg.topic, TopicConfig(partitions=PARTITIONS))
    driver_sinks = open_sinks(driver_settings)
    driver = BatchApplier(driver_sinks, by_topic.get, APP)
    task_sinks = open_sinks(tasks_settings)  # the driver's: shards, prepare and committed only
    planner = Planner(task_sinks, min_shard, min_shard)
    ctx = workers(__name__)
    sliced = 0
    try:
        with ctx.Pool(PARTITIONS) as pool:
            for batch_id in range(6):
                before = {r.topic: store.end_offsets(r.topic) if batch_id else {} for r in regs}
                _append(store, [x for w in workloads for x in _flat(w[batch_id])])
                ranges = [
                    (r.topic, p, before[r.topic].get(p, 0), end)
                    for r in regs
                    for p, end in store.end_offsets(r.topic).items()
                ]
                records = [b for t, p, s, e in ranges for b in read_records(store, t, p, s, e)]
                driver.run(pa.Table.from_batches(records, schema=RECORDS), batch_id)
                slices = planner.plan(ranges, by_topic, lambda t: PARTITIONS)
                sliced += sum(sl.shard is not None for sl in slices)
                results = [
                    r
                    # odd batches: a task per slice; even ones: the slices in 3 tasks, as on 3 cores
                    for rs in pool.map(
                        _run,
                        [
                            (tasks_settings, batch_id, by_topic, sl)
                            for sl in (slices if batch_id % 2 else group_slices(slices, 3))
                        ],
                    )
                    for r in rs
                ]
                commit_slices(task_sinks, regs, results, APP, batch_id)
                assert outcome_of(batch_id, results).dead == []
                assert _state(tasks_settings, regs) == _state(driver_settings, regs), (
                    f"after batch {batch_id}"
                )
    finally:
        driver.close(close_sinks=True, timeout=None)
        for s in task_sinks:
            s.close()
        store.close()
    if min_shard:
        assert sliced == 0, "every batch was below min_shard: whole-table slices of sharded tables"
    else:
        assert sliced >= 5 * 2 * PARTITIONS - 8, "the batches after the first ran one task per partition"


def test_a_key_change_across_shards_keeps_its_unchanged_toast_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Primary-key changes whose new key hashes to another partition than the old one, lacking an
    unchanged TOAST column (``name``, indexed): 2 -> 8, the old row applied by an earlier batch, and
    5 -> 9, the old key inserted in the same micro-batch. The old keys' slices run (and commit their
    search shards) first, as a busy executor may run them; the new keys' slices must still take the
    old rows' values, with no dead letter, and every table equal the whole batch applied at once.
    A new key's slice parses of the other partitions only the old key's records, not the batch."""
    parsed_keys: list[list[bytes]] = []
    real_parse = tasks.parse

    def parse(reg: Any, records: Any, **kw: Any) -> Any:  # what the slices parse, beyond their own
        parsed_keys.append(sorted(set(records.column("key").to_pylist())))
        return real_parse(reg, records, **kw)

    monkeypatch.setattr(tasks, "parse", parse)
    sharded = {"warehouse": {"shards": PARTITIONS}}
    tasks_settings = Settings(state_dir=tmp_path / "tasks", partitions=PARTITIONS, extra=sharded)
    driver_settings = Settings(state_dir=tmp_path / "driver", partitions=PARTITIONS, extra=sharded)
    by_topic = {ITEMS.topic: ITEMS}
    f = Feed(ITEMS)
    long = "x" * 300_000 + " 'q' \"dq\" back\\slash\nline"
    batches: list[list[RawRecord]] = [
        [f.change("r", {"id": i, "name": f"{long} {i}", "note": "n"}, 100) for i in (1, 2, 3)],
        [
            f.change("c", {"id": 5, "name": f"{long} 5", "note": "n"}, 200),
            *f.delete({"id": 2}, 300),
            f.change("c", {"id": 8, "note": "moved"}, 300, unavailable=["name"], before={"id": 2}),
            *f.delete({"id": 5}, 400),
            f.change("c", {"id": 9, "note": "moved"}, 400, unavailable=["name"], before={"id": 5}),
        ],
    ]
    store = open_log_store(tasks_settings, writer=True)
    store.create_topic(ITEMS.topic, TopicConfig(partitions=PARTITIONS))
    driver = BatchApplier(open_sinks(driver_settings), by_topic.get, APP)
    task_sinks = open_sinks(tasks_settings)
    planner = Planner(task_sinks)
    try:
        for batch_id, recs in enumerate(batches):
            before = store.end_offsets(ITEMS.topic) if batch_id else {}
            _append(store, recs)
            ranges = [
                (ITEMS.topic, p, before.get(p, 0), e) for p, e in store.end_offsets(ITEMS.topic).items()
            ]
            records = [b for t, p, s, e in ranges for b in read_records(store, t, p, s, e)]
            assert driver.run(pa.Table.from_batches(records, schema=RECORDS), batch_id).dead == []
            slices = planner.plan(ranges, by_topic, lambda t: PARTITIONS)
            # the old keys' shards (2, 5: partitions 0, 1) before the new keys' (8, 9: 2, 3)
            parsed_keys.clear()
            results = [r for sl in slices for r in _run((tasks_settings, batch_id, by_topic, sl))]
            assert outcome_of(batch_id, results).dead == [], f"batch {batch_id}"
            if batch_id == 1:  # 8's slice took 2's records of the batch, 9's those of 5
                assert sorted(parsed_keys) == [[b'{"id":2}'], [b'{"id":5}']]
            commit_slices(task_sinks, [ITEMS], results, APP, batch_id)
        assert [sl.shard for sl in slices] == [0, 1, 2, 3]
        state = _state(tasks_settings, [ITEMS])
        assert state == _state(driver_settings, [ITEMS])
        current = {r["id"]: r for r in state[0]}
        assert sorted(current) == [1, 3, 8, 9]
        assert current[8]["name"] == f"{long} 2" and current[9]["name"] == f"{long} 5"
    finally:
        driver.close(close_sinks=True, timeout=None)
        for s in task_sinks:
            s.close()
        store.close()


@pytest.mark.parametrize("crash", [False, True])
def test_a_new_table_s_first_batch_is_one_slice_per_shard(tmp_path: Path, crash: bool) -> None:
    """A new table whose first batch holds at least the shard threshold of records: the planner
    has its sinks create its tables from a sample of the batch (fewer records than the batch), so
    that batch too runs one task per partition; a small new table stays one slice, its tables
    created by its task. The tables (buckets, hence the layout, included) equal the whole batch
    applied at once, where the warehouse chose the layout from every row. ``crash``: the driver
    dies after the first batch's tasks wrote, before its commit; the restarted driver (new sinks,
    :meth:`~sinks.Sink.recover`, a new planner) finds the tables created, reads no sample, and
    replays the batch per shard with the layout they have."""
    sharded = {"warehouse": {"shards": PARTITIONS}}
    tasks_settings = Settings(state_dir=tmp_path / "tasks", partitions=PARTITIONS, extra=sharded)
    driver_settings = Settings(state_dir=tmp_path / "driver", partitions=PARTITIONS, extra=sharded)
    regs = [ITEMS, PLAIN]
    by_topic = {r.topic: r for r in regs}
    big, small = Feed(ITEMS), Feed(PLAIN)
    note = "wide 'q' \"dq\"\nline " * 40
    batches: list[list[RawRecord]] = [
        [big.change("r", {"id": i, "name": f"n{i}", "note": note}, 100) for i in range(1, 801)]
        + [small.change("r", {"id": i, "name": f"s{i}", "note": "x"}, 100) for i in range(1, 21)],
        [big.change("u", {"id": i, "name": f"m{i}", "note": "y"}, 200 + i) for i in range(1, 801, 7)]
        + [r for i in range(3, 801, 11) for r in big.delete({"id": i}, 300 + i)],
    ]
    store = open_log_store(tasks_settings, writer=True)
    for reg in regs:
        store.create_topic(reg.topic, TopicConfig(partitions=PARTITIONS))
    driver = BatchApplier(open_sinks(driver_settings), by_topic.get, APP)
    task_sinks = open_sinks(tasks_settings)
    planner = Planner(task_sinks, 200, 200, lambda: store)
    planner.sample_size = 120  # a sample of the batch, not all of it
    wh = WarehouseSink(tasks_settings.state_dir)
    try:
        for batch_id, recs in enumerate(batches):
            before = {r.topic: store.end_offsets(r.topic) if batch_id else {} for r in regs}
            _append(store, recs)
            ranges = [
                (r.topic, p, before[r.topic].get(p, 0), end)
                for r in regs
                for p, end in store.end_offsets(r.topic).items()
            ]
            records = [b for t, p, s, e in ranges for b in read_records(store, t, p, s, e)]
            assert driver.run(pa.Table.from_batches(records, schema=RECORDS), batch_id).dead == []
            slices = planner.plan(ranges, by_topic, lambda t: PARTITIONS)
            assert [(sl.topic, sl.shard) for sl in slices] == [
                *((ITEMS.topic, p) for p in range(PARTITIONS)),
                *([(PLAIN.topic, None)] if batch_id == 0 else []),
            ], f"batch {batch_id}"
            if batch_id == 0:  # created empty, from the sample; the small table not yet
                assert 0 < planner.sample_records <= 120 + 4
                assert wh.live_rows(ITEMS) == 0 and wh.shards(ITEMS) == PARTITIONS
                assert wh.shards(PLAIN) == 1 and wh.live_rows(PLAIN) == 0
            results = _run_all(tasks_settings, batch_id, by_topic, slices)
            if crash and batch_id == 0:  # the driver dies before its commit, then starts again
                for sink in task_sinks:
                    sink.close()
                task_sinks = open_sinks(tasks_settings)
                assert sum(sink.recover(reg) for sink in task_sinks for reg in regs) > 0
                planner = Planner(task_sinks, 200, 200, lambda: store)
                assert planner.plan(ranges, by_topic, lambda t: PARTITIONS) == slices
                assert planner.sample_records == 0, "the tables exist: no sample, their layout kept"
                results = _run_all(tasks_settings, batch_id, by_topic, slices)
            commit_slices(task_sinks, regs, results, APP, batch_id)
            assert outcome_of(batch_id, results).dead == []
            assert _state(tasks_settings, regs) == _state(driver_settings, regs), f"after batch {batch_id}"
        assert planner.sample_records <= 120 + 4, "one sample, of the first batch only"
        assert not crash or planner.sample_records == 0
        for reg in regs:  # the sample chose the layout the whole batch did
            paths = zip(
                WarehouseSink.locations(tasks_settings.state_dir, reg).values(),
                WarehouseSink.locations(driver_settings.state_dir, reg).values(),
                strict=True,
            )
            for mine, oracle in paths:
                assert layout_of(DeltaTable(str(mine))) == layout_of(DeltaTable(str(oracle)))
        assert layout_of(DeltaTable(str(wh.paths(ITEMS)[0]))).shards == PARTITIONS
    finally:
        driver.close(close_sinks=True, timeout=None)
        for s in task_sinks:
            s.close()
        store.close()


def _run_all(
    settings: Settings, batch_id: int, tables: dict[str, TableReg], slices: list[Slice]
) -> list[SliceResult]:
    """Each slice in a task process of its own, at the same time."""
    with workers(__name__).Pool(len(slices)) as pool:
        return [r for rs in pool.map(_run, [(settings, batch_id, tables, sl) for sl in slices]) for r in rs]


def _sampled(keys: list[int]) -> list[int]:
    """The indexes of the records :func:`sample_ranges` picks of a batch of ``keys`` (records in
    that order, each in its key's partition as the reader places them)."""
    parts = partition_array([b'{"id":%d}' % k for k in keys], PARTITIONS)  # the key as the reader writes it
    by_part: dict[int, list[int]] = {}
    for i, p in enumerate(parts.tolist()):
        by_part.setdefault(p, []).append(i)
    ranges = [(p, 0, len(ix)) for p, ix in sorted(by_part.items())]
    return [by_part[p][i] for p, start, end in sample_ranges(ranges) for i in range(start, end)]


def _layouts(keys: list[int], row_bytes: list[float], options: WarehouseOptions) -> tuple[Layout, Layout]:
    """The layout :meth:`Layout.choose` picks from a batch of ``keys`` and from its sample."""
    reg = table("t")
    picked = _sampled(keys)
    whole = Layout.choose(reg, options, lambda: keys, lambda: sum(row_bytes) / len(row_bytes))
    sampled = Layout.choose(
        reg,
        options,
        lambda: [keys[i] for i in picked],
        lambda: sum(row_bytes[i] for i in picked) / len(picked),
        sampled=len(picked) / len(keys),
    )
    return whole, sampled


def test_a_sample_of_the_first_batch_chooses_the_layout_the_whole_batch_does() -> None:
    """Batches of 50,000 records, the sample of :data:`spark_jobs.tasks.SAMPLE_RECORDS`: serial
    inserts, snowflake ids, updates at random over a table 4 and 40 times the batch (keys repeating),
    the newest keys updated again and again, and wide rows of varying size: the same layout from the
    sample as from every record (the range width from the rows' mean size, near no boundary)."""
    # the two largest ranges; one within its share whole, a larger one in 4 runs, from its start to
    # (about) its end
    assert sample_ranges([(0, 0, 10), (1, 5, 1005), (2, 0, 3)], 100) == [
        (0, 0, 10),
        *((1, start, start + 12) for start in (5, 334, 663, 992)),
    ]
    rng = np.random.default_rng(7)
    n = 50_000
    options = WarehouseOptions(shards=PARTITIONS)
    cases = {
        "serial inserts": list(range(1_000_000, 1_000_000 + n)),
        "snowflake ids": ((1 << 41) + rng.integers(0, 1 << 40, n)).tolist(),
        "updates over 4x": rng.integers(0, 4 * n, n).tolist(),
        "updates over 40x": rng.integers(0, 40 * n, n).tolist(),
        "hot keys": rng.integers(0, n // 50, n).tolist(),
    }
    modes = {}
    for name, keys in cases.items():
        whole, sampled = _layouts(keys, [100.0] * n, options)
        assert sampled == whole, name
        modes[name] = whole.mode
    assert modes == {
        "serial inserts": "range",
        "snowflake ids": "hash",
        "updates over 4x": "range",
        "updates over 40x": "range",
        "hot keys": "range",
    }
    wide = rng.uniform(2_000, 4_000, n).tolist()  # 3 kB: 2,048-key buckets of 8 MiB
    whole, sampled = _layouts(cases["serial inserts"], wide, options)
    assert sampled == whole and whole.size < options.range_width, whole
