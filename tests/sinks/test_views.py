"""Views from joins maintained through :class:`spark_jobs.applier.BatchApplier` on the real Delta
tables (no JVM): a random interleaving of inserts, updates, deletes and key changes on the driving
table and on both joined tables, over many batches; after each batch the view's Delta table must
equal the view's SQL evaluated over an in-memory model of the source. Replays change nothing."""

from __future__ import annotations

import contextlib
import itertools
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from deltalake import DeltaTable

from cdc import paths
from cdc.registry import TableReg, ViewReg
from sinks import RawRecord, touched_of
from sinks.parse import records_table
from sinks.warehouse import WarehouseSink
from sinks.warehouse.views import ViewMaintainer, view_rows
from spark_jobs.applier import BatchApplier
from tests.sinks.feed import Feed, join_tables

APP = "cdc-apply-views-test"
ORDERS, CUSTOMERS, REGIONS = join_tables()
TABLES = [ORDERS, CUSTOMERS, REGIONS]
SQL = (
    "SELECT o.id, o.total, c.name AS customer, r.label AS region FROM orders o "
    "JOIN customers c ON o.customer_id = c.id LEFT JOIN regions r ON c.region = r.code "
    "WHERE o.total > 10 AND c.name <> 'hidden'"
)
VIEW = ViewReg("order_view", SQL, tuple(t.qualified for t in TABLES))
KEYS: dict[str, list[Any]] = {
    "orders": list(range(1, 31)),
    "customers": list(range(1, 9)),
    "regions": [f"r{i}" for i in range(1, 5)],
}


