"""Building the local Spark session the apply job, the tests and the benchmarks share.

One session per process: Spark's cold start costs 7-9 s on this machine, so callers build it once
(:func:`get_session`) and reuse it. The session runs ``local[N]`` (default 2) with few shuffle
partitions, no UI, and Python workers running this interpreter (``PYSPARK_PYTHON`` is set to
``sys.executable`` so workers import ``cdc``, ``sinks`` and ``spark_jobs`` from the same venv).
No jars are fetched: the job needs none (the log store is read by the Python Data Source, the sinks
write through ``deltalake`` and ``tantivy``).

``quiet`` (``cdc apply`` without ``--verbose``): Spark's start-up says nothing. The driver's log4j
is configured at ERROR from its start (:data:`QUIET_LOG4J2`, through ``LOG4J_CONFIGURATION_FILE``
unless one is set: without a configuration Spark loads its default profile, says so, and logs
WARN lines such as NativeCodeLoader's and SparkConf's before :func:`get_session` sets ERROR);
the lines the JVM itself prints (the incubator-module warning, :data:`JVM_NOISE`) are dropped from
its stderr, which passes through this process (:class:`StderrFilter`), every other line kept; and
pyspark's own Python warnings (pandas >= 3 "not fully supported") are ignored. Errors still show.

The JVMs this process starts get :data:`JVM_OPTIONS` (issues 33, 35): the driver through
``spark.driver.defaultJavaOptions`` (a user's ``spark.driver.extraJavaOptions``, e.g. in
``$SPARK_CONF_DIR/spark-defaults.conf``, comes after them on the command line and wins), Spark's
launcher (the short-lived JVM ``spark-submit`` runs first to build the driver's command line) through
``SPARK_LAUNCHER_OPTS`` unless set. Under ``spark-submit`` the JVM is already up: its own
``--driver-java-options`` apply.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import select
import shutil
import stat
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING

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


#: the flags of the driver's JVM and of Spark's launcher JVM. The driver's JVM mostly waits: it plans
#: a micro-batch, hands ranges to Python workers and commits, so C2's compilations (hot code
#: compiled a second time, optimised) cost CPU they never pay back, at start and every minute when
#: idle; C1 alone compiles fast and soon has nothing left to compile. A heap of a few hundred MB in
#: use needs no concurrent collector (G1's threads and periodic work): the serial one; and no
#: ``hsperfdata`` file sampled every 50 ms (``jps`` does not list it; ``jstack PID`` still works).
#: Measured by ``python -m bench jvm`` (docs/benchmarks/apply.md); checked again against the JVM's
#: defaults on the test suite (2026-11-29, load 9-17): a Spark start and one query cost 18-20 s CPU
#: with them, 33-34 s without; whole Spark-heavy test files came out even within their noise.
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:-UsePerfData"


def prepare_environment() -> None:
    """Set the environment variables Spark's launcher and workers need (idempotent)."""
    if JVM_OPTIONS:
        os.environ.setdefault("SPARK_LAUNCHER_OPTS", JVM_OPTIONS)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    java = _java_home()
    if java:
        os.environ["JAVA_HOME"] = java


def private_scratch(local_dir: Path | None = None) -> Path:
    """Spark's scratch directory, private to this user: ``local_dir`` created 0700, or a new
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


#: the driver's log4j2 configuration when quiet: Spark's console appender at ERROR from the start
#: (the REPL logger too: at another level than the root's, Spark would print "Setting default log level")
QUIET_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = error
"""

#: what the driver's JVM prints at start whatever log4j says (Spark's launcher always adds the
#: incubating vector module), and Spark's notes about its default log4j profile and REPL log level
JVM_NOISE = re.compile(
    rb"WARNING: Using incubator modules: |Using Spark's default log4j profile: |"
    rb'Setting default log level to "|To adjust logging level use sc\.setLogLevel\('
)


class StderrFilter:
    """A pipe for the JVM's stderr, forwarded line by line to this process's stderr (fd 2) by a
    daemon thread, but for the lines :data:`JVM_NOISE` matches (at their start)."""

    def __init__(self) -> None:
        read_fd, self.write_fd = os.pipe()
        self._read: IO[bytes] = os.fdopen(read_fd, "rb", buffering=0)
        self.dropped: list[bytes] = []
        #: held while a chunk is read and forwarded: what is out of the pipe is on stderr once free
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._forward, name="jvm-stderr", daemon=True)
        self._thread.start()
        _FILTERS.append(self)

    def _forward(self) -> None:
        buffered = b""
        while True:
            select.select([self._read], [], [])
            with self._lock:
                chunk = self._read.read(65536)
                if not chunk:
                    break
                *lines, buffered = (buffered + chunk).split(b"\n")
                kept = []
                for line in lines:
                    if JVM_NOISE.match(line):
                        self.dropped.append(line)
                    else:
                        kept.append(line + b"\n")
                if kept:
                    _write_all(2, b"".join(kept))
        if buffered:
            _write_all(2, buffered)

    def child_started(self) -> None:
        """Close this process's copy of the pipe's write end (the JVM holds its own)."""
        os.close(self.write_fd)

    def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until what the JVM wrote so far is forwarded: nothing left
        in the pipe, and no chunk read from it still being forwarded."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and (left := deadline - time.monotonic()) > 0:
            pending, _, _ = select.select([self._read], [], [], 0)
            if not pending:
                if self._lock.acquire(timeout=left):
                    self._lock.release()
                return
            time.sleep(0.01)


