"""The codec without Postgres: a source catalog (:class:`cdc.reader.schema.Catalog`) and an event
builder that settles a change whose columns changed as the stream loop does."""

from __future__ import annotations

from typing import Any

from cdc.codec import Message
from cdc.codec.envelope import ColumnsSeen, EventBuilder, TableCodec
from cdc.logstore import Record
from cdc.reader.schema import RecordColumns, SchemaFollower
from cdc.registry import Column, TableReg


class StaticCatalog:
    """No domains; ``gone``: every column a change left out was dropped (else none); ``now``: the
    table's columns at the source (asked once a column is gone)."""

    def __init__(self, *, gone: bool = False, now: tuple[Column, ...] = ()) -> None:
        self.all_gone = gone
        self.now = now

    def resolve(self, cols: tuple[Column, ...]) -> tuple[Column, ...]:
        return cols

    def gone(self, reg: TableReg, names: list[str]) -> set[str]:
        return set(names) if self.all_gone else set()

    def columns(self, reg: TableReg) -> tuple[Column, ...]:
        return self.now


def settled(schema: SchemaFollower, out: Any) -> Any:
    """What the stream loop appends for ``EventBuilder.change``'s ``out``."""
    return schema.settle(out) if isinstance(out, ColumnsSeen) else out


class SettlingBuilder(EventBuilder):
    """An :class:`EventBuilder` whose :meth:`change` settles a column change in place (``record``:
    what the reader's registry does, returning the new registration or None; ``catalog``: the
    source's), as the stream loop does; :attr:`schema`: the follower (the DDL recorder's too)."""

    def __init__(
        self,
        codecs: dict[tuple[str, str], TableCodec],
        record: RecordColumns,
        catalog: StaticCatalog | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(codecs, **kw)
        self.schema = SchemaFollower(self, catalog or StaticCatalog(), record)

    def change(self, msg: Message) -> tuple[str, list[Record]] | None:  # type: ignore[override]
        return settled(self.schema, super().change(msg))  # type: ignore[no-any-return]
