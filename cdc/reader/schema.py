"""A registered table's columns changed at the source: the one place the reader settles it
(``docs/schema-changes.md``). Two things tell it while streaming, and both end here:

* a change whose columns are not its codec's, which the codec only reports, returning a
  :class:`~cdc.codec.envelope.ColumnsSeen` in place of the change's records:
  :meth:`SchemaFollower.settle`;
* a DDL recorder's message (:mod:`cdc.reader.ddl`): :meth:`SchemaFollower.told`.

Settling asks the source's catalog (:class:`SourceCatalog`), records the new columns
(:class:`RegistryColumns`), then the codec follows them (``EventBuilder.follow_columns``), all
before any event of the change is made: its events carry the new ``schema_version``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import orjson
import psycopg

from cdc.catalog import column_names, resolve_domains
from cdc.codec import Col
from cdc.codec.envelope import ColumnsSeen, EventBuilder, TableCodec, renamed_columns, retyped_columns
from cdc.codec.values import out_of_line_columns
from cdc.logstore import Record
from cdc.logstore.images import Images
from cdc.registry import Column, Registry, TableReg, TableState
from snapshot.table_info import table_columns

__all__ = ["Catalog", "RegistryColumns", "SchemaFollower", "SourceCatalog", "sent_columns"]

#: how long (seconds) the catalog's answer to "which columns does the table have" is reused
COLUMNS_TTL_S = 2.0
#: a change is looked at in at most three steps (its new row, what it left out, its identity)
_MAX_STEPS = 8


class Catalog(Protocol):
    """What settling a column change asks the source (:class:`SourceCatalog`): ``resolve`` each
    domain to its base type (its name kept in ``domain``); which of ``names`` the table no longer
    has (none when the table itself is gone); the table's columns now, in order, domains resolved."""

    def resolve(self, cols: tuple[Column, ...]) -> tuple[Column, ...]: ...

    def gone(self, reg: TableReg, names: list[str]) -> set[str]: ...

    def columns(self, reg: TableReg) -> tuple[Column, ...]: ...


