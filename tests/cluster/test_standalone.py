"""The pipeline on a real Spark standalone cluster (a master and two 1-core workers started from the
pyspark package, tests/plugins/spark_cluster.py): the real reader (`cdc run`) captures a table, `cdc
apply --master spark://...` applies it with its tasks in the cluster's executors, the state directory
shared by the driver and the executors (as object storage would be), and `cdc verify` is clean, also
after the driver was killed with kill -9 between its tasks and its commit; then an executor is killed
with kill -9 while batches flow, and the run still ends clean."""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import orjson
import psycopg

from tests.plugins.capture import CaptureEnv, SourceLoad, wait_caught_up, wait_streaming
from tests.plugins.items import DDL, Source, item_row
from tests.plugins.postgres import wait_for
from tests.plugins.spark_cluster import SparkCluster

APP = "cdc-apply"  # the Spark application name of `cdc apply`
#: an executor's INFO log line for a task it ran
TASK_DONE = re.compile(r"Finished task \S+ in stage \S+ \(TID \d+\)")


def _items(env: CaptureEnv, rows: int) -> None:
    """``public.items`` with ``rows`` rows of edge values, registered (searched on ``name``)."""
    env.sql(DDL)
    src = Source(env.dsn)
    try:
        src.insert(*(item_row(i) for i in range(1, rows + 1)))
    finally:
        src.close()
    env.add_table("public.items", "--search", "name")


def _assert_clean(env: CaptureEnv) -> dict[str, Any]:
    """``cdc verify`` is clean and the three sides hold the source's row count; the report."""
    code, reports = env.verify("--wait", "120")
    assert code == 0, reports
    report = reports[0]
    source_rows = env.fetch("SELECT count(*) FROM public.items")[0][0]
    assert report["source_rows"] == report["warehouse_rows"] == report["search_docs"] == source_rows
    return report


def _tasks_by_executor(cluster: SparkCluster, app_id: str) -> list[int]:
    """How many tasks each executor of ``app_id`` ran (from the executors' own logs)."""
    return [len(TASK_DONE.findall(log)) for log in cluster.executor_logs(app_id)]


def test_apply_once_on_the_cluster_runs_its_tasks_in_executors_and_verifies_clean(
    env: CaptureEnv, spark_cluster: SparkCluster, jvm: None
) -> None:
    _items(env, 80)
    env.run_once()  # the initial snapshot
    src = Source(env.dsn)
    try:
        for i in range(1, 81, 3):
            src.update(i, {"name": f"widget {i} 'quoted'\nnew line \\ back", "qty": -i})
        for i in (5, 6, 7):
            src.delete(i)
        src.change_key(10, 1010)
    finally:
        src.close()
    env.run_once()

    # cluster settings reach the driver through spark-defaults.conf (docs/apply.md)
    conf = env.state.parent / "spark-conf"
    conf.mkdir()
    (conf / "spark-defaults.conf").write_text("spark.executor.memory 640m\n")
    args = ("apply", "--once", "--json", "--master", spark_cluster.url)
    args = (*args, "--max-records-per-batch", "40")
    # the driver killed (kill -9, with its JVM) after the tasks applied micro-batch 1, before its
    # Delta commits: the search shards hold the batch, the warehouse does not
    crashed = env.cdc(*args, extra_env={"SPARK_CONF_DIR": str(conf), "CDC_FAULTS": "apply.after_sink:1"})
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-5000:]
    assert "cdc-fault: apply.after_sink" in crashed.stderr
    # the restart replays batch 1 from the checkpoint and goes on: nothing lost, nothing twice
    res = env.cdc(*args, extra_env={"SPARK_CONF_DIR": str(conf)})
    assert res.returncode == 0, res.stderr[-5000:]
    summary = orjson.loads(res.stdout)
    assert summary["batches"] >= 2 and summary["dead_letters"] == 0  # batch 1 again, then the rest
    assert "batch 1:" in res.stderr
    _assert_clean(env)

    # not local mode: the master ran the application, and its executors ran the tasks
    # the one killed with its driver, then the restart
    killed, app = sorted(spark_cluster.applications(APP), key=lambda a: a["starttime"])
    assert app["state"] == "FINISHED", (killed, app)
    assert app["memoryperexecutor"] == 640, app
    tasks = _tasks_by_executor(spark_cluster, app["id"])
    assert len(tasks) == 2, f"one executor per worker expected, got {tasks}"
    assert sum(tasks) >= summary["batches"], tasks


class _Churn(SourceLoad):
    """Inserts, updates and deletes of ``public.items``, one transaction each, until stopped."""

    def loop(self, conn: psycopg.Connection[Any]) -> None:
        src = Source(self.env.dsn)
        try:
            i = 0
            while not self.stop.is_set():
                i += 1
                src.insert(item_row(1000 + i, gen=i))
                src.update(1 + i % 100, {"name": f"churn {i}", "qty": i})
                if i % 7 == 0:
                    src.delete(1000 + i - 3)
                self.stop.wait(0.01)  # pacing the load, not waiting for anything
        finally:
            src.close()


def _batches(env: CaptureEnv, proc_index: int) -> int:
    """The micro-batches ``cdc apply`` (the ``proc_index``-th spawned process) reported so far."""
    return len(re.findall(r"^batch \d+:", env.proc_log(proc_index), re.M))


def test_an_executor_killed_with_kill_9_while_batches_flow_loses_nothing(
    env: CaptureEnv, spark_cluster: SparkCluster, jvm: None
) -> None:
    _items(env, 100)
    reader = env.spawn("run")
    wait_streaming(env, reader)
    apply = env.spawn("apply", "--master", spark_cluster.url, "--trigger-interval", "0.5")
    apply_index = len(env.procs) - 1

    def running_app() -> dict[str, Any] | None:
        assert apply.poll() is None, env.proc_log(apply_index)[-5000:]
        apps = [a for a in spark_cluster.status()["activeapps"] if a["name"] == APP]
        return apps[0] if apps and apps[0]["cores"] == 2 else None

    with _Churn(env):
        app = wait_for(running_app, timeout=180, interval=0.2, what="the apply to run on both workers")
        executors = wait_for(
            lambda: len(spark_cluster.executors(app["id"])) == 2 and spark_cluster.executors(app["id"]),
            timeout=60,
            what="two executors of the apply",
        )
        wait_for(
            lambda: running_app() and _batches(env, apply_index) >= 2, timeout=180, what="batches to flow"
        )
        victim = min(executors)
        os.kill(victim, signal.SIGKILL)
        after_kill = _batches(env, apply_index)

        def replaced_and_flowing() -> bool:
            running_app()
            now = spark_cluster.executors(app["id"])
            return victim not in now and len(now) == 2 and _batches(env, apply_index) >= after_kill + 3

        wait_for(replaced_and_flowing, timeout=180, interval=0.2, what="a new executor and more batches")
    wait_caught_up(env)
    report = _assert_clean(env)
    assert report["source_rows"] > 100  # the churn's inserts are in

    apply.send_signal(signal.SIGTERM)  # a graceful stop: the batch in progress finishes
    assert apply.wait(timeout=120) == 0, env.proc_log(apply_index)[-5000:]
    reader.send_signal(signal.SIGTERM)
    reader.wait(timeout=60)
    tasks = _tasks_by_executor(spark_cluster, app["id"])
    assert len(tasks) == 3, f"two executors, then the one that replaced the killed one: {tasks}"
    assert sum(tasks) >= _batches(env, apply_index), tasks
