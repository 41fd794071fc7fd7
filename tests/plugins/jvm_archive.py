"""A class-data-sharing archive of the Spark driver JVM's classes for the test run (issue 33).

A driver JVM's start loads and verifies some ten thousand classes from Spark's jars; a CDS archive
(JDK 17's dynamic archive: ``-XX:ArchiveClassesAtExit``, then ``-XX:SharedArchiveFile``) maps them
ready-made: a Spark start and one query took 7.6 s CPU and 12.7 s with it, 16.9 s and 46.8 s
without (2026-11-29, load 6.5). The run has a few dozen driver starts (the ``spark`` session of
each xdist worker, every ``cdc apply`` a test starts, the fault suite's restarts), so when a
collected test has the ``spark`` marker, every driver JVM of the run gets the archive through
``PYSPARK_SUBMIT_ARGS`` (``--driver-java-options``, which pyspark puts on the ``spark-submit`` line
after the session's own ``--conf``; inherited by every process the tests start). The driver runs
with :data:`spark_jobs.session.JVM_OPTIONS` as in production, its classes read from the archive.

The archive is made once per machine (per user, pyspark version, its jars, the Java and the
flags), by one short session (a Spark start and a query) under a file lock (both xdist workers wait
for one), in a directory only this user can write: the JVM maps what it finds there. The JVM uses
an archive only with the class path it was made with, which holds no non-empty directory: a driver
started with ``SPARK_CONF_DIR`` set (it joins the class path; tests/cluster/test_standalone.py sets
one) loads its classes as usual, and ``-Xlog:cds=off`` keeps that quiet (tests/capture/
test_cli_output.py holds a quiet apply's stderr empty). A run that already sets ``SPARK_CONF_DIR``
or ``PYSPARK_SUBMIT_ARGS`` is left alone."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

#: what makes the archive: a session (the product's flags), a query through Python, then the JVM's
#: exit, waited for (it writes the archive as it exits, on EOF of its stdin)
WARM_UP = """
from pyspark import SparkContext
from spark_jobs.session import get_session
spark = get_session("cdc-jvm-archive", quiet=True)
spark.createDataFrame([(1, "a")], "id int, v string").groupBy("v").count().collect()
spark.range(100).selectExpr("sum(id)").collect()
jvm = SparkContext._gateway.proc
spark.stop()
jvm.stdin.close()
jvm.wait(timeout=300)
"""
#: silences the JVM's class-data-sharing messages (an archive that does not match is then ignored)
QUIET_CDS = "-Xlog:cds=off -Xlog:cds+dynamic=off"


def _private_dir() -> Path:
    """``$TMPDIR/cdc-test-jvm-UID``, created 0700; refused if a symlink or another user's."""
    path = Path(tempfile.gettempdir()) / f"cdc-test-jvm-{os.geteuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise pytest.UsageError(f"{path} is a symlink, another user's or open to others: remove it")
    return path


def _key() -> str:
    """The pyspark version, its jars and the Java the driver runs: an archive per combination."""
    import pyspark

    from spark_jobs.session import JVM_OPTIONS, _java_home

    jars = sorted(p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    java = Path(_java_home() or "", "bin", "java").resolve()
    parts = [pyspark.__version__, *jars, str(java), str(java.stat().st_mtime_ns if java.exists() else 0)]
    return hashlib.sha256("\n".join([*parts, JVM_OPTIONS]).encode()).hexdigest()[:16]


def _submit_args(java_options: str) -> str:
    """``PYSPARK_SUBMIT_ARGS`` giving the driver ``java_options`` (pyspark appends them to the
    ``spark-submit`` line it starts the driver with, after the session's ``--conf``)."""
    return f"--driver-java-options {shlex.quote(java_options)} pyspark-shell"


def _archive() -> Path:
    """The archive, made now under the lock unless there."""
    base = _private_dir()
    archive = base / f"spark-driver-{_key()}.jsa"
    with (base / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not archive.exists():
            partial = base / f"{archive.name}.{os.getpid()}.partial"
            dump = _submit_args(f"-XX:ArchiveClassesAtExit={partial} {QUIET_CDS}")
            env = {**os.environ, "PYSPARK_SUBMIT_ARGS": dump}
            res = subprocess.run(
                [sys.executable, "-c", WARM_UP], env=env, capture_output=True, text=True, timeout=600
            )
            if res.returncode != 0 or not partial.exists():
                raise pytest.UsageError(
                    f"the Spark driver's class-data-sharing archive was not made (exit {res.returncode}):\n"
                    f"{res.stderr[-3000:]}"
                )
            partial.rename(archive)
    return archive


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or {"SPARK_CONF_DIR", "PYSPARK_SUBMIT_ARGS"} & set(os.environ):
        return
    if not any(item.get_closest_marker("spark") for item in session.items):
        return
    os.environ["PYSPARK_SUBMIT_ARGS"] = _submit_args(f"-XX:SharedArchiveFile={_archive()} {QUIET_CDS}")
