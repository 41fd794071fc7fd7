"""Analyst access to the warehouse: DuckDB over the Delta tables' Arrow datasets (``cdc sql``).

Each registered view from joins (:mod:`cdc.views`) the apply has built is a view by its name (in
DuckDB's ``main`` schema: ``SELECT * FROM NAME``). Each registered table ``schema.table`` that the apply job has written is a view ``schema.table``
(current state) and ``schema.table__history`` (history) in a DuckDB schema named like the source
schema, so joins across tables work as they would at the source. The views show the source columns
and the ``_cdc_*`` meta columns documented in :mod:`sinks.warehouse` (``docs/warehouse.md``) (the internal ``_cdc_bucket``
partition column and the tombstones table are hidden). Reads see the tables' latest committed
versions when the connection is opened, whose files stay on disk until it is closed (a read lease on
each table: :mod:`sinks.warehouse.leases`); nothing is written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import duckdb
import pyarrow as pa
from deltalake import DeltaTable

from cdc import paths
from cdc.errors import CdcError
from cdc.names import sql_ident, sql_string
from cdc.registry import TableReg, ViewReg
from sinks.types import plain_types
from sinks.warehouse import duck, leases
from sinks.warehouse.delta import arrow_schema
from sinks.warehouse.layout import BUCKET, META_PREFIX, table_paths

#: the column of a Parquet file's name in :meth:`Warehouse._scan` (never a source column: ``_cdc_``)
FILE = "_cdc_file"


class QueryError(CdcError):
    """A ``cdc sql`` query failed (DuckDB's message in ``detail``)."""


@dataclass
class Catalog:
    """What a :class:`Warehouse` connection offers: the views by name, and the registered tables
    whose Delta tables do not exist yet."""

    views: dict[str, str] = field(default_factory=dict)  # view name -> "current"/"history" of which table
    not_applied: list[str] = field(default_factory=list)


class Warehouse:
    """A DuckDB connection with every applied table registered as views (see the module docstring)."""

    def __init__(
        self,
        state_dir: Path,
        tables: Sequence[TableReg],
        views: Sequence[ViewReg] = (),
        *,
        lease_max_age_s: float = leases.MAX_AGE_S,
    ) -> None:
        """Holds a read lease (:mod:`sinks.warehouse.leases`) on every Delta table it registers,
        taken before it opens the table and released by :meth:`close`: the apply's reclaim deletes
        none of the files of the versions its views read until then (at most ``lease_max_age_s``)."""
        self.con = duck.connect()
        self.catalog = Catalog()
        self._leases = contextlib.ExitStack()
        self._lease_s = lease_max_age_s
        try:
            self._register(Path(state_dir), tables, views)
        except BaseException:
            self.close()
            raise

    def _register(self, state_dir: Path, tables: Sequence[TableReg], views: Sequence[ViewReg]) -> None:
        for i, reg in enumerate(tables):
            current, history, _ = table_paths(state_dir, reg)
            self._leases.enter_context(leases.lease(current, self._lease_s))
            if not DeltaTable.is_deltatable(str(current)):
                self.catalog.not_applied.append(reg.qualified)
                continue
            self.con.execute(f"CREATE SCHEMA IF NOT EXISTS {sql_ident(reg.schema)}")
            for kind, path, view in (
                ("current", current, reg.table),
                ("history", history, f"{reg.table}__history"),
            ):
                if kind == "history":
                    self._leases.enter_context(leases.lease(path, self._lease_s))
                if not DeltaTable.is_deltatable(str(path)):
                    continue
                scan = self._scan(f"__cdc_{kind}_{i}", DeltaTable(str(path)))
                self.con.execute(
                    f"CREATE VIEW {sql_ident(reg.schema)}.{sql_ident(view)} AS "
                    f"SELECT * EXCLUDE ({sql_ident(BUCKET)}) FROM {scan}"
                )
                self.catalog.views[f"{reg.schema}.{view}"] = f"{kind} of {reg.qualified}"
        for view_reg in views:
            self._add_view(state_dir, view_reg)

    def _add_view(self, state_dir: Path, view: ViewReg) -> None:
        """A view from joins (:mod:`cdc.views`) by its name, without its ``_cdc_`` columns."""
        path = paths.view_table(state_dir, view.name)
        self._leases.enter_context(leases.lease(path, self._lease_s))
        if not DeltaTable.is_deltatable(str(path)):
            self.catalog.not_applied.append(view.name)
            return
        table = DeltaTable(str(path))
        columns = [n for n in arrow_schema(table).names if not n.startswith(META_PREFIX)]
        scan = self._scan(f"__cdc_view_{view.name}", table)
        self.con.execute(
            f"CREATE VIEW main.{sql_ident(view.name)} AS "
            f"SELECT {', '.join(sql_ident(c) for c in columns)} FROM {scan}"
        )
        self.catalog.views[view.name] = f"view of {', '.join(view.tables)}"

    def _scan(self, source: str, table: DeltaTable) -> str:
        """A FROM item that reads ``table``'s current version with DuckDB's own Parquet reader:

        * the version's data files (delta-rs writes no deletion vectors: its files are its rows),
          with each file's partition values from the Delta log (``source``_parts, joined by file;
          a partition column is not in the files);
        * unioned by name with an empty Arrow table of the Delta schema (``source``), which gives
          the columns their order and types, and a null for a column added after a file was written.

        Not a pyarrow dataset: DuckDB pushes its filters into a dataset scan, and pyarrow cannot
        compare a string literal with the string views delta-rs writes ("no kernel matching input
        types (string, string_view)"), so a plain ``WHERE name = 'x'`` failed."""
        self.con.register(source, plain_types(arrow_schema(table)).empty_table())
        files = pa.table(table.get_add_actions(flatten=True))
        if files.num_rows == 0:
            return sql_ident(source)
        root = table.table_uri.removeprefix("file://").rstrip("/")
        names = [f"{root}/{unquote(p)}" for p in files.column("path").to_pylist()]
        listed = ", ".join(sql_string(n) for n in names)
        data = (
            f"read_parquet([{listed}], filename = '{FILE}', union_by_name = true, hive_partitioning = false)"
        )
        parts = table.metadata().partition_columns
        if parts:
            values = pa.table({FILE: names, **{c: files.column(f"partition.{c}") for c in parts}})
            self.con.register(f"{source}_parts", values)
            data = (
                f"(SELECT d.* EXCLUDE ({sql_ident(FILE)}), {', '.join('p.' + sql_ident(c) for c in parts)} "
                f"FROM {data} d JOIN {sql_ident(source + '_parts')} p USING ({sql_ident(FILE)}))"
            )
        else:
            data = f"(SELECT * EXCLUDE ({sql_ident(FILE)}) FROM {data})"
        return f"(SELECT * FROM {sql_ident(source)} UNION ALL BY NAME SELECT * FROM {data})"

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
        """Close the connection, then release the leases."""
        try:
            self.con.close()
        finally:
            self._leases.close()

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
