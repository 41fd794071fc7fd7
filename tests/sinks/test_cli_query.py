"""``cdc sql`` and ``cdc search`` over real Delta tables and a real tantivy index."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from cdc.cli import main
from cdc.registry import Registry
from sinks.search import SearchSink
from sinks.warehouse import WarehouseOptions, WarehouseSink
from tests.sinks.feed import Feed, table

APP = "cdc-apply-test"


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state dir with two applied tables (customers, orders), one searchable, and one table
    registered but never applied."""
    monkeypatch.chdir(tmp_path)
    for var in ("CDC_STATE", "CDC_SOURCE", "CDC_LOG", "CDC_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    st = tmp_path / "state"
    customers = table(
        "customers", columns=(("id", "integer"), ("name", "text"), ("bio", "text")), search=("name", "bio")
    )
    orders = table(
        "orders",
        columns=(
            ("id", "bigint"),
            ("customer_id", "integer"),
            ("total", "numeric(14,2)"),
            ("placed", "timestamp with time zone"),
            ("blob", "bytea"),
        ),
    )
    pending = table("pending", schema="sales")
    with Registry(st) as reg:
        for t in (customers, orders, pending):
            reg.add(t)
    wh = WarehouseSink(st, WarehouseOptions(buckets=2))
    se = SearchSink(st)
    fc, fo = Feed(customers), Feed(orders)
    bc = fc.batch(
        fc.change(
            "c",
            {"id": 1, "name": "Ada Lovelace", "bio": "wrote the first program for the analytical engine"},
            100,
        ),
        fc.change("c", {"id": 2, "name": "Grace Hopper", "bio": "built the first compiler"}, 101),
    )
    bo = fo.batch(
        fo.change(
            "c",
            {
                "id": 10,
                "customer_id": 1,
                "total": "12345678901.25",
                "placed": "2026-11-22 02:28:58.742271+00",
                "blob": "cafe",
            },
            102,
        ),
        fo.change(
            "c",
            {"id": 11, "customer_id": 1, "total": "0.10", "placed": "2026-11-22 03:00:00+00", "blob": None},
            103,
        ),
        fo.change(
            "c",
            {"id": 12, "customer_id": 2, "total": "5.00", "placed": "2026-11-22 04:00:00+00", "blob": None},
            104,
        ),
    )
    for sink in (wh, se):
        sink.apply(bc, 1, APP)
        sink.apply(bo, 1, APP)
    se.close()
    return st


JOIN = (
    "SELECT c.name, sum(o.total) AS spent, count(*) AS n FROM public.customers c "
    "JOIN public.orders o ON o.customer_id = c.id GROUP BY c.name ORDER BY c.name"
)


def test_sql_join_json(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--state", str(state), "sql", JOIN, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows == [
        {"name": "Ada Lovelace", "spent": "12345678901.35", "n": 2},
        {"name": "Grace Hopper", "spent": "5.00", "n": 1},
    ]


def test_sql_csv_and_text(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = "SELECT id, total, placed, blob FROM public.orders ORDER BY id"
    assert main(["--state", str(state), "sql", q, "--csv"]) == 0
    got = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert got[0] == ["id", "total", "placed", "blob"]
    assert got[1] == ["10", "12345678901.25", "2026-11-22T02:28:58.742271+00:00", "cafe"]
    assert got[2][3] == "" and len(got) == 4
    assert main(["--state", str(state), "sql", JOIN]) == 0
    out = capsys.readouterr().out
    assert "Ada Lovelace" in out and "12345678901.35" in out and "(2 rows)" in out


def test_sql_history_view(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    q = "SELECT id, is_current, valid_to, valid_from, _cdc_op FROM public.orders__history ORDER BY id"
    assert main(["--state", str(state), "sql", q, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in rows] == [10, 11, 12] and all(r["is_current"] for r in rows)
    assert rows[0]["valid_to"] is None and rows[0]["valid_from"] == "2026-09-21T14:13:20.102000+00:00"


def test_sql_errors(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--state", str(state), "sql", "SELEC 1"]) == 1
    err = capsys.readouterr().err
    assert "syntax error" in err and "public.customers" in err and "public.orders__history" in err
    assert main(["--state", str(state), "sql", "SELECT * FROM sales.pending", "--json"]) == 1
    body = json.loads(capsys.readouterr().err)
    assert "sales.pending" in body["message"] and "not applied" in body["fix"] and "cdc apply" in body["fix"]


def test_search_json_and_text(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--state", str(state), "search", "public.customers", "first compiler", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [h["key"] for h in hits] == [{"id": 2}, {"id": 1}]  # both say "first"; Grace also "compiler"
    assert hits[0]["score"] > hits[1]["score"]
    assert "**compiler**" in hits[0]["snippet"] and "**first**" in hits[0]["snippet"]
    assert hits[0]["document"] == {"id": 2, "name": "Grace Hopper", "bio": "built the first compiler"}
    assert main(["--state", str(state), "search", "public.customers", "bio:engine", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "**engine**" in out and "(1 hit)" in out


def test_search_errors(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--state", str(state), "search", "public.orders", "x"]) == 1
    assert "--search" in capsys.readouterr().err
    assert main(["--state", str(state), "search", "public.customers", "name:(ada", "--json"]) == 1
    assert "cannot parse" in json.loads(capsys.readouterr().err)["message"]
    assert main(["--state", str(state), "search", "public.nope", "x"]) == 1
    assert "not registered" in capsys.readouterr().err


def test_sql_filters_on_strings_after_updates(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A WHERE on a text column of tables the sink merged into more than once (delta-rs writes
    some of their strings as string views): DuckDB's filter reaches the rows, never an error."""
    with Registry(state) as reg:
        customers = reg.get("public", "customers")
    assert customers is not None
    wh = WarehouseSink(state, WarehouseOptions(buckets=2))
    fc = Feed(customers)
    renamed = {"id": 2, "name": "Grace Brewster Hopper", "bio": 'it\'s a "bug",\nliterally'}
    wh.apply(
        fc.batch(fc.change("u", renamed, 200), fc.change("c", {"id": 3, "name": "Edsger", "bio": None}, 201)),
        2,
        APP,
    )
    for q, want in (
        ("SELECT id FROM public.customers WHERE name = 'Grace Brewster Hopper'", [2]),
        ("SELECT id FROM public.customers WHERE name <> 'Ada Lovelace' ORDER BY id", [2, 3]),
        ("SELECT id FROM public.customers WHERE bio = 'it''s a \"bug\",\nliterally'", [2]),
        ("SELECT id FROM public.customers WHERE name > 'B' AND bio IS NULL", [3]),
        ("SELECT id FROM public.orders WHERE blob = '\\xca\\xfe'::BLOB", [10]),
        ("SELECT count(*) AS n FROM public.customers__history WHERE name LIKE 'Grace%'", None),
    ):
        assert main(["--state", str(state), "sql", q, "--json"]) == 0, q
        rows = json.loads(capsys.readouterr().out)
        if want is None:
            assert rows == [{"n": 2}], (q, rows)
        else:
            assert [r["id"] for r in rows] == want, (q, rows)
