"""Write amplification of the warehouse: bytes written per changed row as a table grows.

``python -m bench write_amp [--quick]``

One table (``chaos_accounts``' columns: bigint key, so the ``auto`` clustering picks the range layout,
width 65,536) is grown through :class:`sinks.warehouse.WarehouseSink` by inserts of new keys (not
measured), and at each size (100k, 500k, 1M, 2M, 5M rows; ``--quick``: 5k, 20k) micro-batches of changes
are applied to a copy of it and measured, for two key patterns:

* ``random``: updates spread over the whole key space;
* ``recent``: updates to the newest 1 % of the keys;

each with 10 % inserts of new keys at the end, written as files (the warehouse's only write method
since issue 33; the committed figures before it also measured delta-rs' MERGE). Each size is measured with the batch a caught-up apply takes (:data:`BATCH`
changes) and with :data:`BEHIND` times as many, what a lagging apply takes with a cap that high
(``cdc apply --max-records-per-batch-behind``, whose default is twice the bound; ``docs/apply.md``).
The same table also with the hash layout (16 buckets).

Figures per batch (all from the tables' Delta logs, so they do not depend on the machine's load):
**bytes written per changed row** (the sizes of the ``add`` actions of the batch's commits -- current,
history, tombstones -- over the changed rows), the files removed (rewritten) by the batch, and the
live size (the active files of the current and history tables).
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import loadavg, say
from bench.warehouse_loop import COLUMNS
from cdc.registry import TableReg
from sinks.warehouse import WarehouseOptions, WarehouseSink
from tests.sinks.feed import Feed, table

SIZES = (100_000, 500_000, 1_000_000, 2_000_000, 5_000_000)
QUICK_SIZES = (5_000, 20_000)
#: the changes of a caught-up micro-batch, and how many times more a batch takes when behind
BATCH = 5_000
BEHIND = 8
REPEAT = 2  # measured batches of each kind per point (the median is reported)
GROW_CHUNK = 200_000
INSERTS = 0.10
RECENT = 0.01


@dataclass
class LogCost:
    """What a range of Delta versions of one table wrote: bytes and files added, files removed."""

    added_bytes: int = 0
    added_files: int = 0
    removed_files: int = 0


def log_cost(path: Path, after_version: int) -> LogCost:
    """The add/remove actions of the commits of ``path`` after ``after_version``, from its JSON log."""
    cost = LogCost()
    for f in sorted((path / "_delta_log").glob("*.json")):
        if int(f.stem) <= after_version:
            continue
        for line in f.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                cost.added_bytes += int(action["add"]["size"])
                cost.added_files += 1
            elif "remove" in action:
                cost.removed_files += 1
    return cost


def last_version(path: Path) -> int:
    return max((int(f.stem) for f in (path / "_delta_log").glob("*.json")), default=-1)


def live_bytes(path: Path) -> int:
    """The sizes of the active files of a Delta table (its live data)."""
    from deltalake import DeltaTable

    adds = DeltaTable(str(path)).get_add_actions(flatten=True)
    return int(sum(int(s) for s in adds.column("size_bytes").to_pylist()))


class Workload:
    """One table's changes: keys 1..n live, new keys at the end; rows of ~100 B."""

    def __init__(self, reg: TableReg, seed: int) -> None:
        self.feed = Feed(reg, "columns")
        self.rng = random.Random(seed)
        self.n = 0
        self.lsn = 1_000

    def _row(self, i: int) -> dict[str, Any]:
        return {
            "id": i,
            "name": f"account {i} {self.lsn}",
            "balance": str(i % 1000),
            "ratio": i * 0.5,
            "born": None,
            "updated_at": "2026-11-23 10:00:00.123456+00",
        }

    def inserts(self, count: int) -> list[Any]:
        recs = []
        for _ in range(count):
            self.lsn += 1
            self.n += 1
            recs.append(self.feed.change("c", self._row(self.n), self.lsn))
        return recs

    def changes(self, count: int, pattern: str) -> list[Any]:
        """``count`` changes: updates of live keys drawn at random (``random``: from every key,
        ``recent``: from the newest 1 %; a key drawn twice is updated twice), then :data:`INSERTS` of
        them new keys."""
        new = int(count * INSERTS)
        lo = 1 if pattern == "random" else max(1, self.n - int(self.n * RECENT))
        keys = [self.rng.randint(lo, self.n) for _ in range(count - new)]
        recs = []
        for k in keys:
            self.lsn += 1
            recs.append(self.feed.change("u", self._row(k), self.lsn))
        return recs + self.inserts(new)


class Runner:
    """A sink on ``work`` applying batches to one table, ids counting up; maintenance off (it is
    called explicitly, so no periodic compaction lands inside a measured batch)."""

    def __init__(self, work: Path, config: tuple[str, str, int], reg: TableReg) -> None:
        _write, clustering, width = config
        opts = WarehouseOptions(clustering=clustering, range_width=width, maintain_every=0, vacuum_every=0)
        self.sink = WarehouseSink(work, opts)
        self.reg = reg
        self.batch_id = 0

    def apply(self, recs: list[Any], feed: Feed) -> dict[str, float]:
        paths = self.sink.paths(self.reg)
        before = [last_version(p) if p.exists() else -1 for p in paths]
        t0 = time.process_time()
        self.sink.apply(feed.batch(recs), self.batch_id, "bench")
        cpu = time.process_time() - t0
        self.batch_id += 1
        costs = [log_cost(p, v) for p, v in zip(paths, before, strict=True)]
        return {
            "bytes": sum(c.added_bytes for c in costs),
            "removed": sum(c.removed_files for c in costs),
            "removed_current": costs[0].removed_files,
            "cpu": cpu,
        }

    def tidy(self) -> None:
        """Compact (as ``maintain`` does every 100 batches) and delete every unreferenced file."""
        self.sink.maintain(self.reg, vacuum_retention_hours=0)

    def live(self) -> tuple[int, int]:
        """(live bytes of current + history, active files of current)."""
        from deltalake import DeltaTable

        cur, hist, _ = self.sink.paths(self.reg)
        return live_bytes(cur) + live_bytes(hist), len(DeltaTable(str(cur)).file_uris())


