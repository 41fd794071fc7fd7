"""`cdc status` on the Kafka backend (the Tansu broker): topics' end offsets and the apply lag."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc.devcluster import PgCluster
from tests.capture.test_reader_support import CaptureEnv, make_env
from tests.oncall.support import STATUS, stage, status

pytestmark = [pytest.mark.postgres, pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture
def env(pg: PgCluster, pg_db: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CaptureEnv]:
    yield from make_env(pg, pg_db, tmp_path, "kafka", request, STATUS.format(window=3))


def test_status_reads_kafka_offsets(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 10) g")
    env.add_table("public.t")
    env.run_once()
    code, report = status(env)
    assert report["log_store"] == {"backend": "kafka", "error": None}
    assert stage(report, "capture")["verdict"] == "OK"
    st = stage(report, "apply", "public.t", "warehouse")
    assert st["lag_offsets"] == 10 and st["lag_seconds"] is not None and st["lag_seconds"] >= 0
    assert st["verdict"] in ("STOPPED", "WARN") and code >= 1  # apply never ran, records pending
