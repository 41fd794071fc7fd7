"""Helpers of the schema-change tests (no tests here)."""

from __future__ import annotations

import orjson

from tests.plugins.capture import CaptureEnv, progress, wait_caught_up
from tests.plugins.postgres import wait_for


def install_recorder(env: CaptureEnv) -> None:
    """Install the DDL recorder the way a DBA does: `cdc check --fix` (the test role is a superuser)."""
    res = env.cdc("check", "--fix", "--json")
    assert "installed the DDL recorder" in res.stderr, res.stderr
    report = orjson.loads(res.stdout)
    assert "ddl_recorder" in report["checked"]
    assert not [f for f in report["findings"] if f["check"] == "ddl_recorder"], report


def rename_two_columns_then_write(env: CaptureEnv) -> None:
    """In one transaction, rename ``items.name`` to ``title`` and ``items.note`` to ``memo``; then an
    UPDATE and an INSERT (the first rows after it), wait until the renames are followed and the table
    re-snapshotted, write once more under the new name and wait until capture caught up."""
    env.sql(
        "BEGIN; ALTER TABLE items RENAME COLUMN name TO title; "
        "ALTER TABLE items RENAME COLUMN note TO memo; COMMIT"
    )
    env.sql("UPDATE items SET qty = -1 WHERE id = 1")
    env.sql("INSERT INTO items VALUES (31, 'gadget 31', 'memo 31', 31)")
    wait_for(
        lambda: (p := progress(env, "items")) is not None and p.done,
        timeout=120,
        what="the renames followed and the table snapshotted again",
    )
    env.sql("UPDATE items SET title = 'renamed widget' WHERE id = 2")
    wait_caught_up(env)
