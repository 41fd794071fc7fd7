"""The registry: which tables are captured, and how. The one truth of what is captured.

Stored in the state directory (``<state>/registry.db``, SQLite in WAL mode, safe for the CLI, the
reader and the Spark job to open at the same time). The reader polls :meth:`Registry.generation`
to notice a registration change and applies it without losing or repeating a committed change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str  # Postgres' format_type(), e.g. "numeric(38,9)", "timestamp with time zone", "integer[]"
    nullable: bool = True


@dataclass(frozen=True, slots=True)
class Alignment:
    """Where a table's snapshot meets the stream (DESIGN.md "Snapshot alignment")."""

    consistent_lsn: int
    end_offsets: dict[int, int]


@dataclass(frozen=True, slots=True)
class TableReg:
    """One registered table.

    ``snapshot_state``: ``pending`` (registered, no snapshot yet), ``running``, ``done``.
    ``columns`` follow the source: the reader records a column added at the source.
    """

    schema: str
    table: str
    topic: str
    key: tuple[str, ...]
    search: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    columns: tuple[Column, ...] = ()
    snapshot_state: str = "pending"
    alignment: Alignment | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def qualified(self) -> str:
        """``schema.table`` as people write it (unquoted), used as the table's name in the CLI."""
        return f"{self.schema}.{self.table}"
