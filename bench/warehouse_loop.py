"""The warehouse sink alone in a loop, with the soak's workload: what one micro-batch costs in memory
and time as the tables grow (``docs/benchmarks/soak.md``).

``python -m bench.warehouse_loop [--batches 400] [--per-batch 2000] [--live-cap 0] [--form columns]``

Each batch is what the soak's apply job hands the sink every second for ``chaos_accounts`` (bigint
key, range layout): ``per-batch`` changes, 30 % inserts of new keys, 60 % updates and 10 % deletes of
random live keys (``--live-cap N``: inserts turn into updates once N keys are live, so the current
table stops growing while the history still does). Default options (``maintain_every`` 100). Every
``--every`` batches it prints RSS, the pyarrow pool's bytes, tracemalloc's Python bytes (with
``--tracemalloc``), the seconds of the batch, the rows and active files of the tables and how many
history rows the batch's lookups read (:data:`sinks.warehouse.delta.ROWS_READ`); and, since the
previous line, the mean milliseconds of the sink's maintenance after a batch (compaction within its
budget, the disk bound's reclaim: ``maint_ms``) and, of the current table, the removed files delta-rs
still lists (its tombstones, kept ``deletedFileRetentionDuration``: ``tombs``). A table that ages
under a steady load should show ``maint_ms`` flat.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable

from cdc.registry import TableReg
from sinks.warehouse import WarehouseOptions, WarehouseSink
from sinks.warehouse import delta as D
from tests.sinks.feed import Feed, table

COLUMNS = (
    ("id", "bigint"),
    ("name", "text"),
    ("balance", "numeric(30,6)"),
    ("ratio", "double precision"),
    ("born", "date"),
    ("updated_at", "timestamp with time zone"),
)
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 1e6


def peak_mb() -> float:
    """The process's peak RSS since :func:`reset_peak` (VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class _TimedSink(WarehouseSink):
    """The sink, with the seconds its maintenance after each batch took, summed."""

    maintain_s = 0.0

    def _maintain_after(self, reg: TableReg, batch_id: int) -> None:
        t0 = time.monotonic()
        try:
            super()._maintain_after(reg, batch_id)
        finally:
            self.maintain_s += time.monotonic() - t0


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.warehouse_loop", description=__doc__)
    p.add_argument("--batches", type=int, default=400)
    p.add_argument("--per-batch", type=int, default=2000)
    p.add_argument("--live-cap", type=int, default=0, help="live keys at most (0: no cap)")
    p.add_argument("--form", choices=("columns", "events"), default="columns")
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--maintain-every", type=int, default=100)
    p.add_argument("--dir", default="", help="state directory (default: a temporary one, removed)")
    args = p.parse_args()
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="cdc-wh-loop-"))
    reg = table("chaos_accounts", columns=COLUMNS)
    sink = _TimedSink(work, WarehouseOptions(maintain_every=args.maintain_every))
    since = 0
    feed = Feed(reg, args.form)
    rng = random.Random(7)
    live: list[int] = []
    next_id = 1
    lsn = 1_000
    if args.tracemalloc:
        tracemalloc.start()
    print(
        "batch   rss_mb  peak_mb  arrow_mb  py_mb   secs  cur_rows  cur_files  hist_rows  hist_files  "
        "hist_read  cur_read  maint_ms  tombs",
        flush=True,
    )
    started = time.monotonic()
    peak = 0.0
    try:
        for batch_id in range(args.batches):
            recs = []
            for _ in range(args.per_batch):
                lsn += 1
                r = rng.random()
                capped = args.live_cap and len(live) >= args.live_cap
                if len(live) < 100 or (r < 0.3 and not capped):
                    i = next_id
                    next_id += 1
                    live.append(i)
                    op = "c"
                elif r < 0.9 or (r < 0.3 and capped):
                    i = live[rng.randrange(len(live))]
                    op = "u"
                else:
                    i = live.pop(rng.randrange(len(live)))
                    recs.extend(feed.delete({"id": i}, lsn))
                    continue
                row = {
                    "id": i,
                    "name": f"account {i} {lsn}",
                    "balance": str(i % 1000),
                    "ratio": i * 0.5,
                    "born": None,
                    "updated_at": "2026-11-23 10:00:00.123456+00",
                }
                recs.append(feed.change(op, row, lsn))
            batch = feed.batch(recs)
            D.ROWS_READ.clear()
            reset_peak()
            t0 = time.monotonic()
            sink.apply(batch, batch_id, "loop")
            secs = time.monotonic() - t0
            peak = max(peak, peak_mb())  # the highest of the batches since the last line
            since += 1
            del batch, recs
            gc.collect()
            if batch_id % args.every == 0 or batch_id == args.batches - 1:
                cur_path, hist_path, _ = sink.paths(reg)
                cur, hist = DeltaTable(str(cur_path)), DeltaTable(str(hist_path))
                cur_rows = sum(a["num_records"] for a in _adds(cur))
                hist_rows = sum(a["num_records"] for a in _adds(hist))
                py = tracemalloc.get_traced_memory()[0] / 1e6 if args.tracemalloc else float("nan")
                tombs = len(cur.vacuum(retention_hours=0, dry_run=True, enforce_retention_duration=False))
                print(
                    f"{batch_id:5d} {rss_mb():8.0f} {peak:8.0f} {pa.total_allocated_bytes() / 1e6:9.1f} {py:6.1f} "
                    f"{secs:6.2f} {cur_rows:9,d} {len(cur.file_uris()):10d} {hist_rows:10,d} "
                    f"{len(hist.file_uris()):11d} {D.ROWS_READ.get('history', 0):10,d} "
                    f"{D.ROWS_READ.get('current', 0):9,d} {sink.maintain_s / since * 1000:9.0f} {tombs:6d}",
                    flush=True,
                )
                peak, sink.maintain_s, since = 0.0, 0.0, 0
    finally:
        print(f"{time.monotonic() - started:.0f} s", flush=True)
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


def _adds(t: DeltaTable) -> list[dict[str, int]]:
    adds = t.get_add_actions(flatten=True)
    arr = pa.table(adds) if not isinstance(adds, pa.Table) else adds
    return [{"num_records": int(n or 0)} for n in arr.column("num_records").to_pylist()]


if __name__ == "__main__":
    main()
