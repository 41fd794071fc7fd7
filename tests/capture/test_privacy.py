"""After a real capture run, nothing under the state directory is open to other users."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc.devcluster import PgCluster
from tests.capture.test_reader_support import CaptureEnv, make_env

pytestmark = [pytest.mark.postgres]


@pytest.fixture
def env(pg: PgCluster, pg_db: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CaptureEnv]:
    yield from make_env(pg, pg_db, tmp_path, "embedded", request)


def test_state_directory_and_files_private_after_capture(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t SELECT g, 'secret row ' || g FROM generate_series(1, 100) g")
    env.add_table("public.t")
    env.run_once()
    env.sql("UPDATE t SET v = 'changed' WHERE id < 10")
    env.run_once()
    found = {p: stat.S_IMODE(p.lstat().st_mode) for p in [env.state, *env.state.rglob("*")]}
    assert any(p.parent.name == "log" or "log" in p.parts for p in found)  # the log store is in there
    open_to_others = {str(p): oct(m) for p, m in found.items() if m & 0o077}
    assert open_to_others == {}
    assert stat.S_IMODE(env.state.stat().st_mode) == 0o700
