"""Analyst access to the warehouse: DuckDB over the Delta tables' Arrow datasets (``cdc sql``).

Each registered view from joins (:mod:`cdc.views`) the apply has built is a view by its name (in
DuckDB's ``main`` schema: ``SELECT * FROM NAME``). Each registered table ``schema.table`` that the apply job has written is a view ``schema.table``
(current state) and ``schema.table__history`` (history) in a DuckDB schema named like the source
schema, so joins across tables work as they would at the source. The views show the source columns
and the ``_cdc_*`` meta columns documented in :mod:`sinks.warehouse` (``docs/warehouse.md``) (the internal ``_cdc_bucket``
partition column and the tombstones table are hidden). Reads see the tables' latest committed
versions when the connection is opened; nothing is written.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
from deltalake import DeltaTable

from cdc import paths
from cdc.errors import CdcError
from cdc.registry import TableReg, ViewReg
from sinks.warehouse.layout import BUCKET, META_PREFIX, table_paths


class QueryError(CdcError):
    """A ``cdc sql`` query failed (DuckDB's message in ``detail``)."""


@dataclass
class Catalog:
    """What a :class:`Warehouse` connection offers: the views by name, and the registered tables
    whose Delta tables do not exist yet."""

    views: dict[str, str] = field(default_factory=dict)  # view name -> "current"/"history" of which table
    not_applied: list[str] = field(default_factory=list)


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Warehouse:
    """A DuckDB connection with every applied table registered as views (see the module docstring)."""

    def __init__(self, state_dir: Path, tables: Sequence[TableReg], views: Sequence[ViewReg] = ()) -> None:

        self.con = duckdb.connect(":memory:")
        self.catalog = Catalog()
        for i, reg in enumerate(tables):
            current, history, _ = table_paths(Path(state_dir), reg)
            if not DeltaTable.is_deltatable(str(current)):
                self.catalog.not_applied.append(reg.qualified)
                continue
            self.con.execute(f"CREATE SCHEMA IF NOT EXISTS {_quote(reg.schema)}")
            for kind, path, view in (
                ("current", current, reg.table),
                ("history", history, f"{reg.table}__history"),
            ):
                if not DeltaTable.is_deltatable(str(path)):
                    continue
                source = f"__cdc_{kind}_{i}"
                self.con.register(source, DeltaTable(str(path)).to_pyarrow_dataset())
                self.con.execute(
                    f"CREATE VIEW {_quote(reg.schema)}.{_quote(view)} AS "
                    f"SELECT * EXCLUDE ({_quote(BUCKET)}) FROM {_quote(source)}"
                )
                self.catalog.views[f"{reg.schema}.{view}"] = f"{kind} of {reg.qualified}"
        for view_reg in views:
            self._add_view(Path(state_dir), view_reg)

    def _add_view(self, state_dir: Path, view: ViewReg) -> None:
        """A view from joins (:mod:`cdc.views`) by its name, without its ``_cdc_`` columns. Read
        into Arrow with plain strings, not scanned: pyarrow fails DuckDB's filters pushed into a
        scan of the string views delta-rs writes."""
        path = paths.view_table(state_dir, view.name)
        if not DeltaTable.is_deltatable(str(path)):
            self.catalog.not_applied.append(view.name)
            return
        data = DeltaTable(str(path)).to_pyarrow_table()
        plain = {pa.string_view(): pa.string(), pa.binary_view(): pa.binary()}
        data = data.cast(pa.schema([f.with_type(plain.get(f.type, f.type)) for f in data.schema]))
        data = data.select([n for n in data.column_names if not n.startswith(META_PREFIX)])
        source = f"__cdc_view_{view.name}"
        self.con.register(source, data)
        self.con.execute(f"CREATE VIEW main.{_quote(view.name)} AS SELECT * FROM {_quote(source)}")
        self.catalog.views[view.name] = f"view of {', '.join(view.tables)}"

    def query(self, sql: str) -> pa.Table:
        """Run one SQL statement; the result as an Arrow table (empty for statements without rows).
        A DuckDB error becomes a :class:`QueryError` with DuckDB's message and a fix naming the tables."""
        try:
            rel = self.con.sql(sql)
            if rel is None:
                return pa.table({})
            result: pa.Table = rel.to_arrow_table()
            return result
        except duckdb.Error as exc:
            raise self._error(sql, exc) from exc

    def _error(self, sql: str, exc: duckdb.Error) -> QueryError:
        message = str(exc).strip()
        available = ", ".join(sorted(self.catalog.views)) or "(none)"
        fix = f"tables you can query: {available}"
        pending = [
            name
            for name in self.catalog.not_applied
            if re.search(re.escape(name.split(".")[-1]), sql, re.IGNORECASE)
        ]
        if self.catalog.not_applied:
            fix += (
                f"; registered but not applied yet: {', '.join(self.catalog.not_applied)} "
                "(run `cdc apply --once` after their snapshot)"
            )
        if pending and isinstance(exc, duckdb.CatalogException):
            message = f"{', '.join(pending)} is registered but has no warehouse table yet ({message.splitlines()[0]})"
        return QueryError(f"the query failed: {message}", fix=fix, query=sql)

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> Warehouse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def jsonable(value: Any) -> Any:
    """A result value for JSON/CSV: decimals as strings (every digit), timestamps/dates ISO 8601,
    bytes as hex, lists and structs recursively."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def rows_of(table: pa.Table) -> list[dict[str, Any]]:
    """The result's rows as JSON-ready objects (see :func:`jsonable`)."""
    return [{k: jsonable(v) for k, v in row.items()} for row in table.to_pylist()]
