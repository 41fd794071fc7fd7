"""Sample change events for the log-store benchmarks (both backends append the same data), built by
the reader's own envelope code (:meth:`cdc.codec.envelope.TableCodec.change_records`)."""

from __future__ import annotations

import random
import time

from cdc.codec.envelope import TableCodec, transaction_part
from cdc.events import topic_name
from cdc.logstore import Record
from cdc.registry import Column, TableReg

CUSTOMERS = TableReg(
    schema="public",
    table="customers",
    topic=topic_name("cdc", "public", "customers"),
    key=("id",),
    columns=(
        Column("id", "bigint", False),
        Column("name", "text"),
        Column("email", "text"),
        Column("balance", "numeric(12,2)"),
        Column("note", "text"),
        Column("updated_at", "timestamp with time zone"),
    ),
    snapshot_state="done",
)


def sample_records(n: int, distinct_keys: int | None = None, seed: int = 42) -> list[Record]:
    """Update events of ``public.customers`` of ~600 B: names drawn from a vocabulary and 64 random
    hex characters per record (so the data is neither random nor trivially compressible), ten
    changes per transaction."""
    rng = random.Random(seed)
    words = [f"{rng.getrandbits(32):08x}" for _ in range(2_000)]
    ts = int(time.time() * 1000)
    now = str(ts).encode()
    codec = TableCodec(CUSTOMERS, "cdc", "app", 4)
    out = []
    for i in range(n):
        k = i if distinct_keys is None else i % distinct_keys
        row = {
            "id": k,
            "name": f"{rng.choice(words)} {rng.choice(words)}",
            "email": f"{rng.choice(words)}@example.com",
            "balance": f"{rng.random() * 1000:.2f}",
            "note": f"{rng.getrandbits(256):064x}",
            "updated_at": f"2026-11-22 02:31:00.{i % 1000000:06d}+00",
        }
        commit_lsn = 23456789 + (i // 10 + 1) * 1200
        source = codec.change_source(
            transaction_part(ts, 100000 + i // 10, commit_lsn), 23456789 + i * 120, commit_lsn, i % 10 + 1
        )
        (rec,) = codec.change_records(b"u", None, row, source, now)
        out.append(Record(rec.key, rec.value, timestamp_ms=ts))
    return out
