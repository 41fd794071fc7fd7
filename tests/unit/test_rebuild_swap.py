"""``cdc rebuild``'s swap (:func:`cdc.cli.rebuild.staged.swap_in`): the staged directory or file takes the live
one's place and the old one moves aside, by an atomic exchange where the filesystem has one and by
two renames where it has not; with no live one, the staged one just moves in."""

from __future__ import annotations

from pathlib import Path

import pytest

import cdc.cli.rebuild.staged as rebuild
from cdc.cli.rebuild.staged import swap_in


def _tree(root: Path, marker: str) -> Path:
    (root / "_delta_log").mkdir(parents=True)
    (root / "_delta_log" / "0.json").write_text(marker)
    return root


@pytest.mark.parametrize("exchange", [True, False])
def test_the_staged_directory_takes_the_live_ones_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(rebuild, "_exchange", lambda a, b: False)
    live = _tree(tmp_path / "warehouse" / "public" / "items", "old")
    staged = _tree(tmp_path / "stage" / "items", "new")
    aside = tmp_path / "replaced" / "0-items"
    swap_in(staged, live, aside)
    assert (live / "_delta_log" / "0.json").read_text() == "new"
    assert (aside / "_delta_log" / "0.json").read_text() == "old"
    assert not staged.exists()


def test_a_file_and_a_missing_live_path(tmp_path: Path) -> None:
    live, staged = tmp_path / "live.sqlite", tmp_path / "staged.sqlite"
    live.write_text("old")
    staged.write_text("new")
    swap_in(staged, live, tmp_path / "aside" / "live.sqlite")
    assert live.read_text() == "new" and (tmp_path / "aside" / "live.sqlite").read_text() == "old"
    fresh = _tree(tmp_path / "fresh", "new")
    target = tmp_path / "search" / "topic"  # no live index yet: moved in, nothing aside
    swap_in(fresh, target, tmp_path / "aside" / "topic")
    assert (target / "_delta_log" / "0.json").read_text() == "new"
    assert not (tmp_path / "aside" / "topic").exists()


def test_the_exchange_is_atomic_where_the_kernel_has_it(tmp_path: Path) -> None:
    a, b = _tree(tmp_path / "a", "A"), _tree(tmp_path / "b", "B")
    assert rebuild._exchange(a, b)  # Linux >= 3.15, glibc >= 2.28 on a local filesystem
    assert (a / "_delta_log" / "0.json").read_text() == "B" and (
        b / "_delta_log" / "0.json"
    ).read_text() == "A"
