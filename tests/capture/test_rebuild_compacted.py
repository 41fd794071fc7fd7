"""``cdc rebuild`` of a table whose big column was never updated after its insert, from its topic
after compaction (issue 31): the real reader (``cdc run --once``) filled every update's unchanged
TOAST value in, so the compacted topic -- only each key's newest record -- is a complete copy; the
rebuild's copy verifies against the source and is swapped in. Before, the copy missed the value
for every row updated since its insert, and the rebuild refused it."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import orjson
import pytest

from cdc.cli import main as cdc_main
from tests.capture.test_complete_rows import assert_complete, big, body_table, compact
from tests.plugins.apply import apply_once
from tests.plugins.capture import CaptureEnv

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.decoders("wal2json", "pgoutput"),
]


def test_rebuild_verifies_and_swaps_a_compacted_topic(
    env: CaptureEnv, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic = body_table(env, {i: big(i) for i in range(20)})
    for r in range(3):
        env.sql("UPDATE t SET n = n + 1 WHERE id %% 2 = %s", (r % 2,))  # body left out, every time
    env.sql("UPDATE t SET id = 100 WHERE id = 7")  # a key change: body unchanged
    env.run_once()
    assert apply_once(spark, env).dead_letters == 0
    assert compact(env, topic, monkeypatch) > 0
    assert assert_complete(env, topic) == 20  # the newest record of each key, whole
    for name, value in env.environ().items():
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cdc_main(["rebuild", "public.t", "--yes", "--json"])
    report = orjson.loads(out.getvalue())
    assert code == 0 and report["status"] == "rebuilt", report
    verified, tables = env.verify()
    assert verified == 0 and [t["status"] for t in tables] == ["ok"], tables
