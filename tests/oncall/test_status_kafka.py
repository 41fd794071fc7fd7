"""`cdc status` on the Kafka backend (the Tansu broker): topics' end offsets and the apply lag."""

from __future__ import annotations

from typing import Any

import pytest

from tests.plugins.capture import PROCESS_POLL_S, CaptureEnv
from tests.plugins.postgres import wait_for
from tests.plugins.status import stage, status, status_config

pytestmark = pytest.mark.cdc_config(status_config(window=3), backend="kafka")


def test_status_reads_kafka_offsets(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 10) g")
    env.add_table("public.t")
    env.run_once()

    def captured() -> tuple[int, dict[str, Any]] | None:
        code, report = status(env)
        return (code, report) if stage(report, "capture")["verdict"] == "OK" else None

    # each sample is a `cdc status` process, judged over a 3 s window: polled, not one sample
    code, report = wait_for(
        captured, timeout=60, interval=PROCESS_POLL_S, what="capture OK after cdc run --once"
    )
    assert report["log_store"] == {"backend": "kafka", "error": None}
    st = stage(report, "apply", "public.t", "warehouse")
    assert st["lag_offsets"] == 10 and st["lag_seconds"] is not None and st["lag_seconds"] >= 0
    assert st["verdict"] in ("STOPPED", "WARN") and code >= 1  # apply never ran, records pending
