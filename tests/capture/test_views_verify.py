"""``cdc verify`` of views from joins: real Postgres -> ``cdc run --once`` -> a test-only apply loop,
:func:`tests.plugins.apply.apply_pending_without_spark` (the apply's Spark-free micro-batch, no JVM)
-> the views' Delta tables and search indexes. ``cdc verify`` compares each view with its SQL run
on the source: right after ``cdc views add`` (one view added while the ``apply`` lock is held,
another with it free), clean after every round of changes (:mod:`tests.plugins.views`), and it finds
a row planted in a view's table, a row removed from another and a lost search index, with their keys.

Not end to end: the loop is not the apply job. It does not run the job's Spark source, checkpoint or
Spark tasks (where the job maintains the views by the keys its tasks touched), and it commits the
apply consumer's positions, which ``cdc verify`` waits for, itself, not as the job does from Spark's
offset log. The views through ``cdc run`` and the apply job: ``tests/capture/test_views_e2e.py``."""

from __future__ import annotations

import shutil
from typing import Any

import orjson
from deltalake import DeltaTable

from cdc import paths
from cdc.locks import ProcessLock
from tests.plugins.apply import apply_pending_without_spark
from tests.plugins.capture import CaptureEnv
from tests.plugins.views import ROUNDS, SQL, VIEW, order_tables, source_view

#: a second view that does not select the driving table's key: verify carries it as _cdc_key.id
TOTALS = "SELECT o.total, c.name AS who FROM orders o JOIN customers c ON o.customer_id = c.id"


def _apply(env: CaptureEnv) -> None:
    """``cdc run --once``, then what the reader wrote since the last call through the test-only loop
    (the apply's Spark-free micro-batch; not the apply job)."""
    env.run_once()
    apply_pending_without_spark(env.state, settings=env.settings())


def _verify_views(env: CaptureEnv) -> dict[str, dict[str, Any]]:
    """``cdc verify --json`` (every table and view) by name, asserting its exit code is 0."""
    code, report = env.verify("--wait", "10")
    assert code == 0, report
    return {r["table"]: r for r in report}


def test_verify_compares_views_with_their_sql_on_the_source(env: CaptureEnv) -> None:
    order_tables(env)
    _apply(env)
    # built at add from the tables' current state: while an apply runs (it holds the apply lock),
    # its Delta tables only (the apply holds the index's writer); with none running, its index too
    with ProcessLock(env.state, "apply"):
        added = env.cdc("views", "add", VIEW, "--sql", SQL, "--search", "customer", "--history", "--json")
    assert added.returncode == 0, added.stderr
    build = orjson.loads(added.stdout)["build"]
    assert build["rows"] == len(source_view(env)) > 50 and build["index"] is False
    added = env.cdc("views", "add", "totals", "--sql", TOTALS, "--search", "who", "--json")
    assert orjson.loads(added.stdout)["build"]["index"] is True
    code, report = env.verify("--wait", "0")  # no apply since: the views are there
    assert code == 1 and [r["status"] for r in report] == ["ok"] * 3 + ["different", "ok"], report
    assert report[3]["table"] == VIEW and report[3]["search"]["missing_count"] == build["rows"]
    assert report[3]["missing_count"] == report[3]["different_count"] == 0
    env.sql("UPDATE orders SET total = total + 1 WHERE id % 7 = 0")
    _apply(env)  # maintains both views, and builds the first one's index whole
    for changes in ROUNDS:
        reports = _verify_views(env)
        assert {r["kind"] for r in reports.values()} == {"table", "view"} and len(reports) == 5
        assert reports["totals"]["search_docs"] == reports["totals"]["source_rows"]
        assert reports[VIEW]["source_rows"] == len(source_view(env)) == reports[VIEW]["warehouse_rows"]
        assert reports[VIEW]["search_docs"] == len(source_view(env))
        env.sql(changes)
        _apply(env)
    assert _verify_views(env)[VIEW]["source_rows"] > 50

    view = DeltaTable(str(paths.view_table(env.state, VIEW)))
    row = min(view.to_pyarrow_table().to_pylist(), key=lambda r: r["id"])
    view.update({"customer": "'planted'"}, predicate=f"id = {row['id']}")  # behind the apply's back
    totals = DeltaTable(str(paths.view_table(env.state, "totals")))
    gone = orjson.loads(totals.to_pyarrow_table().column("_cdc_key")[0].as_py())["id"]
    totals.delete(f"_cdc_key = '{orjson.dumps({'id': gone}).decode()}'")
    shutil.rmtree(paths.search_index(env.state, f"_views.{VIEW}"))
    paths.search_versions(env.state, f"_views.{VIEW}").unlink()

    code, report = env.verify(VIEW, "--wait", "5")
    assert code == 1 and len(report) == 1 and report[0]["status"] == "different", report
    (wrong,) = report[0]["different"]
    assert wrong["key"] == {"id": row["id"]}
    assert wrong["columns"] == {"customer": {"source": row["customer"], "warehouse": "planted"}}
    assert report[0]["search"]["missing_count"] == report[0]["source_rows"]
    code, report = env.verify("totals", "--wait", "5")
    assert code == 1 and report[0]["missing"] == [{"_cdc_key.id": gone}], report
    assert report[0]["missing_count"] == 1 and report[0]["different_count"] == 0
    text = env.cdc("verify", "--wait", "5")  # every table and view, the text form
    assert text.returncode == 1 and "totals: missing: [{'_cdc_key.id'" in text.stdout, text.stdout
