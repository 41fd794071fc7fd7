"""Building the local Spark session the apply job, the tests and the benchmarks share.

One session per process: Spark's cold start costs 7-9 s on this machine, so callers build it once
(:func:`get_session`) and reuse it. The session runs ``local[N]`` (default 2) with few shuffle
partitions, no UI, and Python workers running this interpreter (``PYSPARK_PYTHON`` is set to
``sys.executable`` so workers import ``cdc``, ``sinks`` and ``spark_jobs`` from the same venv).
No jars are fetched: the job needs none (the log store is read by the Python Data Source, the sinks
write through ``deltalake`` and ``tantivy``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from cdc.errors import ConfigError

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


def private_scratch(local_dir: Path | None = None) -> Path:
    """Spark's scratch directory, private to this user: ``local_dir`` (e.g.
    :func:`cdc.paths.spark_scratch` of the state directory) created 0700, or a new
    ``tempfile.mkdtemp`` directory (0700, a fresh name another user cannot create first) removed at
    exit. A ``local_dir`` that is a symlink or belongs to another user is refused (ConfigError)."""
    if local_dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="cdc-spark-"))
        atexit.register(shutil.rmtree, scratch, True)
        return scratch
    scratch = Path(local_dir)
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = scratch.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ConfigError(
            f"Spark scratch directory {scratch} is a symlink or belongs to another user",
            fix="remove it, or point the state directory somewhere only this user can write",
            path=str(scratch),
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        scratch.chmod(0o700)
    return scratch


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
    ``local_dir``: Spark's scratch (see :func:`private_scratch`; default a private temp directory).
    """
    prepare_environment()
    from pyspark.sql import SparkSession

    # under spark-submit (the JVM is already up) its --master and --conf win unless a master is asked for
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    master = master or os.environ.get("CDC_SPARK_MASTER") or (None if submitted else "local[2]")
    scratch = private_scratch(local_dir)
    options = {
        "spark.app.name": app_name,
        "spark.driver.memory": driver_memory,
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.local.dir": str(scratch),
        # Hadoop's local filesystem applies its own umask (022, key fs.permissions.umask-mode) to
        # checkpoint files and directories: keep them private
        "spark.hadoop.fs.permissions.umask-mode": "077",
        "spark.sql.warehouse.dir": str(scratch / "warehouse"),
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.sql.streaming.stopTimeout": "60s",
        # the micro-batch fixed cost matters for freshness: keep the state-store and
        # maintenance machinery out of the way (the job keeps no Spark state)
        "spark.sql.streaming.minBatchesToRetain": "20",
        "spark.python.worker.reuse": "true",
    }
    if master:
        options["spark.master"] = master
    if (master or "").startswith("local"):
        # on a cluster the executors connect back to the driver: Spark's own address then
        # (SPARK_LOCAL_IP / SPARK_LOCAL_HOSTNAME, or spark.driver.host: docs/apply.md)
        options["spark.driver.host"] = "127.0.0.1"
        options["spark.driver.bindAddress"] = "127.0.0.1"
    if not submitted:
        start_driver_jvm(options)
    builder = SparkSession.builder
    for key, value in options.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    quiet_query_failures(spark)
    return spark


#: the streaming engine's loggers: a query's failure is logged there, and the apply job reports it
STREAMING_LOGGERS = "org.apache.spark.sql.execution.streaming"


def quiet_query_failures(spark: SparkSession) -> None:
    """Spark logs a streaming query's failure with its stack trace as it ends. The apply job reports
    every failure itself, whole (:meth:`spark_jobs.lifecycle.QueryLoop.raise_if_failed`), and one is
    not a failure: a micro-batch that Spark starts while the job is being stopped between batches is
    refused, having done nothing, and replayed by the next run (``lifecycle.STOP_REQUESTED``). Spark
    would log that refusal as a stack trace on a graceful stop."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
        STREAMING_LOGGERS, jvm.org.apache.logging.log4j.Level.OFF
    )


def start_driver_jvm(options: dict[str, str]) -> None:
    """Start the driver's JVM (pyspark's py4j gateway) with ``options`` in a session and process
    group of its own, and its SparkContext on it; nothing when a JVM is already up.

    A supervisor stops a service by signalling its process group (``kill -TERM -PGID``): the JVM,
    a child of this process, would get the signal too and run its shutdown hooks (stopping the
    SparkContext under the micro-batch in progress), and so would the Python workers it starts, in
    its group. Out of the group, the signal reaches this process only, which stops the job
    gracefully and then the JVM. The JVM still ends with this process, however that ends: pyspark's
    gateway server exits when its stdin, a pipe from this process, reaches EOF (``kill -9`` of this
    process included), and its Python workers end with it."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None or "SPARK_REMOTE" in os.environ:
        return
    conf = SparkConf().setAll(list(options.items()))
    # pyspark adds its own preexec_fn (ignoring SIGINT) and stdin pipe to these
    gateway = launch_gateway(conf, popen_kwargs={"start_new_session": True})  # type: ignore[no-untyped-call]
    SparkContext(conf=conf, gateway=gateway)
