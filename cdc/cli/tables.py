"""``cdc tables add|list|remove``: what is captured.

* ``add SCHEMA.TABLE [--key COL,...] [--search COL,...] [--exclude COL,...]`` describes the table at
  the source and registers it (snapshot state ``pending``: ``cdc run``/``cdc snapshot`` takes its
  snapshot). It refuses, with the reason and the fix, anything that would be captured wrongly or
  silently incompletely: a missing table, a view/materialized view/foreign table, a table whose key
  is not carried by its replica identity (no primary key and no ``--key``, or ``--key`` without
  REPLICA IDENTITY FULL / a covering replica identity index: wal2json would drop its UPDATEs and
  DELETEs), unknown key/search/exclude columns, an excluded key column, a role without SELECT on
  it, and a second registration of the same table or of the same topic.
  A partitioned table is registered as itself: the reader captures every leaf partition into its
  topic (``docs/snapshots.md``, "Partitioned tables").
* ``list`` shows the registrations (``--json``: one object per table, see :func:`table_json`).
* ``remove`` deletes a registration only: the topic, its events and the derived tables are kept.

Names follow Postgres' rules (:func:`cdc.names.parse_table_name`): ``'"Mixed Case"."tab le"'``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import psycopg

from cdc import paths
from cdc.catalog import TableDescription, capture_problems, describe_table
from cdc.cli import VERB_HELP
from cdc.cli.output import print_json, print_table
from cdc.codec.plugins import WAL2JSON, plugin_in_use
from cdc.config import Settings
from cdc.connect import connect
from cdc.errors import RegistryError
from cdc.events import int_to_lsn, topic_name
from cdc.names import parse_column_list, parse_table_name, quote_ident, quote_table_name, sql_ident
from cdc.publication import keep_publication, unpublished_columns
from cdc.recorders.nonfinite import When, ensure_nonfinite, remember, tracked_columns
from cdc.registry import Registry, State, TableReg, TableState, column_json
from snapshot.chunk_state import SnapshotOptions, load_progress, progress_view


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc tables add|list|remove`` to the ``cdc`` parser."""
    tables = sub.add_parser("tables", help=VERB_HELP["tables"])
    verbs = tables.add_subparsers(dest="tables_verb", metavar="add|list|remove")
    verbs.required = True

    add = verbs.add_parser("add", help="register a table for capture (snapshot pending)")
    add.add_argument("table", metavar="SCHEMA.TABLE", help='e.g. public.orders or \'"Mixed Case"."tab le"\'')
    add.add_argument("--key", help="key columns (default: the primary key), comma-separated")
    add.add_argument("--search", help="text columns for the search index, comma-separated")
    add.add_argument("--exclude", help="columns not to capture, comma-separated")
    add.add_argument("--json", action="store_true", help="print the registration as JSON")
    add.set_defaults(handler=add_table)

    lst = verbs.add_parser("list", help="list registered tables")
    lst.add_argument("--json", action="store_true", help="a JSON list of table objects")
    lst.set_defaults(handler=list_tables)

    rm = verbs.add_parser("remove", help="remove a registration (keeps the topic and derived tables)")
    rm.add_argument("table", metavar="SCHEMA.TABLE")
    rm.add_argument("--json", action="store_true")
    rm.set_defaults(handler=remove_table)


# --- add ---------------------------------------------------------------------------------------------
def _columns(text: str | None, flag: str, desc: TableDescription) -> tuple[str, ...]:
    if not text:
        return ()
    names = parse_column_list(text)
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise RegistryError(
            f"{flag} names {', '.join(dupes)} more than once",
            fix=f"name each column once in {flag}",
            flag=flag,
        )
    missing = [n for n in names if desc.column(n) is None]
    if missing:
        hints = []
        for n in missing:
            same = [c.name for c in desc.columns if c.name.lower() == n.lower()]
            if same:
                hints.append(f"{n!r} differs in case from {same[0]!r}: write it as {quote_ident(same[0])}")
        available = ", ".join(quote_ident(c.name) for c in desc.columns)
        raise RegistryError(
            f"{flag}: table {desc.schema}.{desc.table} has no column {', '.join(repr(n) for n in missing)}",
            fix="; ".join([*hints, f"its columns are: {available}"]),
            flag=flag,
            missing=missing,
        )
    return names


