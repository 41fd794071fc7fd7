"""Fixtures of the apply tests: a state directory with a registry and a writable embedded log store."""

from __future__ import annotations

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
