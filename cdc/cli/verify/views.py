"""A view from joins as ``cdc verify`` compares it: the view's SQL run on the source against the
view's current Delta table and its search index (``docs/views.md``, "Checked").

:class:`cdc.cli.verify.compare.Verifier` compares tables; a view becomes one through :func:`subject_of`: a
table registration (:attr:`ViewSubject.reg`, never stored) whose columns are the view's, typed as
the source columns they read, and whose key is the driving table's key -- the view row's identity,
stored in the view's table as ``_cdc_key`` (the driving row's canonical key JSON). A driving key
column the view does not select is carried as a hidden column ``_cdc_key.<column>``: appended to
the view's SQL on the source (:func:`cdc.views.source_sql`) and parsed out of ``_cdc_key`` on the
warehouse side. The verifier then reads the source through :func:`source_from` (the view's query as
a subquery) instead of the table, and the derived side through :func:`stored_rows` and
:func:`stored_docs`; the rest (the consistent point, the wait for the pipeline, the range hashes,
the report) is the tables' own.

A view is compared whole (no incremental record: its rows change with any of its tables), and the
pipeline it waits for is that of the tables it reads (:attr:`ViewSubject.base`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from psycopg import sql

from cdc import paths
from cdc.errors import ConfigError, RegistryError
from cdc.registry import Column, Registry, TableReg, ViewReg

if TYPE_CHECKING:
    from cdc.views import ViewSpec

# cdc.views (sqlglot, ~0.1 s to import) is imported where a view is parsed or read: a verify of
# tables alone never needs it, and its fixed cost is what an incremental run pays on top of the rows

#: the schema of a view's table registration (:attr:`ViewSubject.reg`); no table lives there
VIEW_SCHEMA = "_views"
#: the view rows carry no version: 0, never newer than a consistent point
VERSION_COLUMN = "_cdc_view_version"
HIDDEN = "_cdc_key."


@dataclass(frozen=True)
class ViewSubject:
    """A registered view as the verifier compares it (see the module docstring)."""

    view: ViewReg
    spec: ViewSpec
    reg: TableReg
    #: the registered tables it reads (their pipeline is the one verify waits for)
    base: tuple[TableReg, ...]
    #: per driving key column (its order): the column of :attr:`reg` that holds it
    key_columns: tuple[str, ...]
    #: driving key columns the view does not select: (driving column, hidden column name)
    hidden: tuple[tuple[str, str], ...]


def subject_of(view: ViewReg, tables: list[TableReg]) -> ViewSubject:
    """The view parsed against the registered ``tables`` (a ConfigError when it no longer parses)."""
    from cdc.views import spec_of

    spec = spec_of(view, tables)
    by_alias = {spec.driving_alias: spec.driving, **{j.alias: j.reg for j in spec.joins}}
    types = {a: {c.name: c.type for c in reg.columns} for a, reg in by_alias.items()}
    columns = [
        Column(name, types[alias].get(col, "text"))
        for name, (alias, col) in zip(spec.columns, spec.sources, strict=True)
    ]
    selected = {src: name for name, src in zip(spec.columns, spec.sources, strict=True)}
    key_columns: list[str] = []
    hidden: list[tuple[str, str]] = []
    for k in spec.driving.key:
        name = selected.get((spec.driving_alias, k))
        if name is None:
            name = HIDDEN + k
            hidden.append((k, name))
            columns.append(Column(name, types[spec.driving_alias].get(k, "text")))
        key_columns.append(name)
    reg = TableReg(
        schema=VIEW_SCHEMA,
        table=view.name,
        topic="",
        key=tuple(key_columns),
        search=view.search,
        columns=tuple(columns),
        snapshot_state="done",
    )
    return ViewSubject(view, spec, reg, spec.tables, tuple(key_columns), tuple(hidden))


def subjects(state_dir: Path, name: str | None) -> tuple[list[TableReg], list[ViewSubject], list[str]]:
    """What ``cdc verify [NAME]`` compares: the view ``name`` (a view's name is tried first; one
    that no longer parses raises its ConfigError), the table ``name``, or (no name) every registered
    table and view. The third item: why a view is left out of a run of every view (it no longer
    parses against the registered tables: ``cdc views list`` shows it refused)."""
    with Registry(state_dir) as registry:
        tables, views = registry.list_tables(), registry.list_views()
        if name:
            view = next((v for v in views if v.name == name), None)
            if view is not None:
                return [], [subject_of(view, tables)], []
            try:
                return [registry.find(name)], [], []
            except RegistryError as exc:
                known = ", ".join(v.name for v in views)
                if known:
                    exc.fix = f"{exc.fix}; registered views: {known}"
                raise
    out: list[ViewSubject] = []
    skipped: list[str] = []
    for view in views:
        try:
            out.append(subject_of(view, tables))
        except ConfigError as exc:
            skipped.append(f"view {view.name} not verified: {exc.message} (fix: {exc.fix})")
    return tables, out, skipped


def source_from(subject: ViewSubject) -> sql.Composable:
    """The view's rows at the source, as a ``FROM`` item: its SQL (the hidden key columns
    appended) as a subquery; its columns are :attr:`ViewSubject.reg`'s."""
    from cdc.views import source_sql

    return sql.SQL("({}) AS {}").format(
        sql.SQL(source_sql(subject.spec, subject.hidden)),  # parsed and checked, quoted by sqlglot
        sql.Identifier("__cdc_view"),
    )