def _chunks(total: int, size: int) -> Iterator[int]:
    while total > 0:
        yield min(total, size)
        total -= size


def measure_point(
    base: Path, config: tuple[str, str, int], reg: TableReg, wl: Workload, size: int, quick: bool
) -> list[dict]:
    """For each pattern and batch size: a copy of the grown table at ``base``, batches applied to it."""
    rows = []
    batch = 500 if quick else BATCH
    for pattern in ("random", "recent"):
        for per in (batch, batch * BEHIND):
            work = base.parent / f"{base.name}-m"
            shutil.copytree(base, work)
            run = Runner(work, config, reg)
            run.batch_id = 10_000
            saved = (wl.n, wl.lsn, wl.rng.getstate())
            got = []
            for _ in range(REPEAT):
                recs = wl.changes(per, pattern)
                got.append(run.apply(recs, wl.feed) | {"changed": len(recs)})
            live, files = run.live()
            wl.n, wl.lsn = saved[0], saved[1]
            wl.rng.setstate(saved[2])
            shutil.rmtree(work)
            row = {
                "write": config[0],
                "layout": config[1] if config[1] == "hash" else f"range {config[2]:,}",
                "size": size,
                "pattern": pattern,
                "batch": per,
                "bytes_per_row": statistics.median(g["bytes"] / g["changed"] for g in got),
                "mb_per_batch": statistics.median(g["bytes"] for g in got) / 1e6,
                "removed": statistics.median(g["removed"] for g in got),
                "removed_current": statistics.median(g["removed_current"] for g in got),
                "cpu_per_krow": statistics.median(g["cpu"] / g["changed"] * 1000 for g in got),
                "live_mb": live / 1e6,
                "cur_files": files,
            }
            say(
                f"{config[0]:5s} {config[1]:5s} {size:>9,d} {pattern:6s} batch {per:>6,d}: {row['bytes_per_row']:>9,.0f} B/changed row, "
                f"{row['mb_per_batch']:7.1f} MB/batch, {row['removed']:4.0f} files rewritten "
                f"({row['removed_current']:.0f} of the current table's {files}), live {row['live_mb']:.0f} MB, "
                f"{row['cpu_per_krow']:.2f} CPU s/1k rows"
            )
            rows.append(row)
    return rows


def run_config(config: tuple[str, str, int], sizes: tuple[int, ...], quick: bool, tmp: Path) -> list[dict]:
    reg = table("chaos_accounts", columns=COLUMNS)
    base = tmp / f"grow-{config[0]}-{config[1]}"
    wl = Workload(reg, seed=11)
    grow = Runner(base, config, reg)
    rows: list[dict] = []
    for size in sizes:
        for n in _chunks(size - wl.n, GROW_CHUNK):
            grow.apply(wl.inserts(n), wl.feed)
        grow.tidy()
        rows.extend(measure_point(base, config, reg, wl, size, quick))
    return rows


def report(rows: list[dict]) -> str:
    out = [
        "# Write amplification of the warehouse\n",
        "Bytes written per changed row (the `add` actions of a batch's commits to the current, history and "
        "tombstone tables, over its changes: 90 % updates, 10 % inserts), files rewritten per batch and the "
        "live size, as one table grows (`python -m bench write_amp`; the range layout is what `auto` picks for this "
        "bigint key, hash is 16 buckets; "
        f"median of {REPEAT} batches per cell). `batch` {BATCH:,}: what a caught-up apply takes; "
        f"{BATCH * BEHIND:,}: a batch of a lagging apply with a cap of {BEHIND}x the bound (the default cap is 2x). "
        "Bytes do not depend on the machine's load; the CPU column does (shared machine, load "
        f"{loadavg()} at the end). What the figures mean, and what would bound them: `docs/warehouse.md`, "
        "Write amplification.\n",
        "| write | layout | rows | keys | batch | B / changed row | MB / batch | files rewritten (current) "
        "| current files | live MB | CPU s / 1k rows |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['write']} | {r['layout']} | {r['size']:,} | {r['pattern']} | {r['batch']:,} | {r['bytes_per_row']:,.0f} "
            f"| {r['mb_per_batch']:.1f} | {r['removed']:.0f} ({r['removed_current']:.0f}) | {r['cur_files']} "
            f"| {r['live_mb']:.0f} | {r['cpu_per_krow']:.2f} |"
        )
    return "\n".join(out) + "\n"


def run(quick: bool) -> str:
    sizes = QUICK_SIZES if quick else SIZES
    tmp = Path(tempfile.mkdtemp(prefix="cdc-wamp-"))
    rows: list[dict] = []
    try:
        width = 1_024 if quick else 65_536  # quick: several buckets even in a small table
        for write, clustering in (("files", "range"), ("files", "hash")):
            rows.extend(run_config((write, clustering, width), sizes, quick, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(rows)
    print(text, flush=True)
    return text
