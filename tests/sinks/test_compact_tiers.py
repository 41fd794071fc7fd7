"""The incremental compaction's size tiers (:mod:`sinks.warehouse.compact`): the replay of
delta-rs's bins agrees with delta-rs, and on a partition appended to batch after batch a
compaction's bytes stay bounded, a finished file is never rewritten, the small files are still
merged level by level, and the rows read are the same."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from sinks.warehouse import compact
from sinks.warehouse.handles import open_table

PART = {"part": "a"}


def _append(path: Path, rng: random.Random, rows: int, first: int) -> None:
    """One file of ``rows`` rows (ids from ``first``, incompressible values) into partition ``a``."""
    ids = list(range(first, first + rows))
    write_deltalake(
        str(path),
        pa.table(
            {
                "id": pa.array(ids, pa.int64()),
                "v": pa.array([rng.getrandbits(62) for _ in ids], pa.int64()),
                "s": pa.array([f"{rng.getrandbits(80):x}" for _ in ids]),
                "part": pa.array(["a"] * rows),
            }
        ),
        mode="append",
        partition_by=["part"],
    )


def _files(path: Path) -> dict[str, int]:
    """The table's files (path: bytes) in the log's order (newest first)."""
    files = pa.table(DeltaTable(str(path)).get_add_actions(flatten=True))
    return dict(zip(files.column("path").to_pylist(), files.column("size_bytes").to_pylist(), strict=True))


def _ids(path: Path) -> list[int]:
    return sorted(DeltaTable(str(path)).to_pyarrow_table(columns=["id"]).column("id").to_pylist())


def test_levels_are_powers_of_the_fanout_under_the_target() -> None:
    assert compact.level(1025, 8192, 8) == 0  # over target / fanout: finished
    assert compact.level(1024, 8192, 8) == 1
    assert compact.level(129, 8192, 8) == 1
    assert compact.level(128, 8192, 8) == 2
    assert compact.level(1, 8192, 8) == 4
    assert compact.level(3, 8192, 8) == 3
    assert compact.level(0, 8192, 8) == 4  # the last bound of at least a byte: never loops forever


def test_a_level_is_merged_alone_and_a_larger_file_left_out() -> None:
    """8 files of level 2 (newest) before a merged file of level 1: one bin of the 8, target their
    bytes; the level-1 file is not in it though it is under ``target_file_size``."""
    sizes = [100] * 8 + [900, 3000]
    due = compact.plan(sizes, 8192, 8)
    assert due == compact.Plan(800, 8, 800, 2)
    assert compact.bins(sizes, due.target) == [list(range(8))]
    assert compact.bins(sizes, 8192) == [list(range(10))]  # the rule before: the merged file too
    assert compact.plan([100] * 7 + [900] * 3, 8192, 8) is None  # no level holds 8


def test_a_level_split_by_larger_files_into_bins_of_one_is_passed_over() -> None:
    """Each small file between two finished ones: delta-rs would merge nothing; the plan goes up a
    level (none here), never asking for a compaction that removes nothing."""
    assert compact.plan([100, 5000] * 8, 8192, 8) is None
    # level 1 is due too: merged alone (its target, 3,200, leaves the finished files out)
    sizes = [100, 5000] * 8 + [300] * 8
    assert compact.plan(sizes, 8192, 8) == compact.Plan(3200, 8, 2400, 1)


def test_a_backlog_is_merged_at_most_the_target_at_a_time() -> None:
    """1,000 files of 5-200 KB in random order (a backlog): the smallest level's whole merge would
    bin every file (all under its bytes) and rewrite about 100 MB in one compaction; the plan asks
    for a smaller ``target_size``, at most ``target_file_size`` bytes rewritten."""
    rng = random.Random(1)
    sizes = [rng.randint(5_000, 200_000) for _ in range(1000)]
    target = 8 << 20
    full = sum(s for s in sizes if compact.level(s, target, 8) >= 3)
    assert sum(sizes[i] for b in compact.bins(sizes, full) for i in b) > 10 * target
    due = compact.plan(sizes, target, 8)
    assert due is not None and due.level == 3 and due.target < full
    assert due.files >= 8 and due.bytes <= target


def test_the_replayed_bins_are_delta_rs_s(tmp_path: Path) -> None:
    """For files of mixed sizes in a partition (a large one between small ones), the files
    delta-rs's ``optimize.compact`` removes for a ``target_size`` are those :func:`compact.bins`
    predicts, for several targets."""
    rng = random.Random(2)
    for t, rows in enumerate(((40, 60, 50, 2000, 30, 45, 70, 2500, 55), (10, 3000, 10, 3000, 10))):
        for target in (3_000, 8_000, 40_000):
            path = tmp_path / f"t{t}-{target}"
            first = 0
            for n in rows:
                _append(path, rng, n, first)
                first += n
            before = _files(path)
            names, sizes = list(before), list(before.values())
            predicted = {names[i] for b in compact.bins(sizes, target) for i in b}
            DeltaTable(str(path)).optimize.compact(partition_filters=[("part", "=", "a")], target_size=target)
            assert set(before) - set(_files(path)) == predicted, (rows, target)
            assert _ids(path) == list(range(first))


def test_an_aging_partition_compacts_in_tiers_with_bounded_bytes(tmp_path: Path) -> None:
    """160 batches append a file each (about 2-5 KB) to one partition, each followed by a step
    (fanout 4, target 256 KiB: levels of 64, 16, 4 KiB): no step rewrites more than the target, a
    finished file (over 64 KiB) is never rewritten, the bytes rewritten in all at most 3 times those
    appended (about one rewrite a level; the rule before rewrote 6.8 times here), the small files are merged (fewer than 4 a level at the
    end) and every row reads back."""
    path = tmp_path / "t"
    rng = random.Random(5)
    target, fanout = 256 << 10, 4
    first, appended, rewritten = 0, 0, 0
    finished: set[str] = set()
    for _ in range(160):
        n = rng.randint(60, 160)
        _append(path, rng, n, first)
        first += n
        before = _files(path)
        appended += next(iter(before.values()))
        done = compact.step([path], open_table, target_size=target, budget_s=60.0, min_files=fanout)
        after = _files(path)
        gone = set(before) - set(after)
        assert done.bytes_removed == sum(before[p] for p in gone)
        assert done.bytes_removed <= target
        assert not gone & finished, "a finished file was rewritten"
        finished |= {p for p, size in after.items() if compact.level(size, target, fanout) == 0}
        rewritten += done.bytes_removed
    assert finished, "the test needs files merged up to finished"
    assert rewritten <= 3 * appended, (rewritten, appended)  # two levels under the finished files
    levels = [compact.level(size, target, fanout) for size in _files(path).values()]
    assert all(levels.count(k) < fanout for k in set(levels) if k > 0), levels
    assert _ids(path) == list(range(first))


def test_a_todo_listed_before_another_writer_s_commit_is_planned_again(tmp_path: Path) -> None:
    """:func:`compact.due` lists a partition; before the step, another writer compacts it whole:
    the step plans the table again and compacts nothing. Listed again, a new append makes it due:
    the step compacts it with the new files."""
    path = tmp_path / "t"
    rng = random.Random(9)
    for i in range(8):
        _append(path, rng, 50, 50 * i)
    todo = compact.due([path], open_table, target_size=8 << 20, min_files=8)
    assert [t.partition for t in todo] == [PART] and todo[0].plan.files == 8
    DeltaTable(str(path)).optimize.compact(target_size=8 << 20)  # another writer
    merged = _files(path)
    done = compact.step([path], open_table, target_size=8 << 20, budget_s=60.0, min_files=8, todo=todo)
    assert done.partitions == 0 and _files(path) == merged
    for i in range(8, 16):
        _append(path, rng, 50, 50 * i)
    todo = compact.due([path], open_table, target_size=8 << 20, min_files=8)
    for i in range(16, 24):  # after the listing: the step plans the table again, with these too
        _append(path, rng, 50, 50 * i)
    replanned = compact.plan(list(_files(path).values()), 8 << 20, 8)
    assert replanned is not None and replanned.files > todo[0].plan.files >= 8
    done = compact.step([path], open_table, target_size=8 << 20, budget_s=60.0, min_files=8, todo=todo)
    assert done.partitions == 1 and done.files_removed == replanned.files
    assert _ids(path) == list(range(50 * 24))
