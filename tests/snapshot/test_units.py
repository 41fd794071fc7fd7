"""Pure logic of chunked snapshots: the watermark window (which chunk rows survive, and their
version), the ``--where`` parser, the options and the progress view."""

from __future__ import annotations

import orjson
import pytest
from psycopg import sql

from cdc.codec import Col, Message
from cdc.codec.envelope import TableCodec
from cdc.errors import ConfigError
from cdc.events import Version
from cdc.logstore import Record
from cdc.logstore.images import pack
from cdc.registry import Column, TableReg
from snapshot.chunk_state import ChunkProgress, SnapshotOptions, progress_view
from snapshot.chunked import ChunkTracker
from snapshot.where import Condition, parse_where, where_sql

SLOT = "s1"


def codec() -> TableCodec:
    reg = TableReg(
        "public", "t", "cdc.public.t", ("id",), columns=(Column("id", "integer"), Column("v", "text"))
    )
    return TableCodec(reg, prefix="cdc", db="db", partitions=2)


def mark(text: str, slot: str = SLOT) -> Message:
    return Message(
        action="U",
        schema="public",
        table="cdc_watermark",
        columns=[Col("slot", "text", slot), Col("mark", "text", text)],
    )


def key(i: int) -> bytes:
    return orjson.dumps({"id": i})


def rows(*ids: int) -> list[tuple[bytes, bytes, bytes | None]]:
    """Chunk rows (key, ``after``, packed image): odd ids hold an image, as a long row would."""
    return [
        (key(i), orjson.dumps({"id": i, "v": f"row {i}"}), pack({b'"v"': b'"long"'}) if i % 2 else None)
        for i in ids
    ]


def tracker() -> ChunkTracker:
    return ChunkTracker(SLOT, ("public", "cdc_watermark"), {"cdc.public.t"})


def test_a_key_changed_or_deleted_inside_the_window_is_dropped_the_rest_at_the_hw_version() -> None:
    t = tracker()
    t.begin("n1", codec())
    assert t.watermark(mark("n1:lw"), 100) == []
    assert "cdc.public.t" in t.open
    # inside the window: key 2 deleted (delete + tombstone), key 4 updated
    t.saw("cdc.public.t", 501, [Record(key(2), b"{}"), Record(key(2), None)])
    t.saw("cdc.public.t", 502, [Record(key(4), b"{}")])
    t.put_rows("n1", rows(1, 2, 3, 4), last=True, snapshot="500:503:", read_ts_ms=1)
    out = t.watermark(mark("n1:hw"), 200)
    assert [topic for topic, _, _ in out] == ["cdc.public.t"]
    records = out[0][1]
    assert [r.key for r in records] == [key(1), key(3)]
    assert out[0][2] == [(key(1), pack({b'"v"': b'"long"'})), (key(3), pack({b'"v"': b'"long"'}))]
    values = [orjson.loads(r.value or b"") for r in records]
    assert {Version.of(v) for v in values} == {Version(200, 0)}
    assert [v["op"] for v in values] == ["r", "r"]
    assert [v["source"]["snapshot"] for v in values] == ["true", "last"]
    assert values[0]["after"] == {"id": 1, "v": "row 1"}
    assert "cdc.public.t" not in t.open


def test_an_invisible_transaction_just_before_the_window_drops_its_keys() -> None:
    t = tracker()
    t.saw("cdc.public.t", 700, [Record(key(1), b"{}")])  # committed before LW, in progress for S
    t.saw("cdc.public.t", 650, [Record(key(2), b"{}")])  # committed before LW, visible to S
    t.begin("n", codec())
    t.watermark(mark("n:lw"), 100)
    t.put_rows("n", rows(1, 2, 3), last=False, snapshot="600:710:700,705", read_ts_ms=1)
    out = t.watermark(mark("n:hw"), 200)
    assert [r.key for r in out[0][1]] == [key(2), key(3)]


def test_a_truncate_inside_the_window_drops_every_row_of_the_chunk() -> None:
    t = tracker()
    t.begin("n", codec())
    t.watermark(mark("n:lw"), 100)
    t.saw("cdc.public.t", 9, [Record(b'{"__truncate__":0}', b"{}", partition=0)])
    t.put_rows("n", rows(1, 2), last=False, snapshot="1:2:", read_ts_ms=1)
    assert t.watermark(mark("n:hw"), 200) == []


