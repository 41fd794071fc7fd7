"""A real Spark standalone cluster on this machine, for tests and benchmarks (the Spark counterpart
of :mod:`cdc.devcluster`): a master and N workers started from the pyspark package
(``$SPARK_HOME/bin/spark-class``, SPARK_HOME = pyspark's package directory). The tests' fixture
(``tests/plugins/spark_cluster.py``) and ``bench/apply_cluster.py`` start it with :func:`start_cluster`.

Each worker offers 1 core and :data:`WORKER_MEMORY`; their work directories (each executor's
``stdout``/``stderr`` under ``<work>/<app id>/<executor id>/``) and scratch are under the test's
given directory, and every process is in a process group of its own, ended (SIGTERM, then
SIGKILL) by :meth:`SparkCluster.stop`, so no executor or Python worker outlives it.

The executors' Python: the driver tells them which interpreter to run (``PYSPARK_PYTHON``, this
venv's, the same path on every worker here), and the workers' environment puts the code under test
first on ``PYTHONPATH`` (what a user does by installing the same ``cdc`` wheel, with its native
dependencies, on every worker: see docs/apply.md, "Running on a cluster")."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from cdc.devcluster import die_with_parent, free_port

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 2
WORKER_MEMORY = "1536m"  # an executor asks 1 GiB by default (spark.executor.memory)
START_TIMEOUT_S = 90.0
EXECUTOR_MAIN = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


@dataclass
class SparkCluster:
    """A running standalone cluster: its master URL, the master's web UI and the processes."""

    url: str  # spark://127.0.0.1:PORT
    webui: str  # http://127.0.0.1:PORT
    base: Path
    master: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    groups: list[CpuGroup] = field(default_factory=list)  # each worker's, when started with a quota

    def status(self) -> dict[str, Any]:
        """The master's JSON (``/json``): workers, active and completed applications."""
        with urllib.request.urlopen(f"{self.webui}/json", timeout=5) as resp:
            return dict(orjson.loads(resp.read()))

    def alive_workers(self) -> int:
        try:
            workers = self.status()["workers"]
        except (OSError, ValueError):  # the master's UI is not up yet (no answer, or not its JSON yet)
            return 0
        return sum(1 for w in workers if w["state"] == "ALIVE")

    def applications(self, name: str) -> list[dict[str, Any]]:
        """The active and completed applications called ``name`` (the master's view: id, cores, state)."""
        body = self.status()
        return [a for a in body["activeapps"] + body["completedapps"] if a["name"] == name]

    def executors(self, app_id: str | None = None) -> dict[int, str]:
        """The executor JVMs of this cluster's workers, from /proc: pid -> application id (an executor
        is a ``java`` child of a worker with :data:`EXECUTOR_MAIN` in its command line)."""
        workers = {w.pid for w in self.workers}
        found: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:  # ended meanwhile
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            if ppid not in workers or EXECUTOR_MAIN.encode() not in argv:
                continue
            app = argv[argv.index(b"--app-id") + 1].decode() if b"--app-id" in argv else ""
            if app_id is None or app == app_id:
                found[int(entry.name)] = app
        return found

    def executor_logs(self, app_id: str) -> list[str]:
        """The stderr of every executor of ``app_id`` (Spark's INFO log: the tasks it ran)."""
        return [
            p.read_text(errors="replace") for p in sorted(self.base.glob(f"worker-*/work/{app_id}/*/stderr"))
        ]

    def processes(self) -> list[subprocess.Popen[bytes]]:
        return [*self.workers, *([self.master] if self.master else [])]

    def stop(self) -> None:
        for proc in self.processes():
            _end_group(proc)
        for group in self.groups:
            group.remove()

    def leftovers(self) -> list[int]:
        """The process groups of the cluster that still hold a process (none after :meth:`stop`)."""
        left = []
        for proc in self.processes():
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                continue
            left.append(proc.pid)
        return left


CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
CFS_PERIOD_US = 100_000


class QuotaUnavailable(RuntimeError):
    """The cgroup v1 ``cpu`` and ``cpuacct`` controllers are not mounted or not writable here."""


