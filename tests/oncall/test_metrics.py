"""cdc.metrics: atomic, private publication of a process's counters, read back by status."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from cdc import metrics
from cdc.errors import ApplyError, ConfigError


def test_publish_read_back_private_and_final(tmp_path: Path) -> None:
    pub = metrics.Publisher(tmp_path, "capture", interval_s=0.05).start()
    pub.add("events_written", 3)
    pub.add("events_written", 2)
    pub.total("changes_read", 10)
    pub.total("changes_read", 7)  # never lowered
    pub.set("confirmed_lsn", 1234)
    pub.newest("public.a", 2000)
    pub.newest("public.a", 1000)
    pub.batch(0.5)
    pub.batch(1.5)
    pub.publish()
    doc = metrics.read(tmp_path, "capture")
    assert doc is not None
    assert doc["counters"] == {"events_written": 5, "changes_read": 10}
    assert doc["gauges"]["confirmed_lsn"] == 1234
    assert doc["tables"]["public.a"]["newest_commit_ms"] == 2000
    assert doc["batches"]["count"] == 2 and doc["batches"]["seconds_max"] == 1.5
    assert doc["pid"] == os.getpid() and doc["stopped_ms"] is None
    assert metrics.pid_alive(doc) is True
    path = metrics.metrics_path(tmp_path, "capture")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    pub.close()
    doc = metrics.read(tmp_path, "capture")
    assert doc is not None and doc["stopped_ms"] is not None
    assert metrics.pid_alive(doc) is False
    assert set(metrics.read_all(tmp_path)) == {"capture"}


def test_heartbeat_moves_while_alive(tmp_path: Path) -> None:
    from tests.plugins.postgres import wait_for

    with metrics.Publisher(tmp_path, "apply", interval_s=0.05) as pub:
        first = metrics.read(tmp_path, "apply")
        assert first is not None
        wait_for(lambda: (metrics.read(tmp_path, "apply") or {})["heartbeat_ms"] > first["heartbeat_ms"])
        assert pub.snapshot()["role"] == "apply"


def test_error_recorded_by_context_exit(tmp_path: Path) -> None:
    with pytest.raises(ApplyError), metrics.Publisher(tmp_path, "apply"):
        raise ApplyError("boom", fix="do this")
    doc = metrics.read(tmp_path, "apply")
    assert doc is not None
    assert doc["last_error"]["type"] == "ApplyError" and doc["last_error"]["fix"] == "do this"


def test_dead_process_and_bad_role(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from cdc.metrics import Publisher; "
        "Publisher(Path(sys.argv[1]), 'capture').publish()"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    doc = metrics.read(tmp_path, "capture")
    assert doc is not None and doc["stopped_ms"] is None
    assert metrics.pid_alive(doc) is False  # killed without close(): judged by its pid
    # its pid given to a later process (this one): that one started at another time
    mine = metrics.read(tmp_path, "capture") or {}
    mine["pid"] = os.getpid()
    assert metrics.pid_alive(mine) is False
    assert metrics.pid_alive({**mine, "pid_started": None}) is True  # written before pid_started was
    with pytest.raises(ConfigError):
        metrics.metrics_path(tmp_path, "../x")
