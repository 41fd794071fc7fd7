"""Pure logic of the apply stage (no Spark): read-limit sharing, the offset log, dead-letter records,
verify's canonical values and hashes."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import orjson
import pytest

from cdc import paths
from cdc.cli.verify.compare import SinkDiff, TableReport, canonical, row_hash
from cdc.events import Version
from cdc.logstore import StoredRecord
from sinks import DeadLetter
from sinks.dead_letters import decode, encode
from spark_jobs.apply import app_id_for, read_ledger, write_ledger
from spark_jobs.checkpoint import (
    batch_end_offsets,
    batch_ranges,
    checkpoint_dir,
    offset_key,
    parse_offset_key,
)
from spark_jobs.source import byte_bounded, split_budget


def test_split_budget_fills_small_backlogs_and_splits_the_rest() -> None:
    grant = split_budget({"a|0": 5, "a|1": 1000, "b|0": 1000, "b|1": 0}, 105)
    assert grant == {"a|0": 5, "a|1": 50, "b|0": 50}
    assert sum(split_budget({"x|0": 3, "x|1": 3}, 100).values()) == 6


def test_split_budget_always_makes_progress() -> None:
    grant = split_budget({"a|0": 10, "a|1": 10, "a|2": 10}, 1)
    assert sum(grant.values()) >= 1
    assert split_budget({"a|0": 0}, 10) == {}


def test_byte_bound_cuts_wide_partitions_and_leaves_narrow_ones() -> None:
    """A grant within the byte bound (or without one) is kept; over it, the bytes are shared like
    records: a small partition whole, the wide ones evenly, each at most its record grant; a
    partition without a size estimate keeps its grant."""
    grant = {"wide|0": 100, "wide|1": 100, "narrow|0": 100, "new|0": 7}
    sizes = {"wide|0": 9_000.0, "wide|1": 9_000.0, "narrow|0": 2.0}
    assert byte_bounded(grant, sizes, 0) == grant
    assert byte_bounded(grant, sizes, 10_000_000) == grant
    cut = byte_bounded(grant, sizes, 200_000)
    assert cut == {"wide|0": 11, "wide|1": 11, "narrow|0": 100, "new|0": 7}
    assert sum(n * sizes.get(k, 0.0) for k, n in cut.items()) <= 200_000
    # 500k records of 9 KB rows (the default cap behind) against the default 256 MiB
    big = byte_bounded(
        {f"t|{p}": 125_000 for p in range(4)}, dict.fromkeys((f"t|{p}" for p in range(4)), 9_000.0), 256 << 20
    )
    assert sum(big.values()) * 9_000 <= 256 << 20 and sum(big.values()) >= 29_000


def test_byte_bound_still_makes_progress_with_a_record_larger_than_it() -> None:
    assert byte_bounded({"a|0": 5, "a|1": 3}, {"a|0": 1e6, "a|1": 2e6}, 1_000) == {"a|0": 1}
    assert byte_bounded({}, {}, 1_000) == {}


def test_offset_keys_round_trip_topic_names_with_dots() -> None:
    assert parse_offset_key(offset_key("cdc.public.my|odd", 3)) == ("cdc.public.my|odd", 3)


def test_batch_end_offsets_reads_sparks_offset_log(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "offsets").mkdir(parents=True)
    (ckpt / "offsets" / "7").write_text('v1\n{"batchWatermarkMs":0}\n{"cdc.a.b|0": 10, "cdc.a.b|1": 3}\n')
    assert batch_end_offsets(ckpt, 7) == {"cdc.a.b": {0: 10, 1: 3}}
    assert batch_end_offsets(ckpt, 8) == {}


def test_app_id_is_kept_with_its_checkpoint_and_renewed_without(tmp_path: Path) -> None:
    first = app_id_for(tmp_path)
    assert first.startswith("cdc-apply-") and app_id_for(tmp_path) == first
    checkpoint_dir(tmp_path).rmdir()  # a wiped checkpoint
    assert app_id_for(tmp_path) != first


def test_ledger_of_an_older_state_dir_is_read_once_then_upgraded(tmp_path: Path) -> None:
    old = paths.legacy_apply_ledger(tmp_path)
    old.parent.mkdir(parents=True)
    old.write_bytes(orjson.dumps({"app_id": "a", "dead_letter_batch": 4, "dead_letters": 2}))
    ledger = read_ledger(tmp_path)
    assert ledger["dead_letter_batch"] == 4  # a replay of batch 4 does not write its dead letters again
    write_ledger(tmp_path, ledger)
    assert not old.exists() and paths.apply_ledger(tmp_path).name == "apply-ledger.json"
    assert read_ledger(tmp_path)["dead_letters"] == 2
    assert read_ledger(tmp_path / "empty") == {}


def test_dead_letter_record_keeps_the_original_bytes_reason_and_position() -> None:
    letter = DeadLetter(
        "cdc.s.t", 2, 41, b'{"id":1}', b"\xff\xfe", "value is not JSON", "s.t", '{"id":1}', Version(7, 3)
    )
    rec = encode(letter, 9, "app")
    body = orjson.loads(rec.value or b"")
    assert body["reason"] == "value is not JSON" and body["value_hex"] == "fffe"
    assert body["source"] == {"topic": "cdc.s.t", "partition": 2, "offset": 41}
    assert body["table"] == "s.t" and body["version"] == {"commit_lsn": 7, "seq": 3}
    assert dict(rec.headers)["source_offset"] == b"41" and rec.key == b'{"id":1}'
    stored = StoredRecord("cdc.__dead_letter", 0, 5, rec.key, rec.value, rec.headers, 1)
    entry = decode(stored)
    assert entry.letter == letter and entry.id == "0:5" and entry.batch_id == 9


def test_canonical_values_distinguish_exactly() -> None:
    assert canonical(Decimal("1.10")) != canonical(Decimal("1.1"))  # scale is part of a numeric(p,s) value
    assert canonical(float("nan")) == canonical(float("nan"))
    assert canonical(1) != canonical(1.0) and canonical("1") != canonical(1)
    ts = dt.datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=dt.UTC)
    assert row_hash([1, ts, b"\x00"]) == row_hash([1, ts, b"\x00"])
    assert row_hash([1, ts, b"\x00"]) != row_hash([1, ts, b"\x01"])


def test_stream_reader_offsets_limits_and_a_recreated_topic(tmp_path: Path) -> None:
    """The reader's planning calls, made directly (what Spark's planner worker calls)."""
    from cdc.logstore import Record, TopicConfig
    from cdc.logstore.embedded import EmbeddedLogStore
    from spark_jobs.source import CdcLogStreamReader, ReadAllAvailable, ReadMaxRows

    store = EmbeddedLogStore(tmp_path / "log", writer=True, compaction_interval_s=None)
    store.create_topic("cdc.s.t", TopicConfig(partitions=2))
    store.append("cdc.s.t", [Record(b"k", b"v", partition=i % 2) for i in range(10)])
    reader = CdcLogStreamReader(
        {"state": str(tmp_path), "topics": "cdc.s.t,cdc.s.missing", "maxRecordsPerBatch": "4"}
    )
    start = reader.initialOffset()
    assert start == {"cdc.s.t|0": 0, "cdc.s.t|1": 0}  # a topic that does not exist yet is simply absent
    end = reader.latestOffset(start, ReadMaxRows(4))
    assert end == {"cdc.s.t|0": 2, "cdc.s.t|1": 2}
    assert [(r.partition, r.start, r.end) for r in reader.partitions(start, end)] == [(0, 0, 2), (1, 0, 2)]
    reader.prepareForTriggerAvailableNow()
    store.append("cdc.s.t", [Record(b"k", b"v", partition=0)])  # after availableNow's target: not read
    assert reader.getDefaultReadLimit() == ReadMaxRows(4)
    assert reader.latestOffset(end, ReadAllAvailable()) == {"cdc.s.t|0": 5, "cdc.s.t|1": 5}
    # the topic is deleted and created again: positions past its end restart at its start
    store.delete_topic("cdc.s.t")
    store.create_topic("cdc.s.t", TopicConfig(partitions=2))
    store.append("cdc.s.t", [Record(b"k", b"v", partition=0)])
    fresh = CdcLogStreamReader({"state": str(tmp_path), "topics": "cdc.s.t"})
    old = {"cdc.s.t|0": 6, "cdc.s.t|1": 5}
    new_end = fresh.latestOffset(old, None)
    assert new_end == {"cdc.s.t|0": 1, "cdc.s.t|1": 0}
    assert [(r.partition, r.start, r.end) for r in fresh.partitions(old, new_end)] == [(0, 0, 1)]
    reader.stop()
    fresh.stop()
    store.close()


def test_stream_reader_grows_the_batch_when_behind_and_replans_alike(tmp_path: Path) -> None:
    """With ``maxRecordsPerBatchBehind`` a large backlog gets a larger batch (half of it, up to
    the cap), a small one the usual ``maxRecordsPerBatch``; the batch's ranges come from the planned
    offsets only, so a replay reads the same records however the log grew since."""
    from cdc.logstore import Record, TopicConfig
    from cdc.logstore.embedded import EmbeddedLogStore
    from spark_jobs.source import CdcLogStreamReader, ReadMaxRows

    store = EmbeddedLogStore(tmp_path / "log", writer=True, compaction_interval_s=None)
    store.create_topic("cdc.s.t", TopicConfig(partitions=2))
    store.append("cdc.s.t", [Record(b"k", b"v", partition=i % 2) for i in range(200)])
    opts = {"state": str(tmp_path), "topics": "cdc.s.t", "maxRecordsPerBatch": "4"}
    reader = CdcLogStreamReader({**opts, "maxRecordsPerBatchBehind": "30"})
    limit = reader.getDefaultReadLimit()
    assert limit == ReadMaxRows(4)
    start = reader.initialOffset()
    end = reader.latestOffset(start, limit)
    assert end == {"cdc.s.t|0": 15, "cdc.s.t|1": 15}  # 200 behind: the cap, 30
    planned = [(r.partition, r.start, r.end) for r in reader.partitions(start, end)]
    store.append("cdc.s.t", [Record(b"k", b"v", partition=i % 2) for i in range(400)])
    assert [(r.partition, r.start, r.end) for r in reader.partitions(start, end)] == planned  # a replay
    mid = {"cdc.s.t|0": 290, "cdc.s.t|1": 290}  # 20 behind: half of it, 10
    assert reader.latestOffset(mid, limit) == {"cdc.s.t|0": 295, "cdc.s.t|1": 295}
    near = {"cdc.s.t|0": 297, "cdc.s.t|1": 297}  # 6 behind: the usual 4
    assert reader.latestOffset(near, limit) == {"cdc.s.t|0": 299, "cdc.s.t|1": 299}
    plain = CdcLogStreamReader(opts)  # without the option: never more than maxRecordsPerBatch
    assert plain.latestOffset(start, limit) == {"cdc.s.t|0": 2, "cdc.s.t|1": 2}
    reader.stop()
    plain.stop()
    store.close()


def test_stream_reader_bounds_a_batch_of_wide_records_by_bytes(tmp_path: Path) -> None:
    """``maxBytesPerBatch``: against the embedded log store, 9 KB records (with quotes, newlines and
    backslashes) next to 2-byte ones: the wide partitions get what fits in the bytes, the narrow one
    its records; the sizes come from the log store's next records, and the planned ranges are what a
    replay reads."""
    from cdc.logstore import Record, TopicConfig
    from cdc.logstore.embedded import EmbeddedLogStore
    from spark_jobs.source import CdcLogStreamReader, ReadMaxRows

    store = EmbeddedLogStore(tmp_path / "log", writer=True, compaction_interval_s=None)
    wide = ('{"v": "a \\"quoted\\" \\\\ back\nslash"}' * 300)[:8_999].encode()
    store.create_topic("cdc.s.wide", TopicConfig(partitions=2))
    store.append("cdc.s.wide", [Record(b"k", wide, partition=i % 2) for i in range(400)])
    store.create_topic("cdc.s.narrow", TopicConfig(partitions=1))
    store.append("cdc.s.narrow", [Record(b"k", b"v", partition=0) for i in range(200)])
    opts = {"state": str(tmp_path), "topics": "cdc.s.wide,cdc.s.narrow", "maxRecordsPerBatch": "100"}
    reader = CdcLogStreamReader({**opts, "maxRecordsPerBatchBehind": "300", "maxBytesPerBatch": "200000"})
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadMaxRows(100))
    # 600 behind: 300 records, 100 a partition by records; 200 kB: the narrow 100 (200 bytes) whole,
    # then 99,900 bytes per wide partition = 11 records of 9,000 bytes
    assert end == {"cdc.s.wide|0": 11, "cdc.s.wide|1": 11, "cdc.s.narrow|0": 100}
    planned = [(r.topic, r.partition, r.start, r.end) for r in reader.partitions(start, end)]
    store.append("cdc.s.wide", [Record(b"k", b"v", partition=i % 2) for i in range(400)])
    assert [(r.topic, r.partition, r.start, r.end) for r in reader.partitions(start, end)] == planned
    plain = CdcLogStreamReader({**opts, "maxRecordsPerBatchBehind": "300"})  # records only, as before
    assert plain.latestOffset(start, ReadMaxRows(100)) == {
        "cdc.s.wide|0": 100,
        "cdc.s.wide|1": 100,
        "cdc.s.narrow|0": 100,
    }
    reader.stop()
    plain.stop()
    store.close()


def test_faults_parse_names_points_and_arguments() -> None:
    from cdc.errors import ConfigError
    from cdc.faults import POINTS, Faults

    f = Faults.parse("apply.after_sink:3")
    assert f.on("apply.after_sink", 3) and not f.on("apply.after_sink", 2)
    fired: list[int] = []
    assert f.point("apply.after_sink", 3, lambda: fired.append(3)) and fired == [3]
    assert not Faults.parse("").on("apply.after_sink", 3)
    assert set(POINTS) == {"apply.after_sink", "reader.after_append"}
    assert Faults.parse("reader.after_append").on("reader.after_append")
    for bad in ("nope:1", "apply.after_sink:x"):
        try:
            Faults.parse(bad)
        except ConfigError as err:
            assert "CDC_FAULTS" in str(err)
        else:
            raise AssertionError(bad)


def test_a_fault_armed_by_a_file_fires_once_per_arming(tmp_path: Path) -> None:
    from cdc.faults import Faults

    arm = tmp_path / "arm"
    f = Faults.parse(f"apply.after_sink:@{arm}")
    fired: list[int] = []
    assert not f.point("apply.after_sink", 7, lambda: fired.append(7))  # not armed yet
    arm.touch()
    assert f.point("apply.after_sink", 8, lambda: fired.append(8)) and fired == [8]
    assert not arm.exists() and not f.on("apply.after_sink", 9)  # once


def test_verify_report_keeps_its_json_shape_with_a_diff_per_sink() -> None:
    report = TableReport(
        "public.t",
        source_rows=3,
        sinks={
            "warehouse": SinkDiff("warehouse", "rows", 2, missing=[{"id": 3}], missing_count=1),
            "search": SinkDiff("search", "docs", None),
        },
    )
    body = report.to_dict()
    assert list(body) == [
        "table", "status", "source_rows", "warehouse_rows", "search_docs", "missing", "extra", "different",
        "missing_count", "extra_count", "different_count", "search", "ranges", "ranges_differing",
        "consistent_lsn", "caught_up", "lag", "mode", "fallback", "changes_read", "rows_checked",
        "ranges_checked", "checked_ranges", "kind",
    ]  # fmt: skip
    assert body["status"] == "different" and body["missing"] == [{"id": 3}] and body["search_docs"] is None
    # the ranges compared: a full run's every range, an incremental run's those it lists
    assert body["ranges_checked"] == 0 and body["checked_ranges"] == []
    one = {"warehouse": SinkDiff("warehouse", "rows", 3)}
    assert TableReport("public.t", sinks=one, ranges=7).to_dict()["ranges_checked"] == 7
    listed = [{"range": 2, "from": {"id": 9}, "why": "changed", "equal": True}]
    incremental = TableReport("public.t", sinks=one, ranges=7, mode="incremental", checked=listed).to_dict()
    assert incremental["ranges_checked"] == 1 and incremental["checked_ranges"] == listed
    assert list(body["search"]) == [
        "missing",
        "extra",
        "missing_count",
        "extra_count",
        "different",
        "different_count",
    ]
    report.sinks["warehouse"] = SinkDiff("warehouse", "rows", 3)
    report.sinks["search"].extra_count = 1  # a difference of any sink makes the table different
    assert report.to_dict()["status"] == "different"
    report.sinks["search"].extra_count = 0
    assert report.equal and report.to_dict()["status"] == "ok"


def test_verify_text_says_how_many_ranges_each_run_checked(capsys: pytest.CaptureFixture[str]) -> None:
    from cdc.cli.verify import _print_reports

    one = {"warehouse": SinkDiff("warehouse", "rows", 3)}
    listed = [{"range": 2, "from": {"id": 9}, "why": "changed", "equal": True}]
    _print_reports(
        [
            TableReport("public.f", sinks=one, ranges=7, fallback="no clean verify recorded yet"),
            TableReport("public.i", sinks=dict(one), ranges=7, mode="incremental", checked=listed),
        ]
    )
    out = capsys.readouterr().out
    assert "public.f: full: checked all 7 key ranges (no clean verify recorded yet)" in out
    assert "public.i: incremental: checked 1 of 7 key ranges (1 changed, 0 scrubbed" in out


def _offset_log(ckpt: Path, batch_id: int, line: str) -> None:
    (ckpt / "offsets").mkdir(parents=True, exist_ok=True)
    (ckpt / "offsets" / str(batch_id)).write_text(f'v1\n{{"batchWatermarkMs":0}}\n{line}\n')


def test_batch_ranges_run_from_the_batch_before_to_its_own_offsets(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _offset_log(ckpt, 3, '{"cdc.a.b|0": 10, "cdc.a.b|1": 3, "cdc.c|0": 7}')
    _offset_log(ckpt, 4, '{"cdc.a.b|0": 12, "cdc.a.b|1": 3, "cdc.c|0": 9}')
    assert batch_ranges(ckpt, 4) == [("cdc.a.b", 0, 10, 12), ("cdc.c", 0, 7, 9)]


def test_batch_ranges_are_unknown_where_the_source_asks_the_log_store(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _offset_log(ckpt, 0, '{"cdc.a|0": 5}')
    assert batch_ranges(ckpt, 0) is None  # a query's first batch starts at the store's start
    _offset_log(ckpt, 1, '{"cdc.a|0": 6, "cdc.new|0": 2}')
    assert batch_ranges(ckpt, 1) is None  # a new topic: its start is the store's
    _offset_log(ckpt, 2, '{"cdc.a|0": 1, "cdc.new|0": 2}')
    assert batch_ranges(ckpt, 2) is None  # recreated: read again from the store's start
    _offset_log(ckpt, 3, "-")
    assert batch_ranges(ckpt, 3) is None and batch_ranges(ckpt, 4) is None
    _offset_log(ckpt, 5, '{"cdc.a|0": 1, "cdc.new|0": 2}')
    _offset_log(ckpt, 6, '{"cdc.a|0": 1, "cdc.new|0": 2}')
    assert batch_ranges(ckpt, 6) == []  # nothing new


class _Sources:
    """What :func:`spark_jobs.source.register` calls on a session: ``spark.dataSource.register``."""

    def __init__(self) -> None:
        self.dataSource = self
        self.registered: list[type] = []

    def register(self, cls: type) -> None:
        self.registered.append(cls)


#: unpickles the source's class as Spark's planner and source runner do, in a process of its own,
#: and prints what the reader would open and whether the configuration loader was imported
_UNPICKLE = """
import sys
from pyspark import cloudpickle
cls = cloudpickle.loads(sys.stdin.buffer.read())
reader = cls(options={"topics": "cdc.s.t"}).streamReader(None)
print(reader.address.state_dir, "pydantic" in sys.modules, "cdc.config" in sys.modules)
"""


def test_the_registered_source_carries_the_store_address_and_no_other_setting(tmp_path: Path) -> None:
    """``register(spark, settings)`` pickles the store's address with the source's class: the
    planner and the source runner of each query unpickle it without importing the configuration
    loader (pydantic); a ``[kafka]`` section's SASL password travels with it, the source DSN never."""
    import subprocess
    import sys

    from pydantic import SecretStr
    from pyspark import cloudpickle

    from cdc.config import Settings
    from spark_jobs.source import register

    spark = _Sources()
    dsn = "postgresql://cdc:dsn-Pa55word@db.example/app"
    register(spark, Settings(source=SecretStr(dsn), state_dir=tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", _UNPICKLE],
        input=cloudpickle.dumps(spark.registered[0]),
        capture_output=True,
        check=True,
    ).stdout.decode()
    assert out.split() == [str(tmp_path), "False", "False"]

    sasl = {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_username": "cdc",
        "sasl_password": "sasl-Pa55word",
    }
    kafka = Settings(
        source=SecretStr(dsn), state_dir=tmp_path, log_url="kafka://b:9092", extra={"kafka": sasl}
    )
    fmt = register(spark, kafka)
    pickled = cloudpickle.dumps(spark.registered[1])
    assert b"dsn-Pa55word" not in pickled
    store = cloudpickle.loads(pickled).store
    assert fmt.startswith("cdclog_") and store.log_url == "kafka://b:9092"
    assert store.kafka.client_config()["sasl_plain_password"] == "sasl-Pa55word"
