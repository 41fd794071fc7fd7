"""``cdc views add|list|remove``: views from joins of registered tables (``docs/views.md``).

* ``add NAME --sql "SELECT ... FROM a JOIN b ON a.fk = b.pk ..." [--search COLS]`` parses the SQL
  (:func:`cdc.views.parse_view`) against the registered tables and registers the view; anything the
  apply cannot maintain is refused with what is supported. ``--search``: view columns the apply
  indexes (tantivy, :mod:`sinks.view_search`) for ``cdc search NAME``; ``--history``: its history
  (SCD2) too. The view is built at once from the tables' committed current state, without pausing a
  running apply (:func:`build_at_add`), which then keeps it up to date.
* ``list`` shows the views (``--json``: one object per view, with its Delta table's path).
* ``remove NAME`` deletes the registration, the view's Delta table and its search index (derived
  data); its history, which cannot be derived again, is kept.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from cdc import paths
from cdc.cli import VERB_HELP
from cdc.cli.output import print_json, print_table
from cdc.config import Settings
from cdc.errors import ConfigError, LockedError, RegistryError
from cdc.locks import ProcessLock
from cdc.names import parse_column_list
from cdc.registry import Registry, TableReg, ViewReg
from cdc.views import ViewSpec, check_name, parse_view, spec_of


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc views add|list|remove`` to the ``cdc`` parser."""
    views = sub.add_parser("views", help=VERB_HELP["views"])
    verbs = views.add_subparsers(dest="views_verb", metavar="add|list|remove")
    verbs.required = True

    add = verbs.add_parser("add", help="register a view and build it from its tables' current state")
    add.add_argument("name", metavar="NAME", help="lower case letters, digits and _")
    add.add_argument("--sql", required=True, help='"SELECT ... FROM a JOIN b ON a.fk = b.pk ... [WHERE ...]"')
    add.add_argument(
        "--search", help="view columns for its search index (`cdc search NAME`), comma-separated"
    )
    add.add_argument(
        "--history",
        action="store_true",
        help="also keep its history (SCD2): a Delta table of every version of each view row",
    )
    add.add_argument("--json", action="store_true", help="print the registration as JSON")
    add.set_defaults(handler=add_view)

    lst = verbs.add_parser("list", help="list registered views")
    lst.add_argument("--json", action="store_true", help="a JSON list of view objects")
    lst.set_defaults(handler=list_views)

    rm = verbs.add_parser("remove", help="remove a view and its Delta table")
    rm.add_argument("name", metavar="NAME")
    rm.add_argument("--json", action="store_true")
    rm.set_defaults(handler=remove_view)


