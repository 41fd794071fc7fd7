"""The DDL recorder's stream side: :class:`DdlFollower` applies each recorder message to the tables
being streamed (docs/schema-changes.md, "The DDL recorder").

The recorder itself (the event triggers on the source, the message format, ``cdc check``'s view of
it) is :mod:`cdc.recorders.ddl`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson

from cdc.codec import DDL_PREFIX, Message
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.errors import DecodeError
from cdc.events import int_to_lsn
from cdc.reader.schema import SchemaFollower
from cdc.recorders.ddl import FORMAT_VERSION
from cdc.registry import Column, TableReg

__all__ = ["DDL_PREFIX", "DdlFollower", "DdlMessage", "DdlObject", "parse_ddl"]


# --- the stream side -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DdlColumn:
    name: str
    type: str
    attnum: int
    notnull: bool


@dataclass(frozen=True)
class DdlObject:
    kind: str  # "table" or "table column"
    identity: str
    schema: str
    table: str
    oid: int
    subid: int
    columns: tuple[DdlColumn, ...] | None  # None: a dropped table


@dataclass(frozen=True)
class DdlMessage:
    tag: str
    event: str
    objects: tuple[DdlObject, ...]

    @property
    def drop(self) -> bool:
        return self.event == "sql_drop"


def parse_ddl(content: str | None, lsn: str | None = None) -> DdlMessage:
    """Decode a recorder message; DecodeError (with the fix) when it is not one this reader knows."""
    try:
        body = orjson.loads(content or "")
        if body.get("v") != FORMAT_VERSION:
            raise ValueError(f"format version {body.get('v')!r}, this reader knows {FORMAT_VERSION}")
        objects = tuple(
            DdlObject(
                kind=str(o["type"]),
                identity=str(o["identity"]),
                schema=str(o["schema"]),
                table=str(o["table"]),
                oid=int(o["oid"]),
                subid=int(o.get("subid") or 0),
                columns=None
                if o.get("columns") is None
                else tuple(
                    DdlColumn(str(c["name"]), str(c["type"]), int(c["attnum"]), bool(c["notnull"]))
                    for c in o["columns"]
                ),
            )
            for o in body["objects"]
        )
        return DdlMessage(str(body["tag"]), str(body["event"]), objects)
    except (orjson.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DecodeError(
            f"a {DDL_PREFIX} message at LSN {lsn} is not one this cdc understands: {exc}",
            fix="bring the recorder up to this cdc version: `cdc check --fix` (as a superuser)",
            lsn=lsn,
            reason="bad DDL message",
        ) from exc


#: (registration, "dropped" | "renamed", the new name of a renamed table, the command tag)
TableGone = Callable[[TableReg, str, str | None, str], None]
#: (registration, key columns the command took away)
KeyLost = Callable[[TableReg, list[str]], None]


class DdlFollower:
    """Applies the recorder's messages to the streamed tables (called by the stream loop for each
    ``cdc.ddl`` message, inside its transaction, in order with the changes):

    * a table dropped (``sql_drop``), or renamed / moved to another schema (the same ``oid`` under
      a new name): ``on_gone``; its changes are no longer decoded (``EventBuilder.detach``);
    * a command that took a key column away (dropped or renamed): ``on_key_lost``, detached too;
    * otherwise the table's columns after the command become its columns at once (``schema``:
      :meth:`SchemaFollower.told`; the schema version bumped before the next row). A column is
      **renamed** exactly when the command names one column (``table column`` object of an ALTER
      TABLE) whose name is new while exactly one known column is gone; anything else is a drop
      and/or an add, whatever the types.

    ``oids``: the streamed tables' oids when the session started ({oid: (schema, table)}). Messages
    of other tables are ignored, as are those older than a table's snapshot.
    """

    def __init__(
        self,
        builder: EventBuilder,
        schema: SchemaFollower,
        oids: dict[int, tuple[str, str]],
        *,
        on_gone: TableGone,
        on_key_lost: KeyLost,
    ) -> None:
        self.builder = builder
        self.schema = schema
        self.oids = dict(oids)
        self.on_gone = on_gone
        self.on_key_lost = on_key_lost

    def __call__(self, msg: Message) -> None:
        ddl = parse_ddl(msg.content, int_to_lsn(msg.lsn or 0))
        for obj in ddl.objects:
            self._object(ddl, obj)

    def _codec(self, key: tuple[str, str]) -> TableCodec | None:
        codec = self.builder.codecs.get(key)
        if codec is None or self.builder.commit_lsn < codec.snapshot_lsn:
            return None  # not streamed, or the change is contained in the table's snapshot
        return codec if (codec.reg.schema, codec.reg.table) == key else None  # a leaf: its parent's

    def _object(self, ddl: DdlMessage, obj: DdlObject) -> None:
        key = (obj.schema, obj.table)
        known = self.oids.get(obj.oid)
        if ddl.drop:
            codec = self._codec(known or key)
            if codec is not None:
                self.oids.pop(obj.oid, None)
                self.builder.detach(codec)
                self.on_gone(codec.reg, "dropped", None, ddl.tag)
            return
        if known is not None and known != key:
            # the same table under a new name (ALTER TABLE ... RENAME TO / SET SCHEMA)
            del self.oids[obj.oid]
            codec = self._codec(known)
            if codec is not None:
                self.builder.detach(codec)
                self.on_gone(codec.reg, "renamed", obj.identity, ddl.tag)
        codec = self._codec(key) or self.builder.reattach(key)
        if codec is None or obj.columns is None or self.builder.commit_lsn < codec.snapshot_lsn:
            return
        self.oids[obj.oid] = key
        self._columns(ddl, obj, codec)

    def _columns(self, ddl: DdlMessage, obj: DdlObject, codec: TableCodec) -> None:
        assert obj.columns is not None
        before = {c.name: c for c in codec.columns}
        names = {c.name for c in obj.columns}
        lost = [k for k in codec.key if k not in names]
        if lost:
            self.builder.detach(codec)
            self.on_key_lost(codec.reg, lost)
            return
        renamed: dict[str, str] = {}
        if ddl.tag == "ALTER TABLE" and obj.kind == "table column" and obj.subid > 0:
            new = next((c.name for c in obj.columns if c.attnum == obj.subid), None)
            gone = [n for n in before if n not in names]
            if new is not None and new not in before and len(gone) == 1:
                renamed = {gone[0]: new}
        cols = tuple(
            Column(c.name, c.type, before[c.name].nullable if c.name in before else not c.notnull)
            for c in obj.columns
        )
        self.schema.told(codec, cols, renamed)
