"""Fixtures of the apply tests: a state directory with a registry and a writable embedded log store
(synthetic events, :mod:`tests.apply.changes`), or one that the real reader writes (:func:`cdc_cli`,
:func:`reader_env`)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cdc.config import Settings
from cdc.logstore import LogStore
from cdc.registry import Registry, TableReg


@dataclass
class Env:
    settings: Settings
    store: LogStore
    registry: Registry

    @property
    def state(self) -> Path:
        return Path(self.settings.state_dir)

    def register(self, reg: TableReg) -> TableReg:
        return self.registry.add(reg)


@pytest.fixture
def env(tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> Iterator[Env]:
    """State dir + registry + a writer log store of the parametrised backend (embedded or Kafka)."""
    state = tmp_path / "state"
    state.mkdir()
    if backend == "embedded":
        from cdc.logstore.embedded import EmbeddedLogStore

        settings = Settings(state_dir=state)
        store: LogStore = EmbeddedLogStore(state / "log", writer=True, compaction_interval_s=None)
    else:
        from cdc.logstore.kafka import KafkaLogStore

        broker = request.getfixturevalue("tansu_broker")
        settings = Settings(state_dir=state, log_url=f"kafka://{broker.bootstrap}")
        store = KafkaLogStore(broker.bootstrap, writer=True)
    registry = Registry(state)
    try:
        yield Env(settings, store, registry)
    finally:
        store.close()
        registry.close()


def cdc_cli(dsn: str, state: Path, *args: str) -> tuple[int, str]:
    """``cdc --source DSN --state STATE ARGS...`` in this process: (exit code, stdout)."""
    from cdc.cli import main as cdc_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cdc_main(["--source", dsn, "--state", str(state), *args])
    return code, out.getvalue()


def reader_env(state: Path) -> Env:
    """The apply job's view of a state directory that ``cdc tables add`` / ``cdc run`` (the real
    reader) write: its settings only, no log store or registry held open here (the reader is the
    log store's writer)."""
    return Env(Settings(state_dir=state), None, None)  # type: ignore[arg-type]


def run_job(spark: Any, env: Env, *, sinks: Any = None, max_records: int = 0, **kw: Any) -> Any:
    """Run the apply job once (availableNow) in this process; return its summary."""
    from spark_jobs.apply import ApplyJob, ApplyOptions

    job = ApplyJob(
        spark, env.settings, ApplyOptions(once=True, max_records_per_batch=max_records, **kw), sinks=sinks
    )
    try:
        return job.run()
    finally:
        job.close()
