"""The Spark session for the test run: ONE session (cold start 7-9 s), shared by every Spark test.

``spark`` is session-scoped; tests that run a streaming query give it its own state directory (so
its own checkpoint) and must leave no query running (the fixture stops any left over after each test
through ``spark_clean``).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from spark_jobs.session import get_session
    from spark_jobs.source import register

    scratch = Path(tempfile.mkdtemp(prefix="cdc-spark-test-"))
    session = get_session("cdc-tests", local_dir=scratch)
    register(session)
    try:
        yield session
    finally:
        for q in session.streams.active:
            q.stop()
        session.stop()
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def spark_clean(spark: Any) -> Iterator[Any]:
    """The shared session; any streaming query a test leaves running is stopped afterwards."""
    yield spark
    for q in spark.streams.active:
        q.stop()
