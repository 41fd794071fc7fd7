"""``cdc rebuild`` without a JVM: a real Postgres table changed and captured by the real reader
(``cdc run --once``), the live derived data applied by a test-only loop,
:func:`tests.plugins.apply.apply_without_spark` (the apply's Spark-free micro-batch fed straight from
the log store), then corrupted behind the pipeline's back; the rebuild replays the topic into a
staged copy, verifies it and swaps it in, or leaves the live data when the copy does not verify. The
history table is never touched. A view is rebuilt from the current tables and compared with its SQL
on the source.

Not end to end: the live data are not the apply job's. The loop does not run the job's Spark source,
checkpoint or Spark tasks, commits the apply consumer's positions itself (each topic's end offsets)
instead of the job's commits from Spark's offset log, and drops dead letters. The rebuild between
runs of the real apply job (Spark, in this process): ``tests/apply/test_rebuild_spark.py``."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake

from cdc import paths
from cdc.cli import main as cdc_main
from cdc.config import Settings
from cdc.locks import ProcessLock
from tests.plugins.apply import apply_without_spark, cdc_cli
from tests.plugins.items import PRICES, capture, item_row, items_table, source, verify_json
from tests.plugins.postgres import PgCluster


def _rebuild(dsn: str, state: Path, *args: str, yes: bool = True) -> tuple[int, dict[str, Any], str]:
    """``cdc rebuild --json ARGS [--yes]`` in this process: (exit code, the report, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["--source", dsn, "--state", str(state), "rebuild", "--json", *args, *(["--yes"] if yes else [])]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cdc_main(argv)
    return code, (orjson.loads(out.getvalue()) if out.getvalue() else {}), err.getvalue()


def _history(state: Path) -> tuple[int, int, list[dict[str, Any]]]:
    """The live history table: its directory's inode (the very same table, not an equal one: a
    replay of a topic not yet compacted builds an equal history), its version and its rows."""
    path = paths.warehouse_tables(state, "public", "items")[1]
    table = DeltaTable(str(path))
    return path.stat().st_ino, table.version(), sorted(table.to_pyarrow_table().to_pylist(), key=repr)


#: the live tables' settings: hash clustering, where a new table of a dense integer key gets range
#: clustering by default -- the rebuilt current table must still get the live one's layout, which
#: the kept history table has
HASHED = {"warehouse": {"clustering": "hash"}}


def _workload(dsn: str, state: Path) -> None:
    """Inserts, updates, deletes and key changes (values with quotes, newlines, backslashes, TOAST),
    captured by the real reader and applied to the live derived data (hash-clustered)."""
    capture(dsn, state)  # the snapshot (empty): everything below is streamed
    with source(dsn) as src:
        src.insert(*(item_row(i) for i in range(1, 41)))
        for i in range(1, 41, 3):
            src.update(i, {"name": f'it\'s "{i}"\nline \\ two', "price": PRICES[i % 4]})
        for i in range(2, 41, 9):
            src.update(i, {"qty": 1000 + i})  # the TOASTed blob unchanged: not sent
        for i in (4, 14, 24):
            src.delete(i)
        src.change_key(5, 505)
        src.update(11, {"blob": "a 'quoted' \"multi-MB\" value\nwith \\ backslashes " * 60_000})
    capture(dsn, state)
    assert apply_without_spark(state, settings=Settings(state_dir=state, extra=HASHED)) > 0


def test_rebuild_restores_a_corrupted_table_and_keeps_the_history(
    pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    dsn, reg = items_table(pg, pg_db, state)
    _workload(dsn, state)
    settings = Settings(state_dir=state)
    assert verify_json(settings, dsn)[0] == 0
    current = DeltaTable(str(paths.warehouse_tables(state, "public", "items")[0]))
    current.delete("id = 7")
    current.update(updates={"qty": "-1"}, predicate="id = 8")
    code, report = verify_json(settings, dsn, "--wait", "0")
    assert code == 1 and report[0]["missing_count"] == 1 and report[0]["different_count"] == 1
    history = _history(state)

    code, out, err = _rebuild(dsn, state, "public.items")

    assert code == 0, out
    assert out["status"] == "rebuilt" and out["kind"] == "table"
    assert out["records"] > 0 and out["verify"]["status"] == "ok"
    assert "replayed" in err  # progress on stderr
    assert any("history" in n for n in out["notes"])
    assert str(paths.warehouse_tables(state, "public", "items")[0]) in out["swapped"]
    assert str(paths.search_index(state, reg.topic)) in out["swapped"]  # the search index too
    assert verify_json(settings, dsn)[0] == 0  # warehouse and search index equal the source
    assert _history(state) == history  # the history table untouched
    assert any(Path(out["replaced"]).iterdir())  # the replaced data kept aside
    # the pipeline goes on over the rebuilt table: a later change is applied and verifies
    with source(dsn) as src:
        src.update(9, {"name": "after the rebuild"})
    capture(dsn, state)
    apply_without_spark(state, app_id="cdc-apply-test-2", settings=Settings(state_dir=state, extra=HASHED))
    assert verify_json(settings, dsn)[0] == 0


def test_a_copy_that_does_not_verify_leaves_the_live_table(pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    dsn, _reg = items_table(pg, pg_db, state)
    _workload(dsn, state)
    live = paths.warehouse_tables(state, "public", "items")[0]
    DeltaTable(str(live)).delete("id = 7")  # corrupted: a rebuild would fix it, were the copy clean
    version = (live.stat().st_ino, DeltaTable(str(live)).version())
    history = _history(state)

    # 1. the source changed and the change was not captured: the copy cannot be shown equal
    with source(dsn) as src:
        src.insert(item_row(900))
    code, out, _ = _rebuild(dsn, state, "public.items", "--wait", "0.5")  # no reader runs
    assert code == 3 and out["status"] == "not_caught_up", out
    assert (live.stat().st_ino, DeltaTable(str(live)).version()) == version and _history(state) == history
    assert Path(out["stage"]).is_dir()  # the copy kept for inspection

    # 2. a value the warehouse cannot hold (a BC timestamp, dead-lettered by the apply): different
    with source(dsn) as src:
        src.update(10, {"ts": "0044-03-15 12:00:00+00 BC"})
    capture(dsn, state)
    code, out, _ = _rebuild(dsn, state, "public.items", "--wait", "5")
    assert code == 1 and out["status"] == "different", out
    assert out["rejected"] == 1
    assert out["verify"]["different"][0]["key"] == {"id": 10}
    assert (live.stat().st_ino, DeltaTable(str(live)).version()) == version and _history(state) == history
    assert DeltaTable.is_deltatable(str(paths.warehouse_tables(Path(out["stage"]), "public", "items")[0]))
    assert out["swapped"] == []


def test_while_the_apply_runs_the_copy_is_verified_and_kept_then_resumed(
    pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    """The apply holds its lock: the copy is replayed and verified, not swapped (exit 2, the fix
    says to stop the apply); the next rebuild resumes that copy, replays only what came since."""
    state = tmp_path / "state"
    dsn, _reg = items_table(pg, pg_db, state)
    _workload(dsn, state)
    live = paths.warehouse_tables(state, "public", "items")[0]
    DeltaTable(str(live)).delete("id = 7")
    version = DeltaTable(str(live)).version()
    with ProcessLock(state, "apply"):
        code, out, err = _rebuild(dsn, state, "public.items")
        assert code == 2 and out["status"] == "apply_running", out
        assert out["verify"]["status"] == "ok" and out["records"] > 0
        assert any("stop `cdc apply`" in n for n in out["notes"]) and "the swap waits" in err
        assert DeltaTable(str(live)).version() == version
        assert orjson.loads(Path(out["stage"], "replay.json").read_bytes())["verified"] is True
    first = out["records"]
    with ProcessLock(state, "rebuild.public.items"):  # another rebuild of the same table runs
        code, out2, err = _rebuild(dsn, state, "public.items")
        assert code == 2 and not out2 and "another `cdc rebuild" in err
    assert Path(out["stage"], "replay.json").exists()  # its stage untouched
    with source(dsn) as src:
        src.update(9, {"name": "while the copy waited"})
    capture(dsn, state)
    apply_without_spark(state)  # the apply ran again meanwhile

    code, out, _ = _rebuild(dsn, state, "public.items")

    assert code == 0 and out["status"] == "rebuilt", out
    assert any(
        f"resumed the verified copy of an earlier rebuild ({first} records)" in n for n in out["notes"]
    )
    assert 0 < out["records"] < first  # only what the topic gained since
    assert verify_json(Settings(state_dir=state), dsn)[0] == 0
    # no terminal to ask before the swap, and no --yes: refused before anything is done
    code, out, err = _rebuild(dsn, state, "public.items", yes=False)
    assert code == 2 and "--yes" in err and not out


def _view_docs(state: Path, name: str = "order_view") -> dict[str, str]:
    """The view's search documents: ``_cdc_key`` -> the indexed customer."""
    from cdc.registry import Registry
    from sinks.search.query import live_texts
    from sinks.view_search import view_search_reg

    with Registry(state) as registry:
        (view,) = [v for v in registry.list_views() if v.name == name]
    docs = live_texts(state, view_search_reg(view)).items()
    return {orjson.loads(k)["_cdc_key"]: v["customer"] for k, v in docs}


def test_rebuild_a_view(pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    pg.execute(
        "CREATE TABLE customers (id int PRIMARY KEY, name text, region text);"
        "CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total numeric(10,2), note text)",
        pg_db,
    )
    dsn = pg.dsn(pg_db)
    for table in ("public.customers", "public.orders"):
        assert cdc_cli(dsn, state, "tables", "add", table)[0] == 0
    sql = (
        "SELECT o.id, o.total, o.note, c.name AS customer FROM orders o "
        "JOIN customers c ON o.customer_id = c.id WHERE o.total > 10"
    )
    assert cdc_cli(dsn, state, "views", "add", "order_view", "--sql", sql, "--search", "customer")[0] == 0
    capture(dsn, state)
    pg.execute(
        "INSERT INTO customers SELECT g, 'cust ' || g || E' it''s \\\\ \\n', 'r' || (g % 3) FROM generate_series(1, 8) g;"
        "INSERT INTO orders SELECT g, 1 + g % 8, g * 1.5, E'note \"' || g || '\"' FROM generate_series(1, 60) g;"
        "UPDATE customers SET name = 'renamed' WHERE id = 3; DELETE FROM orders WHERE id IN (20, 21);",
        pg_db,
    )
    capture(dsn, state)
    apply_without_spark(state)
    for i in range(6):  # the live view table at a later Delta version than a fresh copy's
        pg.execute(f"UPDATE orders SET note = 'round {i}' WHERE id = 11", pg_db)
        capture(dsn, state)
        apply_without_spark(state, app_id=f"cdc-apply-round-{i}")
    view = paths.view_table(state, "order_view")
    assert DeltaTable(str(view)).version() > 5
    before = sorted(DeltaTable(str(view)).to_pyarrow_table().to_pylist(), key=repr)
    assert len(before) == 60 - 2 - 6  # totals <= 10: ids 1..6
    DeltaTable(str(view)).delete("id = 30")  # corrupted behind the apply's back

    code, out, _ = _rebuild(dsn, state, "order_view")

    assert code == 0, out
    assert (
        out["kind"] == "view" and out["verify"]["missing_count"] == 0 and out["verify"]["source_rows"] == 52
    )
    assert (
        out["verify"]["search_docs"] == 52 and len(out["swapped"]) == 3
    )  # the table, the index, its metadata
    after = sorted(DeltaTable(str(view)).to_pyarrow_table().to_pylist(), key=repr)
    assert after == before
    assert _view_docs(state) == {r["_cdc_key"]: r["customer"] for r in after}  # its index, rebuilt
    # the apply goes on over the rebuilt view and its index
    pg.execute("UPDATE customers SET name = 'after the rebuild' WHERE id = 4", pg_db)
    capture(dsn, state)
    apply_without_spark(state, app_id="cdc-apply-test-2")
    docs = _view_docs(state)
    assert docs[orjson.dumps({"id": 11}).decode()] == "after the rebuild"  # order 11: customer 1 + 11 % 8
    stored = DeltaTable(str(view)).to_pyarrow_table().to_pylist()
    assert docs == {r["_cdc_key"]: r["customer"] for r in stored}

    # the base tables lag the source (a change not applied): the copy differs, the view stays
    pg.execute("UPDATE orders SET total = 99.5 WHERE id = 2", pg_db)
    version = DeltaTable(str(view)).version()
    code, out, _ = _rebuild(dsn, state, "order_view")
    assert code == 1 and out["status"] == "different"
    assert out["verify"]["missing_count"] == 1 and out["verify"]["missing"][0]["id"] == 2
    assert DeltaTable(str(view)).version() == version
    with ProcessLock(state, "apply"):  # a view: refused outright while the apply runs
        code, out, err = _rebuild(dsn, state, "order_view")
        assert code == 2 and not out and "stop `cdc apply`" in err
    code, text = cdc_cli(dsn, state, "rebuild", "order_view", "--yes")  # the text form says the same
    assert code == 1 and "NOT swapped: the live data is unchanged" in text and "missing" in text
    assert DeltaTable(str(view)).version() == version


def test_a_lost_search_index_comes_back(pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    """The search index removed from disk (and its metadata): verify finds every document missing;
    the rebuild moves a replayed index in (there is none to move aside) and verify is clean."""
    import shutil

    state = tmp_path / "state"
    dsn, reg = items_table(pg, pg_db, state)
    _workload(dsn, state)
    shutil.rmtree(paths.search_index(state, reg.topic))
    paths.search_versions(state, reg.topic).unlink()
    code, report = verify_json(Settings(state_dir=state), dsn, "--wait", "0")
    assert code != 0 and report[0]["search"]["missing_count"] == report[0]["source_rows"] > 0

    code, out, _ = _rebuild(dsn, state, "public.items")

    assert code == 0, out
    assert str(paths.search_index(state, reg.topic)) in out["swapped"]
    assert str(paths.search_versions(state, reg.topic)) in out["swapped"]
    assert verify_json(Settings(state_dir=state), dsn)[0] == 0


def test_a_rebuilt_table_recomputes_the_views_that_read_it(pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    """A customer's name corrupted in the warehouse, and the view computed from it (a replay of the
    topics recomputes every row; the version guard keeps the corrupted name): the rebuild of the
    customers' table computes the view reading it again, and its search index."""
    state = tmp_path / "state"
    pg.execute(
        "CREATE TABLE customers (id int PRIMARY KEY, name text);"
        "CREATE TABLE orders (id int PRIMARY KEY, customer_id int, note text);"
        "CREATE TABLE other (id int PRIMARY KEY, name text)",
        pg_db,
    )
    dsn = pg.dsn(pg_db)
    for table in ("public.customers", "public.orders", "public.other"):
        assert cdc_cli(dsn, state, "tables", "add", table)[0] == 0
    sql = "SELECT o.id, o.note, c.name AS customer FROM orders o JOIN customers c ON o.customer_id = c.id"
    assert cdc_cli(dsn, state, "views", "add", "order_view", "--sql", sql, "--search", "customer")[0] == 0
    other = "SELECT t.id, t.name FROM other t"
    assert cdc_cli(dsn, state, "views", "add", "other_view", "--sql", other)[0] == 0
    capture(dsn, state)
    pg.execute(
        "INSERT INTO customers SELECT g, E'cust ''' || g || E'\\n' FROM generate_series(1, 6) g;"
        "INSERT INTO orders SELECT g, 1 + g % 6, 'note ' || g FROM generate_series(1, 30) g;"
        "INSERT INTO other VALUES (1, 'one')",
        pg_db,
    )
    capture(dsn, state)
    apply_without_spark(state)
    view = paths.view_table(state, "order_view")
    customers = paths.warehouse_tables(state, "public", "customers")[0]
    DeltaTable(str(customers)).update(updates={"name": "'wrong'"}, predicate="id = 4")
    apply_without_spark(state, app_id="cdc-apply-test-2")
    other_version = DeltaTable(str(paths.view_table(state, "other_view"))).version()
    stored = {r["id"]: r["customer"] for r in DeltaTable(str(view)).to_pyarrow_table().to_pylist()}
    assert stored[3] == "wrong" and _view_docs(state)[orjson.dumps({"id": 3}).decode()] == "wrong"

    code, out, err = _rebuild(dsn, state, "public.customers")

    assert code == 0, out
    source = dict(
        pg.fetch("SELECT o.id, c.name FROM orders o JOIN customers c ON o.customer_id = c.id", pg_db)
    )
    rows = DeltaTable(str(view)).to_pyarrow_table().to_pylist()
    assert {r["id"]: r["customer"] for r in rows} == source and source[3] == "cust '4\n"
    assert out["views"] == ["order_view"] and "order_view" in err
    assert _view_docs(state) == {r["_cdc_key"]: r["customer"] for r in rows}  # its index too
    assert DeltaTable(str(paths.view_table(state, "other_view"))).version() == other_version
    # the apply goes on over the recomputed view
    pg.execute("UPDATE customers SET name = 'after' WHERE id = 4", pg_db)
    capture(dsn, state)
    apply_without_spark(state, app_id="cdc-apply-test-3")
    rows = DeltaTable(str(view)).to_pyarrow_table().to_pylist()
    assert {r["id"]: r["customer"] for r in rows}[3] == "after"
    assert _view_docs(state)[orjson.dumps({"id": 3}).decode()] == "after"


def test_rebuild_a_view_brings_its_history_to_the_copy(pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    """A view with a history (``--history``): the rebuild keeps the history and, before the swap,
    closes the open versions that differ from the verified copy (``u``) or that it lacks (``d``) and
    opens the copy's rows, so the history's open rows are the view's rows again; closed versions stay."""
    state = tmp_path / "state"
    pg.execute(
        "CREATE TABLE customers (id int PRIMARY KEY, name text);"
        "CREATE TABLE orders (id int PRIMARY KEY, customer_id int, note text)",
        pg_db,
    )
    dsn = pg.dsn(pg_db)
    for table in ("public.customers", "public.orders"):
        assert cdc_cli(dsn, state, "tables", "add", table)[0] == 0
    sql = "SELECT o.id, o.note, c.name AS customer FROM orders o JOIN customers c ON o.customer_id = c.id"
    assert cdc_cli(dsn, state, "views", "add", "hv", "--sql", sql, "--history")[0] == 0
    capture(dsn, state)
    pg.execute(
        "INSERT INTO customers SELECT g, 'cust ' || g FROM generate_series(1, 4) g;"
        "INSERT INTO orders SELECT g, 1 + g % 4, E'it''s \"' || g || E'\"\\n' FROM generate_series(1, 20) g;",
        pg_db,
    )
    capture(dsn, state)
    apply_without_spark(state)
    pg.execute("UPDATE customers SET name = 'renamed' WHERE id = 2", pg_db)
    capture(dsn, state)
    apply_without_spark(state, app_id="cdc-apply-round-2")
    hist = DeltaTable(str(paths.view_history(state, "hv")))
    closed_before = hist.to_pyarrow_table(filters=[("is_current", "=", False)]).num_rows
    assert closed_before == 5  # the orders of customer 2: one version each closed by the rename
    # the history corrupted behind the apply's back: one open version's value, one extra open row
    key7, ghost = orjson.dumps({"id": 7}).decode(), orjson.dumps({"id": 999}).decode()
    hist.update({"customer": "'corrupt'"}, predicate=f"is_current = true AND _cdc_key = '{key7}'")
    ghost_row = hist.to_pyarrow_table(filters=[("is_current", "=", True)]).slice(0, 1)
    ghost_row = ghost_row.set_column(
        ghost_row.schema.get_field_index("_cdc_key"), "_cdc_key", pa.array([ghost])
    )
    write_deltalake(str(paths.view_history(state, "hv")), ghost_row, mode="append")

    code, out, _ = _rebuild(dsn, state, "hv")

    assert code == 0, out
    assert any("history was kept" in n for n in out["notes"]), out["notes"]
    view_rows = DeltaTable(str(paths.view_table(state, "hv"))).to_pyarrow_table()
    cols = ["_cdc_key", "id", "note", "customer"]
    hist = DeltaTable(str(paths.view_history(state, "hv")))
    open_rows = hist.to_pyarrow_table(filters=[("is_current", "=", True)]).select(cols)
    assert sorted(open_rows.to_pylist(), key=repr) == sorted(view_rows.select(cols).to_pylist(), key=repr)
    closed = hist.to_pyarrow_table(filters=[("is_current", "=", False)]).to_pylist()
    assert len(closed) == closed_before + 2
    ends = {r["_cdc_key"]: r["_cdc_end_op"] for r in closed if r["_cdc_key"] in (key7, ghost)}
    assert ends == {key7: "u", ghost: "d"}
