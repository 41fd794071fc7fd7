"""The watcher of source changes: what a streaming session polls besides the stream.

Every :data:`SOURCE_CHECK_S`, :meth:`SourceWatcher.should_restart` asks the catalog
(:func:`cdc.catalog.source_tables`) whether a registered table was dropped or renamed (recorded,
registry state ``source_missing:[schema, table]``, shown by ``cdc tables list``; the other tables go
on), came back, or had a partition attached, created, detached or dropped (the stream restarts with
the new leaves, and the next session reads what changed); whether a table's key can no longer be
carried (refused) or can again; and, at every poll, whether the registrations the stream depends on
changed. (A column changed at the source is :mod:`cdc.reader.schema`'s.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from cdc.catalog import Leaves, source_tables
from cdc.registry import Registry, TableReg, TableState

#: how often (seconds) the stream checks that the registered tables exist, and their partitions
SOURCE_CHECK_S = 2.0


def signature(regs: list[TableReg]) -> tuple[Any, ...]:
    """What the running stream depends on (columns excluded: the stream tracks those itself)."""
    return tuple(
        sorted(
            (
                r.schema,
                r.table,
                r.topic,
                r.key,
                r.exclude,
                r.snapshot_state,
                r.alignment.consistent_lsn if r.alignment else None,
            )
            for r in regs
        )
    )


def table_names(regs: list[TableReg]) -> list[tuple[str, str]]:
    return [(r.schema, r.table) for r in regs]


class SourceWatcher:
    """One session's watch on its tables ``regs`` (those refused for their key: ``refused``).
    ``refuse(regs)`` records and returns the tables whose key can no longer be carried
    (:meth:`cdc.reader.Reader._refuse_lost_keys`)."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        registry: Registry,
        regs: list[TableReg],
        refused: list[TableReg],
        refuse: Callable[[list[TableReg]], set[tuple[str, str]]],
        log: Callable[[str], None],
    ) -> None:
        self.conn = conn
        self.registry = registry
        self.regs = regs
        self.refused = refused
        self.refuse = refuse
        self.log = log
        self._signature = signature(regs)
        self._generation = registry.generation()
        #: per registered table, as last seen: None (missing), () or its leaf partitions
        self.source = source_tables(conn, table_names(regs))
        self._record_missing()
        #: the leaf partitions of each partitioned table (their changes go to the parent's topic)
        self.leaves = {k: v for k, v in self.source.items() if v}
        self._next_check = time.monotonic() + SOURCE_CHECK_S

    def should_restart(self) -> bool:
        """Polled by the stream (``StreamControl.should_restart``)."""
        if time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + SOURCE_CHECK_S
            if self._source_changed():
                return True
            if self.refuse(self.regs):
                return True  # restart without the refused table
            if self.refused and len(self.refuse(self.refused)) < len(self.refused):
                return True  # a refused table can be keyed again: restart with it
        gen = self.registry.generation()
        if gen == self._generation:
            return False
        self._generation = gen
        return signature(self.registry.list_tables()) != self._signature

    def gone(self, reg: TableReg) -> None:
        """``reg`` was recorded missing already (the DDL recorder told it): not told again."""
        self.source[(reg.schema, reg.table)] = None

    def _record_missing(self) -> None:
        for (schema, table), found in self.source.items():
            missing = self.registry.get_table_state(TableState.SOURCE_MISSING, schema, table)
            if found is None:
                if missing is None:
                    self.log(
                        f"{schema}.{table} does not exist at the source (dropped or renamed); the others go on"
                    )
                    self.registry.set_table_state(
                        TableState.SOURCE_MISSING, schema, table, str(int(time.time()))
                    )
            elif missing is not None:
                self.registry.set_table_state(TableState.SOURCE_MISSING, schema, table, None)
                self.registry.set_table_state(TableState.SOURCE_MISSING_DDL, schema, table, None)

    def _source_changed(self) -> bool:
        """A registered table gone or back, or its partitions changed (then True: restart; the next
        session compares them with the leaves it streamed, ``Reader._partitions_changed``)."""
        now = source_tables(self.conn, table_names(self.regs))
        restart = False
        for key, before in list(self.source.items()):
            after: Leaves = now.get(key)
            if after == before:
                continue
            schema, table = key
            if after is None:
                self.log(
                    f"{schema}.{table} no longer exists at the source (dropped or renamed); the others go on"
                )
                self.registry.set_table_state(TableState.SOURCE_MISSING, schema, table, str(int(time.time())))
            elif before is None:
                self.log(f"{schema}.{table} exists at the source again")
                self.registry.set_table_state(TableState.SOURCE_MISSING, schema, table, None)
                self.registry.set_table_state(TableState.SOURCE_MISSING_DDL, schema, table, None)
                restart = True
            else:
                self.log(f"partitions of {schema}.{table} changed: {[f'{s}.{t}' for s, t in after]}")
                restart = True
            self.source[key] = after
        return restart
