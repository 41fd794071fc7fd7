"""Views from joins, maintained by recomputing the rows a micro-batch affects (``docs/views.md``).

After a micro-batch's base-table writes are committed, :class:`ViewMaintainer` brings every
registered view (:mod:`cdc.views`) up to date in one Delta commit per view:

1. **Affected keys.** The view has at most one row per row of its driving (``FROM``) table, keyed
   by that row's ``_cdc_key``. A view row can change only if its driving row changed, or if the row
   it meets in a joined table (found along the joins, from the driving row) was inserted, updated or
   deleted. So the affected keys are the batch's keys of the driving table, plus, per joined table
   with changes, the driving rows whose join columns (along the chain of joins, each taken as LEFT,
   without the WHERE: a row that did not match before may match now) equal a changed key of it. A
   key change is a delete of the old key and an insert of the new one: both are changed keys.
2. **Recompute.** The view's query runs (DuckDB, over the base tables' current Delta tables, which
   already hold this batch) for the affected keys only.
3. **Write.** One MERGE on ``_cdc_key``: recomputed rows replace or insert; an affected key whose
   recompute found no row (deleted, or filtered out, or an inner join that no longer meets) deletes
   the view's row. The commit carries the batch's application transaction ``(app_id, batch_id)``.

Why this is exactly once, and safe out of order: a view row is a function of the committed base
state only, never of the events themselves. A replay of a batch the view already committed is
skipped by its application transaction; a replay after the base tables committed but before the
view did recomputes the same keys from the same committed state; and events that reached the base
tables out of order were version-guarded there, so the view sees only what the base tables hold. A
view whose table does not exist yet (just registered, over tables that may hold data) or one of
whose tables was truncated in the batch is computed whole from the current state.

The reference lookup reads the driving table's key and join columns (a scan, pruned to those
columns) whenever a joined table changed: the view's own table cannot serve as the foreign-key index,
since an inner join or a filter leaves out driving rows that a later change of a joined row brings in.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from cdc import paths
from cdc.errors import ApplyError, ConfigError
from cdc.names import sql_ident as _q
from cdc.registry import TableReg, ViewReg
from cdc.views import CHANGED, VIEW_KEY, ViewSpec, spec_of
from sinks import ChangeBatch, Touched, touched_of
from sinks import types as T
from sinks.search import SearchSink
from sinks.view_search import index_view
from sinks.warehouse import duck, handles, leases, reclaim
from sinks.warehouse.delta import arrow_schema, not_applied
from sinks.warehouse.layout import KEY, WarehouseOptions, table_paths
from sinks.warehouse.view_history import key_markers, write_history

_DELETE = "__cdc_delete"  # merge-source-only column: the affected key has no row any more
_AFFECTED = "__cdc_affected"  # the registered table of the affected keys a recompute reads


@dataclass
class ViewOutcome:
    """What one view's maintenance did in a batch: ``keys`` recomputed (-1: the whole view),
    ``rows`` found for them, ``seconds`` spent; ``skipped``: the batch was already committed."""

    keys: int = 0
    rows: int = 0
    seconds: float = 0.0
    skipped: bool = False
    refused: bool = False  # the view no longer parses against the registered tables
    #: the keys recomputed (empty: none); None when the whole view was, or the batch was skipped
    affected: set[str] | None = None
    indexed: int = 0  # events handed to the view's search index


class ViewMaintainer:
    """Keeps the registered views in step with the base tables (see the module docstring).

    ``registry()``: the registered views and tables, asked once per batch. Call :meth:`maintain`
    after every sink committed the batch (:class:`spark_jobs.applier.BatchApplier` does), with the
    batch's :class:`~sinks.ChangeBatch` per table, under the batch's id. ``disk``: the warehouse's
    options, whose disk bound (``vacuum_garbage_ratio`` after every batch, the full vacuum every
    ``vacuum_every`` batches) the views' Delta tables then keep too (:meth:`bound_disk`).
    """

    def __init__(
        self,
        state_dir: Path,
        registry: Callable[[], tuple[list[ViewReg], list[TableReg]]],
        app_id: str,
        refused: Callable[[str, dict[str, Any] | None], None] | None = None,
        search: SearchSink | None = None,
        disk: WarehouseOptions | None = None,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.disk = disk
        self.registry = registry
        self.app_id = app_id
        #: records (``{"reason", "fix"}``) or clears (None) why a view cannot be maintained now
        self.refused = refused
        #: the views' search indexes (``--search``, :mod:`sinks.view_search`); None: not indexed
        self.search = search
        #: one DuckDB connection per thread that maintains views, kept from batch to batch (opening
        #: one costs about 20 ms of CPU and 80 ms of wall; each view's tables are registered in it
        #: for its maintenance only: :func:`_tables_in`)
        self._local = threading.local()
        self._connections: list[duckdb.DuckDBPyConnection] = []
        self._lock = threading.Lock()

    def close(self) -> None:
        if self.search is not None:
            self.search.close()
        with self._lock:
            connections, self._connections = self._connections, []
        for con in connections:
            con.close()
        self._local = threading.local()

    @contextlib.contextmanager
    def _duck(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """This thread's DuckDB connection; one that a failure left behind is closed, not reused."""
        con: duckdb.DuckDBPyConnection | None = getattr(self._local, "con", None)
        if con is None:
            con = duck.connect()
            with self._lock:
                self._connections.append(con)
            self._local.con = con
        try:
            yield con
        except BaseException:
            self._local.con = None
            with self._lock:
                if con in self._connections:
                    self._connections.remove(con)
            con.close()
            raise

    def maintain(self, batches: Sequence[ChangeBatch], batch_id: int) -> dict[str, ViewOutcome]:
        """Every registered view brought up to date with the committed state of batch ``batch_id``.

        A view that no longer parses against the registered tables (a column it reads dropped at the
        source), or whose rows no longer fit its table (a type changed at the source), is refused -- recorded with the reason and the fix for ``cdc views list``, left at
        its last state -- and the other views and tables go on; once it parses again it is computed
        whole (the changes it missed are in the tables' current state)."""
        return self._each(touched_of(batches), batch_id)

    def maintain_touched(self, touched: Mapping[str, Touched], batch_id: int) -> dict[str, ViewOutcome]:
        """:meth:`maintain` from what the batch changed (the work in Spark tasks: the tasks hand the
        driver their slices' :class:`~sinks.Touched`, never the events)."""
        return self._each(touched, batch_id)

    def rebuild(self, batch_id: int) -> dict[str, ViewOutcome]:
        """Every registered view computed whole from the committed state of batch ``batch_id``
        (costs a full read of each view's tables)."""
        return self._each(None, batch_id)

    def _each(self, touched: Mapping[str, Touched] | None, batch_id: int) -> dict[str, ViewOutcome]:
        views, tables = self.registry()
        out: dict[str, ViewOutcome] = {}
        for view in views:
            was_refused = "refused" in view.extra
            try:
                spec = spec_of(view, tables)
            except ConfigError as exc:
                if not was_refused and self.refused is not None:
                    self.refused(view.name, {"reason": exc.message, "fix": exc.fix})
                out[view.name] = ViewOutcome(refused=True)
                continue
            whole = touched is None or was_refused
            opened: dict[Path, DeltaTable] = {}
            try:
                with self._duck() as con:
                    out[view.name] = maintain_view(
                        self.state_dir,
                        spec,
                        None if whole else touched,
                        batch_id,
                        self.app_id,
                        history=bool(view.extra.get("history")),
                        con=con,
                        opened=opened,
                    )
            except ApplyError as exc:  # its rows do not fit its table (a type changed at the source)
                if not was_refused and self.refused is not None:
                    self.refused(view.name, {"reason": exc.message, "fix": exc.fix})
                out[view.name] = ViewOutcome(refused=True)
                continue
            if view.search and self.search is not None:
                done = out[view.name]
                done.indexed = index_view(
                    self.search,
                    self.state_dir,
                    view,
                    done.affected,
                    batch_id,
                    self.app_id,
                    table=opened.get(paths.view_table(self.state_dir, view.name)),
                )
            if was_refused and self.refused is not None:
                self.refused(view.name, None)
            if not out[view.name].skipped:
                self.bound_disk(view.name, batch_id, opened)
        return out

    def bound_disk(
        self, name: str, batch_id: int, opened: Mapping[Path, DeltaTable] | None = None
    ) -> reclaim.Reclaimed:
        """The view's Delta tables (current, history) kept as the warehouse's are (``disk``; nothing
        without it): superseded files past ``vacuum_garbage_ratio`` times the live size deleted but
        for those a live reader lease holds, the window's (``vacuum_min_retention_s``) only as far as
        the ratio needs (:func:`.reclaim.within_ratio`), and every ``vacuum_every`` batches the full
        vacuum (files of a killed merge, after ``vacuum_retention_hours``). Never touches a file a
        cdc reader holds or a write in flight (a ``cdc views add`` building the view). Returns what
        it did. ``opened``: Delta tables of these paths this batch opened already (brought to their
        latest version, not opened again)."""
        if self.disk is None:
            return reclaim.Reclaimed()
        tables = (paths.view_table(self.state_dir, name), paths.view_history(self.state_dir, name))
        reuse = dict(opened or {})

        def open_table(path: Path) -> DeltaTable | None:
            held = reuse.get(path)
            if held is None:
                return handles.open_table(path)
            return handles.refresh(held)

        return reclaim.after_batch(tables, self.disk, batch_id, open_table=open_table)


