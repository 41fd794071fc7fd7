"""The ``spark_cluster`` fixture: a real Spark standalone cluster (a master and two 1-core workers,
:mod:`tests.plugins.spark_standalone`) for the tests that run ``cdc apply --master spark://...``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.plugins.postgres import wait_for
from tests.plugins.spark_standalone import SparkCluster, start_cluster

__all__ = ["SparkCluster", "spark_cluster"]


@pytest.fixture(scope="module")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    """A Spark standalone cluster (a master, two 1-core workers) for the module's tests; every
    process of it is gone when the module ends (checked)."""
    base = tmp_path_factory.mktemp("spark-cluster")
    cluster = start_cluster(base)
    try:
        yield cluster
    finally:
        cluster.stop()
        # a SIGKILLed process stays in its group until it is reaped
        wait_for(
            lambda: not cluster.leftovers(), timeout=30, what="every process of the Spark cluster to end"
        )
