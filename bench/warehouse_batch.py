"""What one micro-batch costs the warehouse sink, in CPU, on a ``pgbench_accounts``-like table
(issue 32: "a batch of a few hundred changes to one table should cost tens of milliseconds").

``python -m bench.warehouse_batch [--rounds 5]`` (printed only)

A table of ``pgbench_accounts``' columns (``aid`` integer key, ``bid``, ``abalance`` integers,
``filler`` character(84)) is loaded through :class:`sinks.warehouse.WarehouseSink` (one batch of
inserts), then takes batches of random-key updates; the CPU (``time.process_time``: every thread of
the process, delta-rs' and pyarrow's included) of the last 10 of 15 batches, per batch, median over
the rounds. Shapes: a shard of the sustained bench's accounts (50,000 rows, 500 updates a batch) and
its tellers (20 rows, 800 updates of hot keys). Then the Parquet write alone of such a shard's
50,000 rows with pyarrow's defaults and with :data:`sinks.warehouse.files.PARQUET_OPTIONS`, CPU
median of 9: what the data files' encoding costs.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bench._common import loadavg
from sinks.warehouse import WarehouseOptions, WarehouseSink
from sinks.warehouse.files import PARQUET_OPTIONS
from tests.sinks.feed import Feed, table

COLUMNS = (("aid", "integer"), ("bid", "integer"), ("abalance", "integer"), ("filler", "character(84)"))
SHAPES = ((50_000, 500), (20, 800))


def batch_cpu(rows: int, per: int, seed: int) -> float:
    """CPU seconds per batch of ``per`` random updates to a table of ``rows`` (mean of 10 batches)."""
    work = Path(tempfile.mkdtemp(prefix="cdc-wh-batch-"))
    try:
        reg = table("accounts", columns=COLUMNS, key=("aid",))
        sink = WarehouseSink(work, WarehouseOptions())
        feed = Feed(reg, "columns")
        lsn = 1_000

        def row(i: int, bal: int) -> dict[str, object]:
            return {"aid": i, "bid": 1, "abalance": bal, "filler": " " * 84}

        recs = []
        for i in range(1, rows + 1):
            lsn += 1
            recs.append(feed.change("r", row(i, 0), lsn))
        sink.apply(feed.batch(recs), 0, "bench")
        rng = random.Random(seed)
        cpu = 0.0
        for b in range(1, 16):
            recs = []
            for _ in range(per):
                lsn += 1
                recs.append(feed.change("u", row(rng.randint(1, rows), rng.randint(-5000, 5000)), lsn))
            batch = feed.batch(recs)
            t0 = time.process_time()
            sink.apply(batch, b, "bench")
            if b > 5:
                cpu += time.process_time() - t0
        sink.close()
        return cpu / 10
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_cpu(options: dict[str, object], rounds: int = 9) -> tuple[float, int]:
    """The Parquet write of a 50,000-row accounts shard with ``options``: median CPU s, bytes."""
    n = 50_000
    rows = pa.table(
        {
            "_cdc_key": pa.array([json.dumps({"aid": i}) for i in range(n)]),
            "_cdc_commit_lsn": pa.array(np.arange(n) * 1000 + 123_456_789, pa.int64()),
            "_cdc_seq": pa.array(np.zeros(n, dtype=np.int64)),
            "_cdc_op": pa.array(["u"] * n),
            "aid": pa.array(np.arange(n, dtype=np.int32)),
            "bid": pa.array(np.ones(n, dtype=np.int32)),
            "abalance": pa.array(np.random.default_rng(1).integers(-5000, 5000, n).astype(np.int32)),
            "filler": pa.array([" " * 84] * n),
        }
    )
    path = Path(tempfile.mkdtemp(prefix="cdc-pq-")) / "x.parquet"
    try:
        cpu = []
        for _ in range(rounds):
            t0 = time.process_time()
            pq.write_table(rows, path, **options)  # type: ignore[arg-type]
            cpu.append(time.process_time() - t0)
        return statistics.median(cpu), path.stat().st_size
    finally:
        shutil.rmtree(path.parent, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.warehouse_batch", description=__doc__)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"load average before: {loadavg()}", flush=True)
    print(
        "| table rows | updates a batch | CPU per batch (median) | each round |\n| ---: | ---: | ---: | --- |"
    )
    for rows, per in SHAPES:
        got = [batch_cpu(rows, per, seed) for seed in range(args.rounds)]
        each = ", ".join(f"{g * 1000:.0f}" for g in got)
        print(f"| {rows:,} | {per:,} | {statistics.median(got) * 1000:.0f} ms | {each} |", flush=True)
    for name, options in (
        ("pyarrow's defaults, snappy", {"compression": "snappy"}),
        ("PARQUET_OPTIONS", PARQUET_OPTIONS),
    ):
        cpu, size = write_cpu(options)
        print(
            f"Parquet write of 50,000 rows, {name}: {cpu * 1000:.1f} ms CPU, {size / 1e6:.2f} MB", flush=True
        )
    print(f"load average after: {loadavg()}", flush=True)


if __name__ == "__main__":
    main()
