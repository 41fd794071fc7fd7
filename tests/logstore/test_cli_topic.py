"""``cdc topic list|dump|tail`` through ``cdc.cli.main`` against an embedded store filled here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cdc.cli import main
from cdc.logstore import Record, TopicConfig, partition_for
from cdc.logstore.embedded import EmbeddedLogStore


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # no cdc.toml from elsewhere
    for var in ("CDC_LOG", "CDC_STATE", "CDC_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "state"


def cli(state: Path, *args: str) -> int:
    return main(["--state", str(state), "--log", "embedded", *args])


@pytest.fixture
def filled(state: Path) -> Path:
    with EmbeddedLogStore(state / "log", writer=True, compaction_interval_s=None) as store:
        store.create_topic("cdc.public.users", TopicConfig(partitions=2))
        store.create_topic("cdc.dead_letter", TopicConfig(partitions=1, compacted=False))
        store.append(
            "cdc.public.users",
            [
                Record(b'{"id": 1}', b'{"after": {"id": 1, "n": 1.10}}', timestamp_ms=1_700_000_000_000),
                Record(b'{"id": 2}', b'{"after": {"id": 2}}', timestamp_ms=1_700_000_000_001),
                Record(b'{"id": 1}', None, timestamp_ms=1_700_000_000_002),
                Record(b"not json", b"\xff\xfe raw", timestamp_ms=1_700_000_000_003),
                Record(b'{"id": 123456789012345678901234567890}', b'{\n "pretty": true\n}', timestamp_ms=5),
            ],
        )
    return state


def records_by_position(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_topic_list_json(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(filled, "topic", "list", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in listed] == ["cdc.dead_letter", "cdc.public.users"]
    users = listed[1]
    assert users["partitions"] == 2
    assert users["compacted"] is True
    assert listed[0]["compacted"] is False
    assert users["start_offsets"] == {"0": 0, "1": 0}
    assert sum(users["end_offsets"].values()) == 5
    assert users["records"] == 5


def test_topic_list_text(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(filled, "topic", "list") == 0
    out = capsys.readouterr().out
    assert "cdc.public.users" in out and "cdc.dead_letter" in out


def test_topic_list_empty_store(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(state, "topic", "list", "--json") == 0
    assert json.loads(capsys.readouterr().out) == []


def test_topic_dump_json_shape(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(filled, "topic", "dump", "cdc.public.users", "--json") == 0
    lines = records_by_position(capsys.readouterr().out)
    assert len(lines) == 5
    for line in lines:
        assert list(line) == ["topic", "partition", "offset", "timestamp", "key", "value"]
    # partition by partition, each in offset order
    positions = [(line["partition"], line["offset"]) for line in lines]
    assert positions == sorted(positions)  # type: ignore[type-var]
    by_key = {json.dumps(line["key"]): line for line in lines}
    first = [line for line in lines if line["key"] == {"id": 1}]
    assert [f["value"] for f in first] == [{"after": {"id": 1, "n": 1.1}}, None]  # tombstone -> null
    assert first[0]["partition"] == partition_for(b'{"id": 1}', 2)
    assert first[0]["timestamp"] == 1_700_000_000_000
    raw = by_key[json.dumps("not json")]
    assert raw["value"] == "\\xff\\xfe raw"  # not JSON: printed as a string, not a crash
    big = by_key[json.dumps({"id": 123456789012345678901234567890})]
    assert big["value"] == {"pretty": True}


def test_topic_dump_keeps_json_verbatim(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(filled, "topic", "dump", "cdc.public.users", "--json") == 0
    out = capsys.readouterr().out
    assert '"n": 1.10' in out  # numbers keep their digits
    assert "123456789012345678901234567890" in out


def test_topic_dump_partition_and_from(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = partition_for(b'{"id": 1}', 2)
    assert (
        cli(filled, "topic", "dump", "cdc.public.users", "--partition", str(p), "--from", "1", "--json") == 0
    )
    lines = records_by_position(capsys.readouterr().out)
    assert lines and all(line["partition"] == p for line in lines)
    assert [line["offset"] for line in lines] == list(range(1, 1 + len(lines)))
    assert cli(filled, "topic", "dump", "cdc.public.users", "--from", "99", "--json") == 0
    assert capsys.readouterr().out == ""


def test_topic_dump_text(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(filled, "topic", "dump", "cdc.public.users") == 0
    out = capsys.readouterr().out
    assert "(tombstone)" in out
    assert "2023-11-14 22:13:20.000" in out


def test_topic_errors(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(filled, "topic", "dump", "nope", "--json") == 1
    err = json.loads(capsys.readouterr().err)
    assert err["error"] == "UnknownTopicError" and err["topic"] == "nope" and err["fix"]
    assert cli(filled, "topic", "dump", "cdc.public.users", "--partition", "0", "--from", "99") == 1
    text = capsys.readouterr().err
    assert "past the end offset" in text and "fix:" in text
    assert cli(filled, "topic", "dump", "cdc.public.users", "--partition", "7") == 1
    assert "no partition 7" in capsys.readouterr().err


def test_topic_tail_follows_new_records(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    codes: list[int] = []
    tail = threading.Thread(
        target=lambda: codes.append(
            cli(filled, "topic", "tail", "cdc.dead_letter", "--json", "--interval", "0.02", "--limit", "3")
        )
    )
    tail.start()
    appended: list[bytes] = []
    with EmbeddedLogStore(filled / "log", writer=True, compaction_interval_s=None) as store:
        deadline = time.monotonic() + 120  # generous: the assertion is on what tail prints
        while tail.is_alive() and time.monotonic() < deadline:
            value = json.dumps({"n": len(appended)}).encode()
            store.append("cdc.dead_letter", [Record(b'"k"', value)])
            appended.append(value)
            tail.join(timeout=0.05)
    tail.join(timeout=60)
    assert not tail.is_alive(), "tail did not stop after --limit records"
    assert codes == [0]
    lines = records_by_position(capsys.readouterr().out)
    assert len(lines) == 3
    ns = [line["value"]["n"] for line in lines]  # type: ignore[index]
    assert ns == list(range(ns[0], ns[0] + 3))  # consecutive new records, none skipped
    assert [line["offset"] for line in lines] == ns


def test_topic_tail_exits_after_its_last_record(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--limit N` exits once the Nth record is printed, without waiting for one more."""
    codes: list[int] = []
    tail = threading.Thread(
        target=lambda: codes.append(
            cli(filled, "topic", "tail", "cdc.dead_letter", "--interval", "0.02", "--limit", "2")
        ),
        daemon=True,
    )
    tail.start()
    deadline = time.monotonic() + 60
    err = ""
    while "following" not in err:  # appended before tail reads the end offsets, they would not count
        assert time.monotonic() < deadline and tail.is_alive(), err
        err += capsys.readouterr().err
        time.sleep(0.02)
    with EmbeddedLogStore(filled / "log", writer=True, compaction_interval_s=None) as store:
        store.append("cdc.dead_letter", [Record(b'"k"', b'{"n":0}'), Record(b'"k"', b'{"n":1}')])
    tail.join(timeout=60)
    assert not tail.is_alive(), "tail waited for a record past --limit"
    out = capsys.readouterr().out
    assert codes == [0] and [line.split()[-1] for line in out.splitlines()] == ['{"n":0}', '{"n":1}']


