"""The log is the source of truth: every event carries the whole row, so a compacted topic is a
complete copy of its table (issue 31).

Postgres leaves an unchanged out-of-line TOAST value out of an UPDATE (wal2json omits the column,
pgoutput marks it unchanged). The real reader (``cdc run``) fills it in from the last value it wrote
for the key (:mod:`cdc.logstore.images`); these tests read the topic back as a new consumer would,
before and after the embedded store compacted it, on both decoders."""

from __future__ import annotations

import secrets
import signal
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

import cdc.logstore
from cdc.logstore import APPLY_CONSUMER
from cdc.logstore.factory import open_log_store
from cdc.logstore.images import images_path
from cdc.registry import TableState
from tests.plugins.capture import CaptureEnv, materialize, wait_streaming

pytestmark = [pytest.mark.postgres, pytest.mark.decoders("wal2json", "pgoutput")]


def big(tag: object) -> str:
    """~6 kB, incompressible (stored out of line), with quotes, a newline and backslashes."""
    return f"{tag} 'q' \"dq\" back\\slash new\nline " + secrets.token_hex(3000)


def body_table(env: CaptureEnv, bodies: dict[int, str], *, snapshot: bool = True) -> str:
    """``t (id, n, body)`` with ``body`` stored out of line (``STORAGE EXTERNAL``: not compressed),
    a row per ``bodies`` item, registered and, with ``snapshot``, snapshotted; its topic."""
    env.sql("CREATE TABLE t (id int PRIMARY KEY, n int, body text)")
    env.sql("ALTER TABLE t ALTER COLUMN body SET STORAGE EXTERNAL")
    for i, body in bodies.items():
        env.sql("INSERT INTO t VALUES (%s, 0, %s)", (i, body))
    env.add_table("public.t")
    if snapshot:
        env.run_once()
    return env.reg("public", "t").topic


def source_rows(env: CaptureEnv, table: str) -> dict[str, dict[str, Any]]:
    """The source's rows as the topic keys and encodes them (``row_to_json`` of every column)."""
    out = {}
    for (row,) in env.fetch(f"SELECT row_to_json(t)::text FROM {table} t"):
        value = orjson.loads(row)
        out[orjson.dumps({"id": value["id"]}).decode()] = value
    return out


def normal(row: dict[str, Any]) -> dict[str, Any]:
    """A row with json/jsonb values parsed (the event carries them as text, row_to_json as JSON)."""
    return {k: orjson.loads(v) if k in ("doc", "j") and isinstance(v, str) else v for k, v in row.items()}


def assert_complete(env: CaptureEnv, topic: str) -> int:
    """Every record of ``topic`` that carries a row carries all of it; the number of such records."""
    n = 0
    for rec in env.records(topic):
        if rec.value is None:
            continue
        event = orjson.loads(rec.value)
        if event["after"] is None:
            continue
        assert event["unavailable"] == [], (rec.key, event["op"], event["unavailable"])
        n += 1
    return n


def compact(env: CaptureEnv, topic: str, monkeypatch: pytest.MonkeyPatch) -> int:
    """What the store does once every consumer read past and ``min_compaction_lag_ms`` passed: keep
    only the newest record of each key. Returns how many records it removed."""
    with open_log_store(env.settings(), writer=True) as store:
        store.commit(APPLY_CONSUMER, topic, store.end_offsets(topic))
        real = cdc.logstore.now_ms
        with monkeypatch.context() as m:
            m.setattr(cdc.logstore, "now_ms", lambda: real() + 3_600_000)
            return store.compact(topic)


def assert_replay_equals_source(env: CaptureEnv, topic: str, table: str) -> None:
    """A new consumer reading ``topic`` from offset 0 holds the table, column by column."""
    replay = materialize(env.records(topic))
    source = source_rows(env, table)
    assert set(replay) == set(source)
    for key, row in source.items():
        assert normal(replay[key]) == normal(row), key