def validate_registration(
    desc: TableDescription,
    key_text: str | None,
    search_text: str | None,
    exclude_text: str | None,
    *,
    role: str,
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(key, search, exclude)`` for a registration of ``desc``, or the RegistryError that refuses it."""
    if not desc.is_capturable_kind:  # before the column flags: their errors would hide this one
        (problem,) = capture_problems(desc.schema, desc.table, desc, (), role=role)
        raise RegistryError(problem.message, fix=problem.fix, **problem.values)
    given_key = _columns(key_text, "--key", desc)
    search = _columns(search_text, "--search", desc)
    exclude = _columns(exclude_text, "--exclude", desc)
    key = given_key or desc.primary_key
    # the one rule (cdc.catalog.capture_problems); a missing privilege is told after the flags' errors
    problems = sorted(
        capture_problems(desc.schema, desc.table, desc, key, role=role), key=lambda p: p.kind == "privilege"
    )
    if problems and problems[0].kind != "privilege":
        raise RegistryError(problems[0].message, fix=problems[0].fix, **problems[0].values)
    excluded_keys = [c for c in exclude if c in key]
    if excluded_keys:
        raise RegistryError(
            f"--exclude names key column(s) {', '.join(excluded_keys)}; every event is keyed by them",
            fix="leave key columns out of --exclude",
            columns=excluded_keys,
        )
    excluded_search = [c for c in exclude if c in search]
    if excluded_search:
        raise RegistryError(
            f"--search and --exclude both name {', '.join(excluded_search)}",
            fix="a searched column must be captured: drop it from --exclude or from --search",
            columns=excluded_search,
        )
    for problem in problems:
        raise RegistryError(problem.message, fix=problem.fix, **problem.values)  # the role cannot read it
    return key, search, exclude


def key_warnings(desc: TableDescription, key: tuple[str, ...]) -> list[str]:
    """What ``add`` accepts but a person must see: a key the catalog does not guarantee unique."""
    if desc.is_unique_key(key):
        return []
    why = (
        "its unique indexes include nullable columns"
        if any(set(u) <= set(key) for u in desc.unique_keys)
        else "no unique index on (a subset of) them"
    )
    return [
        f"key ({', '.join(key)}) of {desc.schema}.{desc.table} is not guaranteed unique ({why}): rows sharing a "
        "key value overwrite each other in the topic and the derived tables; "
        f"to make it safe: CREATE UNIQUE INDEX ON {desc.sql_name} ({', '.join(sql_ident(c) for c in key)}) "
        "(its columns NOT NULL)"
    ]


def add_table(args: argparse.Namespace, settings: Settings) -> int:
    schema, table = parse_table_name(args.table)
    with connect(settings.require_source()) as conn:
        desc = describe_table(conn, schema, table)
        row = conn.execute("SELECT current_user::text").fetchone()
        role = str(row[0]) if row else "?"
        key, search, exclude = validate_registration(desc, args.key, args.search, args.exclude, role=role)
        reg = TableReg(
            schema=schema,
            table=table,
            topic=topic_name(settings.topic_prefix, schema, table),
            key=key,
            search=search,
            exclude=exclude,
            columns=desc.columns,
            snapshot_state="pending",
        )
        with Registry(settings.state_dir) as registry:
            clash = [
                r
                for r in registry.list_tables()
                if r.topic == reg.topic and (r.schema, r.table) != (schema, table)
            ]
            if clash:
                raise RegistryError(
                    f"topic {reg.topic} is already used by table {clash[0].qualified}; the two names differ only "
                    "in characters a topic name cannot hold",
                    fix="rename one of the tables, or remove the other registration first",
                    topic=reg.topic,
                )
            plugin = plugin_in_use(registry, settings)
            reg, left_out = _leave_out_unpublished(conn, reg) if plugin.uses_publication else (reg, [])
            if plugin.uses_publication:
                _publish(conn, settings, registry, [(schema, table)])
            registry.add(reg)
            wal2json_sends_them = registry.get_state(State.WAL2JSON_NUMERIC_AS_STRING) == "1"
            warnings = key_warnings(desc, key) + left_out
            recorder = None
            if (
                plugin.may_send_nonfinite_as_null  # pgoutput sends them itself
                and not wal2json_sends_them
                and settings.config.nonfinite_recorder
                and tracked_columns(reg)
            ):
                recorder, more = nonfinite_recorder(
                    conn, reg, registry, settings.config.nonfinite_recorder_when
                )  # the same connection
                warnings += more
    if args.json:
        print_json(
            {**table_json(reg, settings.state_dir), "warnings": warnings, "nonfinite_recorder": recorder}
        )
    else:
        if recorder == "installed":
            print(
                f"installed the non-finite recorder's trigger on {quote_table_name(schema, table)} "
                f"({', '.join(tracked_columns(reg))}: NaN/Infinity would reach the topic as null with "
                "wal2json < 2.6; docs/robustness.md)",
                file=sys.stderr,
            )
        for warning in warnings:
            print(f"warning: {warning}", file=sys.stderr)
        print(
            f"registered {quote_table_name(schema, table)} -> topic {reg.topic} "
            f"(key: {', '.join(key)}; ~{desc.estimated_rows} rows; snapshot pending: "
            "`cdc run` or `cdc snapshot` takes it)"
        )
    return 0


def _leave_out_unpublished(conn: psycopg.Connection[Any], reg: TableReg) -> tuple[TableReg, list[str]]:
    """pgoutput before PostgreSQL 18 never sends a stored generated column: it is left out of the
    capture (the snapshot's too, so both agree), with a warning; refused if it is a search column."""
    gen = [c for c in unpublished_columns(conn, reg.schema, reg.table) if c not in reg.exclude]
    if not gen:
        return reg, []
    if set(gen) & set(reg.search):
        raise RegistryError(
            f"{reg.qualified}: the search column(s) {sorted(set(gen) & set(reg.search))} are stored "
            "generated columns, which pgoutput sends only from PostgreSQL 18",
            fix=f"leave them out of --search, use {WAL2JSON.setting}, or upgrade the source to 18",
            table=reg.qualified,
        )
    warning = (
        f"{', '.join(gen)}: stored generated column(s), which pgoutput sends only from PostgreSQL 18, "
        "left out of the capture (as --exclude would); fix: compute them downstream, use "
        f"{WAL2JSON.setting}, or upgrade the source to 18 and add the table again"
    )
    return dataclasses.replace(reg, exclude=(*reg.exclude, *gen)), [warning]


def _publish(
    conn: psycopg.Connection[Any], settings: Settings, registry: Registry, also: list[tuple[str, str]]
) -> None:
    """Bring pgoutput's publication in step with the registered tables and ``also`` (the one being
    added) before the registration is written (:func:`cdc.publication.keep_publication`)."""
    watermark = SnapshotOptions.from_settings(settings).watermark
    keep_publication(conn, registry, settings, watermark, _warn, also)


def _warn(line: str) -> None:
    if line.startswith("warning:"):  # what changed is the reader's log, not the verb's output
        print(line, file=sys.stderr)


def nonfinite_recorder(
    conn: psycopg.Connection[Any], reg: TableReg, registry: Registry, when: When = "row"
) -> tuple[str | None, list[str]]:
    """Install the non-finite recorder's triggers on a table with float/numeric columns
    (:mod:`cdc.recorders.nonfinite`): what was done (None: nothing to do; ``ok``, ``installed``,
    ``failed``) and the warning, with the fix, when the role may not or a column stays uncovered
    (kept in the registry for ``cdc tables list``)."""
    outcomes = ensure_nonfinite(conn, [reg], when)
    remember(registry, outcomes)
    warnings = [
        f"with wal2json < 2.6 a NaN, Infinity or -Infinity in "
        f"{', '.join(o.uncovered or tracked_columns(o.reg))} reaches the topic as null unless the "
        f"non-finite recorder covers it: {state['reason']}; fix: {state['fix']}"
        for o in outcomes
        if (state := o.to_json()) is not None
    ]
    return (outcomes[0].action if outcomes else None), warnings


# --- list / remove -----------------------------------------------------------------------------------
def table_json(reg: TableReg, state_dir: Path, registry: Registry | None = None) -> dict[str, Any]:
    """The ``--json`` shape of one registration (``cdc tables list --json`` prints a list of these);
    ``snapshot.progress`` (only once a chunked snapshot ran): its progress
    (:func:`snapshot.chunk_state.progress_view`). Where each sink keeps the table:
    :meth:`sinks.Sink.listing` of every sink of :data:`sinks.all.SINKS`."""
    from sinks.all import SINKS  # deferred: the sinks import deltalake and tantivy

    align = reg.alignment
    out: dict[str, Any] = {
        "table": reg.qualified,
        "schema": reg.schema,
        "name": reg.table,
        "topic": reg.topic,
        "key": list(reg.key),
        "search": list(reg.search),
        "exclude": list(reg.exclude),
        "columns": [column_json(c) for c in reg.columns],
        "schema_version": reg.schema_version,
        "dropped_columns": list(reg.dropped_columns),
        "snapshot": {
            "state": reg.snapshot_state,
            "consistent_lsn": int_to_lsn(align.consistent_lsn) if align else None,
            "end_offsets": {str(p): o for p, o in sorted(align.end_offsets.items())} if align else None,
        },
    }
    for sink in SINKS:
        out.update(sink.listing(state_dir, reg))
    progress = progress_view(load_progress(registry, reg.schema, reg.table)) if registry else None
    if progress is not None:
        out["snapshot"]["progress"] = progress

    def state(entry: TableState) -> str | None:
        return registry.get_table_state(entry, reg.schema, reg.table) if registry else None

    missing = state(TableState.SOURCE_MISSING)
    if missing is not None:  # dropped or renamed at the source (noticed by `cdc run`)
        out["source_missing_since"] = int(missing)
        told = state(TableState.SOURCE_MISSING_DDL)
        if told is not None:  # what the DDL recorder said: {"what", "to", "tag"}
            out["source_missing_ddl"] = json.loads(told)
    refused = state(TableState.SCHEMA_REFUSED)
    if refused is not None:  # its key columns are gone at the source: not captured any more
        out["refused"] = json.loads(refused)
    recorder = state(TableState.NONFINITE_RECORDER)
    if recorder is not None:  # NaN/Infinity (some columns') reach the topic as null (wal2json < 2.6)
        out["nonfinite_recorder"] = json.loads(recorder)
    return out


def _told(row: dict[str, Any]) -> str:
    """``: renamed to public.t2`` / ``: dropped (DROP TABLE)`` when the DDL recorder said so."""
    told = row.get("source_missing_ddl")
    if not told:
        return ""
    return f": {told['what']}" + (f" to {told['to']}" if told.get("to") else f" ({told['tag']})")


def _open_existing(settings: Settings) -> Registry | None:
    """The registry if one exists (listing must not create a state directory)."""
    if not paths.registry_path(settings.state_dir).exists():
        return None
    return Registry(settings.state_dir)


def list_tables(args: argparse.Namespace, settings: Settings) -> int:
    registry = _open_existing(settings)
    regs: list[TableReg] = []
    rows: list[dict[str, Any]] = []
    decoder = plugin_in_use(None, settings)
    if registry is not None:
        with registry:
            regs = registry.list_tables()
            decoder = plugin_in_use(registry, settings)
            rows = [{**table_json(r, settings.state_dir, registry), "decoder": decoder.name} for r in regs]
    if args.json:
        print_json(rows)
        return 0
    if not regs:
        print(
            f"no tables registered (state: {settings.state_dir}); add one with `cdc tables add SCHEMA.TABLE`"
        )
        return 0
    print(f"decoder: {decoder.describe(settings.publication)}")
    print_table(
        None,
        ["table", "topic", "key", "search", "snapshot", "consistent LSN", "chunks"],
        [
            (
                quote_table_name(r.schema, r.table),
                r.topic,
                ", ".join(r.key),
                ", ".join(r.search),
                r.snapshot_state
                + (f" (MISSING at the source{_told(row)})" if "source_missing_since" in row else "")
                + (
                    f" (REFUSED: {row['refused']['reason']}; fix: {row['refused']['fix']})"
                    if "refused" in row
                    else ""
                )
                + (
                    f" (NaN recorder {row['nonfinite_recorder']['state']})"
                    if "nonfinite_recorder" in row
                    else ""
                ),
                int_to_lsn(r.alignment.consistent_lsn) if r.alignment else "",
                _chunks_text(row["snapshot"].get("progress")),
            )
            for r, row in zip(regs, rows, strict=True)
        ],
    )
    return 0


def _chunks_text(p: dict[str, Any] | None) -> str:
    """``12 done, 30 left, 41,000 rows/s, ETA 31 s`` (a chunked snapshot's progress), or ""."""
    if p is None:
        return ""
    if p["done"]:
        return f"{p['chunks_done']} done"
    eta = f", ETA {p['eta_s']:.0f} s" if p["eta_s"] is not None else ""
    return f"{p['chunks_done']} done, {p['chunks_left']} left, {p['rate']:,.0f} rows/s{eta}"


def remove_table(args: argparse.Namespace, settings: Settings) -> int:
    """Delete the registration. The topic (and its events) and the warehouse/search tables stay."""
    registry = _open_existing(settings)
    if registry is None:
        schema, table = parse_table_name(args.table)
        raise RegistryError(
            f"table {schema}.{table} is not registered (no registry in {settings.state_dir})",
            fix="check --state / CDC_STATE; `cdc tables list` shows what is registered",
        )
    with registry:
        found = registry.find(args.table)
        readers = [v.name for v in registry.list_views() if found.qualified in v.tables]
        if readers:
            raise RegistryError(
                f"table {found.qualified} is read by view(s) {', '.join(readers)}",
                fix=f"remove them first (`cdc views remove {readers[0]}`)",
                views=readers,
            )
        reg = registry.remove(found.schema, found.table)
        if plugin_in_use(registry, settings).uses_publication:
            with connect(settings.require_source()) as conn:
                _publish(conn, settings, registry, [])
    if args.json:
        print_json({"removed": table_json(reg, settings.state_dir), "topic_kept": True})
    else:
        print(
            f"removed the registration of {quote_table_name(reg.schema, reg.table)}; its topic {reg.topic} "
            "and derived tables are kept (delete them yourself if no longer needed)"
        )
    return 0
