"""`cdc status` shows a registered table dropped or renamed at the source, and one refused (its key
column renamed), as ERROR stages with the fix, while the other table's capture goes on."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.plugins.capture import PROCESS_POLL_S, CaptureEnv, wait_streaming
from tests.plugins.postgres import wait_for
from tests.plugins.status import stage, status, status_config

pytestmark = pytest.mark.cdc_config(status_config())


def test_missing_and_refused_tables_are_error_stages_with_the_fix(env: CaptureEnv) -> None:
    for t in ("keep", "gone", "rekeyed"):
        env.sql(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
        env.sql(f"INSERT INTO {t} VALUES (1, 'a')")
        env.add_table(f"public.{t}")
    proc = env.spawn("run")
    try:
        wait_streaming(env, proc)
        _, report = status(env)
        assert not [s for s in report["stages"] if s["stage"] == "source_table"]

        env.sql("DROP TABLE gone")
        env.sql("ALTER TABLE rekeyed RENAME COLUMN id TO rid")

        def both() -> dict[str, Any] | None:
            _, rep = status(env)
            names = {s["table"] for s in rep["stages"] if s["stage"] == "source_table"}
            return rep if names == {"public.gone", "public.rekeyed"} else None

        wait_for(
            lambda: both() is not None, timeout=60, interval=PROCESS_POLL_S, what="both tables in cdc status"
        )
        code, report = status(env)
        gone = stage(report, "source_table", "public.gone")
        assert gone["verdict"] == "ERROR" and "does not exist at the source" in gone["reason"]
        assert "cdc tables remove public.gone" in gone["fix"]
        rekeyed = stage(report, "source_table", "public.rekeyed")
        assert rekeyed["verdict"] == "ERROR" and "REFUSED" in rekeyed["reason"] and "id" in rekeyed["reason"]
        assert "cdc tables add public.rekeyed" in rekeyed["fix"]
        assert code != 0 and report["verdict"] == "CRITICAL"
        text = env.cdc("status")
        assert "public.gone" in text.stdout and "cdc tables remove public.gone" in text.stdout, text.stdout
        assert proc.poll() is None, env.proc_log()  # the capture of the others goes on
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
