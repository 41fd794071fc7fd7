"""A view from joins end to end: real Postgres -> ``cdc run --once`` -> the apply job (the job ``cdc
apply --once`` runs, :func:`tests.plugins.apply.apply_once`, on the session's Spark: no JVM start per
round) -> the view's Delta table, equal after every round to the view's SQL run on the source
(:mod:`tests.plugins.views`: inserts, updates, deletes and key changes on the driving table and on
both joined tables; the view is registered after the tables hold data and built by ``cdc views
add`` from their current state); ``cdc sql "SELECT * FROM NAME"`` and ``cdc search``, and ``cdc
verify NAME`` clean at the end. ``cdc verify`` of views against a test-only apply loop, without a
JVM: ``tests/capture/test_views_verify.py``."""

from __future__ import annotations

from typing import Any

import orjson

from tests.plugins.apply import apply_once
from tests.plugins.capture import CaptureEnv
from tests.plugins.views import ROUNDS, SQL, VIEW, order_tables, source_view


def _view(env: CaptureEnv) -> list[dict[str, Any]]:
    res = env.cdc("sql", f"SELECT * FROM {VIEW} ORDER BY id", "--json")
    assert res.returncode == 0, res.stderr
    return list(orjson.loads(res.stdout))


def _round(env: CaptureEnv, spark: Any) -> None:
    env.run_once()
    assert apply_once(spark, env).dead_letters == 0
    assert _view(env) == source_view(env)


def test_view_from_joins_equals_the_source_query(env: CaptureEnv, spark: Any) -> None:
    order_tables(env)
    env.run_once()
    assert apply_once(spark, env).dead_letters == 0  # the tables hold data, no view yet
    added = env.cdc("views", "add", VIEW, "--sql", SQL, "--search", "customer", "--json")
    assert added.returncode == 0, added.stderr
    assert orjson.loads(added.stdout)["warehouse"]["built"] is True  # from the tables' current state
    assert _view(env) == source_view(env)

    env.sql("UPDATE orders SET total = total + 1 WHERE id % 7 = 0")
    _round(env, spark)
    for changes in ROUNDS:
        env.sql(changes)
        _round(env, spark)
    assert len(source_view(env)) > 50
    found = env.cdc("search", VIEW, "customer:dee", "--limit", "1000", "--json")
    assert found.returncode == 0, found.stderr
    found_hits = orjson.loads(found.stdout)
    # keyed as a table's hit: the driving row's key as an object, the view's search columns the document
    assert all(set(h["key"]) == {"id"} and h["document"] == {"customer": "dee"} for h in found_hits)
    hits = sorted(h["key"]["id"] for h in found_hits)
    assert hits == [r["id"] for r in source_view(env) if r["customer"] == "dee"] and hits
    text = env.cdc("search", VIEW, "customer:dee", "--limit", "1")
    assert text.returncode == 0 and '{"id":' in text.stdout and "_cdc_key" not in text.stdout, text.stdout
    code, report = env.verify(VIEW, "--wait", "10")
    assert code == 0 and [(r["table"], r["kind"], r["status"]) for r in report] == [(VIEW, "view", "ok")]
