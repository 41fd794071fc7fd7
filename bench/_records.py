"""Sample change events for the log-store benchmarks (both backends append the same data)."""

from __future__ import annotations

import random
import time

from cdc.logstore import Record


def sample_records(n: int, distinct_keys: int | None = None, seed: int = 42) -> list[Record]:
    """Debezium-style change events of ~500 B: JSON with repeated field names, names drawn from a
    vocabulary and 64 random hex characters per record (so the data is neither random nor trivially
    compressible)."""
    rng = random.Random(seed)
    words = [f"{rng.getrandbits(32):08x}" for _ in range(2_000)]
    ts = int(time.time() * 1000)
    out = []
    for i in range(n):
        k = i if distinct_keys is None else i % distinct_keys
        value = (
            f'{{"before": null, "after": {{"id": {k}, "name": "{rng.choice(words)} {rng.choice(words)}", '
            f'"email": "{rng.choice(words)}@example.com", "balance": {rng.random() * 1000:.2f}, '
            f'"note": "{rng.getrandbits(256):064x}", "updated_at": "2026-11-22T02:31:00.{i % 1000000:06d}Z"}}, '
            f'"source": {{"version": "0.1.0", "connector": "postgresql", "name": "cdc", "ts_ms": {ts}, '
            f'"snapshot": "false", "db": "app", "schema": "public", "table": "customers", '
            f'"txId": {100000 + i // 10}, "lsn": {23456789 + i * 120}, "sequence": null}}, '
            f'"op": "u", "ts_ms": {ts}}}'
        )
        out.append(Record(f'{{"id": {k}}}'.encode(), value.encode(), timestamp_ms=ts))
    return out