def view_json(view: ViewReg, state_dir: Path, columns: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The ``--json`` shape of one view; ``warehouse.current``: its Delta table (``built``: whether
    the apply has written it yet); ``columns`` (when given): its columns, null if it no longer parses."""
    current = paths.view_table(state_dir, view.name)
    history = str(paths.view_history(state_dir, view.name)) if view.extra.get("history") else None
    out: dict[str, Any] = {
        "name": view.name,
        "sql": view.sql,
        "tables": list(view.tables),
        "search": list(view.search),
        "warehouse": {
            "current": str(current),
            "history": history,
            "built": (current / "_delta_log").is_dir(),
        },
        "search_index": str(paths.search_index(state_dir, f"_views.{view.name}")) if view.search else None,
        #: why the apply cannot maintain it now ({"reason", "fix"}), else None
        "refused": view.extra.get("refused"),
    }
    out["columns"] = None if columns is None else list(columns)
    return out


def add_view(args: argparse.Namespace, settings: Settings) -> int:
    check_name(args.name)
    with Registry(settings.state_dir) as registry:
        spec = parse_view(args.name, args.sql, registry.list_tables())
        search = parse_column_list(args.search) if args.search else ()
        unknown = [c for c in search if c not in spec.columns]
        if unknown:
            raise ConfigError(
                f"--search names {', '.join(unknown)}, which the view does not have",
                fix=f"the view's columns: {', '.join(spec.columns)}",
                columns=unknown,
            )
        if any(v.name == args.name for v in registry.list_views()):  # before its tables' paths: they exist
            raise RegistryError(
                f"view {args.name} is already registered",
                fix=f"remove it first (`cdc views remove {args.name}`), or choose another name",
                view=args.name,
            )
        wanted = [paths.view_table(settings.state_dir, args.name)]
        if args.history:
            wanted.append(paths.view_history(settings.state_dir, args.name))
        for path in wanted:
            if path.exists():
                raise RegistryError(
                    f"{path} exists (a view of that name was removed without it, or a copy)",
                    fix=f"move it aside (mv {path} {path}.old) or choose another name",
                    path=str(path),
                )
        extra = {"history": True} if args.history else {}
        view = registry.add_view(
            ViewReg(args.name, args.sql, tuple(t.qualified for t in spec.tables), search, extra)
        )
    built = build_at_add(settings, view, spec)
    if args.json:
        print_json(view_json(view, settings.state_dir, spec.columns) | {"build": built})
    else:
        print(
            f"registered view {view.name} ({', '.join(spec.columns)}) over {', '.join(view.tables)}; "
            f"{built['note']}; query it with "
            f'`cdc sql "SELECT * FROM {view.name}"`'
        )
    return 0


BUILD_APP = "cdc-views-add"  # the search index's record of the build at add (never the apply's)


def build_at_add(settings: Settings, view: ViewReg, spec: ViewSpec) -> dict[str, Any]:
    """The view built from its tables' committed current state right after its registration
    (``docs/views.md``, "Built at add"), the running apply not paused: its Delta tables (current, and
    history with ``--history``) are created only if the apply has not created them meanwhile
    (:func:`sinks.warehouse.views.build_view`). The search index is built here only when no apply
    runs (its ``apply`` lock is free, and held meanwhile): a running apply holds the index's writer,
    and builds the index whole at its next micro-batch. Returns ``rows`` (None: the apply built it
    first), ``index`` (built here or not) and a ``note`` for people."""
    from sinks.warehouse import WarehouseOptions
    from sinks.warehouse.views import build_view

    lease_s = WarehouseOptions.from_settings(settings).lease_max_age_s
    history = bool(view.extra.get("history"))
    lock = ProcessLock(settings.state_dir, "apply", command="cdc views add")
    try:
        lock.acquire()
    except LockedError:
        rows = build_view(settings.state_dir, spec, history=history, lease_s=lease_s)
        later = "; its search index at the apply's next micro-batch" if view.search else ""
        note = "the running apply built it first" if rows is None else f"built ({rows} rows){later}"
        return {"rows": rows, "index": False, "note": note}
    try:
        rows = build_view(settings.state_dir, spec, history=history, lease_s=lease_s)
        if view.search:
            from sinks.search import SearchSink
            from sinks.view_search import index_view

            sink = SearchSink.from_settings(settings)
            try:
                index_view(sink, settings.state_dir, view, None, 0, BUILD_APP, lease_s)
            finally:
                sink.close()
    finally:
        lock.release()
    return {"rows": rows, "index": bool(view.search), "note": f"built ({rows} rows)"}


def list_views(args: argparse.Namespace, settings: Settings) -> int:
    views: list[ViewReg] = []
    tables: list[TableReg] = []
    if paths.registry_path(settings.state_dir).exists():
        with Registry(settings.state_dir) as registry:
            views, tables = registry.list_views(), registry.list_tables()
    rows = [view_json(v, settings.state_dir, _columns(v, tables)) for v in views]
    if args.json:
        print_json(rows)
        return 0
    if not views:
        print(
            f'no views registered (state: {settings.state_dir}); add one with `cdc views add NAME --sql "..."`'
        )
        return 0
    print_table(
        None,
        ["view", "tables", "built", "sql"],
        [
            (
                v.name,
                ", ".join(v.tables),
                ("yes" if row["warehouse"]["built"] else "at the next batch")
                + (
                    f" (REFUSED: {row['refused']['reason']}; fix: {row['refused']['fix']})"
                    if row["refused"]
                    else ""
                ),
                v.sql,
            )
            for v, row in zip(views, rows, strict=True)
        ],
    )
    return 0


def _columns(view: ViewReg, tables: list[TableReg]) -> tuple[str, ...] | None:
    """The view's columns as it parses today; None when it does not (``refused`` says why once the
    apply tried)."""
    try:
        return spec_of(view, tables).columns
    except ConfigError:
        return None


def remove_view(args: argparse.Namespace, settings: Settings) -> int:
    if not paths.registry_path(settings.state_dir).exists():
        raise RegistryError(
            f"view {args.name} is not registered (no registry in {settings.state_dir})",
            fix="check --state / CDC_STATE; `cdc views list` shows what is registered",
        )
    with Registry(settings.state_dir) as registry:
        view = registry.remove_view(args.name)
    current = paths.view_table(settings.state_dir, view.name)
    shutil.rmtree(current, ignore_errors=True)
    topic = f"_views.{view.name}"  # its search index (sinks.view_search.view_search_reg)
    shutil.rmtree(paths.search_index(settings.state_dir, topic), ignore_errors=True)
    paths.search_versions(settings.state_dir, topic).unlink(missing_ok=True)
    history = paths.view_history(settings.state_dir, view.name)
    kept = f"; its history is kept at {history} (delete it yourself)" if history.exists() else ""
    if args.json:
        print_json({"removed": view_json(view, settings.state_dir)})
    else:
        print(f"removed view {view.name} and its Delta table {current}{kept}")
    return 0