def maintain_view(
    state_dir: Path,
    spec: ViewSpec,
    changed: Mapping[str, Touched] | None,
    batch_id: int,
    app_id: str,
    *,
    history: bool = False,
    con: duckdb.DuckDBPyConnection | None = None,
    opened: dict[Path, DeltaTable] | None = None,
) -> ViewOutcome:
    """One view after batch ``batch_id`` (see the module docstring); ``changed`` (per table, what
    the batch changed) None: computed whole. ``history``: its history table too, written first
    (:mod:`sinks.warehouse.view_history`). ``con``: the DuckDB connection to compute in (its
    tables registered for this call only; None: a connection of its own). ``opened``: receives the
    view's Delta table as this call opened and merged it, for the batch's later steps."""
    started = time.monotonic()
    path = paths.view_table(state_dir, spec.name)
    table = DeltaTable(str(path)) if DeltaTable.is_deltatable(str(path)) else None
    if table is not None and opened is not None:
        opened[path] = table
    if table is not None and not not_applied(table, app_id, batch_id):
        return ViewOutcome(skipped=True)
    names = {t.qualified for t in spec.tables}
    touched = {n: t for n, t in (changed or {}).items() if n in names and (t.key_jsons or t.truncated)}
    whole = table is None or changed is None or any(t.truncated for t in touched.values())
    if not whole and not touched:
        return ViewOutcome(affected=set())
    props = CommitProperties(app_transactions=[Transaction(app_id, version=batch_id)])
    with _tables_in(con, state_dir, spec) as db:  # the apply's: no lease
        if whole:
            rows = db.sql(spec.select_sql).to_arrow_table()
            if table is not None:
                rows = _conform(rows, table, spec)
            if history:
                before = table.to_pyarrow_table() if table is not None else None
                write_history(state_dir, spec.name, before, rows, None, props, (app_id, batch_id))
            paths.ensure_private_dir(path.parent)
            write_deltalake(str(path), rows, mode="overwrite", commit_properties=props)
            return ViewOutcome(-1, rows.num_rows, time.monotonic() - started)
        assert table is not None
        keys = _affected(db, spec, touched)
        if not keys:
            return ViewOutcome(seconds=time.monotonic() - started, affected=set())
        db.register(_AFFECTED, pa.table({"k": pa.array(sorted(keys), pa.string())}))
        rows = db.sql(
            f"SELECT * FROM ({spec.select_sql}) AS __v WHERE __v.{_q(VIEW_KEY)} IN (SELECT k FROM {_AFFECTED})"
        ).to_arrow_table()
        rows = _conform(rows, table, spec)
        if history:
            before = _rows_of(table, keys)
            write_history(state_dir, spec.name, before, rows, keys, props, (app_id, batch_id))
        _merge(table, rows, keys, props)
        return ViewOutcome(len(keys), rows.num_rows, time.monotonic() - started, affected=keys)


