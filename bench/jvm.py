"""The driver JVM's own CPU and its flags (issues 33, 35): what one ``cdc apply`` process start
costs, what an idle ``cdc apply`` burns, and the catch-up rate, under each set of JVM flags.

Variants (:data:`VARIANTS`): the flags given to the JVMs a ``cdc apply`` process starts, put in
place of the product's :data:`spark_jobs.session.JVM_OPTIONS` (the driver's
``spark.driver.defaultJavaOptions`` and the launcher's ``SPARK_LAUNCHER_OPTS``): the JVM's own
defaults (tiered C1 + C2 compilers, G1 on 2 cores and 2 GB or more, perf data), C1 alone, and C1 with
the serial collector and no perf data (the product's).

Each variant runs in fresh processes, the variants interleaved round by round:

* **start**: ``cdc --state S apply --once`` of 3,000 changes (a fresh copy of one template state
  directory each time), in a cgroup v1 ``cpuacct`` group of its own (not capped): the CPU of the
  whole process tree -- cdc's Python, Spark's launcher JVM, the driver JVM, its Python workers --
  until the last of them ended (``cpuacct.usage``), and its wall time;
* **idle**: :func:`bench.apply_cluster.idle_cpu` (``--idle-seconds``, default 60; one round): the
  share of a core an idle ``cdc apply`` burns, by role, and the JIT compiler threads' part;
* **catch-up** (the JVM's defaults and the product's flags): :data:`CATCH_UP_INSERTS` inserts and half as many updates of ``bench/apply.py``'s
  table applied by ``ApplyJob.run(once)`` into the warehouse and the index on ``local[2]``, after a
  warm-up: changes/s, and the driver JVM's µs of CPU per change.

``--quick``: 1 round, 20 s idle, 30k inserts. Else ``$BENCH_JVM_ROUNDS`` rounds (default 3), medians;
``$BENCH_JVM_INSERTS`` and ``$BENCH_JVM_IDLE_S`` change the catch-up's and the idle run's sizes.
Writes its section into ``docs/benchmarks/apply.md`` (``python -m bench jvm``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SECTION_OF = "apply"
C1 = "-XX:TieredStopAtLevel=1"
PRODUCT = f"{C1} -XX:+UseSerialGC -XX:-UsePerfData"
#: name -> the JVM flags in place of the product's
VARIANTS = {
    "JVM defaults (C1 + C2, G1)": "",
    "C1 only": C1,
    "C1, serial GC, no perf data (product)": PRODUCT,
}
DEFAULTS, PRODUCT_NAME = "JVM defaults (C1 + C2, G1)", "C1, serial GC, no perf data (product)"
START_CHANGES = (2_000, 1_000)
#: the one failure a start is run again for, by its exact message (the process ended, nothing applied)
CONNECT_BACK = "Python worker failed to connect back."  # inserts, updates
CATCH_UP_INSERTS = 300_000
IDLE_S = 60.0


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LAUNCHER_OPTS", "CDC_SPARK_MASTER")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return env


def _child_flags(flags: str) -> None:
    """In a child: ``flags`` are the JVMs' (``spark_jobs.session.JVM_OPTIONS``)."""
    import spark_jobs.session as session

    session.JVM_OPTIONS = flags


# -- start: one `cdc apply --once` in a cgroup of its own ----------------------------------------------
def _template(base: Path) -> Path:
    from bench.apply import EventGen, _fill, _reg, _state
    from cdc.logstore.embedded import EmbeddedLogStore

    reg = _reg("jvm")
    _, state = _state(base, "template", reg)
    with EmbeddedLogStore(state / "log", writer=True, compaction_interval_s=None) as store:
        _fill(store, EventGen(reg), *START_CHANGES)
    return state


