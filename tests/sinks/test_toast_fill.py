"""The warehouse's fill of unchanged TOAST values (``sinks/warehouse/fill.py``) on random workloads: chains
of updates lacking one column or another within a batch and across batches, deletes and re-inserts,
TRUNCATEs, a redelivered batch (the version guard skips it) and multi-MB values with quotes and
newlines. The current table and every history row must hold what a plain model of the source held
at that version."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from sinks import RawRecord
from sinks.warehouse import LSN, WarehouseOptions, WarehouseSink
from tests.sinks.conftest import FeedMaker
from tests.sinks.feed import Feed, table

APP = "cdc-apply-test"
COLS = ("name", "note")


def _value(rng: random.Random, i: int) -> str:
    if rng.random() < 0.05:
        return f'big {i} "q"\n' + "x" * (1 << 20)
    return f'v{i} "q"\n,{rng.randint(0, 99)}'


def _workload(
    f: Feed, seed: int
) -> tuple[list[list[RawRecord]], dict[tuple[int, int], dict[str, Any]], dict[int, dict[str, Any]]]:
    """Batches of records; the model's row at each applied upsert's version (key, lsn); and its live
    rows at the end."""
    rng = random.Random(seed)
    live: dict[int, dict[str, Any]] = {}
    rows_at: dict[tuple[int, int], dict[str, Any]] = {}
    batches: list[list[RawRecord]] = []
    lsn = 100
    for _b in range(6):
        batch: list[RawRecord] = []
        for _ in range(rng.randint(1, 30)):
            lsn += 16
            key = rng.randint(1, 8)
            roll = rng.random()
            if roll < 0.03 and batch:
                batch.extend(f.truncate(lsn))
                live.clear()
                continue
            if key not in live:
                row = {"id": key, **{c: _value(rng, lsn) for c in COLS}}
                batch.append(f.change("c", row, lsn))
                live[key] = row
            elif roll < 0.15:
                batch.extend(f.delete({"id": key}, lsn))
                del live[key]
                continue
            else:
                lacking = [c for c in COLS if rng.random() < 0.6]
                new = {c: _value(rng, lsn) for c in COLS if c not in lacking}
                batch.append(f.change("u", {"id": key, **new}, lsn, unavailable=lacking))
                live[key] = {**live[key], **new}
            rows_at[(key, lsn)] = dict(live[key])
        if batches and rng.random() < 0.4:  # the batch before redelivered with this one
            batch = [*batches[-1], *batch]
        batches.append(batch)
    return batches, rows_at, live


@pytest.mark.parametrize("seed", range(8))
def test_unchanged_toast_values_are_the_sources(tmp_path: Path, feed: FeedMaker, seed: int) -> None:
    reg = table()
    f = feed(reg)
    batches, rows_at, live = _workload(f, seed)
    sink = WarehouseSink(tmp_path / "wh", WarehouseOptions(maintain_every=0, shards=1 + seed % 2 * 3))
    for batch_id, records in enumerate(batches, 1):
        batch = f.batch(records)
        assert sink.reject(batch) == [], "every lacking value has a row to come from"
        sink.apply(batch, batch_id, APP)
    current = {r["id"]: r for r in sink.current_rows(reg, meta=False).to_pylist()}
    assert current == live
    for r in sink.history_rows(reg).to_pylist():
        want = rows_at[(r["id"], r[LSN])]
        assert {c: r[c] for c in ("id", *COLS)} == want, (r["id"], r[LSN])
