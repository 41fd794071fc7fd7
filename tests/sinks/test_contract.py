"""Every sink of :data:`sinks.all.SINKS` describes itself (:class:`sinks.Sink`): where it keeps a
table, what it holds of it for ``cdc verify``, and the batch it applied last. Run against the real
Delta tables and tantivy index; a new sink in the list is covered by these tests as it is."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.config import Settings
from sinks import ReadBack, Sink, StoredRows, StoredTexts
from sinks.all import SINKS
from tests.sinks.conftest import FeedMaker
from tests.sinks.feed import table

pytestmark = pytest.mark.usefixtures("columnar")

APP = "cdc-apply-contract"
COLS = (("id", "bigint"), ("title", "text"), ("note", "text"))


def _live_keys(back: ReadBack) -> set[int]:
    if isinstance(back, StoredRows):
        return set() if back.table is None else set(back.table.column("id").to_pylist())
    return {orjson.loads(k)["id"] for k in back.docs}


@pytest.mark.parametrize("cls", SINKS, ids=lambda c: c.name)
def test_a_listed_sink_implements_every_describing_method(cls: type[Sink]) -> None:
    for method in ("from_settings", "locations", "read_back", "applied_batch"):
        assert getattr(cls, method).__qualname__.startswith(cls.__name__ + "."), (cls.name, method)


@pytest.mark.parametrize("cls", SINKS, ids=lambda c: c.name)
def test_a_sink_implements_the_deferred_commit_exactly_when_it_declares_it(cls: type[Sink]) -> None:
    """The apply asks :attr:`Sink.commits_in_driver`, never the sink's class: the declaration and
    the two hooks go together."""
    for method in ("defer_commits", "commit_deferred"):
        own = getattr(cls, method).__qualname__.startswith(cls.__name__ + ".")
        assert own == cls.commits_in_driver, (cls.name, method)


@pytest.mark.parametrize("cls", [c for c in SINKS if c.commits_in_driver], ids=lambda c: c.name)
def test_deferred_writes_are_visible_only_once_the_driver_commits_them_once(
    tmp_path: Path, feed: FeedMaker, cls: type[Sink]
) -> None:
    """A task's sink (deferring) applies a batch: no reader sees it, nor its batch id; the driver's
    sink commits what the task handed over (pickled, as it travels): all of it is visible with the
    batch id. The replayed batch defers nothing."""
    reg = table("docs", columns=COLS, search=("title",))
    settings = Settings(state_dir=tmp_path)
    driver, task = cls.from_settings(settings), cls.from_settings(settings)
    try:
        f = feed(reg)
        first = [f.change("c", {"id": i, "title": "a", "note": "n"}, 100 + i) for i in (1, 2, 3, 4)]
        driver.apply(f.batch(*first, f.delete({"id": 4}, 150)), 0, APP)
        batch = f.batch(f.change("u", {"id": 1, "title": "b", "note": "n"}, 200), f.delete({"id": 2}, 201))
        pending: list[Any] = []
        task.defer_commits(pending)
        task.apply(batch, 1, APP)
        assert pending, "the task's apply deferred its writes"
        seen = driver.read_back(reg)
        assert seen is not None and _live_keys(seen) == {1, 2, 3} and driver.applied_batch(reg, APP) == 0
        driver.commit_deferred(pickle.loads(pickle.dumps(pending)), APP, 1)
        seen = driver.read_back(reg)
        assert seen is not None and _live_keys(seen) == {1, 3} and driver.applied_batch(reg, APP) == 1
        replayed: list[Any] = []
        task.defer_commits(replayed)
        task.apply(batch, 1, APP)
        assert replayed == []
    finally:
        driver.close()
        task.close()


@pytest.mark.parametrize("cls", SINKS, ids=lambda c: c.name)
def test_a_sink_says_where_it_lives_what_it_holds_and_how_far_it_got(
    tmp_path: Path, feed: FeedMaker, cls: type[Sink]
) -> None:
    reg = table("docs", columns=COLS, search=("title",))
    sink = cls.from_settings(Settings(state_dir=tmp_path))
    try:
        where = cls.locations(tmp_path, reg)
        assert where and all(tmp_path in p.parents for p in where.values())
        before = sink.read_back(reg)  # describing creates nothing
        assert before is not None and _live_keys(before) == set()
        assert sink.applied_batch(reg, APP) is None and not any(p.exists() for p in where.values())
        f = feed(reg)
        rows = [f.change("c", {"id": i, "title": f"t{i}", "note": "n"}, 100 + i) for i in (1, 2, 3)]
        sink.apply(f.batch(*rows), 4, APP)
        sink.apply(f.batch(f.delete({"id": 2}, 200)), 7, APP)
        after = sink.read_back(reg)
        assert after is not None and _live_keys(after) == {1, 3}
        if isinstance(after, StoredTexts):
            assert after.docs[orjson.dumps({"id": 3}).decode()] == {"title": "t3"}
        assert sink.applied_batch(reg, APP) == 7 and sink.applied_batch(reg, "another-app") is None
        assert all(p.exists() for p in where.values())
    finally:
        sink.close()


@pytest.mark.parametrize("cls", SINKS, ids=lambda c: c.name)
def test_a_table_a_sink_does_not_keep_has_no_locations_and_nothing_to_read(
    tmp_path: Path, cls: type[Sink]
) -> None:
    reg = table("plain", columns=COLS)  # no search columns
    sink = cls.from_settings(Settings(state_dir=tmp_path))
    try:
        kept = bool(cls.locations(tmp_path, reg))
        assert (sink.read_back(reg) is not None) == kept
        assert cls.name in {k.split("_")[0] for k in cls.listing(tmp_path, reg)}
    finally:
        sink.close()