def expected(model: dict[str, dict[Any, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The view's SQL over the model, by hand (an implementation independent of the one under test)."""
    out = []
    for o in model["orders"].values():
        c = model["customers"].get(o["customer_id"])
        if (
            c is None
            or o["total"] is None
            or not o["total"] > 10
            or c["name"] is None
            or c["name"] == "hidden"
        ):
            continue
        r = model["regions"].get(c["region"])
        out.append({"id": o["id"], "total": o["total"], "customer": c["name"], "region": r and r["label"]})
    return sorted(out, key=lambda row: row["id"])


def stored(state: Path) -> list[dict[str, Any]]:
    rows = view_rows(state, VIEW.name)
    assert rows is not None
    return sorted(
        ({k: v for k, v in r.items() if not k.startswith("_cdc_")} for r in rows.to_pylist()),
        key=lambda row: row["id"],
    )


class Workload:
    """Random changes to the three tables, as the reader's records, and the model they leave."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.feeds = {t.table: Feed(t) for t in TABLES}
        self.model: dict[str, dict[Any, dict[str, Any]]] = {t.table: {} for t in TABLES}
        self.lsn = 1000

    def row(self, name: str, key: Any) -> dict[str, Any]:
        rng = self.rng
        if name == "orders":
            return {
                "id": key,
                "customer_id": rng.choice([*KEYS["customers"], 99]),
                "total": rng.choice([None, 5, 11, 50, 500]),
                "note": rng.choice(["", "a'b", 'q"\\n\n']),
            }
        if name == "customers":
            return {
                "id": key,
                "name": rng.choice(["ann", "bob", "cy", "hidden", None]),
                "region": rng.choice([*KEYS["regions"], "zz"]),
            }
        return {"code": key, "label": rng.choice(["north", "south", None])}

    def _key(self, name: str) -> str:
        return "code" if name == "regions" else "id"

    def one(self) -> list[RawRecord]:
        """One random change: insert, update, delete or key change of a random table's row."""
        name = self.rng.choice(list(self.model))
        feed, rows, key_col = self.feeds[name], self.model[name], self._key(name)
        present = sorted(rows, key=str)
        absent = [k for k in KEYS[name] if k not in rows]
        actions = ["insert"] * 4 + ["update"] * 3 + ["delete", "rekey"]
        action = self.rng.choice(actions) if present else "insert"
        self.lsn += 10
        if action == "insert" and absent:
            key = self.rng.choice(absent)
            rows[key] = self.row(name, key)
            return [feed.change("c", rows[key], self.lsn)]
        if action in ("update", "insert"):
            key = self.rng.choice(present)
            rows[key] = self.row(name, key)
            return [feed.change("u", rows[key], self.lsn)]
        key = self.rng.choice(present)
        old = rows.pop(key)
        out = feed.delete({key_col: key}, self.lsn)
        if action == "rekey" and absent:
            new = self.rng.choice(absent)
            rows[new] = {**old, key_col: new}
            out.append(feed.change("c", rows[new], self.lsn, 2))
        return out

    def batch(self, n: int) -> list[RawRecord]:
        return [r for _ in range(n) for r in self.one()]


def test_parse_of_the_view_used_here_is_accepted() -> None:
    from cdc.views import parse_view

    spec = parse_view(VIEW.name, SQL, TABLES)
    assert spec.columns == ("id", "total", "customer", "region")
    assert [(j.alias, j.kind, j.pairs) for j in spec.joins] == [
        ("c", "inner", (("customer_id", "id"),)),
        ("r", "left", (("region", "code"),)),
    ]


# seed 2 is make test's alone (tests/plugins/markers.py): 11 s of make check's inner loop each
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.full_size)])
def test_view_equals_its_sql_after_every_batch(tmp_path: Path, seed: int) -> None:
    registered: list[ViewReg] = []
    maintainer = ViewMaintainer(tmp_path, lambda: (list(registered), TABLES), APP)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    sink = WarehouseSink(tmp_path)
    app = BatchApplier([sink], by_topic.get, APP, after=maintainer.maintain)
    work = Workload(seed)
    skipped = 0
    try:
        for batch_id in range(2):  # the tables hold data before the view is registered
            app.run(records_table(work.batch(80)), batch_id)
        assert view_rows(tmp_path, VIEW.name) is None
        registered.append(VIEW)
        for batch_id in range(2, 22):
            records = work.batch(work.rng.randint(1, 12))
            out = app.run(records_table(records), batch_id)
            assert stored(tmp_path) == expected(work.model), f"batch {batch_id}"
            if batch_id == 2:
                assert out.views[VIEW.name][0] == -1  # built whole from the tables' current state
            # a replay of the same batch commits nothing to the view
            before = DeltaTable(str(paths.view_table(tmp_path, VIEW.name))).version()
            again = app.run(records_table(records), batch_id)
            assert DeltaTable(str(paths.view_table(tmp_path, VIEW.name))).version() == before
            assert stored(tmp_path) == expected(work.model), f"batch {batch_id} replayed"
            # skipped by the view's application transaction, unless the batch committed nothing to
            # it (a MERGE that changes nothing commits nothing): then recomputed to the same rows
            skipped += again.views == {VIEW.name: (0, 0, 0.0)}
        assert skipped >= 5
        assert len(expected(work.model)) >= 5  # the view is not trivially empty
    finally:
        app.close(close_sinks=True, timeout=60)


def test_view_catches_up_when_the_base_tables_committed_first(tmp_path: Path) -> None:
    """A crash between the base tables' commits and the view's: the batch's replay, which the base
    tables skip, still brings the view up to date (its changed keys come from the batch)."""
    maintainer = ViewMaintainer(tmp_path, lambda: ([VIEW], TABLES), APP)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    sink = WarehouseSink(tmp_path)
    with_views = BatchApplier([sink], by_topic.get, APP, after=maintainer.maintain)
    without = BatchApplier([sink], by_topic.get, APP)
    work = Workload(7)
    try:
        with_views.run(records_table(work.batch(30)), 0)
        assert stored(tmp_path) == expected(work.model)
        for batch_id in range(1, 8):
            records = work.batch(6)
            without.run(records_table(records), batch_id)  # the view's commit "crashed"
            with_views.run(records_table(records), batch_id)  # the replay
            assert stored(tmp_path) == expected(work.model), f"batch {batch_id}"
    finally:
        with_views.close(close_sinks=True, timeout=60)
        without.close(close_sinks=False, timeout=60)


