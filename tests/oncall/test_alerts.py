"""The compose stack's Prometheus: alert rules valid (`promtool check rules`) and firing on the critical
verdicts (`promtool test rules`), its config valid, a Prometheus service scraping `cdc serve`."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cdc.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "compose" / "prometheus"
pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool (Debian's prometheus)"
)


def _promtool(*args: str, cwd: Path = PROM) -> str:
    res = subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_alert_rules_check_and_fire_on_critical_verdicts() -> None:
    out = _promtool("check", "rules", "alerts.yml")
    assert "SUCCESS" in out
    _promtool("test", "rules", "alerts_test.yml")
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"CdcCaptureStopped", "CdcApplyStopped", "CdcErrorRecorded", "CdcSlotRetainedWalCritical"} <= names


def test_prometheus_config_scrapes_cdc_serve(tmp_path: Path) -> None:
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["static_configs"][0]["targets"] == ["status:8787"] and job["metrics_path"] == "/metrics"
    # promtool wants the token file to exist: check a copy pointing at a stand-in
    token = tmp_path / "token"
    token.write_text("x")
    job["authorization"]["credentials_file"] = str(token)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROM / "alerts.yml", tmp_path / "alerts.yml")
    _promtool("check", "config", "prometheus.yml", cwd=tmp_path)

    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    cmd = services["status"]["command"]
    assert cmd[:2] == ["cdc", "serve"] and "--host" in cmd
    build_parser().parse_args(cmd[1:])
    assert "${CDC_SERVE_TOKEN:?" in services["status"]["environment"]["CDC_SERVE_TOKEN"]
    assert "cdc_serve_token" in services["prometheus"]["secrets"]
