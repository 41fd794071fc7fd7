"""The search sink alone: what sharding an index costs a single process, and what one shard's slice
costs its task (``docs/search.md``, "Shards").

``python -m bench search_shards [--quick]``

The same columnar batches (the reader's envelope code, :mod:`tests.sinks.feed`; a bigint key, a
search text column and a number) into a fresh index, three ways, each run ``RUNS`` times in turn:

* ``1 shard, whole batches``: the peer (an index of one shard, as before shards);
* ``4 shards, whole batches``: the single-process path, every shard committed per batch;
* ``4 shards, 4 slices per batch``: each batch as its 4 partitions' slices (``batch.shard = p``),
  applied one after the other in this process: the sum of what 4 tasks would do.

Half the batches insert new keys, half update random existing ones. Figures: the median wall
seconds of a run, and CPU (this process, tantivy's threads included) per change.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from sinks import ChangeBatch, shard_of
from sinks.columnar import Columns
from sinks.search import SearchSink
from tests.sinks.feed import Feed, table

APP = "bench-search-shards"
SHARDS = 4
RUNS = 3


def _batches(batches: int, per_batch: int) -> list[ChangeBatch]:
    reg = table("docs", columns=(("id", "bigint"), ("t", "text"), ("n", "integer")), search=("t",))
    f = Feed(reg, "columns")
    rng = random.Random(7)
    words = [f"w{i}" for i in range(5000)]
    out, keys, lsn = [], 0, 1000
    for b in range(batches):
        recs = []
        for _ in range(per_batch):
            lsn += 1
            if b < batches // 2:
                keys += 1
                k, op = keys, "c"
            else:
                k, op = rng.randint(1, keys), "u"
            text = " ".join(rng.choices(words, k=12))
            recs.append(f.change(op, {"id": k, "t": text, "n": lsn}, lsn))
        batch = f.batch(recs)
        assert batch.columns is not None, "the columnar parse declined the batch"
        out.append(batch)
    return out


def _slices(batch: ChangeBatch) -> list[ChangeBatch]:
    assert batch.columns is not None
    t = batch.columns.table
    shards = [shard_of(k, SHARDS) for k in t.column("key_json").to_pylist()]
    return [
        ChangeBatch(batch.table, columns=Columns(t.filter(pa.array([s == p for s in shards]))), shard=p)
        for p in range(SHARDS)
    ]


def _run(batches: list[list[ChangeBatch]], shards: int) -> tuple[float, float]:
    """Wall and CPU seconds of applying ``batches`` (each a list of parts) to a fresh index."""
    state = Path(tempfile.mkdtemp(prefix="bench-search-"))
    sink = SearchSink(state, shards=shards)
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        for batch_id, parts in enumerate(batches, 1):
            for part in parts:
                sink.apply(part, batch_id, APP)
        sink.close()
        return time.perf_counter() - wall, time.process_time() - cpu
    finally:
        sink.close()
        shutil.rmtree(state, ignore_errors=True)


def run(quick: bool) -> str:
    n_batches, per_batch = (4, 500) if quick else (20, 5000)
    batches = _batches(n_batches, per_batch)
    changes = n_batches * per_batch
    ways = {
        "1 shard, whole batches": ([[b] for b in batches], 1),
        f"{SHARDS} shards, whole batches": ([[b] for b in batches], SHARDS),
        f"{SHARDS} shards, {SHARDS} slices per batch": ([_slices(b) for b in batches], SHARDS),
    }
    got: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for r in range(RUNS):
        for name, (parts, shards) in ways.items():
            got[name].append(_run(parts, shards))
            wall, cpu = got[name][-1]
            print(f"run {r + 1}: {name}: {wall:.2f} s, {cpu / changes * 1e6:.1f} us CPU/change", flush=True)
    peer = statistics.median(w for w, _ in got["1 shard, whole batches"])
    lines = [
        "## Search sink: shards (`python -m bench search_shards`)",
        "",
        f"{n_batches} columnar batches of {per_batch:,} changes (half inserts of new keys, half updates of "
        f"random ones) into a fresh index; median of {RUNS} runs, the ways in turn.",
        "",
        "| way | wall s | changes/s | CPU µs/change | wall vs 1 shard |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in got.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        lines.append(
            f"| {name} | {wall:.2f} | {changes / wall:,.0f} | {cpu / changes * 1e6:.1f} | {wall / peer:.2f}× |"
        )
    return "\n".join(lines) + "\n"
