"""kill -9 of the Spark apply job between a sink write and the checkpoint: after a restart the derived
tables equal the source (its changes captured by the real reader, `cdc run --once`) and the history
holds no duplicate version."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from deltalake import DeltaTable

from sinks.warehouse import LSN, SEQ, WarehouseSink
from spark_jobs.apply import app_id_for
from spark_jobs.checkpoint import checkpoint_dir
from tests.plugins.apply import reader_env, run_job
from tests.plugins.capture import CDC
from tests.plugins.items import capture, item_row, items_table, source, verify_json
from tests.plugins.postgres import PgCluster


def test_kill_9_after_a_sink_wrote_then_restart_is_exactly_once(
    pg: PgCluster, pg_db: str, tmp_path: Path, jvm: None, spark: Any
) -> None:
    """The driver dies after its tasks applied the batch (the search shards committed it) and
    before its Delta commit."""
    state = tmp_path / "state"
    dsn, reg = items_table(pg, pg_db, state)
    env = reader_env(state)
    capture(dsn, state)  # the initial snapshot (empty): every change below is streamed
    with source(dsn) as src:
        src.insert(*(item_row(i) for i in range(1, 41)))
        for i in range(1, 41, 2):
            src.update(i, {"name": f"widget {i} again", "qty": -i})
        for i in (4, 8):
            src.delete(i)
        src.change_key(10, 1010)
    capture(dsn, state)

    crash_batch = 1
    proc = subprocess.run(
        [
            *CDC,
            "--state",
            str(env.state),
            "apply",
            "--once",
            "--max-records-per-batch",
            "20",
        ],
        env={**os.environ, "CDC_FAULTS": f"apply.after_sink:{crash_batch}"},
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "cdc-fault: apply.after_sink" in proc.stderr
    # the search index's shards committed batch 1, the driver died before its Delta commit of the
    # tasks' warehouse writes; nor did it checkpoint it
    app_id = app_id_for(env.state)
    current_path = WarehouseSink(env.state).paths(reg)[0]
    assert DeltaTable(str(current_path)).transaction_version(app_id) == crash_batch - 1
    ckpt = checkpoint_dir(env.state)
    assert (ckpt / "offsets" / str(crash_batch)).exists()
    assert not (ckpt / "commits" / str(crash_batch)).exists()
    assert _never_committed(current_path)  # the tasks' files of batch 1, which no commit references

    # restart: a new apply job over the same checkpoint, on the session's Spark (a JVM start less;
    # `cdc apply --once --json` restarting in a process of its own: tests/cluster/test_standalone.py):
    # batch 1 is replayed, then the rest
    batches: list[int] = []
    summary = run_job(
        spark,
        env,
        max_records=20,
        sole_writer=True,  # what `cdc apply` sets, holding the apply lock
        on_batch=lambda r: batches.append(r.batch_id),
    )
    assert summary.app_id == app_id
    assert not _never_committed(current_path), "the killed attempt's files were left on disk"
    assert batches[0] == crash_batch and len(batches) >= 2 and summary.dead_letters == 0

    code, reports = verify_json(env.settings, dsn)
    assert code == 0, reports
    assert reports[0]["source_rows"] == 38 and reports[0]["search_docs"] == 38
    hist = WarehouseSink(env.state).history_rows(reg).to_pylist()
    versions = [(r["_cdc_key"], r[LSN], r[SEQ]) for r in hist]
    assert len(versions) == len(set(versions)), "the replayed batch duplicated history rows"


def _never_committed(table: Path) -> set[str]:
    """The data files under the Delta table at ``table`` that no commit of its log ever added."""
    added: set[str] = set()
    for commit in (table / "_delta_log").glob("*.json"):
        for line in commit.read_text().splitlines():
            action = json.loads(line).get("add")
            if action:
                added.add(unquote(action["path"]))
    return {p.relative_to(table).as_posix() for p in table.rglob("*.parquet")} - added