class SourceCatalog:
    """:class:`Catalog` on the session's connection. ``gone`` reads the table's column names at most
    every :data:`COLUMNS_TTL_S` per table (an UPDATE that leaves an unchanged out-of-line value out
    asks it); a domain's base type is read once (it cannot change while a column uses it)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self._types: dict[str, str] = {}
        self._names: dict[tuple[str, str], tuple[float, set[str] | None]] = {}

    def resolve(self, cols: tuple[Column, ...]) -> tuple[Column, ...]:
        return resolve_domains(self.conn, cols, self._types)

    def gone(self, reg: TableReg, names: list[str]) -> set[str]:
        at, have = self._names.get((reg.schema, reg.table), (-COLUMNS_TTL_S, None))
        if time.monotonic() - at >= COLUMNS_TTL_S:
            have = column_names(self.conn, reg.schema, reg.table)
            self._names[(reg.schema, reg.table)] = (time.monotonic(), have)
        if have is None:  # the table itself is gone: the source check says so
            return set()
        return {n for n in names if n not in have}

    def columns(self, reg: TableReg) -> tuple[Column, ...]:
        return table_columns(self.conn, reg.schema, reg.table)


#: records a table's new columns: (its registration, the columns, the renames the DDL recorder
#: told or None); returns the new registration (None: the codec's stays)
RecordColumns = Callable[[TableReg, tuple[Column, ...], dict[str, str] | None], TableReg | None]


class RegistryColumns:
    """:data:`RecordColumns` of the reader: the registry's columns (``schema_version`` bumped when
    they differ), the non-finite recorder's triggers for them (``ensure_nonfinite``: a first float
    column, a generated one), and a chunked re-snapshot of the table when a column was renamed (the
    rows not changed since hold it under its old name only) or retyped where the ALTER rewrote long
    values that no change carries (``images``: which columns held one)."""

    def __init__(
        self,
        registry: Registry,
        images: Images | None,
        ensure_nonfinite: Callable[[list[TableReg]], None],
        log: Callable[[str], None],
    ) -> None:
        self.registry = registry
        self.images = images
        self.ensure_nonfinite = ensure_nonfinite
        self.log = log

    def __call__(self, reg: TableReg, cols: tuple[Column, ...], told: dict[str, str] | None) -> TableReg:
        renamed = renamed_columns(reg.columns, cols) if told is None else told
        rewritten = self._rewritten_long_values(reg, cols)
        new = self.registry.set_columns(reg.schema, reg.table, cols, renamed)
        self.ensure_nonfinite([new])
        self.log(
            f"columns of {reg.qualified} changed at the source (schema version "
            f"{new.schema_version}{', told by the DDL recorder' if told is not None else ''}): "
            f"{[f'{c.name} {c.type}' for c in cols]}"
        )
        if renamed:
            self.log(
                f"{reg.qualified}: column(s) renamed at the source {renamed}"
                f"{' (DDL recorder)' if told is not None else ''}; "
                "snapshotting the table again (chunked) so every row carries the new name"
            )
            self._resnapshot(reg)
        elif rewritten:
            # an UPDATE that leaves these values out could not be filled in
            self.log(
                f"{reg.qualified}: column(s) {rewritten} retyped at the source; snapshotting the "
                "table again (chunked) so every row carries their new values"
            )
            self._resnapshot(reg)
        return new

    def _resnapshot(self, reg: TableReg) -> None:
        self.registry.set_table_state(TableState.SNAPSHOT_REQUEST, reg.schema, reg.table, None)
        self.registry.set_snapshot_state(reg.schema, reg.table, "pending")

    def _rewritten_long_values(self, reg: TableReg, cols: tuple[Column, ...]) -> list[str]:
        """The columns retyped from ``reg``'s columns to ``cols`` whose values the ALTER may have
        rewritten out of line, where no change carries them: their new type can be stored out of
        line, and some row held one (the image store holds the column for the table)."""
        long_now = out_of_line_columns({c.name: c.type for c in cols})
        return [
            n
            for n in retyped_columns(reg.columns, cols)
            if n in long_now
            and self.images is not None
            and self.images.holds_column(reg.topic, orjson.dumps(n))
        ]


def sent_columns(
    known: tuple[Column, ...], sent: list[Col], is_insert: bool, gone: set[str]
) -> tuple[Column, ...]:
    """A table's columns as a change that ``sent`` these shows them: the known ones in their order
    with the types sent (an INSERT sends every column: one it lacks is dropped; another change
    leaves columns out, of which those ``gone`` at the source are dropped), then the new ones."""
    present = {c.name: c.type for c in sent}
    out: list[Column] = []
    for col in known:
        if col.name in present:
            out.append(Column(col.name, present[col.name], col.nullable))
        elif not is_insert and col.name not in gone:
            out.append(col)
    names = {c.name for c in out}
    out.extend(Column(n, t) for n, t in present.items() if n not in names)
    return tuple(out)


class SchemaFollower:
    """Settles the column changes of one streaming session (see the module docstring):
    ``catalog`` answers what the source has, ``record`` records the new columns."""

    def __init__(self, builder: EventBuilder, catalog: Catalog, record: RecordColumns) -> None:
        self.builder = builder
        self.catalog = catalog
        self.record = record

    def settle(self, seen: ColumnsSeen) -> tuple[str, list[Record]]:
        """The records of the change that returned ``seen``, once each column change it shows is
        recorded (in the order the codec saw them, one ``schema_version`` each)."""
        for _ in range(_MAX_STEPS):
            self._step(seen)
            out = self.builder.resume(seen)
            if not isinstance(out, ColumnsSeen):
                return out
            seen = out
        raise RuntimeError(f"the columns of a change of {seen.codec.reg.qualified} never settled (a bug)")

    def _step(self, seen: ColumnsSeen) -> None:
        codec = seen.codec
        if seen.unsent is not None:
            gone = self.catalog.gone(codec.reg, seen.unsent)
            if gone:  # dropped at the source: no longer in the events (the warehouse keeps it, null)
                known = {c.name for c in codec.columns}
                # a rename's new name, say: an unchanged out-of-line value under it is sent by no change
                added = tuple(c for c in self.catalog.columns(codec.reg) if c.name not in known)
                self.change(codec, tuple(c for c in codec.columns if c.name not in gone) + added)
            return
        gone = set()
        if not seen.is_insert:
            # an UPDATE/DELETE leaves out TOASTed values and (identity) non-key columns: only the
            # catalog tells a column dropped (or renamed) at the source
            names = {c.name for c in seen.sent}
            missing = [c.name for c in codec.columns if c.name not in names]
            gone = self.catalog.gone(codec.reg, missing) if missing else set()
        self.change(codec, sent_columns(codec.columns, seen.sent, seen.is_insert, gone))

    def told(self, codec: TableCodec, cols: tuple[Column, ...], renamed: dict[str, str]) -> None:
        """The table's columns as a DDL command left them (``renamed``: exactly the columns it
        renamed, possibly none): recorded now, before the next change of the table."""
        cols = self.catalog.resolve(cols)
        if cols != codec.columns:
            self.change(codec, cols, renamed)

    def change(self, codec: TableCodec, cols: tuple[Column, ...], told: dict[str, str] | None = None) -> None:
        """The table's columns are ``cols`` from now on (``told``: the renames the DDL recorder
        reported, exact; else inferred): recorded, then followed by the codec."""
        cols = self.catalog.resolve(cols)
        self.builder.follow_columns(codec, cols, self.record(codec.reg, cols, told), told)
