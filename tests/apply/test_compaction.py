"""The log store's compaction and a lagging apply job: an update that leaves its unchanged TOAST
columns out needs the key's earlier row, which compaction must not remove before the job read it.

Found by the fault suite (`tests/chaos`): after ``disk_full`` the apply job was down and restarting for
over a minute, longer than the topics' ``min_compaction_lag_ms`` (60 s); the reader's store compacted
the insert of a key away under its later TOAST update, and every restarted job failed that batch with
"lacks the unchanged TOAST columns ['body'] and the warehouse has no stored row"."""

from __future__ import annotations

from typing import Any

import pytest

from cdc.logstore import APPLY_CONSUMER
from cdc.logstore.embedded import EmbeddedLogStore
from sinks.warehouse import WarehouseSink
from tests.plugins.apply import Env, run_job
from tests.plugins.changes import ChangeWriter, make_reg

COLUMNS = [("slug", "text"), ("title", "text"), ("body", "text")]


@pytest.mark.parametrize("backend", ["embedded"])
def test_a_toast_update_survives_compaction_while_the_apply_job_is_away(
    spark_clean: Any,
    env: Env,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import cdc.logstore

    assert isinstance(env.store, EmbeddedLogStore)
    reg = env.register(make_reg("public", "docs", COLUMNS, key=("slug",)))
    w = ChangeWriter(env.store, reg, partitions=1)
    with w.txn():
        w.insert({"slug": "old", "title": "t0", "body": "old body"})
    first = run_job(spark_clean, env)  # the job reads and commits this much, then goes away
    assert first.events == 1 and env.store.committed(APPLY_CONSUMER, reg.topic) == {0: 1}

    with w.txn():
        w.insert({"slug": "new", "title": "draft", "body": "x" * 3000})
    with w.txn():
        w.update({"slug": "old", "title": "t1", "body": "old body"})
    real = cdc.logstore.now_ms  # the job is away past min_compaction_lag_ms (60 s): 2 minutes on
    monkeypatch.setattr(cdc.logstore, "now_ms", lambda: real() + 120_000)
    with w.txn():  # a TOAST update of each key: body unchanged, left out
        w.update({"slug": "new", "title": "published"}, unavailable=("body",))
        w.update({"slug": "old", "title": "t2"}, unavailable=("body",))
    env.store.compact(reg.topic)  # what the reader's store does in the background meanwhile

    second = run_job(spark_clean, env, max_records=2)  # the insert and its update in different batches
    assert second.batches >= 2
    rows = {r["slug"]: r for r in WarehouseSink(env.state).current_rows(reg, meta=False).to_pylist()}
    assert rows == {
        "new": {"slug": "new", "title": "published", "body": "x" * 3000},
        "old": {"slug": "old", "title": "t2", "body": "old body"},
    }
