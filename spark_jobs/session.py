"""Building the local Spark session the apply job, the tests and the benchmarks share.

One session per process: Spark's cold start costs 7-9 s on this machine, so callers build it once
(:func:`get_session`) and reuse it. The session runs ``local[N]`` (default 2) with few shuffle
partitions, no UI, and Python workers running this interpreter (``PYSPARK_PYTHON`` is set to
``sys.executable`` so workers import ``cdc``, ``sinks`` and ``spark_jobs`` from the same venv).
No jars are fetched: the job needs none (the log store is read by the Python Data Source, the sinks
write through ``deltalake`` and ``tantivy``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

JAVA17_CANDIDATES = (
    "/usr/lib/jvm/java-17-openjdk-amd64",
    "/usr/lib/jvm/java-1.17.0-openjdk-amd64",
    "/usr/lib/jvm/openjdk-17",
)


def _java_home() -> str | None:
    current = os.environ.get("JAVA_HOME")
    if current and Path(current, "bin", "java").exists():
        return current
    for cand in JAVA17_CANDIDATES:
        if Path(cand, "bin", "java").exists():
            return cand
    return None


def prepare_environment() -> None:
    """Set the environment variables Spark's launcher and workers need (idempotent)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    java = _java_home()
    if java:
        os.environ["JAVA_HOME"] = java


def get_session(
    app_name: str = "cdc-apply",
    master: str | None = None,
    *,
    shuffle_partitions: int = 2,
    local_dir: Path | None = None,
    driver_memory: str = "2g",
) -> SparkSession:
    """The process's Spark session, created on first call (later calls return the same one).

    ``master`` defaults to ``$CDC_SPARK_MASTER`` or ``local[2]`` (under ``spark-submit``: its ``--master``).
    """
    prepare_environment()
    from pyspark.sql import SparkSession

    # under spark-submit (the JVM is already up) its --master and --conf win unless a master is asked for
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    master = master or os.environ.get("CDC_SPARK_MASTER") or (None if submitted else "local[2]")
    scratch = local_dir or Path(tempfile.gettempdir()) / "cdc-spark"
    scratch.mkdir(parents=True, exist_ok=True)
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.driver.memory", driver_memory)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .config("spark.default.parallelism", "2")
        .config("spark.local.dir", str(scratch))
        .config("spark.sql.warehouse.dir", str(scratch / "warehouse"))
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.streaming.stopTimeout", "60s")
        # the micro-batch fixed cost matters for freshness: keep the state-store and
        # maintenance machinery out of the way (the job keeps no Spark state)
        .config("spark.sql.streaming.minBatchesToRetain", "20")
        .config("spark.python.worker.reuse", "true")
    )
    if master:
        builder = builder.master(master)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark
