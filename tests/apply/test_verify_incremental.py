"""An incremental ``cdc verify`` (issue 20): after a full verify recorded the key ranges, changes made
at a real Postgres table, captured by the real reader (`cdc run --once`) and applied by a test-only
loop, :func:`tests.plugins.apply.apply_pending_without_spark` (the apply's Spark-free micro-batch on
the real Delta and tantivy sinks, no JVM), are verified by checking only the ranges they touched; a
row corrupted in the warehouse in a changed range is found, one in an unchanged range only by
``--full``; ``cdc status`` says when each table was last verified clean.

Not the apply job: the loop commits the apply consumer's positions itself (the end offsets it read),
which ``cdc verify`` waits for, where the job commits the ends of Spark's offset log after each
micro-batch (:func:`spark_jobs.ledger.commit_positions`); nor does it run the job's Spark source,
checkpoint or Spark tasks. ``cdc verify`` over the job's own commits is run by
``tests/apply/test_end_to_end.py`` and ``tests/apply/test_rebuild_spark.py``, not here: the job in
place of the loop made this file several times slower."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pyarrow.parquet as pq
import tantivy
from deltalake import DeltaTable

from cdc.config import Settings
from cdc.registry import Registry
from sinks import KeyRanges
from sinks.search import SearchSink
from sinks.search.index import KEY, find_layout
from sinks.search.write import _document
from sinks.warehouse import WarehouseSink
from sinks.warehouse.delta import ROWS_READ, _read_spans_dataset, read_spans
from tests.plugins.apply import apply_pending_without_spark, cdc_cli
from tests.plugins.items import capture, verify_json
from tests.plugins.postgres import PgCluster

ROWS = 3000
RANGE_ROWS = 8  # cdc.cli.verify.compare.DEFAULT_RANGE_ROWS: ids 1..3000, so the range of id x is (x - 1) // 8


def range_of(i: int) -> int:
    return min((i - 1) // RANGE_ROWS, (ROWS - 1) // RANGE_ROWS)


def setup(pg: PgCluster, db: str, state: Path) -> str:
    """``public.t`` with ROWS rows, registered (search on ``name``), snapshotted and applied."""
    pg.execute("CREATE TABLE public.t (id bigint PRIMARY KEY, name text, n integer)", db)
    pg.execute(f"INSERT INTO public.t SELECT g, 'row ' || g, g FROM generate_series(1, {ROWS}) g", db)
    dsn = pg.dsn(db)
    code, out = cdc_cli(dsn, state, "tables", "add", "public.t", "--search", "name")
    assert code == 0, out
    capture(dsn, state)
    assert apply_pending_without_spark(state) == ROWS
    return dsn


def plant(state: Path, ident: int, name: str) -> None:
    """Change a row in the warehouse behind the pipeline's back (no topic record)."""
    with Registry(state) as r:
        reg = r.find("public.t")
    path = WarehouseSink(state).paths(reg)[0]
    DeltaTable(str(path)).update(updates={"name": f"'{name}'"}, predicate=f"id = {ident}")


def plant_document(state: Path, ident: int, name: str | None) -> None:
    """Replace (``name``) or delete (None) the search document of ``id = ident`` behind the
    pipeline's back: in its shard's tantivy index, with no topic record."""
    with Registry(state) as r:
        reg = r.find("public.t")
    layout = find_layout(state, reg)
    assert layout is not None
    key = orjson.dumps({"id": ident}).decode()
    index = tantivy.Index.open(str(layout.shards[layout.shard_of(key)][0]))
    writer = index.writer()
    writer.delete_documents_by_term(KEY, key)
    if name is not None:
        writer.add_document(_document(key, 1, 0, {"id": ident, "name": name}, {"name": "name"}))
    writer.commit()
    writer.wait_merging_threads()


def checked(report: dict[str, Any], why: str) -> set[int]:
    return {c["range"] for c in report["checked_ranges"] if c["why"] == why}


