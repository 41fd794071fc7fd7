"""The fault suite at its reduced size: every kind of fault once, each backend's own fault (disk_full,
broker_freeze) and half of the others on each log-store backend. After every fault the pipeline catches
up with `cdc verify` clean, nothing lost, nothing applied twice. `make chaos` runs every kind four times
on both.

Time on a 2-core machine: 3.5 to 4.5 minutes a backend (measured: embedded 202 s, Kafka 239-260 s
over three runs): a start-up of about 45 s,
then 20-70 s a fault, most of it `cdc verify` itself (20-30 s even when the pipeline is idle and caught
up). Fewer kinds per backend would bring it under 3 minutes but leave kinds out of CI."""

from __future__ import annotations

import dataclasses
import stat
from pathlib import Path

import pytest

from tests.chaos.harness import FAULT_KINDS, Chaos, Size
from tests.plugins.postgres import PgCluster

pytestmark = [pytest.mark.postgres, pytest.mark.spark, pytest.mark.slow, pytest.mark.chaos]

#: each backend's own fault (disk_full, broker_freeze) and half of the others
CI_KINDS = {
    "embedded": ("reader_kill9", "apply_kill9", "apply_term", "pg_restart_fast", "disk_full", "poison_value"),
    "kafka": (
        "reader_term",
        "apply_kill9_after_sink",
        "walsender_terminate",
        "pg_restart_immediate",
        "broker_freeze",
        "corrupt_record",
    ),
}
assert set(CI_KINDS["embedded"]) | set(CI_KINDS["kafka"]) == set(FAULT_KINDS)


@pytest.mark.parametrize("backend", ["embedded", "kafka"])
@pytest.mark.timeout(900)
def test_every_fault_recovers_with_nothing_lost(
    backend: str, pg: PgCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    db = pg.create_database("chaos")
    broker = request.getfixturevalue("tansu_broker") if backend == "kafka" else None
    kinds = CI_KINDS[backend]
    size = dataclasses.replace(Size.named("ci"), cycles=len(kinds))
    report = Chaos(
        pg,
        db,
        tmp_path,
        backend,
        size,
        seed=7,
        kafka_bootstrap=broker.bootstrap if broker else None,
        kinds=kinds,
        kafka_pid=broker.proc.pid if broker else None,
    ).run()
    print("\n".join(report.lines()))
    assert report.ok, "\n".join(report.lines())
    assert report.lost == 0 and report.duplicated == 0
    assert set(report.faults) | set(report.skipped) == set(kinds)
    assert report.dead_letters_seen >= report.dead_letters_expected
    # what `cdc run` and `cdc apply` wrote as processes (log store, Delta tables, index, Spark
    # checkpoints, metrics, locks) is open to no other user
    state = tmp_path / "state"
    modes = {p: stat.S_IMODE(p.lstat().st_mode) for p in [state, *state.rglob("*")] if not p.is_symlink()}
    assert len(modes) > 50 and {str(p): oct(m) for p, m in modes.items() if m & 0o077} == {}
