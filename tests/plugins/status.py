"""``cdc status --json`` for the on-call tests: the ``[status]`` section of a capture environment's
``cdc.toml`` (:func:`status_config`, for the ``cdc_config`` marker), the report, and one stage of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from tests.plugins.capture import PROCESS_POLL_S, CaptureEnv
from tests.plugins.postgres import wait_for

STATUS = "[status]\nwindow_s = {window}\nlag_warn_s = 30\nlag_critical_s = 600\n"


def status_config(window: float = 3, extra: str = "") -> str:
    """The ``cdc.toml`` lines of a status window of ``window`` seconds, then ``extra``."""
    return STATUS.format(window=window) + extra


def status(env: CaptureEnv) -> tuple[int, dict[str, Any]]:
    res = env.cdc("status", "--json", timeout=120)
    assert res.stdout.strip(), res.stderr
    return res.returncode, dict(orjson.loads(res.stdout))


def status_until(
    env: CaptureEnv, check: Callable[[dict[str, Any]], object], what: str, timeout: float = 60
) -> dict[str, Any]:
    """The first report of ``cdc status --json`` for which ``check`` is truthy, sampled every
    :data:`tests.plugins.capture.PROCESS_POLL_S` (AssertionError naming ``what`` after ``timeout`` seconds)."""
    return dict(
        wait_for(
            lambda: check(report := status(env)[1]) and report,
            timeout=timeout,
            interval=PROCESS_POLL_S,
            what=what,
        )
    )


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
