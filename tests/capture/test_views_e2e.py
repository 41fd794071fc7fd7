"""A view from joins end to end: real Postgres -> ``cdc run --once`` -> the apply job once (Spark,
the session's: the job ``cdc apply --once`` runs, without a JVM start per round) -> ``cdc sql
"SELECT * FROM NAME"``, equal after every round to the view's SQL run on the source.
The rounds interleave inserts, updates, deletes and key changes on the driving table and on both
joined tables; the view is registered after the tables hold data. Its search index (``--search``)
finds the rows of the view."""

from __future__ import annotations

from typing import Any

import orjson

from tests.plugins.apply import apply_once
from tests.plugins.capture import CaptureEnv

SQL = (
    "SELECT o.id, o.total, c.name AS customer, r.label AS region FROM orders o "
    "JOIN customers c ON o.customer_id = c.id LEFT JOIN regions r ON c.region = r.code "
    "WHERE o.total > 10 AND c.name <> 'hidden'"
)
COLUMNS = ("id", "total", "customer", "region")


def _source(env: CaptureEnv) -> list[dict[str, Any]]:
    return [dict(zip(COLUMNS, row, strict=True)) for row in env.fetch(SQL + " ORDER BY 1")]


def _view(env: CaptureEnv) -> list[dict[str, Any]]:
    res = env.cdc("sql", "SELECT * FROM order_view ORDER BY id", "--json")
    assert res.returncode == 0, res.stderr
    return list(orjson.loads(res.stdout))


def _round(env: CaptureEnv, spark: Any) -> None:
    env.run_once()
    assert apply_once(spark, env).dead_letters == 0
    assert _view(env) == _source(env)


def test_view_from_joins_equals_the_source_query(env: CaptureEnv, spark: Any) -> None:
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
    env.run_once()
    assert apply_once(spark, env).dead_letters == 0  # the tables hold data, no view yet
    added = env.cdc("views", "add", "order_view", "--sql", SQL, "--search", "customer", "--json")
    assert added.returncode == 0, added.stderr
    assert orjson.loads(added.stdout)["warehouse"]["built"] is False

    env.sql("UPDATE orders SET total = total + 1 WHERE id % 7 = 0")  # a change: the next batch builds it
    _round(env, spark)
    listed = env.cdc("views", "list", "--json")
    assert [v["warehouse"]["built"] for v in orjson.loads(listed.stdout)] == [True]

    env.sql(
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
        "INSERT INTO orders SELECT g, g % 23, 99, NULL FROM generate_series(301, 320) g"
    )
    _round(env, spark)

    env.sql(
        "UPDATE regions SET code = 'w' WHERE code = 'e';"  # key change of the second join's table
        "UPDATE customers SET region = 'w' WHERE id = 21;"
        "TRUNCATE regions;"
        "INSERT INTO regions VALUES ('n', 'north again');"
        "UPDATE orders SET total = 0 WHERE id = 1000"
    )
    _round(env, spark)
    assert len(_source(env)) > 50
    found = env.cdc("search", "order_view", "customer:dee", "--limit", "1000", "--json")
    assert found.returncode == 0, found.stderr
    hits = sorted(orjson.loads(h["key"]["_cdc_key"])["id"] for h in orjson.loads(found.stdout))
    assert hits == [r["id"] for r in _source(env) if r["customer"] == "dee"] and hits
