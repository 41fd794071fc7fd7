"""``cdc views add``'s parser (:func:`cdc.views.parse_view`): what it accepts, and every kind of
view it refuses with an error that says what is supported; and the verbs without a source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cdc.cli import main
from cdc.errors import ConfigError
from cdc.registry import Column, Registry, TableReg
from cdc.views import SUPPORTED, parse_view, source_sql


def _table(
    name: str, cols: tuple[str, ...], key: tuple[str, ...] = ("id",), schema: str = "public"
) -> TableReg:
    return TableReg(
        schema, name, f"cdc.{schema}.{name}", key, columns=tuple(Column(c, "bigint") for c in cols)
    )


ORDERS = _table("orders", ("id", "customer_id", "total", "note"))
CUSTOMERS = _table("customers", ("id", "name", "region_id"))
REGIONS = _table("regions", ("id", "label"))
LINES = _table("lines", ("order_id", "line_no", "qty"), key=("order_id", "line_no"))
OTHER_ORDERS = _table("orders", ("id",), schema="shop")
PARCELS = TableReg(
    "public",
    "parcels",
    "cdc.public.parcels",
    ("id",),
    columns=tuple(
        Column(n, t)
        for n, t in (
            ("id", "bigint"),
            ("status", "text"),
            ("code", "character varying(8)"),
            ("mood", "mood"),  # an enum: ordered by its declared order at the source
            ("placed", "date"),
            ("at", "timestamp with time zone"),
            ("amount", "numeric(10,2)"),
            ("ratio", "double precision"),
        )
    ),
)
TABLES = [ORDERS, CUSTOMERS, REGIONS, LINES, PARCELS]


def test_accepts_inner_and_left_joins_along_keys_with_renames_and_filters() -> None:
    spec = parse_view(
        "order_details",
        'SELECT o.id, o.total AS "Total", c.name AS customer, r.label FROM public.orders AS o '
        "INNER JOIN customers c ON c.id = o.customer_id LEFT OUTER JOIN regions r ON c.region_id = r.id "
        "WHERE o.total >= 10 AND (c.name IS NOT NULL AND r.label <> 'x') AND o.note IN ('a', 'b')",
        TABLES,
    )
    assert spec.columns == ("id", "Total", "customer", "label")
    assert spec.driving == ORDERS
    assert [(j.reg.table, j.kind, j.parent, j.pairs) for j in spec.joins] == [
        ("customers", "inner", "o", (("customer_id", "id"),)),
        ("regions", "left", "c", (("region_id", "id"),)),
    ]
    assert spec.select_sql.endswith("\"o\".\"note\" IN ('a', 'b')")
    assert '"o"."_cdc_key" AS "_cdc_key"' in spec.select_sql
    assert [t.table for t in spec.tables] == ["orders", "customers", "regions"]


def test_accepts_orderings_where_the_warehouse_orders_as_the_source() -> None:
    """< <= > >= on numbers, dates and timestamps; text and enums only with = <> IN IS NULL."""
    spec = parse_view(
        "recent",
        "SELECT s.id FROM parcels s WHERE s.placed >= '2026-01-01' AND s.at < '2026-11-01T00:00:00Z' "
        "AND s.amount > 9.5 AND s.ratio <= 1 AND s.id > 3 AND s.status = 'open' AND s.code <> 'x' "
        "AND s.mood IN ('ok', 'sad')",
        TABLES,
    )
    assert set(spec.used["public.parcels"]) == {c.name for c in PARCELS.columns}


def test_accepts_a_composite_key_and_unqualified_unambiguous_columns() -> None:
    spec = parse_view(
        "v", "SELECT qty, total FROM lines l JOIN orders o ON o.id = l.order_id WHERE qty > 1", TABLES
    )
    assert spec.columns == ("qty", "total")
    comp = _table("shipments", ("id", "order_id", "line_no"))
    spec = parse_view(
        "s",
        "SELECT s.id, l.qty FROM shipments s LEFT JOIN lines l ON l.line_no = s.line_no AND s.order_id = l.order_id",
        [*TABLES, comp],
    )
    assert spec.joins[0].pairs == (("order_id", "order_id"), ("line_no", "line_no"))


def test_source_sql_appends_the_driving_key_it_does_not_select() -> None:
    """The view's SQL as ``cdc verify`` runs it on the source: the registered SQL (filters, joins,
    renames as written) with the driving table's key columns appended, quoted; the verifier's view
    registration keys rows by them (a selected key column by its output name)."""
    from cdc.cli.verify.views import subject_of
    from cdc.registry import ViewReg

    sql = 'SELECT l.qty AS "Q", o.total FROM lines l JOIN orders o ON o.id = l.order_id WHERE l.qty > 1'
    spec = parse_view("v", sql, TABLES)
    assert spec.sources == (("l", "qty"), ("o", "total"))
    out = source_sql(spec, (("order_id", "_cdc_key.order_id"), ("line_no", "_cdc_key.line_no")))
    assert out == (
        'SELECT l.qty AS "Q", o.total, "l"."order_id" AS "_cdc_key.order_id", "l"."line_no" AS '
        '"_cdc_key.line_no" FROM lines AS l JOIN orders AS o ON o.id = l.order_id WHERE l.qty > 1'
    )
    subject = subject_of(ViewReg("v", sql, ("public.lines", "public.orders")), TABLES)
    assert subject.reg.key == ("_cdc_key.order_id", "_cdc_key.line_no")
    assert [c.name for c in subject.reg.columns] == ["Q", "total", "_cdc_key.order_id", "_cdc_key.line_no"]
    renamed = subject_of(ViewReg("w", "SELECT o.id AS order_no FROM orders o", ("public.orders",)), TABLES)
    assert renamed.reg.key == ("order_no",) and not renamed.hidden


REFUSED = {
    "aggregate": ("SELECT count(*) FROM orders", "aggregate"),
    "group by": ("SELECT o.id FROM orders o GROUP BY o.id", "GROUP BY"),
    "distinct": ("SELECT DISTINCT o.id FROM orders o", "DISTINCT"),
    "order by": ("SELECT o.id FROM orders o ORDER BY o.id", "ORDER BY"),
    "limit": ("SELECT o.id FROM orders o LIMIT 3", "LIMIT"),
    "subquery in where": ("SELECT o.id FROM orders o WHERE o.id IN (SELECT id FROM customers)", "subquery"),
    "subquery in from": ("SELECT x.id FROM (SELECT id FROM orders) x", "subquery"),
    "union": ("SELECT id FROM orders UNION SELECT id FROM customers", "UNION"),
    "with": ("WITH x AS (SELECT id FROM orders) SELECT id FROM x", "WITH"),
    "star": ("SELECT * FROM orders", "SELECT *"),
    "expression": ("SELECT o.total * 2 FROM orders o", "only columns"),
    "non-equi join": (
        "SELECT o.id FROM orders o JOIN customers c ON o.customer_id > c.id",
        "column = column",
    ),
    "join filter in on": (
        "SELECT o.id FROM orders o JOIN customers c ON o.customer_id = c.id AND c.id = 3",
        "column = column",
    ),
    "not the key": ("SELECT o.id FROM orders o JOIN customers c ON o.customer_id = c.region_id", "whole key"),
    "part of a key": ("SELECT o.id FROM orders o JOIN lines l ON l.order_id = o.id", "whole key"),
    "right join": (
        "SELECT o.id FROM orders o RIGHT JOIN customers c ON o.customer_id = c.id",
        "INNER and LEFT",
    ),
    "full join": (
        "SELECT o.id FROM orders o FULL JOIN customers c ON o.customer_id = c.id",
        "INNER and LEFT",
    ),
    "cross join": ("SELECT o.id FROM orders o CROSS JOIN customers c", "INNER and LEFT"),
    "comma join": ("SELECT o.id FROM orders o, customers c", "ON a.fk = b.pk"),
    "using": ("SELECT o.id FROM orders o JOIN customers c USING (id)", "ON a.fk = b.pk"),
    "or": ("SELECT o.id FROM orders o WHERE o.total > 1 OR o.total < 0", "the filter"),
    "function filter": ("SELECT o.id FROM orders o WHERE abs(o.total) > 1", "compare columns and literals"),
    "unregistered": ("SELECT x.id FROM nowhere x", "not registered"),
    "text ordered": ("SELECT s.id FROM parcels s WHERE s.status > 'm'", "collation"),
    "varchar ordered, literal first": ("SELECT s.id FROM parcels s WHERE 'k' <= s.code", "collation"),
    "enum ordered": ("SELECT s.id FROM parcels s WHERE s.mood < 'happy'", "declared order"),
    "ambiguous table": ("SELECT id FROM orders", "ambiguous"),
    "ambiguous column": (
        "SELECT id FROM public.orders o JOIN customers c ON o.customer_id = c.id",
        "ambiguous",
    ),
    "unknown column": ("SELECT o.nope FROM orders o", "no captured column"),
    "duplicate names": (
        "SELECT o.id, c.id FROM orders o JOIN customers c ON o.customer_id = c.id",
        "two columns",
    ),
    "reserved name": ("SELECT o.id AS _cdc_key FROM orders o", "reserved"),
    "two statements": ("SELECT o.id FROM orders o; SELECT 1", "statements"),
    "not a select": ("DELETE FROM orders", "DELETE"),
    "garbage": ("SELECT FROM WHERE (", "parse"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refuses_what_it_cannot_maintain(case: str) -> None:
    sql, says = REFUSED[case]
    tables = [*TABLES, OTHER_ORDERS] if case in ("ambiguous table",) else TABLES
    with pytest.raises(ConfigError) as err:
        parse_view("v", sql, tables)
    assert says.lower() in str(err.value).lower()
    assert err.value.fix


def test_refusal_says_what_is_supported() -> None:
    with pytest.raises(ConfigError) as err:
        parse_view("v", "SELECT count(*) FROM orders", TABLES)
    assert err.value.fix == SUPPORTED


@pytest.mark.parametrize("name", ["Bad", "1x", "a-b", "_cdc_x", "__x", ""])
def test_refuses_bad_view_names(name: str) -> None:
    with pytest.raises(ConfigError):
        parse_view(name, "SELECT o.id FROM orders o", TABLES)


def test_views_add_list_remove(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Registry(tmp_path) as registry:
        for t in TABLES:
            registry.add(t)
    sql = "SELECT o.id, c.name FROM orders o LEFT JOIN customers c ON o.customer_id = c.id"
    assert main(["--state", str(tmp_path), "views", "add", "ov", "--sql", sql, "--json"]) == 0
    added = json.loads(capsys.readouterr().out)
    assert added["columns"] == ["id", "name"] and added["tables"] == ["public.orders", "public.customers"]
    views_dir = tmp_path / "warehouse" / "_views"
    assert added["warehouse"] == {"current": str(views_dir / "ov"), "history": None, "built": True}
    assert added["build"] == {"rows": 0, "index": False, "note": "built (0 rows)"}  # no data yet
    assert main(["--state", str(tmp_path), "views", "add", "ov", "--sql", sql]) != 0  # a second time
    assert "already registered" in capsys.readouterr().err
    assert (
        main(["--state", str(tmp_path), "views", "add", "bad", "--sql", "SELECT count(*) FROM orders"]) == 2
    )
    assert "view not supported" in capsys.readouterr().err
    assert main(["--state", str(tmp_path), "views", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(v["name"], v["columns"], v["refused"]) for v in listed] == [("ov", ["id", "name"], None)]
    assert main(["--state", str(tmp_path), "tables", "remove", "public.customers"]) != 0
    assert "read by view(s) ov" in capsys.readouterr().err
    assert main(["--state", str(tmp_path), "views", "remove", "ov"]) == 0
    capsys.readouterr()
    assert main(["--state", str(tmp_path), "views", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    # --history: its table is named; a removal keeps it (it cannot be derived again), so adding the
    # view again with --history is refused until it is moved aside
    assert main(["--state", str(tmp_path), "views", "add", "oh", "--sql", sql, "--history", "--json"]) == 0
    history = views_dir / "oh__history"
    assert json.loads(capsys.readouterr().out)["warehouse"]["history"] == str(history)
    assert main(["--state", str(tmp_path), "views", "remove", "oh"]) == 0
    assert f"its history is kept at {history}" in capsys.readouterr().out and history.is_dir()
    assert main(["--state", str(tmp_path), "views", "add", "oh", "--sql", sql, "--history"]) != 0
    assert f"{history} exists" in capsys.readouterr().err