# -- bad input: each a clear error with its fix and a non-zero exit, through the real `cdc` command ----
def cdc_command(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from cdc.cli import entry; entry()",
            "--state",
            str(state),
            "--log",
            "embedded",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CDC_LOG": "", "CDC_STATE": ""},
    )


def test_dump_a_corrupt_topic_file(filled: Path) -> None:
    path = filled / "log" / "cdc.public.users.db"
    with path.open("r+b") as fh:
        fh.write(b"this is not a SQLite header at all" * 3)
    done = cdc_command(filled, "topic", "dump", "cdc.public.users", "--json")
    assert done.returncode != 0 and done.stdout == ""
    err = json.loads(done.stderr.strip().splitlines()[-1])
    assert err["error"] == "StoreCorruptError"
    assert err["path"] == str(path)
    assert "restore" in err["fix"] and "cdc snapshot" in err["fix"]
    assert path.read_bytes().startswith(b"this is not")  # nothing rewritten or dropped
    text = cdc_command(filled, "topic", "dump", "cdc.public.users")
    assert text.returncode != 0 and "corrupt" in text.stderr and "fix:" in text.stderr


def test_dump_an_unknown_topic(filled: Path) -> None:
    done = cdc_command(filled, "topic", "dump", "cdc.public.nope", "--json")
    assert done.returncode != 0
    err = json.loads(done.stderr.strip().splitlines()[-1])
    assert err["error"] == "UnknownTopicError" and err["topic"] == "cdc.public.nope"
    assert "cdc topic list" in err["fix"]


@pytest.mark.parametrize(
    ("offset", "says"), [("99", "past the end offset"), ("-1", "before the start offset")]
)
def test_dump_an_offset_out_of_range(filled: Path, offset: str, says: str) -> None:
    done = cdc_command(
        filled, "topic", "dump", "cdc.public.users", "--partition", "0", "--from", offset, "--json"
    )
    assert done.returncode != 0
    err = json.loads(done.stderr.strip().splitlines()[-1])
    assert err["error"] == "OffsetOutOfRangeError" and says in err["message"]
    assert err["offset"] == int(offset) and err["fix"]


def test_dump_before_the_start_after_retention(state: Path) -> None:
    with EmbeddedLogStore(state / "log", writer=True, compaction_interval_s=None) as store:
        store.create_topic(
            "dlq", TopicConfig(partitions=1, compacted=False, retention_ms=None, retention_bytes=1)
        )
        for i in range(3):
            store.append("dlq", [Record(b"k", b'{"n": %d}' % i)])
        assert store.enforce_retention("dlq") > 0
        start = store.start_offsets("dlq")[0]
    done = cdc_command(state, "topic", "dump", "dlq", "--partition", "0", "--from", "0", "--json")
    assert done.returncode != 0
    err = json.loads(done.stderr.strip().splitlines()[-1])
    assert err["error"] == "OffsetOutOfRangeError" and err["start"] == start
    assert f"read from offset {start}" in err["fix"]
