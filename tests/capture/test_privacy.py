"""After a real capture run, nothing under the state directory is open to other users."""

from __future__ import annotations

import stat

from tests.plugins.capture import CaptureEnv


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
