"""`cdc serve`: /metrics (parsed by prometheus-client's own parser), /status, the token rule, and the
dashboard in headless Chromium (Debian's /usr/bin/chromium driven by Playwright)."""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from cdc.cli.serve.server import ServeOptions, Server
from cdc.errors import ConfigError
from tests.plugins.apply import apply_once
from tests.plugins.capture import CaptureEnv
from tests.plugins.postgres import wait_for
from tests.plugins.status import stage, status_config, status_until

pytestmark = pytest.mark.cdc_config(status_config(window=30))
CHROMIUM = Path("/usr/bin/chromium")


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


class Running:
    def __init__(self, server: Server) -> None:
        self.server = server
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)
        self.thread.start()
        _host, port = server.address
        self.base = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(timeout=30)


def _pipeline(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE items (id int PRIMARY KEY, name text)")
    env.sql("INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 30) g")
    env.add_table("public.items", "--search", "name")
    env.spawn("run")
    status_until(env, lambda r: stage(r, "capture")["lag_bytes"] == 0, "capture caught up")


def test_metrics_status_and_token(env: CaptureEnv) -> None:
    _pipeline(env)
    settings = env.settings()
    with pytest.raises(ConfigError, match="token"):
        Server(settings, ServeOptions(host="0.0.0.0", port=0))
    run = Running(
        Server(settings, ServeOptions(host="0.0.0.0", port=0, sample_interval_s=1), token=SecretStr("s3cret"))
    )
    try:
        assert _get(run.base + "/metrics")[0] == 401
        assert _get(run.base + "/status", "wrong")[0] == 401
        assert _get(run.base + "/")[0] == 401

        def families_now() -> dict[str, Any]:
            code, body = _get(run.base + "/metrics", "s3cret")
            assert code == 200
            return {f.name: f for f in text_string_to_metric_families(body.decode())}

        families = wait_for(
            lambda: (f := families_now())["cdc_events_captured"].samples[0].value >= 30 and f,
            timeout=30,
            what="the capture counters in /metrics",
        )
        for name in (
            "cdc_source_lag_bytes",
            "cdc_sink_lag_seconds",
            "cdc_events_captured",
            "cdc_events_applied",
            "cdc_dead_letters",
            "cdc_slot_retained_wal_bytes",
            "cdc_stage_severity",
        ):
            assert name in families, sorted(families)
        assert families["cdc_events_captured"].type == "counter"
        assert families["cdc_events_captured"].samples[0].name == "cdc_events_captured_total"
        assert families["cdc_events_captured"].samples[0].value >= 30
        sinks = {
            (s.labels["table"], s.labels["sink"]): s.value for s in families["cdc_sink_lag_seconds"].samples
        }
        assert set(sinks) == {("public.items", "warehouse"), ("public.items", "search")}
        assert families["cdc_source_lag_bytes"].samples[0].value == 0
        code, body = _get(run.base + "/status?token=s3cret")
        report = orjson.loads(body)
        assert code == 200 and report["version"] == 1
        assert {s["stage"] for s in report["stages"]} == {"capture", "slot", "apply", "dead_letters"}
        assert "s3cret" not in body.decode() and "password" not in body.decode()
    finally:
        run.stop()


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")
def test_dashboard_in_chromium(spark_clean: Any, env: CaptureEnv, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    _pipeline(env)
    apply_once(spark_clean, env)
    run = Running(Server(env.settings(), ServeOptions(port=0, sample_interval_s=1)))
    errors: list[str] = []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
            page.goto(run.base + "/")
            page.wait_for_function("window.cdcUpdates >= 1", timeout=30_000)
            rows = page.locator("#stages tbody tr")
            stages = {r.get_attribute("data-stage"): r.get_attribute("data-verdict") for r in rows.all()}
            assert set(stages) == {
                "capture",
                "slot",
                "apply:public.items:warehouse",
                "apply:public.items:search",
                "dead_letters",
            }
            assert all(v in ("OK", "WARN", "STALLED", "STOPPED", "ERROR") for v in stages.values())
            assert page.locator('tr[data-stage="capture"] .verdict').inner_text() == stages["capture"]
            # the chart: a series per stage with lag in seconds, drawn with points
            page.wait_for_function("window.cdcChart && window.cdcChart.data[0].length >= 3", timeout=30_000)
            n_series = page.evaluate("window.cdcChart.series.length")
            assert n_series >= 3
            assert page.evaluate("window.cdcChart.series.slice(1).every(s => s.points.show !== false)")
            drawn = page.evaluate(
                """() => { const c = document.querySelector('#chart canvas');
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && (d[i] < 200 || d[i + 2] < 200)) n++;
                return n; }"""
            )
            assert drawn > 200
            # new changes arrive (apply is not running): the apply stages' lag rises on the page
            env.sql("UPDATE items SET name = 'renamed ' || id WHERE id <= 12")
            page.wait_for_function(
                """() => { const r = document.querySelector('tr[data-stage="apply:public.items:warehouse"]');
                return r && r.children[2].textContent.startsWith('12 offsets'); }""",
                timeout=60_000,
            )
            page.wait_for_function(
                """() => { const d = window.cdcChart.data; const i = window.cdcChart.series.findIndex(
                s => s.label === 'apply:public.items:warehouse'); const ys = d[i]; return ys[ys.length - 1] > 0; }""",
                timeout=60_000,
            )
            shot = Path(os.environ.get("CDC_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
            page.screenshot(path=str(shot), full_page=True)
            browser.close()
    finally:
        run.stop()
    assert not errors, errors
