"""Write amplification with wide rows: the range width sized from the row size, against the fixed
65,536 keys per bucket that tables got before.

``python -m bench write_amp_wide [--quick]`` (a section of ``docs/benchmarks/write_amp.md``)

As :mod:`bench.write_amp` (file writes, range layout, 90 % updates and 10 % inserts per batch, bytes from
the Delta logs, so load-independent), with ~1 KB of random hex per row (which Parquet does not compress): the table of
:data:`ROWS` rows is created once with the width :func:`sinks.warehouse.layout.range_width_for` picks
(4,096 for these rows) and once with the fixed 65,536 (the function replaced for that run).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench._common import loadavg, say
from bench.warehouse_loop import COLUMNS
from bench.write_amp import GROW_CHUNK, REPEAT, Runner, Workload, _chunks
from sinks.warehouse import layout
from tests.sinks.feed import table

SECTION_OF = "write_amp"
ROWS = 150_000
BATCH = 5_000


class WideWorkload(Workload):
    """Rows with ~1 KB of random hex in ``name``."""

    def _row(self, i: int) -> dict[str, Any]:
        row = super()._row(i)
        row["name"] = f"{i} {self.rng.getrandbits(4_000):01000x}"
        return row


def measure(tmp: Path, sized: bool, rows: int, batch: int) -> list[dict]:
    reg = table("chaos_accounts", columns=COLUMNS)
    wl = WideWorkload(reg, seed=17)
    fixed = layout.range_width_for
    if not sized:  # the layout as tables got it before: range_width whatever the rows
        layout.range_width_for = lambda options, row_bytes: options.range_width  # type: ignore[assignment]
    try:
        base = tmp / ("sized" if sized else "fixed")
        grow = Runner(base, ("files", "range", 65_536), reg)
        for n in _chunks(rows, GROW_CHUNK):
            grow.apply(wl.inserts(n), wl.feed)
    finally:
        layout.range_width_for = fixed
    grow.tidy()
    conf = grow.sink.paths(reg)[0]
    from deltalake import DeltaTable

    width = DeltaTable(str(conf)).metadata().configuration["cdc.layout"]
    out = []
    for pattern in ("random", "recent"):
        work = tmp / "m"
        shutil.copytree(base, work)
        run = Runner(work, ("files", "range", 65_536), reg)
        run.batch_id = 10_000
        saved = (wl.n, wl.lsn, wl.rng.getstate())
        got = [run.apply(recs, wl.feed) | {"changed": len(recs)} for recs in _batches(wl, batch, pattern)]
        live, files = run.live()
        wl.n, wl.lsn = saved[0], saved[1]
        wl.rng.setstate(saved[2])
        shutil.rmtree(work)
        row = {
            "layout": width,
            "pattern": pattern,
            "per_row": statistics.median(g["bytes"] / g["changed"] for g in got),
            "mb": statistics.median(g["bytes"] for g in got) / 1e6,
            "removed": statistics.median(g["removed_current"] for g in got),
            "files": files,
            "live": live / 1e6,
        }
        say(
            f"{width:12s} {pattern:6s}: {row['per_row']:9,.0f} B/changed row, {row['mb']:7.1f} MB/batch, "
            f"{row['removed']:.0f} of {files} current files rewritten, live {row['live']:.0f} MB"
        )
        out.append(row)
    shutil.rmtree(base)
    return out


def _batches(wl: Workload, batch: int, pattern: str) -> list[list[Any]]:
    return [wl.changes(batch, pattern) for _ in range(REPEAT)]


def run(quick: bool) -> str:
    rows, batch = (6_000, 300) if quick else (ROWS, BATCH)
    tmp = Path(tempfile.mkdtemp(prefix="cdc-wamp-wide-"))
    try:
        got = measure(tmp, False, rows, batch) + measure(tmp, True, rows, batch)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = [
        "## Wide rows: the range width sized from the row size\n",
        f"`python -m bench write_amp_wide`: {rows:,} rows of ~1 KB (random hex), file writes, batches "
        f"of {batch:,} changes (median of {REPEAT}); the fixed width every range table got before, "
        "against the one `range_width_for` picks (`target_file_size` 8 MiB). Bytes from the Delta logs "
        f"(load-independent; load {loadavg()}).\n",
        "| layout | keys | B / changed row | MB / batch | current files rewritten | current files | live MB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in got:
        out.append(
            f"| {r['layout']} | {r['pattern']} | {r['per_row']:,.0f} | {r['mb']:.1f} | {r['removed']:.0f} "
            f"| {r['files']} | {r['live']:.0f} |"
        )
    text = "\n".join(out) + "\n"
    print(text, flush=True)
    return text
