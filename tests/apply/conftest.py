"""The ``env`` of the apply tests: a state directory with a registry and a writable log store of the
parametrised backend, for synthetic events (:mod:`tests.plugins.changes`). Tests of what the real
reader writes use :func:`tests.plugins.apply.reader_env` instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc.config import Settings
from cdc.registry import Registry
from tests.plugins.apply import Env
from tests.plugins.logstore import kafka_url, open_store


@pytest.fixture
def env(tmp_path: Path, backend: str, request: pytest.FixtureRequest) -> Iterator[Env]:
    """State dir + registry + a writer log store of the parametrised backend (embedded or Kafka)."""
    state = tmp_path / "state"
    state.mkdir()
    log_url = None if backend == "embedded" else kafka_url(request)
    settings = Settings(state_dir=state, log_url=log_url)
    store = open_store(backend, state / "log", request, writer=True, compaction_interval_s=None)
    registry = Registry(state)
    try:
        yield Env(settings, store, registry)
    finally:
        store.close()
        registry.close()
