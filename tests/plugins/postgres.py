"""The private PostgreSQL 15 cluster for the test session (see cdc/devcluster.py).

Use the ``pg`` fixture (session-scoped) and give every test its own database with
``pg.create_database()`` (or the ``pg_db`` fixture).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc.devcluster import PgCluster, free_port, start_cluster

__all__ = ["PgCluster", "free_port", "pg", "pg_db", "start_cluster", "wait_for"]


@pytest.fixture(scope="session")
def pg() -> Iterator[PgCluster]:
    base = Path(tempfile.mkdtemp(prefix="cdc-pg-"))
    cluster = start_cluster(base)
    try:
        yield cluster
    finally:
        try:
            cluster.stop("immediate")
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_db(pg: PgCluster) -> Iterator[str]:
    """A fresh database in the session cluster; returns its name. Dropped (with its slots) after."""
    name = pg.create_database()
    try:
        yield name
    finally:
        pg.drop_database(name)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
