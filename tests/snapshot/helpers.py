"""Helpers of the snapshot tests (no tests here)."""

from __future__ import annotations

import subprocess

import orjson

from snapshot.chunked import ChunkProgress, load_progress
from tests.capture.test_reader_support import CaptureEnv
from tests.plugins.postgres import wait_for


def rows_of(env: CaptureEnv, table: str, key: str = "id") -> dict[str, dict[str, object]]:
    """The source's rows of ``table`` keyed like the topic (single key column ``key``)."""
    return {
        orjson.dumps({key: k}).decode(): orjson.loads(r)
        for k, r in env.fetch(f"SELECT {key}, row_to_json(t)::text FROM {table} t")
    }


def topic_size(env: CaptureEnv, topic: str) -> int:
    try:
        with env.store() as store:
            return sum(store.end_offsets(topic).values())
    except Exception:  # the topic may not exist yet
        return 0


def wait_streaming(env: CaptureEnv, proc: subprocess.Popen[bytes]) -> None:
    """Until the reader streams: its initial snapshot is done and its slot is active (the slot is
    active during the initial snapshot too, while the connection that created it holds the exported
    snapshot)."""

    def active() -> bool:
        assert proc.poll() is None, env.proc_log()
        with env.registry() as registry:
            if registry.get_state("initial_snapshot") != "done":
                return False
        rows = env.pg.fetch(f"SELECT active FROM pg_replication_slots WHERE slot_name = '{env.slot}'")
        return bool(rows and rows[0][0])

    wait_for(active, timeout=60, what="the reader to stream")


def wait_caught_up(env: CaptureEnv, timeout: float = 90) -> None:
    """Until the slot confirmed the WAL position of now: every change committed before this call is
    durable in the topics."""
    from cdc.events import lsn_to_int

    target = lsn_to_int(str(env.fetch("SELECT pg_current_wal_lsn()::text")[0][0]))
    wait_for(lambda: (env.slot_confirmed() or 0) >= target, timeout=timeout, what="the reader to catch up")


def progress(env: CaptureEnv, table: str, schema: str = "public") -> ChunkProgress | None:
    with env.registry() as r:
        return load_progress(r, schema, table)
