"""A lagging apply catching up, with the fixed batch bound and with the adaptive one: the bytes the
warehouse writes for the same backlog.

``python -m bench write_amp_catchup [--quick]`` (a section of ``docs/benchmarks/write_amp.md``)

A table of :data:`ROWS` rows (as in :mod:`bench.write_amp`: range layout, file writes) is behind by
:data:`BACKLOG_BATCHES` batches' worth of changes (random or recent keys). The same changes are applied
to copies of the table in micro-batches sized as the ``cdclog`` source sizes them
(:func:`spark_jobs.source.batch_budget`): the fixed bound (``--max-records-per-batch-behind 0``), the
default cap (twice the bound) and a cap of 8 times the bound. Bytes from the Delta logs, so
load-independent.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench._common import loadavg, say
from bench.warehouse_loop import COLUMNS
from bench.write_amp import GROW_CHUNK, Runner, Workload, _chunks
from spark_jobs.source import batch_budget
from tests.sinks.feed import table

SECTION_OF = "write_amp"
ROWS = 500_000
BASE = 5_000
BACKLOG_BATCHES = 16
CAPS = (("fixed bound", 0), ("cap 2x (the default ratio)", 2), ("cap 8x", 8))


def catch_up(
    base: Path, config: tuple[str, str, int], recs: list[Any], wl: Workload, bound: int, cap: int
) -> dict:
    """``recs`` applied to a copy of the table at ``base`` in batches of :func:`batch_budget`."""
    work = base.parent / f"{base.name}-c"
    shutil.copytree(base, work)
    run = Runner(work, config, wl.feed.reg)
    run.batch_id = 10_000
    total = batches = 0
    sizes = []
    at = 0
    while at < len(recs):
        take = min(batch_budget(len(recs) - at, bound, cap), len(recs) - at)
        total += int(run.apply(recs[at : at + take], wl.feed)["bytes"])
        sizes.append(take)
        at += take
        batches += 1
    shutil.rmtree(work)
    return {"batches": batches, "mb": total / 1e6, "per_row": total / len(recs), "sizes": sizes}


def run(quick: bool) -> str:
    rows, bound = (20_000, 500) if quick else (ROWS, BASE)
    width = 1_024 if quick else 65_536
    config = ("files", "range", width)
    tmp = Path(tempfile.mkdtemp(prefix="cdc-wamp-catchup-"))
    out = [
        f"## Catching up: a backlog of {BACKLOG_BATCHES} batches\n",
        f"`python -m bench write_amp_catchup`: a table of {rows:,} rows (file writes, range layout) behind by "
        f"{BACKLOG_BATCHES * bound:,} changes, applied in micro-batches sized as the `cdclog` source "
        f"sizes them (`batch_budget`: half the backlog, at least the bound of {bound:,}, at most the "
        "cap). Bytes written from the Delta logs (load-independent; "
        f"load {loadavg()}).\n",
        "| keys | batches sized by | batches | MB written | B / changed row | batch sizes |",
        "|---|---|---:|---:|---:|---|",
    ]
    try:
        reg = table("chaos_accounts", columns=COLUMNS)
        grown = tmp / "grown"
        wl = Workload(reg, seed=13)
        grow = Runner(grown, config, reg)
        for n in _chunks(rows, GROW_CHUNK):
            grow.apply(wl.inserts(n), wl.feed)
        grow.tidy()
        grown_n = wl.n
        for pattern in ("random", "recent"):
            wl.n = grown_n  # the keys the table holds (the other pattern's inserts are not in it)
            recs = wl.changes(BACKLOG_BATCHES * bound, pattern)
            for name, factor in CAPS:
                got = catch_up(grown, config, recs, wl, bound, factor * bound)
                sizes = ", ".join(f"{s // 1000}k" if s >= 1000 else str(s) for s in got["sizes"])
                say(
                    f"{pattern:6s} {name:28s}: {got['batches']:3d} batches, {got['mb']:7.1f} MB, "
                    f"{got['per_row']:7,.0f} B/changed row ({sizes})"
                )
                out.append(
                    f"| {pattern} | {name} | {got['batches']} | {got['mb']:.1f} | {got['per_row']:,.0f} | {sizes} |"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = "\n".join(out) + "\n"
    print(text, flush=True)
    return text
