"""Embedded log store: durable append, full read and compaction, beside a plain fsync'd file.

* append: N records of ~500 B (JSON-ish key and value) in batches of 1,000 into a 4-partition topic,
  each batch durable (SQLite WAL, synchronous=FULL) before the next;
* peer: the same bytes written to a plain sequential file with one fsync per batch of 1,000 -- the
  disk's limit for this write pattern, so the ratio says how close the store gets to it;
* read: every record back through ``iter_partition()`` (StoredRecord objects), all partitions, by a
  read-only instance (as Spark executors open the store);
* compaction: a topic of N records over N/100 distinct keys, ``compact()`` timed, records left.

Bars (full run, N = 1,000,000): append >= 300k records/s, read >= 1M records/s, compaction < 10 s
leaving ~10k records.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from bench._records import sample_records
from cdc.logstore import Record, TopicConfig
from cdc.logstore.embedded import EmbeddedLogStore

BATCH = 1_000


def _plain_file(path: Path, records: list[Record]) -> float:
    started = time.perf_counter()
    with path.open("wb", buffering=0) as fh:
        for i in range(0, len(records), BATCH):
            chunk = records[i : i + BATCH]
            fh.write(b"".join(r.key + (r.value or b"") for r in chunk))
            os.fsync(fh.fileno())
    return time.perf_counter() - started


def _append_all(store: EmbeddedLogStore, topic: str, records: list[Record]) -> tuple[float, list[float]]:
    """Append in batches; return the elapsed seconds and each batch's latency in ms."""
    latencies = []
    started = time.perf_counter()
    for i in range(0, len(records), BATCH):
        t = time.perf_counter()
        store.append(topic, records[i : i + BATCH])
        latencies.append((time.perf_counter() - t) * 1000)
    return time.perf_counter() - started, latencies


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stored_bytes(root: Path, topic: str) -> int:
    return sum(p.stat().st_size for p in root.glob(f"{topic}.db*"))


def run(quick: bool) -> str:
    n = 50_000 if quick else 1_000_000
    load_before = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="bench-logstore-"))
    log_dir = root / "log"
    try:
        records = sample_records(n)
        nbytes = sum(len(r.key) + len(r.value or b"") for r in records)
        print(f"{n:,} records, {nbytes / n:.0f} B key+value on average, batches of {BATCH:,}", flush=True)

        plain_s = _plain_file(root / "plain.bin", records)
        plain_rate = n / plain_s
        print(f"plain file, fsync per batch: {plain_rate:,.0f} records/s ({nbytes / plain_s / 1e6:.0f} MB/s)")

        store = EmbeddedLogStore(log_dir, writer=True, compaction_interval_s=None)
        store.create_topic("bench.append", TopicConfig(partitions=4))
        append_s, lat = _append_all(store, "bench.append", records)
        append_rate = n / append_s
        print(
            f"append: {append_rate:,.0f} records/s ({append_rate / plain_rate:.2f}x plain file), "
            f"batch latency p50 {_pct(lat, 0.5):.1f} ms p99 {_pct(lat, 0.99):.1f} ms",
            flush=True,
        )

        reader = EmbeddedLogStore(log_dir)  # a read-only instance, as Spark executors and the CLI open it
        started = time.perf_counter()
        got = 0
        for p in range(4):
            for _ in reader.iter_partition("bench.append", p):
                got += 1
        read_s = time.perf_counter() - started
        reader.close()
        assert got == n, (got, n)
        read_rate = n / read_s
        print(f"read:   {read_rate:,.0f} records/s ({read_rate / plain_rate:.2f}x plain-file write rate)")
        del records
        store.close()  # checkpoints and removes the WAL, so the file size is what the topic keeps
        stored = _stored_bytes(log_dir, "bench.append")
        print(f"stored: {stored / n:.0f} B per record ({stored / nbytes:.2f}x key+value bytes)")
        store = EmbeddedLogStore(log_dir, writer=True, compaction_interval_s=None)

        keys = max(n // 100, 1)
        store.create_topic("bench.compact", TopicConfig(partitions=4, min_compaction_lag_ms=0))
        crecords = sample_records(n, distinct_keys=keys)
        _append_all(store, "bench.compact", crecords)
        started = time.perf_counter()
        removed = store.compact("bench.compact")
        compact_s = time.perf_counter() - started
        left = sum(store.record_counts("bench.compact").values())
        print(f"compaction: {compact_s:.2f} s, removed {removed:,}, {left:,} records left ({keys:,} keys)")
        store.close()

        # The same appends with the background compaction thread working on the topic meanwhile.
        store = EmbeddedLogStore(log_dir, writer=True, compaction_interval_s=0.05)
        store.create_topic("bench.background", TopicConfig(partitions=4, min_compaction_lag_ms=0))
        bg_s, bg_lat = _append_all(store, "bench.background", crecords)
        bg_rate = n / bg_s
        del crecords
        bg_left = sum(store.record_counts("bench.background").values())
        store.close()
        print(
            f"append with background compaction: {bg_rate:,.0f} records/s, batch latency "
            f"p50 {_pct(bg_lat, 0.5):.1f} ms p99 {_pct(bg_lat, 0.99):.1f} ms max {max(bg_lat):.1f} ms; "
            f"{bg_left:,} records left at the end"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]

    def verdict(ok: bool) -> str:
        return "meets the bar" if ok else "BELOW the bar"

    full = not quick
    return f"""## Embedded log store (SQLite WAL, synchronous=FULL)

{n:,} Debezium-style change events of ~{nbytes / n:.0f} B (key + value), appended in batches of
{BATCH:,} to a 4-partition topic, each batch durable (fsync'd) before the next. Peer: the same bytes
written to a plain file with one `fsync` per batch of {BATCH:,} (the disk's limit for this pattern),
measured in the same run. The store keeps each batch LZ4-compressed: {stored / n:.0f} B on disk per
record ({stored / nbytes:.2f}x the key+value bytes) for these events.

| measure | result | ratio to the plain fsync'd file | bar |
| --- | --- | --- | --- |
| plain file write, fsync per {BATCH:,} | {plain_rate:,.0f} records/s | 1.00 | |
| durable append | {append_rate:,.0f} records/s (batch p50 {_pct(lat, 0.5):.1f} ms, p99 {_pct(lat, 0.99):.1f} ms) | {append_rate / plain_rate:.2f} | >= 300,000/s{f": {verdict(append_rate >= 300_000)}" if full else ""} |
| full read (`iter_partition()` -> StoredRecord, read-only instance) | {read_rate:,.0f} records/s | {read_rate / plain_rate:.2f} | >= 1,000,000/s{f": {verdict(read_rate >= 1_000_000)}" if full else ""} |
| `compact()`, {keys:,} keys | {compact_s:.2f} s, {left:,} records left of {n:,} | | < 10 s, ~{keys:,} left{f": {verdict(compact_s < 10 and left <= keys * 1.05)}" if full else ""} |
| durable append while the background thread compacts the same topic | {bg_rate:,.0f} records/s (batch p50 {_pct(bg_lat, 0.5):.1f} ms, p99 {_pct(bg_lat, 0.99):.1f} ms, max {max(bg_lat):.1f} ms); {bg_left:,} records left | {bg_rate / plain_rate:.2f} | |

The machine's 2 cores are shared with other work (1-minute load average {load_before:.1f} at the
start, {load_after:.1f} at the end of this run); figures within ~15% of a bar are close to it, and a
busy machine moves them by more than that.
"""