def test_truncate_of_a_joined_table_recomputes_the_view(tmp_path: Path) -> None:
    maintainer = ViewMaintainer(tmp_path, lambda: ([VIEW], TABLES), APP)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP, after=maintainer.maintain)
    work = Workload(3)
    try:
        app.run(records_table(work.batch(120)), 0)
        assert any(r["region"] is not None for r in stored(tmp_path))
        work.lsn += 10
        work.model["regions"].clear()
        out = app.run(records_table(work.feeds["regions"].truncate(work.lsn)), 1)
        assert out.views[VIEW.name][0] == -1
        assert stored(tmp_path) == expected(work.model)
        assert stored(tmp_path) and all(r["region"] is None for r in stored(tmp_path))
    finally:
        app.close(close_sinks=True, timeout=60)


def test_cdc_sql_reads_the_view_by_its_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``cdc sql "SELECT * FROM NAME"`` sees the view (without its ``_cdc_`` columns), with the
    apply's registry as the maintainer's source of views and tables."""
    import json

    from cdc.cli import main
    from cdc.registry import Registry

    with Registry(tmp_path) as registry:
        for t in TABLES:
            registry.add(t)
        registry.add_view(VIEW)
        maintainer = ViewMaintainer(tmp_path, lambda: (registry.list_views(), registry.list_tables()), APP)
        by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
        app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP, after=maintainer.maintain)
        work = Workload(11)
        try:
            for batch_id in range(3):
                app.run(records_table(work.batch(60)), batch_id)
        finally:
            app.close(close_sinks=True, timeout=60)
    assert main(["--state", str(tmp_path), "sql", f"SELECT * FROM {VIEW.name} ORDER BY id", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == expected(work.model) and got
    where = f"SELECT id FROM {VIEW.name} WHERE customer = 'ann' ORDER BY id"
    assert main(["--state", str(tmp_path), "sql", where, "--json"]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [
        r["id"] for r in expected(work.model) if r["customer"] == "ann"
    ]


def _orders_only(work: Workload, n: int) -> list[RawRecord]:
    """``n`` inserts or updates of orders (no event of the other tables)."""
    out = []
    for _ in range(n):
        key = work.rng.choice(KEYS["orders"])
        work.lsn += 10
        op = "u" if key in work.model["orders"] else "c"
        work.model["orders"][key] = work.row("orders", key)
        out.append(work.feeds["orders"].change(op, work.model["orders"][key], work.lsn))
    return out


@contextlib.contextmanager
def _registered_view(state: Path) -> Iterator[tuple[Any, BatchApplier]]:
    """The tables and :data:`VIEW` registered in ``state``'s registry, and an applier that maintains
    the view after each batch, recording a refusal in the registry."""
    from cdc.registry import Registry

    with Registry(state) as registry:
        for t in TABLES:
            registry.add(t)
        registry.add_view(VIEW)
        maintainer = ViewMaintainer(
            state, lambda: (registry.list_views(), registry.list_tables()), APP, registry.set_view_refused
        )
        by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
        yield registry, BatchApplier([WarehouseSink(state)], by_topic.get, APP, after=maintainer.maintain)


def test_a_view_that_no_longer_parses_is_refused_then_computed_whole(tmp_path: Path) -> None:
    """A column the view reads is dropped from the registration: the view is refused (recorded,
    left as it was) while its tables go on; once it parses again it is computed whole."""

    with _registered_view(tmp_path) as (registry, app):
        work = Workload(11)
        try:
            app.run(records_table(work.batch(180)), 0)
            built = stored(tmp_path)
            assert built == expected(work.model) and built
            registry.set_columns(
                "public", "customers", tuple(c for c in CUSTOMERS.columns if c.name != "name")
            )
            out = app.run(records_table(_orders_only(work, 15)), 1)
            assert out.views[VIEW.name] == (0, 0, 0.0)  # refused: nothing written
            assert stored(tmp_path) == built
            (view,) = registry.list_views()
            assert "no captured column 'name'" in view.extra["refused"]["reason"]
            assert [t.events for t in out.tables] == [15]  # the table went on
            registry.set_columns("public", "customers", CUSTOMERS.columns)
            out = app.run(records_table(_orders_only(work, 5)), 2)
            assert out.views[VIEW.name][0] == -1  # computed whole: it missed batch 1
            assert stored(tmp_path) == expected(work.model)
            assert "refused" not in registry.list_views()[0].extra
        finally:
            app.close(close_sinks=True, timeout=60)


def test_after_committed_slices_the_view_recomputes_the_keys_they_changed(tmp_path: Path) -> None:
    """The work in Spark tasks (``--work tasks``): each slice hands the driver what it changed
    (:attr:`SliceResult.touched`), and after ``commit_slices`` the driver recomputes those keys
    (:meth:`ViewMaintainer.maintain_touched`), once per batch id; :meth:`ViewMaintainer.rebuild`
    computes the view whole to the same rows."""
    from spark_jobs.tasks import SliceResult, touched_by

    maintainer = ViewMaintainer(tmp_path, lambda: ([VIEW], TABLES), APP)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP)  # the tasks' commits, no views
    work = Workload(13)
    try:
        for batch_id in range(6):
            prepared = app.prepare(records_table(work.batch(70 if batch_id == 0 else 15)))
            app.apply(prepared, batch_id)
            slices = [SliceResult(touched=touched_of([b])) for b in prepared.batches]  # one per table
            out = maintainer.maintain_touched(touched_by(slices), batch_id)
            assert (out[VIEW.name].keys == -1) == (batch_id == 0), out  # built whole, then by keys
            assert stored(tmp_path) == expected(work.model), f"batch {batch_id}"
            assert maintainer.maintain_touched(touched_by(slices), batch_id)[VIEW.name].skipped  # a replay
        assert stored(tmp_path)
        assert maintainer.rebuild(99)[VIEW.name].keys == -1
        assert stored(tmp_path) == expected(work.model)
    finally:
        app.close(close_sinks=True, timeout=60)


def test_view_equals_its_sql_with_batches_parsed_in_columns(tmp_path: Path) -> None:
    """Large batches (parsed in columns, :mod:`sinks.columnar`): the changed keys come from the
    columnar form's events; key changes and deletes among them."""
    maintainer = ViewMaintainer(tmp_path, lambda: ([VIEW], TABLES), APP)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP, after=maintainer.maintain)
    work = Workload(17)
    try:
        for batch_id in range(6):
            records: list[RawRecord] = []
            for _ in range(300):  # upserts of every table
                name = work.rng.choice(list(work.model))
                key = work.rng.choice(KEYS[name])
                work.lsn += 10
                op = "u" if key in work.model[name] else "c"
                work.model[name][key] = work.row(name, key)
                records.append(work.feeds[name].change(op, work.model[name][key], work.lsn))
            records += work.batch(8)  # deletes and key changes among them
            out = app.run(records_table(records), batch_id)
            assert out.columnar == len(out.tables) == 3
            assert stored(tmp_path) == expected(work.model), f"batch {batch_id}"
    finally:
        app.close(close_sinks=True, timeout=60)


