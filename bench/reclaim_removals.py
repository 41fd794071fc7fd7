"""What reading back a table's recent commits costs each reclaim, with and without the cache (issue 32).

``python -m bench.reclaim_removals [--commits N]`` (printed only).

Every batch's reclaim (:func:`sinks.warehouse.reclaim.reclaim`) reads the removes of the commits of
the last ``vacuum_min_retention_s`` of each table it reclaims (:func:`~sinks.warehouse.reclaim.removals`):
under pgbench about 300 a table, of which one or two are new since the last batch. A table of 16
partitions gets :data:`COMMITS` overwrites (16 adds and 16 removes a commit, as a copy-on-write batch
of random keys makes); then, 15 times, the removes of all its commits are read with the cache
cleared (``cold``: every commit file parsed) and once more with it filled (``cached``: the files
only stated). Medians, in milliseconds; the machine's load changes the seconds, not the ratio much.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from sinks.warehouse import reclaim

COMMITS = 300
ROWS = 16 * 500
ROUNDS = 15


def run(commits: int = COMMITS) -> dict[str, float]:
    """The medians (ms) of reading ``commits`` commits' removes, cold and cached."""
    with tempfile.TemporaryDirectory(prefix="cdc-bench-removals-") as tmp:
        path = Path(tmp) / "t"
        data = pa.table(
            {"k": list(range(ROWS)), "b": [i % 16 for i in range(ROWS)], "pad": ["x" * 50] * ROWS}
        )
        for _ in range(commits):
            write_deltalake(str(path), data, partition_by=["b"], mode="overwrite")
        latest = DeltaTable(str(path)).version()
        cold, cached = [], []
        for _ in range(ROUNDS):
            reclaim._removed_by.cache_clear()
            t0 = time.perf_counter()
            first = reclaim.removals(path, 0.0, None, latest)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            again = reclaim.removals(path, 0.0, None, latest)
            cached.append(time.perf_counter() - t0)
            assert again == first
        return {
            "commits": len(first),
            "removes": sum(len(r.files) for r in first),
            "cold_ms": statistics.median(cold) * 1000,
            "cached_ms": statistics.median(cached) * 1000,
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--commits", type=int, default=COMMITS)
    got = run(ap.parse_args().commits)
    print(
        f"{got['commits']:.0f} commits, {got['removes']:.0f} removes: "
        f"cold {got['cold_ms']:.1f} ms, cached {got['cached_ms']:.1f} ms (medians of {ROUNDS})"
    )


if __name__ == "__main__":
    main()