def _driving_keys(subject: ViewSubject, key_jsons: list[Any]) -> dict[str, Any]:
    """Per driving key column, the Arrow array of its values in the view rows' ``_cdc_key``s."""
    from sinks.types import to_array

    types = {c.name: c.type for c in subject.spec.driving.columns}
    keys = [orjson.loads(k) for k in key_jsons]
    return {k: to_array([key.get(k) for key in keys], types.get(k)) for k in subject.spec.driving.key}


def stored_rows(state_dir: Path, subject: ViewSubject, lease_max_age_s: float | None = None) -> Any:
    """The view's current Delta table as the verifier reads a table's (:class:`sinks.StoredRows`):
    the view's columns, the hidden key columns out of ``_cdc_key``, a version column of zeros. Read
    under a lease (:mod:`sinks.warehouse.leases`, at most ``lease_max_age_s``; None: its default)."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from cdc.views import VIEW_KEY
    from sinks import StoredRows
    from sinks.warehouse import leases

    path = paths.view_table(state_dir, subject.view.name)
    with leases.lease(path, leases.MAX_AGE_S if lease_max_age_s is None else lease_max_age_s):
        if not DeltaTable.is_deltatable(str(path)):
            return StoredRows(None, VERSION_COLUMN)
        table = DeltaTable(str(path)).to_pyarrow_table()
    keys = _driving_keys(subject, table.column(VIEW_KEY).to_pylist())
    for column, name in subject.hidden:
        table = table.append_column(name, keys[column])
    table = table.append_column(VERSION_COLUMN, pa.array([0] * table.num_rows, pa.int64()))
    return StoredRows(table, VERSION_COLUMN)


def stored_docs(state_dir: Path, subject: ViewSubject) -> list[tuple[tuple[Any, ...], dict[str, str]]]:
    """The view's search documents (``--search``): per document, the driving key (normalised
    values, in key order) and its indexed texts; empty without ``--search`` or before the index."""
    from cdc.views import VIEW_KEY
    from sinks.search.query import live_texts
    from sinks.view_search import view_search_reg

    if not subject.view.search:
        return []
    docs = live_texts(state_dir, view_search_reg(subject.view))
    inner = [orjson.loads(k).get(VIEW_KEY) for k in docs]
    keys = _driving_keys(subject, inner)
    columns = [keys[k].to_pylist() for k in subject.spec.driving.key]
    return [(tuple(c[i] for c in columns), texts) for i, texts in enumerate(docs.values())]