def test_a_view_whose_rows_no_longer_fit_its_table_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    with _registered_view(tmp_path) as (registry, app):
        work = Workload(11)
        try:
            app.run(records_table(work.batch(180)), 0)
            path = str(paths.view_table(tmp_path, VIEW.name))
            odd = pa.table({"_cdc_key": ["x"], "other": [1]})
            write_deltalake(path, odd, mode="overwrite", schema_mode="overwrite")
            out = app.run(records_table(_orders_only(work, 10)), 1)
            assert out.views[VIEW.name] == (0, 0, 0.0) and [t.events for t in out.tables] == [10]
            (view,) = registry.list_views()
            assert "its table holds" in view.extra["refused"]["reason"]
            assert "cdc views remove" in view.extra["refused"]["fix"]
        finally:
            app.close(close_sinks=True, timeout=60)


def test_a_views_search_index_follows_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--search COLS``: the view's rows as documents (the view's search index, built from its
    Delta table after each commit), equal to the view after every batch and through a replay;
    ``cdc search NAME`` finds them."""
    import json

    import orjson

    from cdc.cli import main
    from cdc.registry import Registry
    from sinks.search import SearchSink
    from sinks.view_search import view_search_reg

    view = ViewReg(VIEW.name, SQL, VIEW.tables, search=("customer", "region"))
    search = SearchSink(tmp_path, shards=2)
    with Registry(tmp_path) as registry:
        for t in TABLES:
            registry.add(t)
        registry.add_view(view)
        maintainer = ViewMaintainer(
            tmp_path, lambda: (registry.list_views(), registry.list_tables()), APP, search=search
        )
        by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
        app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP, after=maintainer.maintain)
        work = Workload(19)
        try:
            for batch_id in range(8):
                records = work.batch(120 if batch_id == 0 else 10)
                app.run(records_table(records), batch_id)
                if batch_id == 4:  # the index is rebuilt whole by a replay whose keys are unknown
                    app.run(records_table(records), batch_id)
                back = search.read_back(view_search_reg(view))
                assert back is not None
                docs = {orjson.loads(orjson.loads(k)["_cdc_key"])["id"]: v for k, v in back.docs.items()}
                want = {
                    r["id"]: {"customer": r["customer"], "region": r["region"] or ""}
                    for r in expected(work.model)
                }
                got = {i: {c: d.get(c) or "" for c in ("customer", "region")} for i, d in docs.items()}
                assert got == want, f"batch {batch_id}"
        finally:
            app.close(close_sinks=True, timeout=60)
            maintainer.close()
    name = expected(work.model)[0]["customer"]
    query = ["search", VIEW.name, f"customer:{name}", "--limit", "1000", "--json"]
    assert main(["--state", str(tmp_path), *query]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == sum(r["customer"] == name for r in expected(work.model)) > 0


def _history(state: Path) -> list[dict[str, Any]]:
    path = paths.view_history(state, VIEW.name)
    return DeltaTable(str(path)).to_pyarrow_table().to_pylist()


def test_a_views_history_keeps_every_version_of_its_rows(tmp_path: Path) -> None:
    """``--history``: after every batch (random changes on all three tables, the view registered
    over tables that hold data) the history holds one version per change of each view row, its open
    rows are exactly the view's rows, a version is closed by the next (``u``, same time) or by the
    row leaving the view (``d``); a replay of a batch adds nothing, nor does a batch that leaves the
    view's rows as they were."""
    view = ViewReg(VIEW.name, SQL, VIEW.tables, extra={"history": True})
    registered: list[ViewReg] = []
    maintainer = ViewMaintainer(tmp_path, lambda: (list(registered), TABLES), APP)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP, after=maintainer.maintain)
    work = Workload(11)
    versions: dict[Any, int] = {}  # per id: the versions the history must hold
    closed: dict[Any, list[str]] = {}  # per id: how its versions were closed, in order
    try:
        app.run(records_table(work.batch(60)), 0)
        registered.append(view)
        before: dict[Any, dict[str, Any]] = {}
        for batch_id in range(1, 16):
            records = work.batch(work.rng.randint(1, 10))
            app.run(records_table(records), batch_id)
            after = {r["id"]: r for r in expected(work.model)}
            for k, row in after.items():
                if before.get(k) != row:
                    versions[k] = versions.get(k, 0) + 1
                    if k in before:
                        closed.setdefault(k, []).append("u")
            for k in before.keys() - after.keys():
                closed.setdefault(k, []).append("d")
            before = after
            count = len(_history(tmp_path))
            app.run(records_table(records), batch_id)  # a replay: skipped by the app transaction
            assert len(_history(tmp_path)) == count
            rows = _history(tmp_path)
            assert len(rows) == sum(versions.values()), f"batch {batch_id}"
            live = [
                {k: v for k, v in r.items() if not k.startswith("_cdc_") and k not in HISTORY_ONLY}
                for r in sorted(rows, key=lambda r: r["id"])
                if r["is_current"]
            ]
            assert live == sorted(stored(tmp_path), key=lambda r: r["id"]) == expected(work.model)
        rows = sorted(_history(tmp_path), key=lambda r: (r["id"], r["valid_from"]))
        for k, ends in closed.items():
            mine = [r for r in rows if r["id"] == k]
            assert [r["_cdc_end_op"] for r in mine if not r["is_current"]] == ends
            for old, new in itertools.pairwise(mine):
                assert old["valid_to"] is not None and old["valid_to"] <= new["valid_from"]
                if old["_cdc_end_op"] == "u":
                    assert old["valid_to"] == new["valid_from"] and new["_cdc_op"] == "u"
        assert "d" in {e for ends in closed.values() for e in ends}
        assert any(len(e) >= 2 for e in closed.values())
    finally:
        app.close(close_sinks=True, timeout=60)


