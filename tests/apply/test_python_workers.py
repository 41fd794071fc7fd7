"""Spark's Python workers in the apply's session: forked from the product's daemon
(spark_jobs/pydaemon.py), with pyspark imported from the installed package, and the daemon holding
what the workers import for the apply (:data:`spark_jobs.pydaemon.PRELOAD`) before it forks them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def test_a_worker_forks_from_the_daemon_with_the_installed_pyspark_and_the_preload(spark_clean: Any) -> None:
    """A task's Python worker is forked from the product's daemon (``spark.python.daemon.module``:
    spark_jobs/pydaemon.py) and imported pyspark from the installed package, not from Spark's zip;
    neither that zip nor Spark's core jar is on its import path; the daemon imported what a task
    imports (:data:`spark_jobs.pydaemon.PRELOAD`) before it forked the worker."""

    def where(_: Any) -> tuple[str, str, str, list[str]]:
        import sys

        import pyspark

        parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        archives = [p for p in sys.path_importer_cache if p.endswith((".jar", ".zip")) or ".jar/" in p]
        return parent, str(pyspark.__file__), Path(f"/proc/{os.getppid()}/maps").read_text(), archives

    parent, module, maps, archives = spark_clean.sparkContext.parallelize([0], 1).map(where).collect()[0]
    assert "-m spark_jobs.pydaemon" in parent, parent
    assert ".zip" not in module and module.endswith("pyspark/__init__.py"), module
    # no importer of Spark's zips or jars is left for an invalidate_caches to read again
    assert not [p for p in archives if "pyspark" in p], archives
    # the daemon, which runs no task itself, imported the sinks' and pandas' compiled libraries before
    # it forked the worker: a worker starts with them
    mapped = {line.split()[-1] for line in maps.splitlines()}
    for package in ("deltalake", "tantivy", "pandas", "pyarrow"):
        assert any(f"/site-packages/{package}/" in m for m in mapped), package