@dataclass
class CpuGroup:
    """A cgroup v1 pair (``cpu`` for the quota, ``cpuacct`` for the usage) of the same name: the
    processes added, and their children from then on, share ``quota`` of one core (CFS bandwidth:
    ``cpu.cfs_quota_us`` over a period of :data:`CFS_PERIOD_US`)."""

    name: str
    quota: float

    @classmethod
    def create(cls, name: str, quota: float) -> CpuGroup:
        group = cls(name, quota)
        try:
            for root in (CGROUP_CPU, CGROUP_CPUACCT):
                (root / name).mkdir(exist_ok=True)
            (CGROUP_CPU / name / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (CGROUP_CPU / name / "cpu.cfs_quota_us").write_text(str(round(quota * CFS_PERIOD_US)))
        except OSError as e:
            group.remove()
            raise QuotaUnavailable(
                f"cannot make the cgroup {name} under {CGROUP_CPU} and {CGROUP_CPUACCT} ({e}): CPU quotas"
                " need cgroup v1's cpu and cpuacct controllers mounted and writable (as root)"
            ) from e
        return group

    def add(self, pid: int) -> None:
        for root in (CGROUP_CPU, CGROUP_CPUACCT):
            (root / self.name / "cgroup.procs").write_text(str(pid))

    def usage_s(self) -> float:
        """CPU seconds used by the group's processes since it was made (ended ones included)."""
        return int((CGROUP_CPUACCT / self.name / "cpuacct.usage").read_text()) / 1e9

    def throttled_s(self) -> float:
        """Seconds the group spent throttled: runnable, but its quota for the period used up."""
        for line in (CGROUP_CPU / self.name / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "throttled_time":
                return int(value) / 1e9
        return 0.0

    def remove(self) -> None:
        """Remove the group (once its processes ended: a cgroup with a process cannot go)."""
        for root in (CGROUP_CPU, CGROUP_CPUACCT):
            deadline = time.monotonic() + 10
            while (root / self.name).exists():
                try:
                    (root / self.name).rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """End ``proc`` and everything in its process group (a worker's executors and their Python
    workers): SIGTERM, then SIGKILL for what is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group's stragglers (an executor being torn down)
        return


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: the executors it starts are ended with it
            preexec_fn=die_with_parent,
        )


def cluster_environ(base: Path) -> dict[str, str]:
    """The master's and workers' environment: Java 17, pyspark as SPARK_HOME, loopback only, and the
    code under test first on the executors' PYTHONPATH."""
    from spark_jobs.session import JVM_OPTIONS, prepare_environment

    prepare_environment()  # JAVA_HOME (Java 17), PYSPARK_PYTHON, SPARK_LOCAL_IP: as the driver has them
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_DIRS": str(base / "scratch"),
        "SPARK_LOG_DIR": str(base / "logs"),
        "PYTHONPATH": path,
        # the master and workers schedule and wait: the driver's flags (C1 alone, serial GC)
        "SPARK_DAEMON_JAVA_OPTS": os.environ.get("SPARK_DAEMON_JAVA_OPTS", JVM_OPTIONS),
    }


def start_cluster(base: Path, workers: int = WORKERS, cpu_quota: float | None = None) -> SparkCluster:
    """A master and ``workers`` workers (1 core each), registered with it when this returns. With
    ``cpu_quota``, each worker (and so every executor and Python worker it starts) runs in a cgroup
    of its own capped at that fraction of a core (:class:`CpuGroup`)."""
    for sub in ("scratch", "logs"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    env = cluster_environ(base)
    port, ui = free_port(), free_port()
    cluster = SparkCluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{ui}", base)
    try:
        cluster.master = _spawn(
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--webui-port",
                str(ui),
            ],
            env,
            base / "logs" / "master.log",
        )
        for i in range(workers):
            work = base / f"worker-{i}" / "work"
            work.mkdir(parents=True)
            group = CpuGroup.create(f"cdc-spark-{port}-w{i}", cpu_quota) if cpu_quota else None
            cluster.groups += [group] if group else []
            worker = _spawn(
                [
                    "org.apache.spark.deploy.worker.Worker",
                    cluster.url,
                    *("--host", "127.0.0.1", "--cores", "1", "--memory", WORKER_MEMORY),
                    *("--work-dir", str(work), "--webui-port", str(free_port())),
                ],
                env,
                base / "logs" / f"worker-{i}.log",
            )
            cluster.workers.append(worker)
            if group:  # spark-class execs the JVM, so this pid is the worker's from now on
                group.add(worker.pid)

        def registered() -> bool:
            for proc in [cluster.master, *cluster.workers]:
                assert proc is not None and proc.poll() is None, _logs(base)
            return cluster.alive_workers() == workers

        deadline = time.monotonic() + START_TIMEOUT_S
        while not registered():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{workers} Spark workers did not register in {START_TIMEOUT_S} s:\n{_logs(base)}"
                )
            time.sleep(0.2)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _logs(base: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(base.glob("logs/*.log"))
    )