def test_a_compacted_topic_replays_every_row_whole(env: CaptureEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's reproduction: 200 rows, a text and a jsonb column stored out of line, updates that
    change one of the two or neither, a key change and deletes; then compaction."""
    env.sql("CREATE TABLE t (id int PRIMARY KEY, n int, body text, doc jsonb)")
    env.sql("ALTER TABLE t ALTER COLUMN body SET STORAGE EXTERNAL, ALTER COLUMN doc SET STORAGE EXTERNAL")
    for i in range(200):
        env.sql("INSERT INTO t VALUES (%s, 0, %s, %s)", (i, big(i), orjson.dumps({"d": big(i)}).decode()))
    env.add_table("public.t")
    env.run_once()  # the initial snapshot: the images come from its rows
    for r in range(3):
        env.sql("UPDATE t SET n = n + 1 WHERE id %% 3 = %s", (r,))
        env.sql("UPDATE t SET body = %s WHERE id %% 10 = %s", (big(f"b{r}"), r))
        env.sql("UPDATE t SET doc = %s WHERE id %% 10 = %s", (orjson.dumps({"r": r}).decode(), r + 5))
    env.sql("UPDATE t SET id = 1000 WHERE id = 7")  # a key change: body and doc unchanged
    env.sql("UPDATE t SET n = 99 WHERE id = 1000")
    env.sql("DELETE FROM t WHERE id IN (11, 12)")
    env.run_once()
    topic = env.reg("public", "t").topic
    assert assert_complete(env, topic) > 200 + 200
    assert_replay_equals_source(env, topic, "t")

    removed = compact(env, topic, monkeypatch)
    assert removed > 0
    assert assert_complete(env, topic) == 198  # the newest record of each key left
    assert_replay_equals_source(env, topic, "t")

    # and so on from the compacted topic: the reader keeps filling in from its images
    env.sql("UPDATE t SET n = -1")
    env.run_once()
    assert_complete(env, topic)
    assert_replay_equals_source(env, topic, "t")
    with env.registry() as reg:
        assert reg.get_table_state(TableState.VALUES_UNKNOWN, "public", "t") is None


@pytest.mark.cdc_config("batch_max_events = 1\n")  # a batch per change: the kill falls between changes
def test_kill_between_the_append_and_the_images_keeps_every_event_right(env: CaptureEnv) -> None:
    """kill -9 of the reader after the log store made a batch durable and before its images were
    committed: the restarted reader decodes those changes again and fills each from the images as
    they were, never from a later value. Each event is checked against the row it stands for."""
    bodies = {(k, 0): big(f"{k}/0") for k in range(5)}
    topic = body_table(env, {k: bodies[(k, 0)] for k in range(5)}, snapshot=False)
    arm = env.state.parent / "arm"
    proc = env.spawn("run", extra_env={"CDC_FAULTS": f"reader.after_append:@{arm}"})
    wait_streaming(env, proc)
    arm.touch()
    # per key: odd steps change body (new images), even steps leave it out (filled in)
    for j in range(1, 7):
        for k in range(5):
            if j % 2:
                bodies[(k, j)] = big(f"{k}/{j}")
                env.sql("UPDATE t SET n = %s, body = %s WHERE id = %s", (j, bodies[(k, j)], k))
            else:
                env.sql("UPDATE t SET n = %s WHERE id = %s", (j, k))
    assert proc.wait(timeout=120) == -signal.SIGKILL, env.proc_log()
    assert "cdc-fault: reader.after_append" in env.proc_log()
    assert not arm.exists()  # the fault hit
    env.run_once()
    seen: set[tuple[int, int]] = set()
    for rec in env.records(topic):
        event = orjson.loads(rec.value) if rec.value else None
        if event is None or event["after"] is None:
            continue
        after = event["after"]
        k, j = after["id"], after["n"]
        assert event["unavailable"] == []
        assert after["body"] == bodies[(k, j if j % 2 or j == 0 else j - 1)], (k, j)
        seen.add((k, j))
    assert seen == {(k, j) for k in range(5) for j in range(7)}
    assert_replay_equals_source(env, topic, "t")


def test_the_images_are_rebuilt_from_the_topic_when_lost(
    env: CaptureEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image store deleted (a lost disk, a restore of the state without it): the next ``cdc run``
    rebuilds it from the compacted topic, which is complete, and every event stays whole."""
    topic = body_table(env, {i: big(i) for i in range(50)})
    env.sql("UPDATE t SET body = %s WHERE id < 10", (big("new"),))
    env.sql("UPDATE t SET n = 1")
    env.run_once()
    compact(env, topic, monkeypatch)
    for p in Path(env.state).glob(images_path(env.state).name + "*"):
        p.unlink()
    env.sql("UPDATE t SET n = 2")
    env.sql("UPDATE t SET id = id + 100 WHERE id < 5")  # key changes too
    res = env.cdc("run", "--once")
    assert res.returncode == 0, res.stderr
    assert "rebuilt from" in res.stderr and "values unknown" not in res.stderr, res.stderr
    assert assert_complete(env, topic) >= 50
    assert_replay_equals_source(env, topic, "t")


def test_schema_changes_keep_every_row_whole(env: CaptureEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Add, drop, rename and retype columns of a table with out-of-line values, with updates that
    leave them out in between: each event is whole (a retype that rewrote the values at the source
    is read again by a chunked snapshot), and the compacted topic replays the table."""
    env.sql("CREATE TABLE t (id int PRIMARY KEY, n int, body text, doc text, gone text)")
    env.sql("ALTER TABLE t ALTER COLUMN body SET STORAGE EXTERNAL, ALTER COLUMN doc SET STORAGE EXTERNAL")
    env.sql("ALTER TABLE t ALTER COLUMN gone SET STORAGE EXTERNAL")
    for i in range(20):
        env.sql(
            "INSERT INTO t VALUES (%s, 0, %s, %s, %s)",
            (i, big(i), orjson.dumps({"d": big(i)}).decode(), big(f"gone {i}")),
        )
    env.add_table("public.t")
    env.run_once()
    topic = env.reg("public", "t").topic
    steps = [
        "ALTER TABLE t ADD COLUMN extra text",
        "UPDATE t SET extra = repeat(md5(id::text), 200) WHERE id < 10",
        "ALTER TABLE t DROP COLUMN gone",
        "ALTER TABLE t RENAME COLUMN body TO text_body",
        "ALTER TABLE t ALTER COLUMN doc TYPE jsonb USING doc::jsonb",
        "ALTER TABLE t ALTER COLUMN text_body TYPE varchar",
        "ALTER TABLE t ADD COLUMN gone text",  # the name again: none of the old values may come back
        "UPDATE t SET gone = 'new ' || id WHERE id < 5",
    ]
    readded_at: set[tuple[int, int]] = set()
    for i, step in enumerate(steps):
        env.sql(step)
        env.sql("UPDATE t SET n = %s", (i + 1,))  # every out-of-line value left out
        env.run_once()  # --once also finishes a chunked snapshot the step asked for
        if step.startswith("ALTER TABLE t ADD COLUMN gone"):
            readded_at = {(r.partition, r.offset) for r in env.records(topic)}
    assert env.reg("public", "t").snapshot_state == "done"
    env.sql("UPDATE t SET n = 100")
    env.run_once()
    records = env.records(topic)
    for rec in records:
        event = orjson.loads(rec.value) if rec.value else None
        if event is None or event["after"] is None:
            continue
        if (
            rec.partition,
            rec.offset,
        ) not in readded_at:  # the re-added column: none of the dropped one's values come back
            gone = event["after"].get("gone")
            assert gone is None or gone.startswith("new"), gone
            assert event["unavailable"] == [], event["unavailable"]
    compact(env, topic, monkeypatch)
    assert_complete(env, topic)
    assert_replay_equals_source(env, topic, "t")


def test_a_value_that_cannot_be_known_is_named_and_repaired(
    env: CaptureEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A topic written before the image store (its newest record of a key lists the value in
    ``unavailable``), compacted, and the store lost: the value cannot be known. The change that
    leaves it out keeps it in ``unavailable`` -- never null, never a guess --, ``cdc check`` and
    ``cdc status`` name the table, and ``cdc snapshot TABLE`` makes the topic whole again."""
    topic = body_table(env, {i: big(i) for i in range(5)})
    # what an earlier cdc wrote for an update that left body out
    last = [r for r in env.records(topic) if r.key == b'{"id":1}'][-1]
    legacy = orjson.loads(last.value or b"")
    del legacy["after"]["body"]
    legacy["op"], legacy["unavailable"] = "u", ["body"]
    with open_log_store(env.settings(), writer=True) as store:
        store.append(topic, [cdc.logstore.Record(last.key, orjson.dumps(legacy))])
    compact(env, topic, monkeypatch)
    for p in Path(env.state).glob(images_path(env.state).name + "*"):
        p.unlink()
    env.sql("UPDATE t SET n = 1")
    res = env.cdc("run", "--once")
    assert res.returncode == 0, res.stderr
    assert "values unknown: {'body': 1}" in res.stderr, res.stderr
    events = {r.key: orjson.loads(r.value) for r in env.records(topic) if r.value}
    assert events[b'{"id":1}']["unavailable"] == ["body"] and "body" not in events[b'{"id":1}']["after"]
    assert all(e["unavailable"] == [] for k, e in events.items() if k != b'{"id":1}')

    check = env.cdc("check", "--json")
    found = [f for f in orjson.loads(check.stdout)["findings"] if f["check"] == "complete_topics"]
    assert (
        len(found) == 1 and "public.t" in found[0]["message"] and "cdc snapshot public.t" in found[0]["fix"]
    )
    status = orjson.loads(env.cdc("status", "--json").stdout)
    warned = [s for s in status["stages"] if s.get("table") == "public.t" and s["stage"] == "source_table"]
    assert warned and warned[0]["verdict"] == "WARN", status["stages"]

    assert env.cdc("snapshot", "public.t").returncode == 0
    env.run_once()
    with env.registry() as reg:
        assert reg.get_table_state(TableState.VALUES_UNKNOWN, "public", "t") is None
    compact(env, topic, monkeypatch)
    assert_complete(env, topic)
    assert_replay_equals_source(env, topic, "t")


@pytest.mark.kafka
@pytest.mark.cdc_config("", backend="kafka")
def test_a_librdkafka_consumer_reads_every_row_whole_from_offset_0(env: CaptureEnv) -> None:
    """On Kafka (Tansu, which never compacts), another client -- librdkafka through confluent-kafka --
    reading the topic from offset 0 gets whole rows in every record: what a compacted topic keeps."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    topic = body_table(env, {i: big(i) for i in range(30)})
    env.sql("UPDATE t SET n = 1")
    env.sql("UPDATE t SET id = id + 100 WHERE id < 3")
    env.sql("UPDATE t SET body = %s WHERE id = 10", (big("new"),))
    env.sql("UPDATE t SET n = 2 WHERE id >= 10")
    env.run_once()
    expected = env.records(topic)
    assert env.log_url is not None
    consumer = Consumer(
        {
            "bootstrap.servers": env.log_url.removeprefix("kafka://"),
            "group.id": f"librdkafka-{env.slot}",
            "enable.auto.commit": False,
            "fetch.max.bytes": 50 << 20,
            "max.partition.fetch.bytes": 50 << 20,
        }
    )
    try:
        parts = consumer.list_topics(topic, timeout=30).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        got: list[Any] = []
        deadline = time.monotonic() + 60
        while len(got) < len(expected) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got.append(msg)
    finally:
        consumer.close()
    assert len(got) == len(expected)
    whole = 0
    for msg in got:
        if msg.value() is None:
            continue
        event = orjson.loads(msg.value())
        if event["after"] is not None:
            assert event["unavailable"] == [] and "body" in event["after"], (msg.key(), event["op"])
            whole += 1
    assert whole == 30 + 30 + 3 + 1 + 23  # snapshot, n = 1, key changes, body, n = 2 (ids 10-29, 100-102)
    assert_replay_equals_source(env, topic, "t")


@pytest.mark.decoders("pgoutput")
def test_the_fill_turned_off_and_on_again_never_fills_from_a_stale_store(env: CaptureEnv) -> None:
    """``fill_unchanged_toast = false`` (to measure the fill, or spare its disk) lists the values in
    ``unavailable`` and drops the image store, which missed those changes; turned on again, the
    store is rebuilt from the topic: the values a change wrote while it was off are the ones filled."""
    topic = body_table(env, {1: big("first")})
    on = env.config.read_text()
    env.config.write_text(on + "fill_unchanged_toast = false\n")
    env.sql("UPDATE t SET body = %s", (big("written while off"),))
    env.sql("UPDATE t SET n = 1")
    env.run_once()
    assert not images_path(env.state).exists()
    last = orjson.loads(env.records(topic)[-1].value or b"")
    assert last["unavailable"] == ["body"] and "body" not in last["after"]
    env.config.write_text(on)
    env.sql("UPDATE t SET n = 2")
    res = env.cdc("run", "--once")
    assert res.returncode == 0 and "rebuilt from" in res.stderr, res.stderr
    last = orjson.loads(env.records(topic)[-1].value or b"")
    assert last["unavailable"] == [] and last["after"]["body"].startswith("written while off")
