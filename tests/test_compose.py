"""compose/ cannot run here (no docker engine); these tests parse it and check what it promises."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose" / "docker-compose.yml"


def load() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def test_stack_has_the_production_services() -> None:
    services = load()["services"]
    assert {"postgres", "kafka", "spark-master", "spark-worker", "capture", "apply"} <= set(services)


def test_postgres_is_logical_with_wal2json() -> None:
    pg = load()["services"]["postgres"]
    assert "wal_level=logical" in pg["command"]
    dockerfile = (ROOT / "compose" / "postgres" / "Dockerfile").read_text()
    assert "postgresql-15-wal2json" in dockerfile
    # current minor releases refuse a plugin left out of output_plugin_libraries: the image allows it
    assert "output_plugin_libraries = 'pgoutput, test_decoding, wal2json'" in dockerfile
    assert any(str(c).startswith("max_slot_wal_keep_size=") for c in pg["command"])


def test_kafka_runs_in_kraft_mode_without_zookeeper() -> None:
    services = load()["services"]
    env = services["kafka"]["environment"]
    assert "controller" in env["KAFKA_PROCESS_ROLES"]
    assert not any("zookeeper" in name for name in services)
    assert not any("ZOOKEEPER" in k for k in env)


def test_service_uses_kafka_and_no_secret_is_inline() -> None:
    services = load()["services"]
    for name in ("capture", "apply"):
        env = services[name]["environment"]
        assert env["CDC_LOG"] == "kafka://kafka:9092"
        # the password is interpolated from compose/.env, never written in the file
        assert re.search(r"\$\{CDC_PASSWORD:\?", env["CDC_SOURCE"])
    assert "change-me" not in COMPOSE.read_text()


def test_service_commands_are_real_cdc_verbs() -> None:
    from cdc.cli import build_parser

    parser = build_parser()
    for name in ("capture", "apply"):
        cmd = load()["services"][name]["command"]
        assert cmd[0] == "cdc"
        parser.parse_args(cmd[1:])  # raises SystemExit on an unknown verb


def test_cdc_services_get_time_to_finish_their_batch_when_stopped() -> None:
    """`docker stop` sends SIGTERM to the container's first process, then SIGKILL after the grace
    period (10 s by default): `cdc run` and `cdc apply` finish their batch first, which takes longer
    (docs/apply.md, "Stopping and restarting")."""
    services = load()["services"]
    for name in ("capture", "apply"):
        assert services[name]["stop_signal"] == "SIGTERM"
        grace = re.fullmatch(r"(\d+)s", services[name]["stop_grace_period"])
        assert grace and int(grace.group(1)) >= 60, services[name]["stop_grace_period"]


def test_image_copies_packages_that_exist() -> None:
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (\S+) ", dockerfile, re.M):
        assert (ROOT / src).exists(), src


def test_apply_drives_the_spark_cluster_and_its_workers_share_the_state() -> None:
    services = load()["services"]
    master_cmd, worker_cmd = services["spark-master"]["command"], services["spark-worker"]["command"]
    assert master_cmd[1] == "org.apache.spark.deploy.master.Master"
    host = master_cmd[master_cmd.index("--host") + 1]
    url = f"spark://{host}:7077"  # the master's default port
    apply_env = services["apply"]["environment"]
    assert apply_env["CDC_SPARK_MASTER"] == url
    assert worker_cmd[1:3] == ["org.apache.spark.deploy.worker.Worker", url]
    assert services["spark-worker"]["deploy"]["replicas"] >= 2
    # the executors connect back to the driver by the apply service's name, not a loopback address
    assert apply_env["SPARK_LOCAL_HOSTNAME"] == "apply"
    # the image runs as an unprivileged user: the worker's work directory must be writable (not the venv)
    work = worker_cmd[worker_cmd.index("--work-dir") + 1]
    assert not work.startswith("/opt/venv")
    # the state directory the driver names is the same volume, at the same path, on every worker
    state = apply_env["CDC_STATE"]
    assert f"cdcstate:{state}" in services["apply"]["volumes"]
    assert f"cdcstate:{state}" in services["spark-worker"]["volumes"]
