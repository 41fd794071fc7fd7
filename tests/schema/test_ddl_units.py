"""The DDL recorder's messages applied to the streamed tables (pure: no Postgres). The messages are
shaped as ``public.cdc_record_ddl()`` writes them (tests/schema/test_ddl_recorder.py runs the real
trigger)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest

from cdc.codec import DDL_PREFIX, HEARTBEAT_PREFIX, NONFINITE_PREFIX, Col, Message
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.codec.wal2json import BASE_OPTIONS, decode
from cdc.errors import DecodeError
from cdc.reader.ddl import DdlFollower, parse_ddl
from cdc.reader.schema import SchemaFollower
from cdc.registry import Column, TableReg
from tests.codec_fakes import StaticCatalog, settled

OID = 16400


def _reg(table: str = "items") -> TableReg:
    cols = (
        Column("id", "integer", False),
        Column("name", "text"),
        Column("note", "text"),
        Column("qty", "integer"),
    )
    return TableReg("public", table, f"cdc.public.{table}", ("id",), search=("name",), columns=cols)


def _cols(*spec: tuple[str, str, int]) -> list[dict[str, Any]]:
    return [{"name": n, "type": t, "attnum": a, "notnull": n == "id"} for n, t, a in spec]


def _msg(tag: str, objects: list[dict[str, Any]], event: str = "ddl_command_end") -> Message:
    content = orjson.dumps({"v": 1, "tag": tag, "event": event, "objects": objects}).decode()
    return Message(action="M", lsn=0x20, transactional=True, prefix=DDL_PREFIX, content=content)


def _obj(
    columns: list[dict[str, Any]] | None,
    *,
    table: str = "items",
    kind: str = "table",
    subid: int = 0,
    oid: int = OID,
    schema: str = "public",
) -> dict[str, Any]:
    identity = f"{schema}.{table}" + (
        f".{next(c['name'] for c in columns or [] if c['attnum'] == subid)}" if subid else ""
    )
    return {
        "type": kind,
        "identity": identity,
        "schema": schema,
        "table": table,
        "oid": oid,
        "subid": subid,
        "columns": columns,
    }


BASE = [("id", "integer", 1), ("name", "text", 2), ("note", "text", 3), ("qty", "integer", 4)]


class Harness:
    def __init__(self, reg: TableReg | None = None) -> None:
        self.reg = reg or _reg()
        self.codec = TableCodec(self.reg, prefix="cdc", db="db", partitions=1)
        self.changed: list[tuple[tuple[Column, ...], dict[str, str] | None]] = []
        self.gone: list[tuple[str, str, str | None, str]] = []
        self.lost: list[tuple[str, list[str]]] = []

        def columns_changed(
            reg: TableReg, cols: tuple[Column, ...], renamed: dict[str, str] | None
        ) -> TableReg:
            self.changed.append((cols, renamed))
            return replace(reg, columns=cols, extra={"schema_version": reg.schema_version + 1})

        self.builder = EventBuilder({("public", self.reg.table): self.codec})
        self.schema = SchemaFollower(self.builder, StaticCatalog(), columns_changed)
        self.follower = DdlFollower(
            self.builder,
            self.schema,
            {OID: ("public", self.reg.table)},
            on_gone=lambda reg, what, to, tag: self.gone.append((reg.qualified, what, to, tag)),
            on_key_lost=lambda reg, lost: self.lost.append((reg.qualified, lost)),
        )
        self.builder.begin(Message(action="B", xid=9, lsn=0x30))

    def insert(self, cols: list[Col], table: str = "items") -> dict[str, Any] | None:
        out = self.builder.change(Message(action="I", schema="public", table=table, lsn=0x31, columns=cols))
        out = settled(self.schema, out)
        return None if out is None else dict(orjson.loads(out[1][0].value or b"null"))


def _alter(*spec: tuple[str, str, int], subid: int = 0) -> Message:
    """``ALTER TABLE items ...`` as the recorder tells it: the table's columns after it; ``subid``:
    the column the command named (a rename), else a change of the table."""
    kind = "table column" if subid else "table"
    return _msg("ALTER TABLE", [_obj(_cols(*spec), kind=kind, subid=subid)])


RENAMED = [("id", "integer", 1), ("title", "text", 2), ("note", "text", 3), ("qty", "integer", 4)]
ID = Column("id", "integer", False)  # not null: kept from the registration


@pytest.mark.parametrize(
    ("messages", "renames", "columns"),
    [
        pytest.param(
            [_alter(*RENAMED, subid=2)],
            [{"name": "title"}],
            [ID, Column("title", "text"), Column("note", "text"), Column("qty", "integer")],
            id="a renamed column is told exactly",
        ),
        pytest.param(
            [
                _alter(*RENAMED, subid=2),
                _alter(
                    ("id", "integer", 1),
                    ("title", "text", 2),
                    ("memo", "text", 3),
                    ("qty", "integer", 4),
                    subid=3,
                ),
            ],
            [{"name": "title"}, {"note": "memo"}],
            [ID, Column("title", "text"), Column("memo", "text"), Column("qty", "integer")],
            id="two renames are two renames where inference sees two drops and two adds",
        ),
        pytest.param(
            # ALTER TABLE items DROP COLUMN note, ADD COLUMN memo text: inference would call it a rename
            [_alter(("id", "integer", 1), ("name", "text", 2), ("qty", "integer", 4), ("memo", "text", 5))],
            [{}],
            [ID, Column("name", "text"), Column("qty", "integer"), Column("memo", "text")],
            id="drop and add in one command is not a rename even with the same type",
        ),
        pytest.param(
            [
                _alter(
                    ("id", "integer", 1),
                    ("name", "text", 2),
                    ("note", "text", 3),
                    ("qty", "bigint", 4),
                    ("tag", "character varying(10)", 5),
                )
            ],
            [{}],
            [
                ID,
                Column("name", "text"),
                Column("note", "text"),
                Column("qty", "bigint"),
                Column("tag", "character varying(10)", True),
            ],
            id="retype and add follow at once",
        ),
    ],
)
def test_column_changes_are_told_exactly_and_the_next_row_carries_the_new_version(
    messages: list[Message], renames: list[dict[str, str]], columns: list[Column]
) -> None:
    h = Harness()
    for message in messages:
        h.follower(message)
    assert [r for _, r in h.changed] == renames
    assert list(h.changed[-1][0]) == columns
    row = {c.name: 1 if c.type in ("integer", "bigint") else "t" for c in columns}
    ev = h.insert([Col(c.name, c.type, v) for c, v in zip(columns, row.values(), strict=True)])
    assert ev is not None and ev["source"]["schema_version"] == 1 + len(renames) and ev["after"] == row
    assert len(h.changed) == len(renames)  # the row showed nothing new: no inference


@pytest.mark.parametrize(
    "case",
    ["a comment on a column or an unchanged table", "other tables and changes older than the snapshot"],
)
def test_messages_that_change_nothing_are_ignored(case: str) -> None:
    h = Harness()
    if case == "a comment on a column or an unchanged table":
        h.follower(_msg("COMMENT", [_obj(_cols(*BASE), kind="table column", subid=2)]))
        h.follower(
            _msg("ALTER TABLE", [_obj(_cols(*BASE))])
        )  # e.g. SET NOT NULL: nullability is not followed
    else:
        h.follower(_msg("CREATE TABLE", [_obj(_cols(("a", "integer", 1)), table="other", oid=OID + 5)]))
        h.follower(_msg("DROP TABLE", [_obj(None, table="other", oid=OID + 5)], event="sql_drop"))
        assert h.changed == [] and h.gone == []
        h.codec.snapshot_lsn = 0x40  # the table's snapshot is newer than this transaction (commit 0/30)
        h.follower(_msg("ALTER TABLE", [_obj(_cols(("id", "integer", 1), ("name", "text", 2)))]))
        h.follower(_msg("DROP TABLE", [_obj(None)], event="sql_drop"))
    assert h.changed == [] and h.gone == []


def test_a_dropped_table_is_gone_at_once_and_its_later_changes_are_skipped() -> None:
    h = Harness()
    h.follower(_msg("DROP TABLE", [_obj(None)], event="sql_drop"))
    assert h.gone == [("public.items", "dropped", None, "DROP TABLE")]
    assert h.insert([Col("id", "integer", 1)]) is None  # a new table of that name: the source check tells
    # created again under its name: decoded again, with the columns it has now
    h.follower(_msg("CREATE TABLE", [_obj(_cols(("id", "integer", 1), ("v", "text", 2)), oid=OID + 1)]))
    assert [c.name for c in h.changed[-1][0]] == ["id", "v"]
    assert h.insert([Col("id", "integer", 1), Col("v", "text", "x")]) is not None


def test_a_renamed_table_is_told_with_its_new_name() -> None:
    h = Harness()
    h.follower(_msg("ALTER TABLE", [_obj(_cols(*BASE), table="things")]))
    assert h.gone == [("public.items", "renamed", "public.things", "ALTER TABLE")]
    assert h.changed == [] and h.insert([Col("id", "integer", 1)]) is None
    # moved to another schema: the same oid again, nothing more to tell
    h.follower(_msg("ALTER TABLE", [_obj(_cols(*BASE), table="things", schema="archive")]))
    assert len(h.gone) == 1


def test_a_key_column_renamed_refuses_the_table() -> None:
    h = Harness()
    h.follower(
        _alter(
            ("rid", "integer", 1), ("name", "text", 2), ("note", "text", 3), ("qty", "integer", 4), subid=1
        )
    )
    assert h.lost == [("public.items", ["id"])] and h.changed == []
    assert h.insert([Col("rid", "integer", 1)]) is None


def test_a_message_of_another_version_is_a_decode_error_with_the_fix() -> None:
    with pytest.raises(DecodeError) as err:
        parse_ddl(
            orjson.dumps({"v": 2, "tag": "X", "event": "ddl_command_end", "objects": []}).decode(), "0/1"
        )
    assert "cdc check --fix" in (err.value.fix or "")
    with pytest.raises(DecodeError):
        parse_ddl("not json", "0/1")


def test_wal2json_sends_only_our_message_prefixes_and_their_content() -> None:
    assert BASE_OPTIONS["add-msg-prefixes"] == f"{HEARTBEAT_PREFIX},{DDL_PREFIX},{NONFINITE_PREFIX}"
    raw = b'{"action":"M","lsn":"0/1925158","transactional":true,"prefix":"cdc.ddl","content":"{\\"v\\": 1}"}'
    msg = decode(raw)
    assert msg.prefix == DDL_PREFIX and msg.transactional and msg.content == '{"v": 1}'
