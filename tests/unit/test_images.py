"""The image store (cdc.logstore.images): staged images seen at once, durable only once committed,
replays recognised by the committed version, column changes, TRUNCATE, and the rebuild from a topic
with its unknown values; and the codec's fill of an UPDATE's unchanged TOAST values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from cdc.codec import Col, Message
from cdc.codec.envelope import EventBuilder, TableCodec, images_alter
from cdc.logstore.images import Images, pack, rebuild, unpack
from cdc.registry import Column, TableReg
from tests.codec_fakes import SettlingBuilder

T = "cdc.public.t"
COLS = (Column("id", "integer"), Column("n", "integer"), Column("body", "text"))


def k(i: int) -> bytes:
    return orjson.dumps({"id": i})


@pytest.fixture
def images(tmp_path: Path) -> Any:
    store = Images(tmp_path / "images.sqlite")
    yield store
    store.close()


def test_pack_round_trips_names_and_values_with_control_characters() -> None:
    image = {b'"a\\u0001b"': b'"x\\n\\u0000y"', b'"c"': b"null", b'"e"': b'""'}
    assert unpack(pack(image)) == image
    assert unpack(pack({})) == {}


def test_staged_images_are_seen_at_once_and_durable_only_once_committed(
    images: Images, tmp_path: Path
) -> None:
    st = images.staging()
    st.put(T, k(1), pack({b'"body"': b'"one"'}))
    assert images.get(T, k(1)) == {b'"body"': b'"one"'}
    st.version = (100, 3)
    sealed = st.seal()
    other = Images(tmp_path / "images.sqlite")
    try:
        assert other.get(T, k(1)) is None and other.high == (0, 0)  # not committed: not durable
        images.commit(sealed)
        assert other.get(T, k(1)) == {b'"body"': b'"one"'}
        assert other.restart() == (100, 3)
    finally:
        other.close()
    assert st.seal() is None  # nothing staged since
    assert images.get(T, k(1)) == {b'"body"': b'"one"'}  # pruned from memory, read from disk


def test_a_restart_forgets_what_was_staged_and_never_committed(images: Images) -> None:
    st = images.staging()
    st.put(T, k(1), pack({b'"body"': b'"old"'}))
    images.commit(st.seal())
    st.put(T, k(1), pack({b'"body"': b'"new"'}))
    st.seal()  # its batch's append failed: never committed
    assert images.get(T, k(1)) == {b'"body"': b'"new"'}
    images.restart()
    assert images.get(T, k(1)) == {b'"body"': b'"old"'}


def test_deletes_truncates_and_column_changes_apply_in_order(images: Images) -> None:
    st = images.staging()
    for i in range(3):
        st.put(T, k(i), pack({b'"body"': b'"b%d"' % i, b'"doc"': b'"d"'}))
    st.put("other", k(0), pack({b'"body"': b'"kept"'}))
    images.commit(st.seal())
    st.put(T, k(0), None)
    st.alter(T, {b'"body"': b'"text_body"', b'"doc"': None})  # a rename and a drop
    assert images.get(T, k(1)) == {b'"text_body"': b'"b1"'}  # from disk, through the pending alter
    st.put(T, k(1), pack({b'"text_body"': b'"new"'}))
    sealed = st.seal()
    assert images.get(T, k(2)) == {b'"text_body"': b'"b2"'}
    images.commit(sealed)
    st.seal()
    assert images.get(T, k(0)) is None
    assert images.get(T, k(1)) == {b'"text_body"': b'"new"'}
    assert images.get(T, k(2)) == {b'"text_body"': b'"b2"'}
    st.clear(T)
    assert images.get(T, k(2)) is None  # before the commit too
    st.put(T, k(5), pack({b'"text_body"': b'"after"'}))
    images.commit(st.seal())
    assert images.get(T, k(2)) is None and images.get(T, k(5)) == {b'"text_body"': b'"after"'}
    assert images.get("other", k(0)) == {b'"body"': b'"kept"'}


def test_images_alter_renames_drops_and_forgets_a_rewritten_type() -> None:
    old = (Column("id", "integer"), Column("a", "text"), Column("b", "text"), Column("c", "text"))
    renamed = (Column("id", "integer"), Column("a2", "text"), Column("b", "text"), Column("c", "jsonb"))
    assert images_alter(old, renamed, {"a": "a2"}) == {b'"a"': b'"a2"', b'"c"': None}
    widened = (Column("id", "integer"), Column("a", "character varying"), Column("b", "text"))
    assert images_alter(old, widened, None) == {b'"c"': None}  # text -> varchar keeps its text


def _rec(op: str, after: Any, lsn: int, seq: int, unavailable: list[str] | None = None, **kw: Any) -> bytes:
    source = {"commit_lsn": lsn, "seq": seq, "snapshot": kw.pop("snapshot", "false")}
    body = {"before": kw.pop("before", None), "after": after, "source": source, "op": op}
    return orjson.dumps({**body, "unavailable": unavailable or []})


def test_rebuild_reads_the_topic_up_to_the_confirmed_position(images: Images) -> None:
    codec = TableCodec(TableReg("public", "t", T, ("id",), columns=COLS), prefix="cdc", db="d", partitions=1)
    long = "x" * 3000
    records = [
        (k(1), _rec("r", {"id": 1, "n": 0, "body": long}, 10, 0, snapshot="true")),
        (k(2), _rec("r", {"id": 2, "n": 0, "body": long + "2"}, 10, 0, snapshot="true")),
        (k(3), _rec("r", {"id": 3, "n": 0, "body": "short"}, 10, 0, snapshot="true")),
        (k(1), _rec("u", {"id": 1, "n": 1}, 20, 1, ["body"])),  # written before the store: filled
        (k(2), _rec("d", None, 20, 2)),
        (k(2), None),
        (k(4), _rec("u", {"id": 4, "n": 1}, 20, 3, ["body"])),  # its earlier record compacted away
        (k(1), _rec("u", {"id": 1, "n": 2, "body": "later"}, 30, 1)),  # after the slot's position
    ]
    result = rebuild(images, T, records, 30, codec.image_of_event, lambda before: None)
    assert result.unknown == {"body": 1}
    assert images.get(T, k(1)) == {b'"body"': orjson.dumps(long)}
    assert images.get(T, k(2)) is None
    assert images.get(T, k(3)) == {}  # a row too short to hold a value out of line
    assert images.get(T, k(4)) == {}


def _builder(images: Images) -> tuple[EventBuilder, TableCodec]:
    codec = TableCodec(TableReg("public", "t", T, ("id",), columns=COLS), prefix="cdc", db="d", partitions=1)
    builder = SettlingBuilder(
        {("public", "t"): codec},
        lambda *a: None,
        images=images,
        staging=images.staging(),
        report_left_out=True,
    )
    return builder, codec


def _msg(action: str, lsn: int, cols: list[tuple[str, str, Any]], identity: Any = None) -> Message:
    return Message(
        action=action,
        schema="public",
        table="t",
        lsn=lsn,
        columns=[Col(n, t, v) for n, t, v in cols],
        identity=None if identity is None else [Col(n, t, v) for n, t, v in identity],
    )


def test_an_update_is_filled_from_the_image_and_a_key_change_from_the_old_key(images: Images) -> None:
    builder, _ = _builder(images)
    long = 'q"uote\\ new\nline ' + "é" * 2000
    builder.begin(Message(action="B", lsn=0x10, xid=7))
    builder.change(_msg("I", 0x11, [("id", "integer", 1), ("n", "integer", 0), ("body", "text", long)]))
    _, recs = builder.change(_msg("U", 0x12, [("id", "integer", 1), ("n", "integer", 1)])) or ("", [])
    event = orjson.loads(recs[0].value or b"")
    assert event["after"] == {"id": 1, "n": 1, "body": long} and event["unavailable"] == []
    assert list(event["after"]) == ["id", "n", "body"]  # the table's column order
    moved = builder.change(
        _msg("U", 0x13, [("id", "integer", 9), ("n", "integer", 2)], identity=[("id", "integer", 1)])
    )
    assert moved is not None
    d, tomb, c = moved[1]
    assert (d.key, tomb.value, c.key) == (k(1), None, k(9))
    assert orjson.loads(c.value or b"")["after"] == {"id": 9, "n": 2, "body": long}
    assert images.get(T, k(1)) is None and images.get(T, k(9)) == {b'"body"': orjson.dumps(long)}
    unknown = builder.change(_msg("U", 0x14, [("id", "integer", 5), ("n", "integer", 1)]))
    assert unknown is not None
    event = orjson.loads(unknown[1][0].value or b"")
    assert event["unavailable"] == ["body"] and "body" not in event["after"]  # never null, never a guess
    assert builder.unknown == {"public.t": 1}


def test_a_replayed_change_at_or_below_the_committed_version_is_skipped(images: Images) -> None:
    builder, _ = _builder(images)
    st = builder.staging
    assert st is not None
    builder.begin(Message(action="B", lsn=0x20, xid=7))
    row = [("id", "integer", 1), ("n", "integer", 0), ("body", "text", "x" * 3000)]
    assert builder.change(_msg("I", 0x21, row)) is not None
    assert builder.change(_msg("U", 0x22, [("id", "integer", 1), ("n", "integer", 1)])) is not None
    images.commit(st.seal())
    assert images.high == (0, 0)  # this process's view; a new session reads it again
    images.restart()
    again, _ = _builder(images)
    again.begin(Message(action="B", lsn=0x20, xid=7))
    assert again.change(_msg("I", 0x21, row)) is None  # (0x20, 1) <= (0x20, 2): in the topic already
    assert again.change(_msg("U", 0x22, [("id", "integer", 1), ("n", "integer", 1)])) is None
    assert again.change(_msg("U", 0x23, [("id", "integer", 1), ("n", "integer", 2)])) is not None
    again.begin(Message(action="B", lsn=0x30, xid=8))
    assert again.change(_msg("U", 0x31, [("id", "integer", 1), ("n", "integer", 3)])) is not None


def test_a_new_slot_resets_the_images_and_the_committed_version(images: Images) -> None:
    st = images.staging()
    st.put(T, k(1), pack({b'"body"': b'"old"'}))
    st.version = (500, 1)
    images.commit(st.seal())
    assert images.restart() == (500, 1)
    images.reset()  # a lost slot: the old one's positions order nothing, its values may be stale
    assert images.high == (0, 0) and images.get(T, k(1)) is None
    assert images.restart() == (0, 0)


def test_holds_column_finds_a_column_staged_or_committed_and_no_other(images: Images) -> None:
    st = images.staging()
    st.put(T, k(1), pack({b'"a"': b'"x"', b'"body"': b'"y"'}))
    assert images.holds_column(T, b'"body"') and images.holds_column(T, b'"a"')
    images.commit(st.seal())
    st.seal()  # pruned: read from disk now
    assert images.holds_column(T, b'"body"') and images.holds_column(T, b'"a"')
    assert not images.holds_column(T, b'"bod"') and not images.holds_column(T, b'"y"')
    assert not images.holds_column("other", b'"body"')