def test_incremental_verify_checks_the_changed_ranges_only(pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    dsn = setup(pg, pg_db, state)
    settings = Settings(state_dir=state)
    code, (first,) = verify_json(settings, dsn, "--wait", "30")
    assert code == 0, first
    assert first["mode"] == "full" and first["fallback"] == "no clean verify recorded yet"
    assert first["source_rows"] == ROWS and first["ranges"] == range_of(ROWS) + 1
    assert first["ranges_checked"] == first["ranges"] and first["checked_ranges"] == []  # every range

    pg.execute("UPDATE public.t SET name = 'it''s a \"quote\"\n\\ back' WHERE id IN (100, 101)", pg_db)
    pg.execute("UPDATE public.t SET n = -1 WHERE id = 2500", pg_db)
    pg.execute("DELETE FROM public.t WHERE id = 1500", pg_db)
    pg.execute("INSERT INTO public.t VALUES (5000, 'new', 5000)", pg_db)
    capture(dsn, state)
    assert apply_pending_without_spark(state) == 6  # the delete is two records: the event and a tombstone
    changed = {range_of(i) for i in (100, 2500, 1500, 5000)}

    code, (inc,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "2")
    assert code == 0, inc
    assert inc["mode"] == "incremental" and inc["changes_read"] == 6
    assert checked(inc, "changed") == changed
    assert len(checked(inc, "scrub")) == 2 and not checked(inc, "scrub") & changed
    assert all(c["equal"] for c in inc["checked_ranges"])
    assert inc["ranges_checked"] == len(inc["checked_ranges"]) == len(changed) + 2
    # only the checked ranges were compared; the counts are the whole table's, equal on every side
    assert 3 * RANGE_ROWS < inc["rows_checked"] <= 6 * RANGE_ROWS
    assert inc["source_rows"] == inc["warehouse_rows"] == inc["search_docs"] == ROWS

    # a corruption in a changed range is found; one in a range without changes is not (until --full)
    pg.execute("UPDATE public.t SET n = -2 WHERE id = 2500", pg_db)
    capture(dsn, state)
    assert apply_pending_without_spark(state) == 1
    plant(state, 2501, "planted in a changed range")
    plant(state, 700, "planted in an unchanged range")
    code, (bad,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "0")
    assert code == 1 and bad["mode"] == "incremental", bad
    assert checked(bad, "changed") == {range_of(2500)} and checked(bad, "scrub") == set()
    assert [d["key"] for d in bad["different"]] == [{"id": 2501}]
    assert bad["checked_ranges"] == [
        {"range": range_of(2500), "from": {"id": 2497}, "why": "changed", "equal": False}
    ]
    assert bad["ranges_checked"] == 1

    code, (full,) = verify_json(settings, dsn, "--wait", "30", "--full")
    assert code == 1 and full["mode"] == "full" and full["checked_ranges"] == []
    assert full["ranges_checked"] == full["ranges"] == first["ranges"]  # every range, not 0
    assert [d["key"] for d in full["different"]] == [{"id": 700}, {"id": 2501}]


def test_scrub_finds_an_unchanged_range_in_turn_and_status_shows_the_last_clean_run(
    pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    dsn = setup(pg, pg_db, state)
    settings = Settings(state_dir=state)
    started = time.time()
    code, _ = verify_json(settings, dsn, "--wait", "30")
    assert code == 0
    code, out = cdc_cli(dsn, state, "status", "--json")
    (table,) = orjson.loads(out)["tables"]
    clean = table["last_verified_clean"]
    assert clean["mode"] == "full" and clean["at"] >= started and clean["ranges"] == range_of(ROWS) + 1

    # no changes: each run scrubs the next 10 ranges, so a planted row is found within a lap
    plant(state, 85, "planted where nothing changes")  # range 10: the second run's
    code, (one,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "10")
    assert code == 0 and checked(one, "scrub") == set(range(10)) and checked(one, "changed") == set()
    code, (two,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "10")
    assert code == 1 and checked(two, "scrub") == set(range(10, 20)), two
    assert [d["key"] for d in two["different"]] == [{"id": 85}]
    code, out = cdc_cli(dsn, state, "status", "--json")
    (table,) = orjson.loads(out)["tables"]
    assert table["last_verified_clean"]["mode"] == "incremental"  # the first scrub; not the failed one
    assert table["last_verified_clean"]["at"] >= clean["at"]
    code, out = cdc_cli(dsn, state, "status")
    assert "verified clean public.t: " in out and "(incremental, at 0/" in out, out


def test_text_and_composite_keys_are_ranged_in_the_same_order_at_the_source(
    pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    """Ranges are read at the source by key comparisons: text keys in code point order (``COLLATE
    "C"``, whatever the column's collation), composite keys as rows. A range read in another order
    than the bounds' would hash differently and be reported different."""
    state = tmp_path / "state"
    # a linguistic collation (ICU), whose order is not the code points'
    pg.execute(
        'CREATE TABLE public.k (a text COLLATE "und-x-icu", b integer, v text, PRIMARY KEY (a, b))', pg_db
    )
    ugly = ["Zeta", "alpha", "Ärger", "émile", "a b", "a\nb", "it's", 'q"q', "back\\slash", "日本", "", "~"]
    rows = [(f"{w}{i % 7}", i, f"v{i}") for i, w in enumerate(ugly * 40)]
    with psycopg.connect(pg.dsn(pg_db), autocommit=True) as conn:
        conn.cursor().executemany("INSERT INTO public.k VALUES (%s, %s, %s)", rows)
    dsn = pg.dsn(pg_db)
    assert cdc_cli(dsn, state, "tables", "add", "public.k")[0] == 0
    capture(dsn, state)
    apply_pending_without_spark(state)
    settings = Settings(state_dir=state)
    code, (first,) = verify_json(settings, dsn, "--wait", "30")
    assert code == 0 and first["source_rows"] == len(rows), first
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE public.k SET v = 'changed' WHERE a = %s AND b = %s", rows[17][:2])
        conn.execute("UPDATE public.k SET v = 'changed' WHERE a = %s AND b = %s", rows[300][:2])
    capture(dsn, state)
    assert apply_pending_without_spark(state) == 2
    code, (inc,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "3")
    assert code == 0 and inc["mode"] == "incremental", orjson.dumps(inc).decode()
    assert 1 <= len(checked(inc, "changed")) <= 2 and len(checked(inc, "scrub")) == 3
    # every checked range held its rows on both sides (full ranges of 8, but the last may be short)
    assert inc["rows_checked"] > 3 * RANGE_ROWS and inc["source_rows"] == inc["warehouse_rows"] == len(rows)


def test_an_oid_key_is_ranged_like_every_integer_key(pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    """``oid`` is an integer to every stage (:mod:`cdc.pgtypes`): its ranges are read at the source by
    the integer path (an array of bounds cast to the key's type), up to the largest unsigned value."""
    state = tmp_path / "state"
    pg.execute("CREATE TABLE public.o (k oid PRIMARY KEY, v text)", pg_db)
    keys = [*range(1, 400), 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
    with psycopg.connect(pg.dsn(pg_db), autocommit=True) as conn:
        conn.cursor().executemany("INSERT INTO public.o VALUES (%s, %s)", [(k, f"v{k}") for k in keys])
    dsn = pg.dsn(pg_db)
    assert cdc_cli(dsn, state, "tables", "add", "public.o")[0] == 0
    capture(dsn, state)
    apply_pending_without_spark(state)
    settings = Settings(state_dir=state)
    code, (first,) = verify_json(settings, dsn, "--wait", "30")
    assert code == 0 and first["mode"] == "full" and first["source_rows"] == len(keys), first
    pg.execute("UPDATE public.o SET v = 'changed' WHERE k IN (17, 4294967295)", pg_db)
    capture(dsn, state)
    assert apply_pending_without_spark(state) == 2
    code, (inc,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "1")
    assert code == 0 and inc["mode"] == "incremental", orjson.dumps(inc).decode()
    assert len(checked(inc, "changed")) == 2 and all(c["equal"] for c in inc["checked_ranges"])
    assert inc["source_rows"] == inc["warehouse_rows"] == len(keys)


def test_an_uncaptured_change_and_a_lost_row_make_the_run_full(
    pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    """The topics say which ranges changed only once capture has passed the consistent point: before
    that the run is full (and a change not captured is "not caught up", exit 3, as before). A row
    missing from one side (its count differs from the source's) makes the run full too."""
    state = tmp_path / "state"
    dsn = setup(pg, pg_db, state)
    settings = Settings(state_dir=state)
    assert verify_json(settings, dsn, "--wait", "30")[0] == 0
    pg.execute("UPDATE public.t SET n = 0 WHERE id = 10", pg_db)  # not captured
    code, (behind,) = verify_json(settings, dsn, "--wait", "0.5")  # no reader runs
    assert code == 3 and behind["status"] == "not_caught_up", behind
    assert behind["mode"] == "full" and behind["fallback"].startswith("capture had not reached"), behind
    assert behind["lag"]["slot"]["pending_changes"] == 1
    capture(dsn, state)
    apply_pending_without_spark(state)
    code, (caught,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "0")
    assert code == 0 and caught["mode"] == "incremental" and checked(caught, "changed") == {range_of(10)}

    with Registry(state) as r:
        path = WarehouseSink(state).paths(r.find("public.t"))[0]
    DeltaTable(str(path)).delete("id = 2900")  # behind the pipeline's back, in a range without changes
    code, (lost,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "0")
    assert code == 1 and lost["mode"] == "full", lost
    assert (
        lost["fallback"]
        == f"row counts differ (source {ROWS}, warehouse {ROWS - 1}, search {ROWS}): every row checked"
    )
    assert lost["missing"] == [{"id": 2900}]


def test_incremental_verify_reads_the_checked_ranges_documents_and_finds_a_planted_one(
    pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    """The index is read by key (a term set query per shard), not whole: a wrong document and one
    the source and the warehouse lack, both in a changed range, are found; documents elsewhere are
    not read, so one missing there (with the counts kept equal) is found only by ``--full``."""
    state = tmp_path / "state"
    dsn = setup(pg, pg_db, state)
    settings = Settings(state_dir=state)
    assert verify_json(settings, dsn, "--wait", "30")[0] == 0
    pg.execute("UPDATE public.t SET n = -1 WHERE id = 100", pg_db)
    pg.execute("DELETE FROM public.t WHERE id = 103", pg_db)
    capture(dsn, state)
    apply_pending_without_spark(state)
    plant_document(state, 101, "planted 'wrong'\ndocument")  # the changed range of 100 and 103
    plant_document(state, 103, "a deleted row's document")  # extra: neither the source nor the warehouse
    plant_document(state, 2900, None)  # missing, in a range without changes: the counts stay equal
    code, (inc,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "0")
    assert code == 1 and inc["mode"] == "incremental", inc
    assert checked(inc, "changed") == {range_of(100)}
    assert inc["different_count"] == inc["missing_count"] == inc["extra_count"] == 0
    assert [d["key"] for d in inc["search"]["different"]] == [{"id": 101}]
    assert inc["search"]["different"][0]["search"] == {"name": "planted 'wrong'\ndocument"}
    assert inc["search"]["extra"] == [{"id": 103}] and inc["search"]["missing"] == []
    assert inc["search_docs"] == inc["source_rows"] == ROWS - 1

    code, (full,) = verify_json(settings, dsn, "--wait", "30", "--full")
    assert code == 1 and full["mode"] == "full"
    assert full["search"]["missing"] == [{"id": 2900}] and full["search"]["extra"] == [{"id": 103}]


def test_sinks_read_back_only_the_ranges_asked_for(pg: PgCluster, pg_db: str, tmp_path: Path) -> None:
    """``read_back(reg, KeyRanges)``: the warehouse reads only the range buckets the spans reach
    and keeps the spans' rows; the index returns the documents of the keys given; both count the
    whole table."""
    state = tmp_path / "state"
    dsn = setup(pg, pg_db, state)
    pg.execute("INSERT INTO public.t VALUES (100000, 'far', 1), (100001, 'far too', 2)", pg_db)
    capture(dsn, state)
    assert apply_pending_without_spark(state) == 2
    with Registry(state) as r:
        reg = r.find("public.t")
    warehouse, search = WarehouseSink(state), SearchSink(state)
    before = ROWS_READ["current"]
    back = warehouse.read_back(reg, KeyRanges((((100001,), None),)))
    assert back.table is not None and back.table.column("id").to_pylist() == [100001]
    assert back.total == ROWS + 2
    assert ROWS_READ["current"] - before == 2, "only the bucket of ids 65536.. was read"
    back = warehouse.read_back(reg, KeyRanges((((10,), (12,)), ((2999,), (100000,)))))
    assert back.table is not None and sorted(back.table.column("id").to_pylist()) == [10, 11, 2999, 3000]
    assert back.table.column_names == ["id", "name", "n", "_cdc_commit_lsn"]

    keys = frozenset(orjson.dumps({"id": i}).decode() for i in (7, 100001, 123456))
    texts = search.read_back(reg, KeyRanges((((7,), (8,)),), keys))
    assert texts is not None and texts.total == ROWS + 2
    assert texts.docs == {'{"id":7}': {"name": "row 7"}, '{"id":100001}': {"name": "far too"}}


def test_the_warehouse_read_by_file_equals_the_dataset_read_after_a_column_was_added(
    pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    """``read_spans`` reads a local table's Parquet files one by one (no ``pyarrow.dataset``, which
    imports pandas): the same rows, columns and types as the dataset read, a column added since the
    older files were written read as nulls there; and an incremental verify over it is clean."""
    state = tmp_path / "state"
    dsn = setup(pg, pg_db, state)
    settings = Settings(state_dir=state)
    assert verify_json(settings, dsn, "--wait", "30")[0] == 0
    pg.execute("ALTER TABLE public.t ADD COLUMN extra text", pg_db)
    pg.execute("UPDATE public.t SET extra = 'x', n = -1 WHERE id IN (100, 2500)", pg_db)
    capture(dsn, state)
    apply_pending_without_spark(state)
    with Registry(state) as r:
        reg = r.find("public.t")
    assert "extra" in [c.name for c in reg.columns]
    path = str(WarehouseSink(state).paths(reg)[0])
    files = DeltaTable(path).file_uris()
    lacking = [
        f for f in files if "extra" not in pq.ParquetFile(f.removeprefix("file://")).schema_arrow.names
    ]
    assert lacking and len(lacking) < len(files), files  # older files without the column, newer with it
    columns = ["id", "name", "n", "extra", "_cdc_commit_lsn"]
    for spans in [(((90,), (110,)), ((2490,), (2510,))), ((None, None),), ((None, (5,)), ((2998,), None))]:
        direct, total = read_spans(DeltaTable(path), reg, spans, columns)
        dataset, dataset_total = _read_spans_dataset(DeltaTable(path), reg, spans, columns)
        assert total == dataset_total == ROWS
        assert direct.schema == dataset.schema
        assert direct.sort_by("id").to_pylist() == dataset.sort_by("id").to_pylist()
    got, _ = read_spans(DeltaTable(path), reg, (((99,), (102,)),), columns)
    assert sorted((r["id"], r["extra"]) for r in got.to_pylist()) == [(99, None), (100, "x"), (101, None)]
    code, (inc,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "3")
    assert code == 0 and inc["mode"] in ("incremental", "full"), inc


def test_a_narrow_table_divergence_beside_a_change_is_found_incrementally(
    pg: PgCluster, pg_db: str, tmp_path: Path
) -> None:
    """The bench's narrow shape (int key, text, numeric(12,2), no search columns), spread over several
    range buckets: changes to a few rows, then values planted in the warehouse behind the pipeline's
    back. The incremental run finds the one beside a change (its range is checked), with the column
    that differs; the one in a range without changes is found by ``--full``. The warehouse's bucket
    pruning (:class:`sinks.warehouse.delta._Meets`) reads only the buckets the checked ranges reach."""
    state = tmp_path / "state"
    rows = 70_000  # past one range bucket of 65,536 integer keys
    pg.execute("CREATE TABLE public.narrow (id int PRIMARY KEY, name text, price numeric(12,2))", pg_db)
    pg.execute(
        f"INSERT INTO public.narrow SELECT g, 'name ' || g, g * 0.01 FROM generate_series(1, {rows}) g", pg_db
    )
    dsn = pg.dsn(pg_db)
    assert cdc_cli(dsn, state, "tables", "add", "public.narrow")[0] == 0
    capture(dsn, state)
    assert apply_pending_without_spark(state) == rows
    settings = Settings(state_dir=state)
    code, (first,) = verify_json(settings, dsn, "--wait", "30")
    assert code == 0 and first["mode"] == "full" and first["search_docs"] is None, first

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE public.narrow SET name = 'it''s\n\"ugly\"', price = -0.01 WHERE id = 41")
        conn.execute("UPDATE public.narrow SET price = 9999999999.99 WHERE id = 62")
    capture(dsn, state)
    assert apply_pending_without_spark(state) == 2
    with Registry(state) as r:
        path = WarehouseSink(state).paths(r.find("public.narrow"))[0]
    table = DeltaTable(str(path))
    table.update(updates={"price": "CAST(1.23 AS DECIMAL(12,2))"}, predicate="id = 44")  # beside 41
    table.update(updates={"name": "'planted far away'"}, predicate="id = 68000")  # no change near it
    code, (inc,) = verify_json(settings, dsn, "--wait", "30", "--scrub", "0")
    assert code == 1 and inc["mode"] == "incremental", inc
    assert checked(inc, "changed") == {(41 - 1) // RANGE_ROWS, (62 - 1) // RANGE_ROWS}
    assert inc["rows_checked"] == 2 * RANGE_ROWS and inc["source_rows"] == inc["warehouse_rows"] == rows
    assert inc["different"] == [
        {"key": {"id": 44}, "columns": {"price": {"source": "0.44", "warehouse": "1.23"}}}
    ], inc["different"]
    assert inc["missing_count"] == inc["extra_count"] == 0
    spans = tuple(((c["from"]["id"],), (c["from"]["id"] + RANGE_ROWS,)) for c in inc["checked_ranges"])
    with Registry(state) as r:
        reg = r.find("public.narrow")
    before = ROWS_READ["current"]
    back = WarehouseSink(state).read_back(reg, KeyRanges(spans))
    assert back.table is not None and back.table.num_rows == 2 * RANGE_ROWS and back.total == rows
    assert ROWS_READ["current"] - before == 65_535, "only the bucket of ids 1..65535 was read"

    code, (full,) = verify_json(settings, dsn, "--wait", "30", "--full")
    assert code == 1 and full["mode"] == "full"
    assert [d["key"] for d in full["different"]] == [{"id": 44}, {"id": 68000}]
