"""Freshness with the apply's tasks on a Spark standalone cluster (issue 19): ``bench/freshness.py``'s
measurement (:func:`bench.freshness.run_on_cluster`), its section in ``docs/benchmarks/freshness.md``.
``$BENCH_FRESHNESS_WORKERS``: the cluster's one-core workers (default 2)."""

from __future__ import annotations

from bench.freshness import run_on_cluster

SECTION_OF = "freshness"  # its section goes in docs/benchmarks/freshness.md (bench/__main__.py)


def run(quick: bool) -> str:
    return run_on_cluster(quick)