@contextlib.contextmanager
def _tables_in(
    con: duckdb.DuckDBPyConnection | None, state_dir: Path, spec: ViewSpec, lease_s: float | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """``con`` (None: a connection of its own, closed after) with the view's tables
    (:func:`_connect`) for the block; after it, ``con`` holds none of what it was given for the
    view: its tables' views and registered data, the keys :func:`_affected` and
    :func:`maintain_view` registered."""
    if con is None:
        own = duck.connect()
        try:
            yield _connect(state_dir, spec, own, lease_s)
        finally:
            own.close()
        return
    try:
        yield _connect(state_dir, spec, con, lease_s)
    finally:
        for i, reg in enumerate(spec.tables):
            con.execute(f"DROP VIEW IF EXISTS {_q(reg.schema)}.{_q(reg.table)}")
            con.unregister(f"__cdc_t{i}")
        for i in range(len(spec.joins)):
            con.unregister(f"{CHANGED}_{i}")
        con.unregister(_AFFECTED)


def _connect(
    state_dir: Path, spec: ViewSpec, con: duckdb.DuckDBPyConnection, lease_s: float | None
) -> duckdb.DuckDBPyConnection:
    """``con`` with each of the view's tables as ``"schema"."table"``: ``_cdc_key`` and the columns
    the view reads (:attr:`ViewSpec.used`) of its current Delta table as of now (empty before its
    first batch). Each table is read under a lease of at most ``lease_s`` (:mod:`.leases`) -- by
    another process than the apply (``cdc views add``, ``cdc rebuild``); None: none, the apply's
    own read within its batch (its reclaim runs in the same process, after the batch commits).

    The tables are read into Arrow (string views as strings), not scanned as datasets: DuckDB pushes
    its filters into a dataset scan, where pyarrow fails to compare a string literal with the string
    views delta-rs writes ("no kernel matching input types (string, string_view)")."""
    for i, reg in enumerate(spec.tables):
        current = table_paths(state_dir, reg)[0]
        used = spec.used.get(reg.qualified, ())
        types = {c.name: c.type for c in reg.columns}
        empty = pa.schema([(KEY, pa.string()), *((n, T.arrow_type(types.get(n, "text"))) for n in used)])
        with leases.lease(current, lease_s) if lease_s is not None else contextlib.nullcontext():
            data = _used_columns(current, empty)
        con.register(f"__cdc_t{i}", data)
        con.execute(f"CREATE SCHEMA IF NOT EXISTS {_q(reg.schema)}")
        con.execute(f"CREATE OR REPLACE VIEW {_q(reg.schema)}.{_q(reg.table)} AS SELECT * FROM __cdc_t{i}")
    return con


def _used_columns(current: Path, empty: pa.Schema) -> pa.Table:
    """The columns of ``empty`` of the current Delta table at ``current`` (none: no rows), string
    views as strings; a column the table does not hold yet (added at the source): null."""
    if not DeltaTable.is_deltatable(str(current)):
        return empty.empty_table()
    dataset = DeltaTable(str(current)).to_pyarrow_dataset()
    stored = [n for n in empty.names if n in dataset.schema.names]
    data = dataset.to_table(columns=stored)
    data = data.cast(T.plain_types(data.schema))
    for f in empty:
        if f.name not in stored:
            data = data.append_column(f, pa.nulls(data.num_rows, f.type))
    return data


def _affected(con: duckdb.DuckDBPyConnection, spec: ViewSpec, touched: Mapping[str, Touched]) -> set[str]:
    """The driving keys whose view row may have changed (see the module docstring, 1.)."""
    keys: set[str] = set()
    driving = touched.get(spec.driving.qualified)
    if driving is not None:
        keys.update(driving.key_jsons)
    for i, j in enumerate(spec.joins):
        changed_keys = touched.get(j.reg.qualified)
        if changed_keys is None:
            continue
        parsed = [orjson.loads(k) for k in set(changed_keys.key_jsons)]
        types = {c.name: c.type for c in j.reg.columns}
        changed = pa.table(
            {
                f"k{n}": T.to_array([key[k] for key in parsed], types.get(k))
                for n, (_, k) in enumerate(j.pairs)
            }
        )
        con.register(f"{CHANGED}_{i}", changed)
        found = con.sql(spec.refs_sql[i]).to_arrow_table().column("k").to_pylist()
        keys.update(str(k) for k in found)
    return keys


def _conform(rows: pa.Table, table: DeltaTable, spec: ViewSpec) -> pa.Table:
    """``rows`` in the view table's stored schema (a type changed at the source: ApplyError)."""
    schema = arrow_schema(table)
    if rows.schema.names != schema.names:
        raise ApplyError(
            f"view {spec.name} computes columns {rows.schema.names}, its table holds {schema.names}",
            fix=f"remove the view (`cdc views remove {spec.name}`) and add it again",
            view=spec.name,
        )
    try:
        return rows.cast(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise ApplyError(
            f"view {spec.name}: the computed rows ({rows.schema}) do not fit its table ({schema}): {exc}",
            fix=f"a column's type changed at the source: `cdc views remove {spec.name}` and add it again",
            view=spec.name,
        ) from exc


def _rows_of(table: DeltaTable, keys: set[str]) -> pa.Table:
    """The view table's rows of ``keys``."""
    rows = table.to_pyarrow_table()
    column = rows.column(VIEW_KEY).cast(pa.string())
    return rows.filter(pc.is_in(column, value_set=pa.array(sorted(keys), pa.string())))


def _merge(table: DeltaTable, rows: pa.Table, keys: set[str], props: CommitProperties) -> None:
    """One MERGE on ``_cdc_key``: ``rows`` replace or insert; the other ``keys`` delete their row."""
    found = set(rows.column(VIEW_KEY).to_pylist())
    gone = sorted(keys - found)
    source = rows.append_column(_DELETE, pa.array([False] * rows.num_rows, pa.bool_()))
    if gone:
        markers = key_markers(gone, rows.schema)
        markers[_DELETE] = pa.array([True] * len(gone), pa.bool_())
        source = pa.concat_tables([source, pa.table(markers, schema=source.schema)])
    cols = {c: f"s.{_q(c)}" for c in rows.column_names}
    (
        table.merge(
            source,
            f"t.{_q(VIEW_KEY)} = s.{_q(VIEW_KEY)}",
            source_alias="s",
            target_alias="t",
            streamed_exec=False,
            commit_properties=props,
        )
        .when_matched_delete(predicate=f"s.{_q(_DELETE)}")
        .when_matched_update(cols, predicate=f"NOT s.{_q(_DELETE)}")
        .when_not_matched_insert(cols, predicate=f"NOT s.{_q(_DELETE)}")
        .execute()
    )


def build_view(
    state_dir: Path, spec: ViewSpec, *, history: bool = False, lease_s: float = leases.MAX_AGE_S
) -> int | None:
    """The view computed whole from its tables' committed current state and created, at ``cdc
    views add`` (``docs/views.md``, "Built at add"): its history first (``history``), then its
    current table, each created only if absent, with no application transaction (the apply's next
    batch maintains it). Never over what a running apply created meanwhile: the apply builds a view
    it finds without a table from a state at least as new, so its build wins. Returns the rows,
    or None when the view had a table (the apply built it first). Its reads hold leases of at most
    ``lease_s`` (:mod:`.leases`): the base tables' while it reads them, the history's while it
    writes it (it reads the open rows of a history a build stopped before the view's table)."""
    path = paths.view_table(state_dir, spec.name)
    if DeltaTable.is_deltatable(str(path)):
        return None
    with _tables_in(None, state_dir, spec, lease_s) as con:
        rows = con.sql(spec.select_sql).to_arrow_table()
    paths.ensure_private_dir(path.parent)
    with leases.lease(paths.view_history(state_dir, spec.name), lease_s):
        return _create(path, rows, state_dir, spec, history)


def _create(path: Path, rows: pa.Table, state_dir: Path, spec: ViewSpec, history: bool) -> int | None:
    """:func:`build_view`'s commits: the history first (``history``), then the view's table, each
    only if absent; None when one was created meanwhile."""
    from deltalake.exceptions import DeltaError

    steps: list[tuple[Path, Callable[[], object]]] = [
        (path, lambda: write_deltalake(str(path), rows, mode="error")),
    ]
    if history:
        hist = paths.view_history(state_dir, spec.name)
        build = CommitProperties()
        steps.insert(
            0,
            (hist, lambda: write_history(state_dir, spec.name, None, rows, None, build, None, mode="error")),
        )
    for target, write in steps:
        try:
            write()
        except DeltaError:  # created meanwhile (it exists, or a concurrent commit of its version 0)
            if DeltaTable.is_deltatable(str(target)):
                return None
            raise
    return int(rows.num_rows)


def view_rows(state_dir: Path, name: str) -> pa.Table | None:
    """The view's current table (its ``_cdc_`` columns included), None before its first build."""
    path = paths.view_table(state_dir, name)
    if not DeltaTable.is_deltatable(str(path)):
        return None
    return DeltaTable(str(path)).to_pyarrow_table()


def view_copy(state_dir: Path, spec: ViewSpec, dest: Path, lease_s: float = leases.MAX_AGE_S) -> int:
    """The view computed whole from ``state_dir``'s current tables into a new Delta table at ``dest``
    (in the stored schema of the view's live table, when it has one), the live one untouched: what
    ``cdc rebuild VIEW`` swaps in once it verified (:mod:`cdc.cli.rebuild.staged`). The base tables are read
    under leases of at most ``lease_s`` (:mod:`.leases`). Returns its rows."""
    live = paths.view_table(state_dir, spec.name)
    table = DeltaTable(str(live)) if DeltaTable.is_deltatable(str(live)) else None
    with _tables_in(None, state_dir, spec, lease_s) as con:
        rows = con.sql(spec.select_sql).to_arrow_table()
    if table is not None:
        rows = _conform(rows, table, spec)
    paths.ensure_private_dir(dest.parent)
    write_deltalake(str(dest), rows, mode="overwrite")
    return int(rows.num_rows)