def _start(template: Path, run_dir: Path, flags: str) -> dict[str, float]:
    """One ``cdc apply --once``: ``cpu`` (s, the whole process tree), ``jvm`` (s, the driver JVM's
    own, sampled every 0.1 s until it ends) and ``wall`` (s)."""
    from tests.plugins.spark_standalone import CpuGroup

    state = run_dir / "state"
    shutil.copytree(template, state)
    group = CpuGroup.create(f"cdc-bench-jvm-{os.getpid()}-{run_dir.name}", 2.0)
    procs = Path(f"/sys/fs/cgroup/cpuacct/{group.name}/cgroup.procs")
    cmd = [sys.executable, "-m", "bench.jvm", "--child", "start", flags, "--state", str(state)]
    jvm: dict[int, float] = {}
    try:
        t0 = time.monotonic()
        proc = subprocess.Popen(
            [*cmd, "apply", "--once"],
            env=_env(),
            cwd=run_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: group.add(os.getpid()),
        )
        deadline = time.monotonic() + 600
        while pids := procs.read_text().split():  # the driver JVM ends after cdc's process
            assert time.monotonic() < deadline, f"left in the group: {pids}"
            jvm.update(_jvm_cpu(pids))
            time.sleep(0.1)
        out, err = proc.communicate()
        if proc.returncode != 0 and CONNECT_BACK in err:  # Spark's, on a loaded machine: once more
            print(f"  ({CONNECT_BACK}: run again)", flush=True)
            shutil.rmtree(state, ignore_errors=True)
            return _start(template, run_dir / "again", flags)
        assert proc.returncode == 0, f"cdc apply --once failed ({proc.returncode}): {err[-3000:]}"
        assert "applied 3,000 events" in out, out
        wall, cpu = time.monotonic() - t0, group.usage_s()
    finally:
        group.remove()
        shutil.rmtree(state, ignore_errors=True)
    return {"cpu": cpu, "jvm": sum(jvm.values()), "wall": wall}