#: the filters of this process's driver JVM (one; :func:`drain_jvm_stderr`)
_FILTERS: list[StderrFilter] = []


def drain_jvm_stderr(timeout_s: float = 0.5) -> None:
    """Before the process ends hard (``os._exit``): what the JVM wrote to its stderr so far is
    forwarded first (at most ``timeout_s``)."""
    for f in _FILTERS:
        f.drain(timeout_s)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):  # a closed stderr: nothing to tell
        while data:
            data = data[os.write(fd, data) :]


@contextlib.contextmanager
def _quiet_log4j(scratch: Path) -> Iterator[None]:
    """``LOG4J_CONFIGURATION_FILE`` pointing at :data:`QUIET_LOG4J2` (written in ``scratch``) while
    the JVM starts (it copies this environment); a configuration the user set is kept."""
    if "LOG4J_CONFIGURATION_FILE" in os.environ:
        yield
        return
    path = scratch / "log4j2-quiet.properties"
    path.write_text(QUIET_LOG4J2)
    os.environ["LOG4J_CONFIGURATION_FILE"] = str(path)
    try:
        yield
    finally:
        os.environ.pop("LOG4J_CONFIGURATION_FILE", None)


def quiet_python_warnings() -> None:
    """pyspark's Python warnings ignored in this process (e.g. its FutureWarning that it does not
    yet fully support pandas >= 3, raised as the first Python object reaches the JVM)."""
    warnings.filterwarnings("ignore", module=r"pyspark(\.|$)")


def get_session(
    app_name: str = "cdc-apply",
    master: str | None = None,
    *,
    shuffle_partitions: int = 2,
    local_dir: Path | None = None,
    driver_memory: str = "2g",
    quiet: bool = False,
) -> SparkSession:
    """The process's Spark session, created on first call (later calls return the same one).

    ``master`` defaults to ``$CDC_SPARK_MASTER`` or ``local[2]`` (under ``spark-submit``: its ``--master``).
    ``local_dir``: Spark's scratch (see :func:`private_scratch`; default a private temp directory).
    ``quiet``: nothing of Spark's start-up on stderr but errors (the module docstring).
    """
    prepare_environment()
    if quiet:
        quiet_python_warnings()
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
        # the Python workers import pyspark from the installed package, not from Spark's zip, whose
        # modules Python compiles again in every worker (spark_jobs/pydaemon.py)
        "spark.python.daemon.module": "spark_jobs.pydaemon",
    }
    if JVM_OPTIONS:
        options["spark.driver.defaultJavaOptions"] = JVM_OPTIONS
    if master:
        options["spark.master"] = master
    if (master or "").startswith("local"):
        # on a cluster the executors connect back to the driver: Spark's own address then
        # (SPARK_LOCAL_IP / SPARK_LOCAL_HOSTNAME, or spark.driver.host: docs/apply.md)
        options["spark.driver.host"] = "127.0.0.1"
        options["spark.driver.bindAddress"] = "127.0.0.1"
    if not submitted:
        start_driver_jvm(options, quiet=quiet, scratch=scratch)
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


def start_driver_jvm(options: dict[str, str], *, quiet: bool = False, scratch: Path | None = None) -> None:
    """Start the driver's JVM (pyspark's py4j gateway) with ``options`` in a session and process
    group of its own, and its SparkContext on it; nothing when a JVM is already up.

    A supervisor stops a service by signalling its process group (``kill -TERM -PGID``): the JVM,
    a child of this process, would get the signal too and run its shutdown hooks (stopping the
    SparkContext under the micro-batch in progress), and so would the Python workers it starts, in
    its group. Out of the group, the signal reaches this process only, which stops the job
    gracefully and then the JVM. The JVM still ends with this process, however that ends: pyspark's
    gateway server exits when its stdin, a pipe from this process, reaches EOF (``kill -9`` of this
    process included), and its Python workers end with it.

    ``quiet``: its start-up noise left out (the module docstring; the log4j configuration is written
    in ``scratch``)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None or "SPARK_REMOTE" in os.environ:
        return
    conf = SparkConf().setAll(list(options.items()))
    # pyspark adds its own preexec_fn (ignoring SIGINT) and stdin pipe to these
    popen: dict[str, object] = {"start_new_session": True}
    if not quiet:
        gateway = launch_gateway(conf, popen_kwargs=popen)  # type: ignore[no-untyped-call]
        SparkContext(conf=conf, gateway=gateway)
        return
    stderr = StderrFilter()  # reading before the JVM starts: it never blocks on a full pipe
    popen["stderr"] = stderr.write_fd
    try:
        with _quiet_log4j(scratch or private_scratch()):
            gateway = launch_gateway(conf, popen_kwargs=popen)  # type: ignore[no-untyped-call]
    finally:
        stderr.child_started()
    SparkContext(conf=conf, gateway=gateway)
