"""Log-store fixtures: ``log_store_factory`` is parametrised over both backends, so every test that
uses it runs against the embedded store and against Kafka (the Tansu broker)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cdc.logstore import LogStore

pytest_plugins = ["tests.plugins.tansu"]

BACKENDS = ["embedded", pytest.param("kafka", marks=pytest.mark.kafka)]


def open_store(backend: str, path: Path, request: pytest.FixtureRequest, **kwargs: object) -> LogStore:
    """A log store of ``backend``: the embedded store in ``path``, or a client of the session's
    Tansu broker (``kafka``)."""
    if backend == "embedded":
        from cdc.logstore.embedded import EmbeddedLogStore

        return EmbeddedLogStore(path, **kwargs)  # type: ignore[arg-type]
    from cdc.logstore.kafka import KafkaLogStore

    broker = request.getfixturevalue("tansu_broker")
    return KafkaLogStore(broker.bootstrap, **kwargs)  # type: ignore[arg-type]


def kafka_url(request: pytest.FixtureRequest) -> str:
    """The ``CDC_LOG`` URL of the session's Tansu broker."""
    return f"kafka://{request.getfixturevalue('tansu_broker').bootstrap}"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def log_store_factory(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., LogStore]]:
    """Opens stores of the current backend, all on the same place (same dir / same broker)."""
    opened: list[LogStore] = []

    def make(**kwargs: object) -> LogStore:
        store = open_store(backend, tmp_path / "log", request, **kwargs)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def log_store(log_store_factory: Callable[..., LogStore]) -> LogStore:
    return log_store_factory(writer=True)


@pytest.fixture
def topic_name() -> str:
    """A unique topic name (the Kafka broker is shared by the session)."""
    return f"cdc.test.t_{uuid.uuid4().hex[:8]}"
