"""Reused Delta table handles (``sinks/warehouse/handles.py``): always the table's latest version,
and never a handle of another table that took its path."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from sinks.warehouse.handles import Handles, refresh


def _write(path: Path, rows: range, mode: str = "append") -> None:
    write_deltalake(str(path), pa.table({"id": list(rows)}), mode=mode)  # type: ignore[arg-type]


def _ids(table: DeltaTable | None) -> list[int]:
    assert table is not None
    return sorted(table.to_pyarrow_table().column("id").to_pylist())


def test_a_handle_is_reused_and_sees_every_later_commit(tmp_path: Path) -> None:
    path = tmp_path / "t"
    handles = Handles()
    assert handles.get(path) is None
    _write(path, range(3))
    first = handles.get(path)
    _write(path, range(3, 5))  # committed by someone else
    again = handles.get(path)
    assert again is first and again.version() == 1 and _ids(again) == list(range(5))


def test_refresh_lists_the_log_only_when_a_later_commit_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """delta-rs lists the whole ``_delta_log`` to learn the latest version, a cost that grows with
    every commit the log keeps; :func:`refresh` asks it only when the next version's commit file
    exists, and then sees every commit made since, by anyone."""
    path = tmp_path / "t"
    _write(path, range(3))
    table = DeltaTable(str(path))
    updates: list[int] = []
    real = DeltaTable.update_incremental
    monkeypatch.setattr(DeltaTable, "update_incremental", lambda self: updates.append(1) or real(self))
    for _ in range(3):
        assert refresh(table) is table and table.version() == 0
    assert updates == [], "refreshed with no new commit"
    _write(path, range(3, 5))
    _write(path, range(5, 6))
    assert refresh(table).version() == 2 and _ids(table) == list(range(6)) and len(updates) == 1
    assert refresh(table).version() == 2 and len(updates) == 1


def test_a_table_created_again_or_swapped_in_is_opened_anew(tmp_path: Path) -> None:
    path, staged = tmp_path / "t", tmp_path / "copy"
    handles = Handles()
    _write(path, range(10))
    _write(path, range(10, 12))
    old = handles.get(path)
    assert old is not None and old.version() == 1
    shutil.rmtree(path)  # removed, then created again: versions restart
    _write(path, range(100, 101))
    _write(path, range(101, 102))
    _write(path, range(102, 103))
    fresh = handles.get(path)
    assert fresh is not old and _ids(fresh) == [100, 101, 102]
    _write(staged, range(7, 9))  # a copy built beside it, renamed over it (cdc rebuild's swap)
    shutil.rmtree(path)
    staged.rename(path)
    assert _ids(handles.get(path)) == [7, 8]
    shutil.rmtree(path)
    assert handles.get(path) is None


def test_each_thread_has_its_own_handles(tmp_path: Path) -> None:
    path = tmp_path / "t"
    _write(path, range(2))
    handles = Handles()
    mine = handles.get(path)
    theirs: list[DeltaTable | None] = []
    t = threading.Thread(target=lambda: theirs.append(handles.get(path)))
    t.start()
    t.join()
    assert theirs[0] is not None and theirs[0] is not mine and handles.get(path) is mine