HISTORY_ONLY = {"valid_from", "valid_to", "is_current"}


def test_a_crash_between_the_history_and_the_view_commits_replays_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The history is committed, the view's MERGE fails (a crash between the two commits): the
    batch's replay skips the history (its app transaction) and brings the view to the state the
    history says; no version is written twice."""
    import sinks.warehouse.views as views_mod

    view = ViewReg(VIEW.name, SQL, VIEW.tables, extra={"history": True})
    maintainer = ViewMaintainer(tmp_path, lambda: ([view], TABLES), APP)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP, after=maintainer.maintain)
    work = Workload(5)
    merge = views_mod._merge
    crashed_with_versions = 0

    def crash(*args: Any, **kw: Any) -> None:
        raise OSError("killed between the history's commit and the view's")

    try:
        app.run(records_table(work.batch(60)), 0)
        for batch_id in range(1, 7):
            records = work.batch(20)
            count = len(_history(tmp_path))
            monkeypatch.setattr(views_mod, "_merge", crash)
            with pytest.raises(Exception, match="killed between"):
                app.run(records_table(records), batch_id)
            opened = len(_history(tmp_path)) - count
            crashed_with_versions += opened > 0
            monkeypatch.setattr(views_mod, "_merge", merge)
            app.run(records_table(records), batch_id)
            assert len(_history(tmp_path)) == count + opened, f"batch {batch_id}"
            live = sorted(r["_cdc_key"] for r in _history(tmp_path) if r["is_current"])
            assert live == sorted(r["_cdc_key"] for r in view_rows(tmp_path, VIEW.name).to_pylist())  # type: ignore[union-attr]
            assert stored(tmp_path) == expected(work.model)
        assert crashed_with_versions >= 3  # the history had committed new versions when it crashed
    finally:
        app.close(close_sinks=True, timeout=60)


def _history_open(state: Path) -> list[dict[str, Any]]:
    return sorted(
        ({"id": r["id"], "customer": r["customer"]} for r in _history(state) if r["is_current"]),
        key=lambda r: r["id"],
    )


def test_built_at_add_from_the_tables_current_state_then_maintained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cdc views add`` builds the view (and its history) from the committed tables
    (:func:`sinks.warehouse.views.build_view`), reading each under a reader lease; the apply's next
    batch maintains it incrementally, without leases. A view the apply created first is left to it;
    a build that stopped between its history and its current table is completed by the apply's
    whole build without a second open version."""
    from cdc.views import parse_view
    from sinks.warehouse import leases
    from sinks.warehouse import views as V
    from sinks.warehouse.views import build_view

    leased: list[int] = []
    read = V._used_columns

    def counting(current: Path, empty: Any) -> Any:
        leased.append(len(leases.live_leases(current)))
        return read(current, empty)

    monkeypatch.setattr(V, "_used_columns", counting)

    spec = parse_view(VIEW.name, SQL, TABLES)
    view = ViewReg(VIEW.name, SQL, VIEW.tables, extra={"history": True})
    registered: list[ViewReg] = []
    maintainer = ViewMaintainer(tmp_path, lambda: (list(registered), TABLES), APP)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP, after=maintainer.maintain)
    work = Workload(7)
    try:
        app.run(records_table(work.batch(80)), 0)
        registered.append(view)
        leased.clear()
        assert build_view(tmp_path, spec, history=True) == len(expected(work.model)) > 3
        assert leased == [1] * len(spec.tables)  # each base table read under its lease
        leased.clear()
        assert stored(tmp_path) == expected(work.model)
        assert {r["_cdc_op"] for r in _history(tmp_path)} == {"c"} and all(
            r["is_current"] for r in _history(tmp_path)
        )
        version = DeltaTable(str(paths.view_table(tmp_path, VIEW.name))).version()
        assert build_view(tmp_path, spec, history=True) is None  # it exists: never rebuilt over
        assert DeltaTable(str(paths.view_table(tmp_path, VIEW.name))).version() == version
        out = app.run(records_table(work.batch(6)), 1)
        assert out.views[VIEW.name][0] >= 0  # maintained, not built again
        assert leased and set(leased) == {0}  # the apply's own reads: no lease
        assert stored(tmp_path) == expected(work.model)
        open_rows = _history_open(tmp_path)
        assert open_rows == [{"id": r["id"], "customer": r["customer"]} for r in expected(work.model)]

        # stopped between the history's commit and the current table's: the apply completes it
        shutil.rmtree(paths.view_table(tmp_path, VIEW.name))
        shutil.rmtree(paths.view_history(tmp_path, VIEW.name))
        app.run(records_table(work.batch(6)), 2)  # the view rebuilt whole by the apply
        shutil.rmtree(paths.view_table(tmp_path, VIEW.name))
        before = len(_history(tmp_path))
        app.run(records_table(work.batch(6)), 3)
        assert stored(tmp_path) == expected(work.model)
        open_rows = _history_open(tmp_path)
        assert open_rows == [{"id": r["id"], "customer": r["customer"]} for r in expected(work.model)]
        assert len(_history(tmp_path)) - before < len(expected(work.model))  # only what changed
    finally:
        app.close(close_sinks=True, timeout=60)