def test_marks_of_other_slots_and_stale_marks_are_ignored_and_durability_is_reported() -> None:
    t = tracker()
    t.begin("n", codec())
    assert t.watermark(mark("n:lw", slot="other"), 100) == []
    assert "cdc.public.t" not in t.open
    assert t.watermark(mark("old:hw"), 90) == []  # a previous session's chunk, replayed
    t.watermark(mark("n:lw"), 100)
    t.put_rows("n", rows(1), last=False, snapshot="1:2:", read_ts_ms=1)
    assert len(t.watermark(mark("n:hw"), 200)[0][1]) == 1
    import threading

    stop = threading.Event()
    t.durable(200)  # not past the HW's commit record yet
    stop.set()
    assert t.wait_durable("n", stop) is None
    t.begin("m", codec())
    t.watermark(mark("m:lw"), 300)
    t.put_rows("m", rows(5), last=False, snapshot="1:2:", read_ts_ms=1)
    t.watermark(mark("m:hw"), 400)
    t.durable(401)
    w = t.wait_durable("m", threading.Event())
    assert w is not None and w.emitted == 1 and w.lw_commit == 300 and w.hw_commit == 400


def test_where_builds_sql_from_parsed_parts_only() -> None:
    cols = ["id", "kind", "Mixed Col", "price"]
    conds = parse_where("id >= 10 AND kind = 'it''s' AND \"Mixed Col\" IS NOT NULL AND price < 1.50", cols)
    assert conds == (
        Condition("id", ">=", 10),
        Condition("kind", "=", "it's"),
        Condition("Mixed Col", "IS NOT NULL", None),
        Condition("price", "<", conds[3].value),
    )
    text = where_sql(conds)
    assert isinstance(text, sql.Composable)
    assert parse_where("ID != -3", cols) == (Condition("id", "<>", -3),)
    assert parse_where("kind = true", cols) == (Condition("kind", "=", True),)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "id > 0; DROP TABLE t",
        "id > 0 OR 1 = 1",
        "id > (SELECT 1)",
        "pg_sleep(1) IS NULL",
        "nope = 1",
        "kind = 'unterminated",
        "id > 0 -- x",
        "id > 0 /* x */",
        "id = kind",
        "id IS 3",
        "id >",
        "id > 1 AND",
        'kind = "id"',
        "kind = E'\\x41'",
    ],
)
def test_where_refuses_everything_else_with_the_form(text: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_where(text, ["id", "kind"])
    assert "COLUMN OP VALUE" in (err.value.fix or "")


def test_options_and_progress_view() -> None:
    assert SnapshotOptions.from_mapping({}) == SnapshotOptions()
    opts = SnapshotOptions.from_mapping({"chunk_size": 10, "parallel_chunks": 2, "watermark_table": "cdc.Wm"})
    assert opts.watermark == ("cdc", "wm")
    for bad in (
        {"chunk_size": 0},
        {"parallel_chunks": "2"},
        {"chunk_size": True},
        {"nope": 1},
        {"watermark_table": 3},
    ):
        with pytest.raises(ConfigError):
            SnapshotOptions.from_mapping(bad)
    p = ChunkProgress(
        run="r", estimate=10_000, read=2_000, chunks=2, chunk_size=1000, started=100.0, updated=110.0
    )
    view = progress_view(p)
    assert view is not None
    assert (
        view["chunks_done"] == 2
        and view["chunks_left"] == 8
        and view["rate"] == 200.0
        and view["eta_s"] == 40.0
    )
    assert progress_view(None) is None
    assert ChunkProgress.from_json(p.to_json()) == p


def test_a_dropped_row_whose_change_lacked_a_toasted_column_asks_for_another_read() -> None:
    import threading

    t = tracker()
    for base, nonce, value in (
        (100, "n1", b'{"op":"u","unavailable":["v"]}'),
        (300, "n2", b'{"op":"u","unavailable":[]}'),
    ):
        t.begin(nonce, codec())
        t.watermark(mark(f"{nonce}:lw"), base)
        t.saw("cdc.public.t", 501, [Record(key(2), value)])
        t.put_rows(nonce, rows(1, 2), last=False, snapshot="500:502:", read_ts_ms=1)
        out = t.watermark(mark(f"{nonce}:hw"), base + 100)
        assert [r.key for r in out[0][1]] == [key(1)]
        t.durable(base + 101)
        w = t.wait_durable(nonce, threading.Event())
        assert w is not None and w.redo is (nonce == "n1")
