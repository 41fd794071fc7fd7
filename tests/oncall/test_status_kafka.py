"""`cdc status` on the Kafka backend (the Tansu broker): topics' end offsets and the apply lag."""

from __future__ import annotations

import pytest

from tests.plugins.capture import CaptureEnv
from tests.plugins.status import stage, status, status_config

pytestmark = pytest.mark.cdc_config(status_config(window=3), backend="kafka")


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
