"""The sinks on a bad day (issue 9, bad input): a Delta table deleted underneath, a Delta table that
cannot be written, a search index another writer holds. Real Delta tables and a real tantivy index;
each case is a clear error (what is wrong, which path, how to fix it) and changes nothing else."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from cdc.errors import ApplyError
from cdc.events import encode_key
from sinks import shard_of
from sinks.search import SearchSink, search
from sinks.warehouse import WarehouseOptions, WarehouseSink
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


#: the unprivileged user the read-only write runs as when the tests run as root (CI): root writes
#: through any mode, so a read-only table cannot be made for it
UNPRIVILEGED = "nobody"
REPO = Path(__file__).resolve().parents[2]


def _read_only_write(root: Path, shards: int) -> dict[str, Any]:
    """The read-only case, run by :func:`_as_user` in a process of its own as the user it runs as: a
    batch applied (the user can write the tables while their modes allow it), then every directory
    of the three tables made read-only (r-x) by their owner, another batch applied: its error, and
    the tables' versions and rows before and after it."""
    sink = WarehouseSink(root, WarehouseOptions(buckets=4, maintain_every=0, shards=shards))
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
    error = None
    try:
        sink.apply(f.batch(f.change("u", {"id": 1, "name": "b", "note": "x"}, 200)), 2, APP)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        for d, mode in modes.items():
            d.chmod(mode)
    after = _state(sink, reg, trio)
    return {
        "euid": os.geteuid(),
        "error": error,
        "tables": [str(p) for p in trio],
        "before": repr(before),
        "after": repr(after),
    }


def _as_user() -> None:
    """``python -c`` entry of the child: ``ROOT SHARDS [UID GID]``. With a user, the process
    (started as root, its interpreter where only root can read it) becomes that user for good, with
    no supplementary group, before anything is written: from then on it is that user, as a process
    of its own would be. Prints :func:`_read_only_write`'s result as JSON."""
    root, shards, *user = sys.argv[1:]
    if user:
        os.setgroups([])
        os.setgid(int(user[1]))
        os.setuid(int(user[0]))
    print(json.dumps(_read_only_write(Path(root), int(shards))))


def test_a_read_only_delta_table_is_an_error_and_changes_nothing(sink: WarehouseSink, tmp_path: Path) -> None:
    """A table its owner made read-only cannot be written: the batch fails with "Permission denied"
    and the tables are unchanged. Run in a process of its own as an unprivileged user, so it runs as
    root too (CI): there, as ``nobody`` in a directory ``nobody`` owns (under /tmp: pytest's tmp_path
    is private to root, and a directory the user cannot reach would fail for the wrong reason). The
    user first writes the tables: a later "Permission denied" is the read-only modes', nothing else's."""
    work = tmp_path / "as-user"
    user: list[str] = []
    if os.geteuid() == 0:
        pw = pwd.getpwnam(UNPRIVILEGED)
        work = Path(tempfile.mkdtemp(prefix="cdc-read-only-"))
        os.chown(work, pw.pw_uid, pw.pw_gid)
        user = [str(pw.pw_uid), str(pw.pw_gid)]
    try:
        res = subprocess.run(
            [
                sys.executable,
                "-c",
                "from tests.sinks.test_bad_input import _as_user; _as_user()",
                str(work),
                str(sink.options.shards),
                *user,
            ],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
            cwd=work,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        if user:
            shutil.rmtree(work)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["euid"] != 0, out  # the write was unprivileged: root's would go through the modes
    assert out["error"] is not None and "ermission denied" in out["error"], out
    assert any(t in out["error"] for t in out["tables"]), out  # the read-only table's path, named
    assert out["after"] == out["before"], out


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
