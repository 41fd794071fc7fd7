"""Paths under the state directory cannot escape it; the state directory is private (issue 9 item 4)."""

from __future__ import annotations

import os
import pwd
import stat
from pathlib import Path

import pytest

from cdc import paths
from cdc.cli import main
from cdc.errors import ConfigError
from cdc.registry import TableReg
from sinks.all import SINKS


@pytest.mark.parametrize("name", ["..", ".", "...", "../x", "a/../../b", "/etc", "", "a\x00b", "..\\..", " "])
def test_a_component_stays_in_its_directory(tmp_path: Path, name: str) -> None:
    base = tmp_path / "warehouse"
    part = paths.component(name)
    assert "/" not in part and part not in ("", ".", "..")
    assert (base / part).resolve().parent == base.resolve()


def test_plain_names_keep_their_paths(tmp_path: Path) -> None:
    current, history, tombstones = paths.warehouse_tables(tmp_path, "Mixed Case", "tab.le")
    assert current == tmp_path / "warehouse" / "Mixed_Case" / "tab.le"
    assert history.name == "tab.le__history" and tombstones.name == "tab.le__tombstones"


@pytest.mark.parametrize("schema,table", [("..", ".."), ("..", "x"), (".", ".."), ("public", "..")])
def test_warehouse_and_search_paths_of_dot_names_stay_inside(tmp_path: Path, schema: str, table: str) -> None:
    reg = TableReg(schema, table, f"cdc.{schema}.{table}", ("id",), search=("v",))
    warehouse = (tmp_path / "warehouse").resolve()
    by_sink = {cls.name: cls.locations(tmp_path, reg) for cls in SINKS}
    assert set(by_sink["warehouse"]) == {"current", "history", "tombstones"}
    for p in by_sink["warehouse"].values():
        assert warehouse in p.resolve().parents
        assert p.resolve().parent.parent == warehouse
    assert set(by_sink["search"]) == {"index", "versions"}
    for p in by_sink["search"].values():
        assert p.resolve().parent == (tmp_path / "search").resolve()
    for where in by_sink.values():  # every sink, a new one too: nothing outside the state directory
        assert all(tmp_path.resolve() in p.resolve().parents for p in where.values())


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def test_cli_creates_the_state_directory_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert main(["--state", str(state), "snapshot", "--all"]) == 0  # opens (creates) the registry
    modes = _modes(state)
    assert modes["."] == 0o700 and "registry.db" in modes
    assert all(m & 0o077 == 0 for m in modes.values()), modes


def test_cli_tightens_an_existing_state_directory(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "warehouse" / "s").mkdir(parents=True)
    state.chmod(0o755)
    (state / "warehouse").chmod(0o755)
    (state / "warehouse" / "s" / "part.parquet").write_text("x")
    (state / "warehouse" / "s" / "part.parquet").chmod(0o644)
    assert main(["--state", str(state), "tables", "list"]) == 0
    modes = _modes(state)
    assert all(m & 0o077 == 0 for m in modes.values()), modes
    assert modes["warehouse/s/part.parquet"] == 0o600


def test_spark_scratch_is_private(tmp_path: Path) -> None:
    from spark_jobs.session import private_scratch

    fresh = private_scratch()
    assert fresh != Path("/tmp/cdc-spark") and stat.S_IMODE(fresh.stat().st_mode) == 0o700
    given = private_scratch(tmp_path / "spark" / "scratch")
    assert given == tmp_path / "spark" / "scratch" and stat.S_IMODE(given.stat().st_mode) == 0o700


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a directory owned by another user")
def test_spark_scratch_created_first_by_another_user_is_refused(tmp_path: Path) -> None:
    from spark_jobs.session import private_scratch

    other = tmp_path / "scratch"
    other.mkdir()
    pw = pwd.getpwnam("postgres")
    os.chown(other, pw.pw_uid, pw.pw_gid)
    with pytest.raises(ConfigError, match="another user"):
        private_scratch(other)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(ConfigError):
        private_scratch(link)
