"""The fault suite's disk: a sampler of the bytes under the run's state dir while it runs (the peak of
each part and of the whole), and the live size at the end, what the warehouse's Delta tables'
current versions reference (``docs/warehouse.md``, Disk)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cdc import paths
from sinks.warehouse import WarehouseOptions
from sinks.warehouse.reclaim import LOG_DIR, tree_bytes, usage

PARTS = ("warehouse", "search", "log", "other")
GB = 1e9
#: what the warehouse's disk may reach, in times its live size, with the default settings: after each
#: batch a table's superseded files are at most ``vacuum_garbage_ratio`` times its live size (plus
#: what was removed while a cdc reader held a lease: a `cdc verify` of the harness), and a batch being
#: written adds at most about one more live size (a batch of random keys rewrites the whole table)
WAREHOUSE_BOUND = 2 + WarehouseOptions().vacuum_garbage_ratio


def part_dirs(state: Path) -> dict[str, Path]:
    return {
        "warehouse": paths.warehouse_dir(state),
        "search": paths.search_dir(state),
        "log": paths.log_dir(state),
    }


def measure(state: Path, skip: Path | None = None) -> dict[str, int]:
    """Bytes per part of the state dir now, in one walk (``skip``: a file not counted, the harness's
    disk filler)."""
    dirs = {path.name: name for name, path in part_dirs(state).items()}
    out = dict.fromkeys(PARTS, 0)
    try:
        entries = list(os.scandir(state))
    except FileNotFoundError:
        return out
    for entry in entries:
        with contextlib.suppress(FileNotFoundError):
            part = dirs.get(entry.name, "other")
            if entry.is_dir(follow_symlinks=False):
                out[part] += tree_bytes(Path(entry.path))
            else:
                out[part] += entry.stat(follow_symlinks=False).st_size
    if skip is not None:
        with contextlib.suppress(FileNotFoundError):
            part = dirs.get(skip.relative_to(state).parts[0], "other")
            out[part] = max(out[part] - skip.stat().st_size, 0)
    return out


def live(state: Path, skip: Path | None = None) -> dict[str, int]:
    """The live size: every Delta table's current files and its _delta_log; the rest as it is."""
    now = measure(state, skip)
    warehouse = paths.warehouse_dir(state)
    tables = [log.parent for log in warehouse.rglob(LOG_DIR)] if warehouse.exists() else []
    now["warehouse"] = sum(usage(t).live for t in tables)
    now["total"] = sum(now[p] for p in PARTS)
    return now


@dataclass
class Disk:
    """Peak and live bytes per part (``PARTS``) and of the whole (``total``)."""

    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys((*PARTS, "total"), 0))
    peak_at_s: float = 0.0
    live: dict[str, int] = field(default_factory=dict)
    samples: int = 0
    #: a sample a minute: (seconds since the start, warehouse bytes, whole bytes)
    series: list[tuple[float, int, int]] = field(default_factory=list)
    #: a sample or the live size that could not be measured (why): the figures are then partial,
    #: and the run fails (``Report.ok``)
    errors: list[str] = field(default_factory=list)

    @staticmethod
    def size(n: int) -> str:
        return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 1e6:.1f} MB"

    def ratio(self, part: str) -> float | None:
        return self.peak[part] / self.live[part] if self.live.get(part) else None

    def lines(self) -> list[str]:
        errors = [f"  DISK NOT MEASURED ({len(self.errors)} errors): {e}" for e in self.errors[:5]]
        if not self.live:
            return [
                f"  disk: peak {self.size(self.peak['total'])} in {self.samples} samples "
                "(live not measured: the run stopped)",
                *errors,
            ]
        out = [f"  disk high-water mark ({self.samples} samples; the whole at {self.peak_at_s:.0f} s):"]
        for part in ("warehouse", "total"):
            r = self.ratio(part)
            out.append(
                f"    {part:10} peak {self.size(self.peak[part])}, live {self.size(self.live[part])}"
                + (f", peak/live {r:.2f}x" if r is not None else "")
                + (f" (bound {WAREHOUSE_BOUND:.1f}x)" if part == "warehouse" else "")
            )
        out.append(
            "    parts' peaks: "
            + ", ".join(
                f"{p} {self.size(self.peak[p])} (live {self.size(self.live.get(p, 0))})" for p in PARTS
            )
        )
        return out + errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "peak": dict(self.peak),
            "peak_at_s": round(self.peak_at_s, 1),
            "live": dict(self.live),
            "peak_over_live": {p: self.ratio(p) for p in ("warehouse", "total")},
            "samples": self.samples,
            "series": [[round(t), w, a] for t, w, a in self.series],
            "errors": self.errors[:5],
        }


class Sampler:
    """A thread that measures the state dir every ``interval`` seconds and keeps the peaks. A sample
    that fails is an error in ``Disk.errors`` (the run goes on, and fails at its end), as is a thread
    that does not stop."""

    def __init__(
        self,
        state: Path,
        disk: Disk,
        interval: float = 3.0,
        skip: Path | None = None,
        note: Callable[[str], None] | None = None,
    ) -> None:
        """``note``: where the minute's sample is also written (the harness's log: kept if the run
        is killed before its report)."""
        self.state, self.disk, self.interval, self.skip, self.note = state, disk, interval, skip, note
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="disk-sampler", daemon=True)
        self._t0 = time.monotonic()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
            if self._thread.is_alive():
                self.disk.errors.append("the sampler did not stop within 60 s (a sample hangs)")

    def sample(self) -> None:
        now = measure(self.state, self.skip)
        peak = self.disk.peak
        for part in PARTS:
            peak[part] = max(peak[part], now[part])
        total, at = sum(now.values()), time.monotonic() - self._t0
        if total > peak["total"]:
            peak["total"], self.disk.peak_at_s = total, at
        self.disk.samples += 1
        if not self.disk.series or at - self.disk.series[-1][0] >= 60:
            self.disk.series.append((at, now["warehouse"], total))
            if self.note is not None:
                self.note(f"disk at {at:.0f} s: {now}, peak {peak}")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample()
            except Exception as exc:  # reported, and fails the run at its end; the run goes on
                self.disk.errors.append(f"a sample failed: {exc!r}")
