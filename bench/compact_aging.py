"""What the incremental compaction of the history's closed rows costs as their partition ages (issue 32).

``python -m bench compact_aging [--quick]`` (writes ``docs/benchmarks/compact_aging.md``), or
``python -m bench.compact_aging [--batches N]`` (printed only).

A ``pgbench_accounts``-like table (``aid`` integer key, ``bid``, ``abalance`` integers, ``filler``
character(84); :data:`ROWS` rows, one bucket) takes :data:`BATCHES` batches of random-key updates
through :class:`sinks.warehouse.WarehouseSink` (its own compaction off): each batch appends one file
of closed rows (``is_current = false``) to the history, of the size a batch writes (:data:`UPDATES`
updates: about 20 to 200 KB). After each batch the partition is compacted as the maintenance thread
does, with :class:`~sinks.warehouse.WarehouseOptions`' defaults (``target_file_size``,
``compact_min_files``, ``compact_budget_s``), by two rules on the same batches:

* ``product``: :func:`sinks.warehouse.compact.step` (listing included), the code under test;
* ``whole``: the rule before size tiering (commit 19eb9a1): once the partition holds
  ``compact_min_files`` files smaller than half ``target_file_size``, delta-rs' ``optimize.compact``
  on the partition with ``target_size = target_file_size``, which takes every file under the target,
  the partition's merged file too.

Per window of :data:`WINDOW` steps: the seconds of a step (mean and max), the bytes the compactions
removed from the table (read from the Delta log: the files a step's commits removed, whatever rule
made them), the largest of one step, and the partition's files at the window's end. The bytes do not
depend on the machine's load; the seconds do (the machine is shared).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from bench._common import loadavg, say
from cdc.registry import TableReg
from sinks.warehouse import WarehouseOptions, WarehouseSink, compact
from sinks.warehouse.layout import IS_CURRENT
from tests.sinks.feed import Feed, table

COLUMNS = (("aid", "integer"), ("bid", "integer"), ("abalance", "integer"), ("filler", "character(84)"))
ROWS = 20_000
BATCHES = 500
QUICK_BATCHES = 60
WINDOW = 50
#: the updates of a batch: its closed-rows file is about 43 bytes a row
UPDATES = (500, 4_500)
CLOSED = {"_cdc_bucket": "0", IS_CURRENT: "false"}

#: one step of a rule on the history at a path, with the sink's table opener
Rule = Callable[[Path, WarehouseSink, WarehouseOptions], None]


def _product(path: Path, sink: WarehouseSink, opts: WarehouseOptions) -> None:
    compact.step(
        [path],
        sink.handles.get,
        target_size=opts.target_file_size,
        budget_s=opts.compact_budget_s,
        min_files=opts.compact_min_files,
        where=compact.append_only,
    )


def _whole(path: Path, sink: WarehouseSink, opts: WarehouseOptions) -> None:
    target = opts.target_file_size or 100 << 20
    handle = sink.handles.get(path)
    assert handle is not None
    files = _closed(handle)
    small = pc.sum(pc.less(files.column("size_bytes"), target // 2)).as_py() or 0
    if small >= opts.compact_min_files:
        handle.optimize.compact(
            partition_filters=[(k, "=", v) for k, v in CLOSED.items()], target_size=target
        )


RULES: dict[str, Rule] = {"product": _product, "whole": _whole}


def _closed(handle: DeltaTable) -> pa.Table:
    files = pa.table(handle.get_add_actions(flatten=True))
    return files.filter(pc.equal(files.column(f"partition.{IS_CURRENT}"), False))


@dataclass
class Step:
    seconds: float
    removed_bytes: int
    removed_files: int
    files: int  # the partition's files after the step


@dataclass
class Run:
    rule: str
    steps: list[Step] = field(default_factory=list)
    appended: list[int] = field(default_factory=list)  # each batch's closed-rows bytes


def run_rule(rule: str, batches: int, seed: int = 7) -> Run:
    """``batches`` batches through a fresh sink, each followed by one step of ``rule``."""
    work = Path(tempfile.mkdtemp(prefix="cdc-compact-aging-"))
    out = Run(rule)
    try:
        reg = table("accounts", columns=COLUMNS, key=("aid",))
        opts = WarehouseOptions(buckets=1, compact_budget_s=0, maintain_every=0)
        sink = WarehouseSink(work, opts)
        feed = Feed(reg, "columns")
        lsn = _load(sink, reg, feed)
        path = sink.paths(reg)[1]
        rng = random.Random(seed)
        defaults = WarehouseOptions()
        for b in range(1, batches + 1):
            recs = []
            for _ in range(rng.randint(*UPDATES)):
                lsn += 1
                row = {
                    "aid": rng.randrange(ROWS),
                    "bid": 1,
                    "abalance": rng.randint(-5000, 5000),
                    "filler": " " * 84,
                }
                recs.append(feed.change("u", row, lsn))
            sink.apply(feed.batch(recs), b, "bench")
            before = _sizes(sink, path)
            out.appended.append(_newest(before))
            t0 = time.perf_counter()
            RULES[rule](path, sink, defaults)
            seconds = time.perf_counter() - t0
            after = _sizes(sink, path)
            gone = set(before) - set(after)
            out.steps.append(Step(seconds, sum(before[p] for p in gone), len(gone), len(after)))
            if b % WINDOW == 0:
                say(f"{rule}: batch {b}, {len(after)} files, load {loadavg()}")
        sink.close()
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _load(sink: WarehouseSink, reg: TableReg, feed: Feed) -> int:
    lsn = 1_000
    recs = []
    for i in range(ROWS):
        lsn += 1
        recs.append(feed.change("r", {"aid": i, "bid": 1, "abalance": 0, "filler": " " * 84}, lsn))
    sink.apply(feed.batch(recs), 0, "bench")
    return lsn


def _sizes(sink: WarehouseSink, path: Path) -> dict[str, int]:
    """The closed partition's files (path: bytes), in the log's order (newest first)."""
    handle = sink.handles.get(path)
    assert handle is not None
    files = _closed(handle)
    return dict(zip(files.column("path").to_pylist(), files.column("size_bytes").to_pylist(), strict=True))


def _newest(sizes: dict[str, int]) -> int:
    return next(iter(sizes.values()))


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def report(runs: list[Run]) -> str:
    """The Markdown table of ``runs`` (one per rule, same batches), windows of :data:`WINDOW` steps."""
    appended = runs[0].appended
    lines = [
        f"{len(appended)} batches; closed-rows files of {min(appended) / 1e3:.0f}-{max(appended) / 1e3:.0f} KB "
        f"(median {statistics.median(appended) / 1e3:.0f} KB), {_mb(sum(appended))} MB appended in all.",
        "",
        "| rule | steps | step ms, mean | step ms, max | MB rewritten | largest step, MB | files removed | files at the end |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        for lo in range(0, len(run.steps), WINDOW):
            window = run.steps[lo : lo + WINDOW]
            ms = [s.seconds * 1000 for s in window]
            lines.append(
                f"| {run.rule} | {lo + 1}-{lo + len(window)} | {statistics.mean(ms):.0f} | {max(ms):.0f} "
                f"| {_mb(sum(s.removed_bytes for s in window))} | {_mb(max(s.removed_bytes for s in window))} "
                f"| {sum(s.removed_files for s in window)} | {window[-1].files} |"
            )
    lines += [
        "",
        "| rule | MB rewritten in all | rewritten / appended | step ms, mean of all |",
        "| --- | ---: | ---: | ---: |",
    ]
    for run in runs:
        rewritten = sum(s.removed_bytes for s in run.steps)
        mean_ms = statistics.mean(s.seconds * 1000 for s in run.steps)
        lines.append(f"| {run.rule} | {_mb(rewritten)} | {rewritten / sum(appended):.1f} | {mean_ms:.0f} |")
    return "\n".join(lines) + "\n"


def measure(batches: int) -> str:
    say(f"load average before: {loadavg()}")
    runs = [run_rule(rule, batches) for rule in RULES]
    body = report(runs)
    say(body)
    return body + f"\nLoad average after: {loadavg()}.\n"


def run(quick: bool) -> str:
    """``python -m bench compact_aging``: the section of ``docs/benchmarks/compact_aging.md``."""
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    batches = QUICK_BATCHES if quick else BATCHES
    opts = WarehouseOptions()
    head = (
        "# Incremental compaction as a partition ages\n\n"
        f"Measured on {started} by `python -m bench compact_aging`: one partition of closed history "
        "rows, one file appended per batch (real rows, written by the sink), then one compaction step; "
        f"defaults `target_file_size` {opts.target_file_size}, `compact_min_files` {opts.compact_min_files}, "
        f"`compact_budget_s` {opts.compact_budget_s}. `whole`: the rule before size tiering; `product`: "
        "`compact.step` of this commit. See `bench/compact_aging.py`.\n\n"
    )
    return head + measure(batches)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.compact_aging", description=__doc__)
    p.add_argument("--batches", type=int, default=BATCHES)
    args = p.parse_args()
    measure(args.batches)


if __name__ == "__main__":
    main()