def _jvm_cpu(pids: list[str]) -> dict[int, float]:
    """pid -> own CPU s, of those of ``pids`` that are a Spark driver JVM."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        try:
            if b"org.apache.spark.deploy.SparkSubmit" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        out[int(pid)] = (int(f[11]) + int(f[12])) / tick
    return out


def _launcher(flags: str) -> float:
    """CPU s of Spark's launcher JVM alone (``org.apache.spark.launcher.Main`` as ``spark-class``
    runs it, building a driver's command line), children's rusage."""
    import resource

    from spark_jobs.session import prepare_environment
    from tests.plugins.spark_standalone import spark_home

    prepare_environment()
    java = Path(os.environ["JAVA_HOME"], "bin", "java")
    cmd = [
        str(java),
        "-Xmx128m",
        *flags.split(),
        "-cp",
        f"{spark_home()}/jars/*",
        "org.apache.spark.launcher.Main",
    ]
    env = {
        **os.environ,
        "SPARK_HOME": str(spark_home()),
        "SPARK_SCALA_VERSION": "2.13",
    }  # as spark-class has them
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [*cmd, "org.apache.spark.deploy.SparkSubmit", "pyspark-shell"],
        env=env,
        capture_output=True,
        check=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _child_start(flags: str, argv: list[str]) -> int:
    _child_flags(flags)
    from cdc.cli import main

    return main(argv)


# -- idle and catch-up: in a driver process of their own ------------------------------------------------
def _child_idle(flags: str, seconds: float, group: str) -> None:
    _child_flags(flags)
    from bench.apply_cluster import idle_cpu
    from tests.plugins.spark_standalone import CpuGroup

    print("RESULT " + json.dumps(idle_cpu(seconds, group=CpuGroup(group, 2.0))), flush=True)


def _child_catch_up(flags: str, base: Path, inserts: int) -> None:
    _child_flags(flags)
    from bench.apply import EventGen, _fill, _reg, _state, _warm_up
    from bench.apply_cluster import cpu_by_role
    from cdc.logstore.embedded import EmbeddedLogStore
    from spark_jobs.apply import ApplyJob, ApplyOptions
    from spark_jobs.session import get_session

    reg = _reg()
    settings, state = _state(base, "catch-up", reg)
    with EmbeddedLogStore(state / "log", writer=True, compaction_interval_s=None) as store:
        _fill(store, EventGen(reg), inserts, inserts // 2)
    spark = get_session("cdc-bench-jvm", local_dir=base / "spark")
    try:
        _warm_up(spark, base)
        job = ApplyJob(spark, settings, ApplyOptions(once=True, max_records_per_batch=250_000))
        app_id = spark.sparkContext.applicationId
        try:
            cpu0, t0 = cpu_by_role(app_id), time.monotonic()
            summary = job.run()
            seconds, cpu1 = time.monotonic() - t0, cpu_by_role(app_id)
        finally:
            job.close()
    finally:
        spark.stop()
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    print("RESULT " + json.dumps({"records": summary.records, "seconds": seconds, "cpu": cpu}), flush=True)


def _result(cmd: list[str], what: str, group: Any = None) -> dict[str, Any]:
    """The ``RESULT`` a child printed (in ``group``, a :class:`~tests.plugins.spark_standalone.CpuGroup`, if given)."""
    add = (lambda: group.add(os.getpid())) if group else None
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, preexec_fn=add)
    if proc.returncode != 0 and CONNECT_BACK in proc.stderr:  # as in _start: once more
        print(f"  ({CONNECT_BACK}: run again)", flush=True)
        proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, preexec_fn=add)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{what} failed ({proc.returncode}): {proc.stderr[-3000:]}"
    return dict(json.loads(lines[-1][7:]))


# -- the runs --------------------------------------------------------------------------------------------
def run(quick: bool) -> str:
    from tests.plugins.spark_standalone import CpuGroup

    rounds = 1 if quick else int(os.environ.get("BENCH_JVM_ROUNDS", "3"))
    idle_s = 20.0 if quick else float(os.environ.get("BENCH_JVM_IDLE_S", IDLE_S))
    inserts = 30_000 if quick else int(os.environ.get("BENCH_JVM_INSERTS", CATCH_UP_INSERTS))
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-jvm-"))
    try:
        template = _template(base)
        flags = VARIANTS
        starts: dict[str, list[dict[str, float]]] = {v: [] for v in flags}
        idles: dict[str, dict[str, Any]] = {}
        catch: dict[str, list[dict[str, Any]]] = {v: [] for v in (DEFAULTS, PRODUCT_NAME)}
        for r in range(rounds):
            for i, (name, f) in enumerate(flags.items()):
                res = {**_start(template, base / f"s{r}-{i}", f), "launcher": _launcher(f)}
                starts[name].append(res)
                print(
                    f"  start, {name}: {res['cpu']:.2f} s CPU (driver JVM {res['jvm']:.2f} s,"
                    f" launcher JVM {res['launcher']:.2f} s), {res['wall']:.1f} s",
                    flush=True,
                )
            for i, name in enumerate(catch):
                out = base / f"c{r}-{i}"
                cmd = [sys.executable, "-m", "bench.jvm", "--child", "catch-up", flags[name], str(out)]
                catch[name].append(res := _result([*cmd, str(inserts)], f"catch-up, {name}"))
                shutil.rmtree(out, ignore_errors=True)
                print(f"  catch-up, {name}: {res['records'] / res['seconds']:,.0f}/s", flush=True)
        for i, (name, f) in enumerate(flags.items()):
            group = CpuGroup.create(f"cdc-bench-jvm-{os.getpid()}-idle{i}", 2.0)
            try:
                cmd = [sys.executable, "-m", "bench.jvm", "--child", "idle", f, str(idle_s), group.name]
                idles[name] = res = _result(cmd, f"idle, {name}", group)
            finally:
                _remove_when_empty(group)
            print(f"  idle, {name}: {res['all'] / res['wall']:.2%} of a core", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = "\n".join(_report(starts, idles, catch, rounds, inserts))
    print(text)
    return text


def _remove_when_empty(group: Any) -> None:
    procs = Path(f"/sys/fs/cgroup/cpuacct/{group.name}/cgroup.procs")
    deadline = time.monotonic() + 60
    while procs.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)
    group.remove()


def _jit(threads: dict[str, float]) -> float:
    return sum(v for k, v in threads.items() if "Compiler" in k)


def _report(
    starts: dict[str, list[dict[str, float]]],
    idles: dict[str, dict[str, Any]],
    catch: dict[str, list[dict[str, Any]]],
    rounds: int,
    inserts: int,
) -> list[str]:
    med = statistics.median
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        "## The driver JVM's flags (issues 33, 35): start-up, idle and catch-up CPU",
        "",
        f"{rounds} round{'s' * (rounds > 1)}, medians (each run in brackets); variants interleaved."
        f" Load average at the end: {load} (a shared 2-core machine: other work ran alongside).",
        "",
        f"- start: one `cdc apply --once` of {sum(START_CHANGES):,} changes, the whole process tree's CPU"
        " (cgroup `cpuacct.usage`: cdc's Python, Spark's launcher JVM, the driver JVM, its Python workers),"
        " the driver JVM's own (sampled every 0.1 s), and Spark's launcher JVM run alone;",
        "- idle: an idle `cdc apply` (`bench.apply_cluster.idle_cpu`, one run), share of a core: all its"
        " processes (cgroup) and the driver JVM; JIT: the driver JVM's compiler threads;",
        f"- catch-up: {inserts:,} inserts + {inserts // 2:,} updates into the warehouse and the index on"
        " local[2], changes/s and the driver JVM's µs of CPU per change.",
        "",
        "| JVM flags | start: CPU s | start: driver JVM s | start: launcher JVM s | start: wall s"
        " | idle: all | idle: driver JVM | idle: JIT s/min | catch-up changes/s | catch-up: driver JVM µs/change |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, runs in starts.items():
        cpu = [r["cpu"] for r in runs]
        idle = idles.get(name)
        cells = [
            f"{med(cpu):.2f} ({', '.join(f'{c:.2f}' for c in cpu)})",
            f"{med(r['jvm'] for r in runs):.2f}",
            f"{med(r['launcher'] for r in runs):.2f}",
            f"{med(r['wall'] for r in runs):.1f}",
        ]
        if idle:
            wall = idle["wall"]
            cells += [
                f"{idle['all'] / wall:.2%}",
                f"{idle['roles']['driver JVM'] / wall:.2%}",
                f"{_jit(idle['threads']) / wall * 60:.3f}",
            ]
        else:
            cells += ["-"] * 3
        if catch.get(name):
            rates = [c["records"] / c["seconds"] for c in catch[name]]
            jvm_us = med(c["cpu"]["driver JVM"] / c["records"] * 1e6 for c in catch[name])
            cells += [f"{med(rates):,.0f} ({', '.join(f'{x:,.0f}' for x in rates)})", f"{jvm_us:.2f}"]
        else:
            cells += ["-", "-"]
        lines.append(f"| {name}: `{VARIANTS[name] or '(none)'}` | " + " | ".join(cells) + " |")
    return [*lines, ""]


if __name__ == "__main__":
    if sys.argv[1:3] == ["--child", "start"]:
        sys.exit(_child_start(sys.argv[3], sys.argv[4:]))
    elif sys.argv[1:3] == ["--child", "idle"]:
        _child_idle(sys.argv[3], float(sys.argv[4]), sys.argv[5])
    elif sys.argv[1:3] == ["--child", "catch-up"]:
        _child_catch_up(sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]))
    else:
        run(quick="--quick" in sys.argv)
