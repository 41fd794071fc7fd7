"""What the apply job's driver records around a micro-batch, besides the sinks' own commits: the
job's identity (:func:`app_id_for`), its correctness ledger (:class:`Ledger`, ``<state>/spark/
apply-ledger.json``: the last batch whose dead letters were written, the counters), the dead letters
(once per batch id) and the consumer positions in the log store. ``docs/apply.md`` ("Guarantees")
says why each is kept."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from cdc import paths
from cdc.errors import UnknownTopicError
from cdc.logstore import APPLY_CONSUMER, LogStore
from cdc.registry import TableReg
from sinks import DeadLetter, dead_letters
from spark_jobs.checkpoint import batch_end_offsets, checkpoint_dir

__all__ = [
    "Ledger",
    "app_id_for",
    "commit_positions",
    "hold_positions",
    "ledger_path",
    "read_ledger",
    "write_ledger",
]


def ledger_path(state_dir: Path) -> Path:
    """The job's correctness ledger (:func:`cdc.paths.apply_ledger`)."""
    return paths.apply_ledger(state_dir)


def read_ledger(state_dir: Path) -> dict[str, Any]:
    """The ledger's content, ``{}`` when there is none. A state directory written before the ledger
    got its name holds it as ``apply-metrics.json`` (:func:`cdc.paths.legacy_apply_ledger`): that
    file is read when the ledger is absent; the next write creates the ledger and removes it."""
    for path in (ledger_path(state_dir), paths.legacy_apply_ledger(state_dir)):
        try:
            return dict(orjson.loads(path.read_bytes()))
        except FileNotFoundError:
            continue
        except orjson.JSONDecodeError:
            return {}
    return {}


def write_ledger(state_dir: Path, current: dict[str, Any]) -> None:
    """Replace the ledger atomically (stamped ``updated_ms``); the old-named file, read once by
    :func:`read_ledger`, is removed after the new one is in place."""
    path = ledger_path(state_dir)
    current["updated_ms"] = int(time.time() * 1000)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(current))
    os.replace(tmp, path)
    paths.legacy_apply_ledger(state_dir).unlink(missing_ok=True)


def app_id_for(state_dir: Path) -> str:
    """The job's app id, created with the checkpoint (a new checkpoint gets a new id)."""
    ckpt = checkpoint_dir(state_dir)
    id_file = ckpt.parent / "apply.id"
    if id_file.exists() and ckpt.exists():
        text = id_file.read_text().strip()
        if text:
            return text
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    app_id = f"cdc-apply-{uuid.uuid4()}"
    tmp = id_file.with_suffix(".tmp")
    tmp.write_text(app_id + "\n")
    os.replace(tmp, id_file)
    ckpt.mkdir(parents=True, exist_ok=True)
    return app_id


class Ledger:
    """The ledger of the job ``app_id`` (its counters start afresh for a new app id).
    ``dead_letters_total``: the dead letters over the checkpoint's life, as of the last write."""

    def __init__(self, state_dir: Path, app_id: str) -> None:
        self.state_dir = state_dir
        self.app_id = app_id
        self.dead_letters_total = 0

    def read(self) -> dict[str, Any]:
        """This checkpoint's ledger (:func:`read_ledger`), reset for a new app id."""
        current = read_ledger(self.state_dir)
        if current.get("app_id") != self.app_id:
            current = {"app_id": self.app_id, "batches": 0, "records": 0, "events": 0, "dead_letters": 0}
        return current

    def write(self, current: dict[str, Any]) -> None:
        write_ledger(self.state_dir, current)
        self.dead_letters_total = int(current.get("dead_letters", 0))

    def write_dead_letters(
        self, store: LogStore, topic: str, dead: Sequence[DeadLetter], batch_id: int
    ) -> None:
        """Append the batch's dead letters to ``topic`` once per (app id, batch id): the ledger
        records the last batch whose dead letters were written and counted, so a replayed batch skips
        them (only a crash between the append and that record can write them twice)."""
        current = self.read()
        done = current.get("dead_letter_batch")
        if done is not None and int(done) >= batch_id:
            return
        store.create_topic(topic, dead_letters.TOPIC_CONFIG)
        store.append(topic, [dead_letters.encode(d, batch_id, self.app_id) for d in dead])
        current["dead_letter_batch"] = batch_id
        current["dead_letters"] = int(current.get("dead_letters", 0)) + len(dead)
        self.write(current)

    def count_batch(self, batch_id: int, records: int, events: int, newest_ts_ms: int | None) -> None:
        """Count a finished batch once (a replayed batch id is not counted again); dead letters are
        counted when written (:meth:`write_dead_letters`). ``newest_event_ts_ms`` is the newest source
        commit time applied (for time lag)."""
        current = self.read()
        last = current.get("last_batch_id")
        if last is None or batch_id > int(last):
            current["batches"] += 1
            current["records"] += records
            current["events"] += events
            current["last_batch_id"] = batch_id
        if newest_ts_ms is not None:
            current["newest_event_ts_ms"] = max(int(current.get("newest_event_ts_ms") or 0), newest_ts_ms)
        current["applied_ms"] = int(time.time() * 1000)
        self.write(current)


def commit_positions(store: Callable[[], LogStore], ckpt: Path, batch_id: int) -> None:
    """Commit the batch's end offsets (from Spark's offset log) as the job's consumer positions in
    ``store()`` (opened only when there are some): advisory, for lag and ``cdc verify``; the
    checkpoint is where the job resumes."""
    ends = batch_end_offsets(ckpt, batch_id)
    if not ends:
        return
    log = store()
    for topic, offsets in ends.items():
        try:
            log.commit(APPLY_CONSUMER, topic, offsets)
        except UnknownTopicError:
            continue


def hold_positions(store: LogStore, tables: Sequence[TableReg]) -> None:
    """Commit a position at its start offsets in every topic the job has none in yet, before the
    first micro-batch (which can take a while on a loaded host): the embedded log store never
    compacts away what a consumer has not read (an update without its unchanged TOAST columns needs
    the key's earlier row), and without a position the job is not a consumer yet. A later batch's
    commit moves it on."""
    for reg in tables:
        try:
            store.hold(APPLY_CONSUMER, reg.topic)
        except UnknownTopicError:
            continue
