"""The orders -> customers -> regions view of the view tests (``tests/capture/test_views_e2e.py``,
``tests/capture/test_views_verify.py``):
its SQL, the source tables with data (:func:`order_tables`) and rounds of changes on all three
tables (:data:`ROUNDS`: inserts, updates, deletes, key changes on either side, a TRUNCATE), and the
view's SQL run on the source (:func:`source_view`)."""

from __future__ import annotations

from typing import Any

from tests.plugins.capture import CaptureEnv

VIEW = "order_view"
SQL = (
    "SELECT o.id, o.total, c.name AS customer, r.label AS region FROM orders o "
    "JOIN customers c ON o.customer_id = c.id LEFT JOIN regions r ON c.region = r.code "
    "WHERE o.total > 10 AND c.name <> 'hidden'"
)
COLUMNS = ("id", "total", "customer", "region")

#: after the view is built: each round is applied, then the view must equal the source query
ROUNDS = (
    "UPDATE customers SET name = 'hidden' WHERE id = 2;"  # leaves the view (filter on the one side)
    "UPDATE customers SET name = 'dee' WHERE id = 3;"  # enters it
    "UPDATE regions SET label = 'NORTH' WHERE code = 'n';"  # every order of a northern customer
    "DELETE FROM regions WHERE code = 's';"  # left join: region null
    "INSERT INTO regions VALUES ('zz', 'far away');"  # left join: a dangling reference now matches
    "INSERT INTO customers VALUES (21, 'new', 'e'), (22, 'newer', 'n');"  # orders 21, 22 join now
    "DELETE FROM customers WHERE id = 5;"  # inner join: its orders leave
    "UPDATE customers SET id = 105 WHERE id = 6;"  # key change on the one side
    "UPDATE orders SET id = 1000 WHERE id = 30;"  # key change on the many side
    "UPDATE orders SET customer_id = 1 WHERE id BETWEEN 40 AND 45;"  # the foreign key moves
    "DELETE FROM orders WHERE id BETWEEN 50 AND 60;"
    "INSERT INTO orders SELECT g, g % 23, 99, NULL FROM generate_series(301, 320) g",
    "UPDATE regions SET code = 'w' WHERE code = 'e';"  # key change of the second join's table
    "UPDATE customers SET region = 'w' WHERE id = 21;"
    "TRUNCATE regions;"
    "INSERT INTO regions VALUES ('n', 'north again');"
    "UPDATE orders SET total = 0 WHERE id = 1000",
)


def order_tables(env: CaptureEnv) -> None:
    """The three source tables, with data (quotes, backslashes in a column the view does not read),
    registered with ``cdc tables add``."""
    env.sql(
        "CREATE TABLE regions (code text PRIMARY KEY, label text);"
        "CREATE TABLE customers (id int PRIMARY KEY, name text, region text);"
        "CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total int, note text);"
        "INSERT INTO regions VALUES ('n', 'north'), ('s', 'south'), ('e', 'east');"
        "INSERT INTO customers SELECT g, (ARRAY['ann', 'bob', 'hidden', 'cy'])[g % 4 + 1],"
        " (ARRAY['n', 's', 'e', 'zz'])[g % 4 + 1] FROM generate_series(1, 20) g;"
        "INSERT INTO orders SELECT g, g % 23, g % 40, 'it''s \"quoted\"\\' || g FROM generate_series(1, 300) g"
    )
    for table in ("regions", "customers", "orders"):
        env.add_table(f"public.{table}")


def source_view(env: CaptureEnv) -> list[dict[str, Any]]:
    """The view's SQL run on the source, by id."""
    return [dict(zip(COLUMNS, row, strict=True)) for row in env.fetch(SQL + " ORDER BY 1")]
