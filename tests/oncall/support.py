"""Helpers of the on-call tests: a capture environment with a `[status]` section, `cdc status --json`
as a subprocess, and the apply job run once in this process on the session's Spark."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.devcluster import PgCluster
from tests.capture.test_reader_support import CaptureEnv, make_env

STATUS = "[status]\nwindow_s = {window}\nlag_warn_s = 30\nlag_critical_s = 600\n"


def env_with_status(
    pg: PgCluster,
    db: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    *,
    window: float = 3,
    extra: str = "",
) -> Iterator[CaptureEnv]:
    yield from make_env(pg, db, tmp_path, "embedded", request, STATUS.format(window=window) + extra)


def status(env: CaptureEnv) -> tuple[int, dict[str, Any]]:
    res = env.cdc("status", "--json", timeout=120)
    assert res.stdout.strip(), res.stderr
    return res.returncode, dict(orjson.loads(res.stdout))


def stage(
    report: dict[str, Any], name: str, table: str | None = None, sink: str | None = None
) -> dict[str, Any]:
    for st in report["stages"]:
        if (
            st["stage"] == name
            and (table is None or st["table"] == table)
            and (sink is None or st["sink"] == sink)
        ):
            return dict(st)
    raise AssertionError(f"no stage {name} {table} {sink} in {[s['stage'] for s in report['stages']]}")


def apply_once(spark: Any, env: CaptureEnv) -> Any:
    from spark_jobs.apply import ApplyJob, ApplyOptions

    job = ApplyJob(spark, env.settings(), ApplyOptions(once=True))
    try:
        return job.run()
    finally:
        job.close()
