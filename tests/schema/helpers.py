"""Helpers of the schema-change tests (no tests here)."""

from __future__ import annotations

import orjson

from tests.capture.test_reader_support import CaptureEnv


def install_recorder(env: CaptureEnv) -> None:
    """Install the DDL recorder the way a DBA does: `cdc check --fix` (the test role is a superuser)."""
    res = env.cdc("check", "--fix", "--json")
    assert "installed the DDL recorder" in res.stderr, res.stderr
    report = orjson.loads(res.stdout)
    assert "ddl_recorder" in report["checked"]
    assert not [f for f in report["findings"] if f["check"] == "ddl_recorder"], report
