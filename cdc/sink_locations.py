"""Where each sink keeps a registered table, and so which sinks keep it, without importing the sinks.

:data:`sinks.all.SINKS` brings the sinks' libraries (pyarrow, deltalake, tantivy: 0.5-0.8 s of CPU
in a new process); ``cdc status`` and ``cdc wait`` only ask which sinks keep a table (one apply
stage each), so they ask here. Each sink's :meth:`sinks.Sink.locations` is its function here, and
:data:`LOCATIONS` names the sinks in the order of :data:`sinks.all.SINKS` (a unit test holds the
two equal): a new sink adds its entry here too. Every path is built by :mod:`cdc.paths`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cdc import paths
from cdc.registry import TableReg

__all__ = ["LOCATIONS", "keeping", "search", "warehouse"]


def warehouse(state_dir: Path, reg: TableReg) -> dict[str, Path]:
    """Every table: ``current``, ``history``, ``tombstones`` (:func:`cdc.paths.warehouse_tables`)."""
    tables = paths.warehouse_tables(Path(state_dir), reg.schema, reg.table)
    return dict(zip(("current", "history", "tombstones"), tables, strict=True))


def search(state_dir: Path, reg: TableReg) -> dict[str, Path]:
    """A table with search columns: ``index`` (the directory of its shards, each a tantivy index
    with its side table) and ``versions`` (the index's metadata: the shard count, the fields)."""
    if not reg.search:
        return {}
    state = Path(state_dir)
    return {
        "index": paths.search_index(state, reg.topic),
        "versions": paths.search_versions(state, reg.topic),
    }


#: sink name -> where it keeps a table (role -> path; empty: it keeps nothing of it), in the order
#: of :data:`sinks.all.SINKS`
LOCATIONS: dict[str, Callable[[Path, TableReg], dict[str, Path]]] = {"warehouse": warehouse, "search": search}


def keeping(state_dir: Path, reg: TableReg) -> list[str]:
    """The names of the sinks that keep ``reg``, in apply order."""
    return [name for name, where in LOCATIONS.items() if where(state_dir, reg)]