def test_the_views_delta_tables_are_reclaimed_like_the_tables(tmp_path: Path) -> None:
    """A view's table and history are rewritten by every batch's merge like a table's, and kept as
    the warehouse's are (they grew without bound): past ``vacuum_garbage_ratio`` (here 1%, so any
    superseded file) the superseded files go after the batch, and the view still reads right."""
    from sinks.warehouse.layout import WarehouseOptions

    disk = WarehouseOptions(vacuum_every=0, vacuum_garbage_ratio=0.01, vacuum_min_retention_s=0)
    view = ViewReg(VIEW.name, SQL, VIEW.tables, extra={"history": True})
    maintainer = ViewMaintainer(tmp_path, lambda: ([view], TABLES), APP, disk=disk)
    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    app = BatchApplier([WarehouseSink(tmp_path)], by_topic.get, APP, after=maintainer.maintain)
    work = Workload(7)
    where = (paths.view_table(tmp_path, VIEW.name), paths.view_history(tmp_path, VIEW.name))
    merged = 0
    try:
        app.run(records_table(work.batch(80)), 0)
        for batch_id in range(1, 9):
            out = app.run(records_table(work.batch(12)), batch_id)
            merged += out.views[VIEW.name][0] > 0
            for path in where:
                on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*.parquet")}
                live = {
                    unquote(a)
                    for a in DeltaTable(str(path)).get_add_actions(flatten=True).column("path").to_pylist()
                }
                assert on_disk == live, (
                    f"batch {batch_id}: {path.name} keeps {len(on_disk - live)} superseded files"
                )
        assert stored(tmp_path) == expected(work.model)
        assert merged >= 6  # the view was rewritten batch after batch
    finally:
        app.close(close_sinks=True, timeout=60)
