"""The sinks on a bad day (issue 9, bad input): a Delta table deleted underneath, a Delta table that
cannot be written, a search index another writer holds. Real Delta tables and a real tantivy index;
each case is a clear error (what is wrong, which path, how to fix it) and changes nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from cdc.errors import ApplyError
from cdc.events import encode_key
from sinks import shard_of
from sinks.search import SearchSink, search
from sinks.warehouse import WarehouseSink
from sinks.warehouse.layout import CURRENT_META, Layout
from tests.sinks.feed import Feed, table

APP = "cdc-apply-test"


def _state(sink: WarehouseSink, reg: Any, paths: list[Path]) -> list[tuple[int, list[dict[str, Any]]]]:
    """Each table's Delta version and rows (sorted)."""
    return [
        (DeltaTable(str(p)).version(), sorted(DeltaTable(str(p)).to_pyarrow_table().to_pylist(), key=repr))
        for p in paths
    ]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["current", "history", "tombstones"])
def test_a_deleted_delta_table_is_an_error_not_a_silent_rebuild(sink: WarehouseSink, which: int) -> None:
    reg = table()
    f = Feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": "x"}, 100)), 1, APP)
    sink.apply(
        f.batch(f.change("c", {"id": 2, "name": "b", "note": "y"}, 200), f.delete({"id": 1}, 210)), 2, APP
    )
    trio = list(sink.paths(reg))
    gone = trio[which]
    rest = [p for p in trio if p != gone]
    shutil.rmtree(gone)
    before = _state(sink, reg, rest)
    with pytest.raises(ApplyError) as err:
        sink.apply(f.batch(f.change("c", {"id": 3, "name": "c", "note": "z"}, 300)), 3, APP)
    assert f"the warehouse table {gone} of public.items is gone" in err.value.message
    assert err.value.fix is not None and "cdc snapshot public.items" in err.value.fix
    assert all(str(p) in err.value.fix for p in rest)
    assert not gone.exists() and _state(sink, reg, rest) == before  # nothing written, nothing lost
    # the fix: delete the rest, re-snapshot; the apply job creates the tables afresh
    for p in rest:
        shutil.rmtree(p)
    sink.apply(f.batch(f.change("r", {"id": 2, "name": "b", "note": "y"}, 400)), 4, APP)
    assert [r["id"] for r in sink.current_rows(reg).to_pylist()] == [2]


def test_a_crash_between_creating_the_three_tables_is_not_a_loss(sink: WarehouseSink) -> None:
    """Only the current table exists, just created (no batch committed): the others are created."""
    reg = table()
    f = Feed(reg)
    cur = sink.paths(reg)[0]
    columns = {c.name: c.type for c in reg.columns}
    sink._ensure(cur, columns, CURRENT_META, lambda: Layout.choose(reg, sink.options, lambda: [1]))
    assert DeltaTable(str(cur)).version() == 0
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": "x"}, 100)), 1, APP)
    assert [r["id"] for r in sink.current_rows(reg).to_pylist()] == [1]
    assert all(DeltaTable.is_deltatable(str(p)) for p in sink.paths(reg))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod: a read-only table cannot be made")
def test_a_read_only_delta_table_is_an_error_and_changes_nothing(sink: WarehouseSink) -> None:
    reg = table()
    f = Feed(reg)
    sink.apply(f.batch(f.change("c", {"id": 1, "name": "a", "note": "x"}, 100)), 1, APP)
    trio = list(sink.paths(reg))
    before = _state(sink, reg, trio)
    modes = {}
    for p in trio:
        for d in [p, *(x for x in p.rglob("*") if x.is_dir())]:
            modes[d] = d.stat().st_mode
            d.chmod(0o555)
    try:
        with pytest.raises(Exception) as err:
            sink.apply(f.batch(f.change("u", {"id": 1, "name": "b", "note": "x"}, 200)), 2, APP)
        assert "ermission denied" in str(err.value), err.value
    finally:
        for d, mode in modes.items():
            d.chmod(mode)
    assert _state(sink, reg, trio) == before


HOLD_WRITER = """
import sys, tantivy
index = tantivy.Index.open(sys.argv[1])
writer = index.writer()
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_search_index_held_by_another_writer(tmp_path: Path) -> None:
    """Another process holds the index's tantivy writer lock: a clear error naming the index and
    the fix; the index is unchanged, and once the other writer is gone the batch applies."""
    reg = table(search=("name",))
    f = Feed(reg)
    first = SearchSink(tmp_path)
    first.apply(f.batch(f.change("c", {"id": 1, "name": "widget one", "note": "x"}, 100)), 1, APP)
    first.close()
    # the shard of the next batch's key (id 2)
    two = shard_of(encode_key({"id": 2}).decode(), first.new_shards)
    index = tmp_path / "search" / reg.topic / f"shard-{two}"
    assert (index / "meta.json").is_file()
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD_WRITER, str(index)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "holding"
        second = SearchSink(tmp_path)
        with pytest.raises(ApplyError) as err:
            second.apply(f.batch(f.change("c", {"id": 2, "name": "widget two", "note": "y"}, 200)), 2, APP)
        second.close()
        assert "cannot open the search index of public.items for writing" in err.value.message
        assert "lock" in err.value.message.lower() and str(index) in str(err.value.to_dict())
        assert err.value.fix is not None and "stop it first" in err.value.fix
    finally:
        other.communicate("", timeout=30)
    assert [h.key["id"] for h in search(tmp_path, reg, "widget", limit=10)] == [1]
    third = SearchSink(tmp_path)
    third.apply(f.batch(f.change("c", {"id": 2, "name": "widget two", "note": "y"}, 200)), 2, APP)
    third.close()
    assert sorted(h.key["id"] for h in search(tmp_path, reg, "widget", limit=10)) == [1, 2]
