"""The registry: which tables are captured, and how. The one truth of what is captured.

Stored in the state directory (``<state>/registry.db``, SQLite in WAL mode, safe for the CLI, the
reader and the Spark job to open at the same time). The reader polls :meth:`Registry.generation`
to notice a registration change and applies it without losing or repeating a committed change.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import orjson

from cdc import paths
from cdc.errors import RegistryError
from cdc.names import cli_table_name, parse_table_name


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str  # Postgres' format_type(), e.g. "numeric(38,9)", "timestamp with time zone", "integer[]"
    nullable: bool = True
    #: the type's name at the source when it is a domain (or an array of one), as format_type() and
    #: wal2json name it (``year``, ``year[]``); ``type`` is then its base type, resolved through
    #: domains over domains (``integer``, ``integer[]``). wal2json sends a domain's values as text.
    domain: str = ""


@dataclass(frozen=True, slots=True)
class Alignment:
    """Where a table's snapshot meets the stream (docs/architecture.md, "Snapshot alignment")."""

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
    def schema_version(self) -> int:
        """The version of the table's registered columns (``extra["schema_version"]``, 1 at
        registration): :meth:`Registry.set_columns` bumps it whenever the columns change. Events
        carry it as ``source.schema_version`` (docs/schema-changes.md)."""
        return int(self.extra.get("schema_version", 1))

    @property
    def dropped_columns(self) -> tuple[str, ...]:
        """Columns dropped at the source since registration (``extra["dropped_columns"]``): the
        warehouse keeps them, null from then on (docs/schema-changes.md)."""
        return tuple(self.extra.get("dropped_columns", ()))

    def search_field(self, column: str) -> str:
        """The search index's field of a search column: the column's name, or for a column renamed
        at the source since the index was built, the name it had then (``extra["search_fields"]``)."""
        return str(self.extra.get("search_fields", {}).get(column, column))

    @property
    def qualified(self) -> str:
        """``schema.table`` as people write it (unquoted), used as the table's name in the CLI."""
        return f"{self.schema}.{self.table}"


@dataclass(frozen=True, slots=True)
class ViewReg:
    """One registered view (``cdc views add``, :mod:`cdc.views`): its ``name``, its ``sql`` (parsed
    again against the registered tables whenever it is used), its ``search`` columns (the view's
    search index, :mod:`sinks.view_search`) and ``tables`` (qualified names it reads, for listings and
    for refusing the removal of a table a view reads)."""

    name: str
    sql: str
    tables: tuple[str, ...]
    search: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        body = {"name": self.name, "sql": self.sql, "tables": list(self.tables), "search": list(self.search)}
        return json.dumps({**body, "extra": self.extra}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ViewReg:
        body = json.loads(text)
        return cls(
            body["name"],
            body["sql"],
            tuple(body.get("tables", ())),
            tuple(body.get("search", ())),
            dict(body.get("extra") or {}),
        )


# --- the state store's keys -------------------------------------------------------------------------
class State(StrEnum):
    """The pipeline-wide entries of the registry's key/value state (:meth:`Registry.get_state`).
    Each value is the stored key: never change one (existing ``registry.db`` files hold them)."""

    #: the initial snapshot of the tables registered before the first ``cdc run``: ``running``/``done``
    INITIAL_SNAPSHOT = "initial_snapshot"
    #: the tables the last stream session read (JSON list of [schema, table])
    STREAMED_TABLES = "streamed_tables"
    #: the leaves of each registered table the last session streamed (JSON list of
    #: [[schema, table], [[leaf schema, leaf], ...]]); a session compares them with the catalog's
    STREAMED_PARTITIONS = "streamed_partitions"
    #: whether wal2json knows ``numeric-data-types-as-string`` ("1"/"0"; absent: unknown)
    WAL2JSON_NUMERIC_AS_STRING = "wal2json_numeric_as_string"
    #: the last slot drop of the status policy (JSON, :mod:`cdc.cli.status.slot`)
    SLOT_DROPPED = "slot_dropped"
    #: the output plugin the slot was created with (``wal2json``/``pgoutput``; absent: a slot
    #: created before decoders were recorded, which is wal2json)
    DECODER = "decoder"


class TableState(StrEnum):
    """The per-table entries of the registry's key/value state (:meth:`Registry.get_table_state`).
    The stored key is ``<value>:["schema","table"]`` (:meth:`key`); never change a value."""

    #: a chunked snapshot's progress (JSON, :class:`snapshot.chunk_state.ChunkProgress`)
    CHUNKED_PROGRESS = "chunked"
    #: set (to the epoch seconds it was noticed) while the table does not exist at the source
    #: (dropped or renamed); the capture of the other tables goes on
    SOURCE_MISSING = "source_missing"
    #: what the DDL recorder told of the missing table (JSON ``{"what": "dropped" | "renamed",
    #: "to": new name or null, "tag": command tag}``, :mod:`cdc.reader.ddl`); cleared with it
    SOURCE_MISSING_DDL = "source_missing_ddl"
    #: the capture refuses the table: its key columns are gone at the source (JSON ``{"reason", "fix"}``)
    SCHEMA_REFUSED = "schema_refused"
    #: a pending ``cdc snapshot --where`` request (JSON ``{"where": ...}``), or a partitioned table's
    #: attached partitions to read (JSON ``{"partitions": [[schema, table], ...]}``: those leaves only)
    SNAPSHOT_REQUEST = "snapshot_request"
    #: partitions detached from the table whose rows the reader has yet to delete from its topic
    #: (JSON list of [schema, table])
    PARTITIONS_DETACHED = "partitions_detached"
    #: stream changes of the table with a commit LSN below this value are dropped (they are in its
    #: snapshot and were never streamed before)
    DROP_BEFORE = "drop_before"
    #: the non-finite recorder does not carry the table's NaN/Infinity (JSON,
    #: :meth:`cdc.recorders.nonfinite.Outcome.to_json`); absent when it does
    NONFINITE_RECORDER = "nonfinite_recorder"
    #: the last clean ``cdc verify`` of the table (JSON ``{"at": epoch s, "lsn", "mode", "ranges"}``,
    #: :mod:`cdc.cli.verify.ranges`); its range hashes live in :func:`cdc.paths.verify_ranges`
    VERIFIED_CLEAN = "verified_clean"
    #: the topic holds changes with values the reader could not know (listed in their ``unavailable``:
    #: its image store was lost and the topic predates it, :mod:`cdc.logstore.images`); JSON
    #: ``{"events", "keys", "columns", "since"}``; cleared by a full snapshot of the table
    VALUES_UNKNOWN = "values_unknown"

    def key(self, schema: str, table: str) -> str:
        """The stored key of this entry for ``schema.table``."""
        return f"{self.value}:" + orjson.dumps([schema, table]).decode()


# --- storage ---------------------------------------------------------------------------------------
SNAPSHOT_STATES = ("pending", "running", "done")
_SCHEMA_VERSION = 1


def column_json(c: Column) -> dict[str, Any]:
    """A column as the registry and ``cdc tables list --json`` write it (``domain`` only for one)."""
    body: dict[str, Any] = {"name": c.name, "type": c.type, "nullable": c.nullable}
    if c.domain:
        body["domain"] = c.domain
    return body


def _reg_to_json(reg: TableReg) -> str:
    body: dict[str, Any] = {
        "schema": reg.schema,
        "table": reg.table,
        "topic": reg.topic,
        "key": list(reg.key),
        "search": list(reg.search),
        "exclude": list(reg.exclude),
        "columns": [column_json(c) for c in reg.columns],
        "snapshot_state": reg.snapshot_state,
        "alignment": None
        if reg.alignment is None
        else {
            "consistent_lsn": reg.alignment.consistent_lsn,
            "end_offsets": {str(p): o for p, o in reg.alignment.end_offsets.items()},
        },
        "extra": reg.extra,
    }
    return json.dumps(body, sort_keys=True)


def _reg_from_json(text: str) -> TableReg:
    body = json.loads(text)
    align = body.get("alignment")
    return TableReg(
        schema=body["schema"],
        table=body["table"],
        topic=body["topic"],
        key=tuple(body["key"]),
        search=tuple(body.get("search", ())),
        exclude=tuple(body.get("exclude", ())),
        columns=tuple(
            Column(c["name"], c["type"], bool(c.get("nullable", True)), c.get("domain", ""))
            for c in body["columns"]
        ),
        snapshot_state=body.get("snapshot_state", "pending"),
        alignment=None
        if align is None
        else Alignment(
            consistent_lsn=int(align["consistent_lsn"]),
            end_offsets={int(p): int(o) for p, o in align["end_offsets"].items()},
        ),
        extra=dict(body.get("extra") or {}),
    )


class Registry:
    """The registered tables, in ``<state_dir>/registry.db``.

    Safe to open from several processes at once (the CLI adds a table while ``cdc run`` polls
    :meth:`generation` and the Spark job reads :meth:`list_tables`): SQLite in WAL mode, a busy
    timeout, and one short transaction per call. Every method sees the latest committed state; a
    write is durable when the method returns. Reads never block writers.

    :meth:`generation` increases (in the same transaction as the change) whenever the set of
    registrations changes in a way the reader must act on: :meth:`add`, :meth:`remove`,
    :meth:`set_columns` with different columns, and :meth:`set_snapshot_state` to ``pending`` (a
    re-snapshot request). Progress the capture side records itself (``running``/``done`` with the
    alignment, :meth:`set_state`) does not bump it, so the reader is not woken by its own writes.

    A file that is not a readable registry raises :class:`RegistryError` naming the path and a fix.
    """

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = Path(state_dir)
        self.path = paths.registry_path(self.state_dir)
        self._lock = threading.Lock()
        try:
            paths.ensure_private_dir(self.state_dir)
        except OSError as exc:
            raise RegistryError(
                f"cannot create the state directory {self.state_dir}: {exc.strerror}",
                fix="point --state / CDC_STATE at a writable directory",
                path=str(self.state_dir),
            ) from exc
        try:
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise self._corrupt(exc) from exc
        try:
            self._db.execute("PRAGMA busy_timeout = 30000")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            with self._write() as db:
                db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value NOT NULL)")
                db.execute(
                    "CREATE TABLE IF NOT EXISTS tables (schema_name TEXT NOT NULL, table_name TEXT NOT NULL,"
                    " body TEXT NOT NULL, PRIMARY KEY (schema_name, table_name))"
                )
                db.execute("CREATE TABLE IF NOT EXISTS state (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
                db.execute("CREATE TABLE IF NOT EXISTS views (name TEXT PRIMARY KEY, body TEXT NOT NULL)")
                db.execute("INSERT OR IGNORE INTO meta VALUES ('generation', 0)")
                db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (_SCHEMA_VERSION,))
                row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is None or int(row[0]) != _SCHEMA_VERSION:
                raise RegistryError(
                    f"{self.path} has registry format {row[0] if row else None}, this cdc reads {_SCHEMA_VERSION}",
                    fix="use the cdc version that wrote it, or move the file aside and register the tables again",
                    path=str(self.path),
                )
        except sqlite3.Error as exc:
            self._db.close()
            raise self._translate(exc) from exc
        except BaseException:
            self._db.close()
            raise

    def _corrupt(self, exc: Exception) -> RegistryError:
        return RegistryError(
            f"the registry {self.path} cannot be read: {exc}",
            fix=f"restore {self.path} from a backup, or move it aside (mv {self.path} {self.path}.bad) "
            "and register the tables again with `cdc tables add` (their topics are kept)",
            path=str(self.path),
        )

    # -- plumbing ----------------------------------------------------------------------------------
    def _translate(self, exc: sqlite3.Error) -> RegistryError:
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF  # primary code of an extended one
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            return RegistryError(
                f"the registry {self.path} stayed locked by another process: {exc}",
                fix="retry; if it persists, find the process holding it (e.g. `fuser` on the file)",
                path=str(self.path),
            )
        return self._corrupt(exc)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction (BEGIN IMMEDIATE: takes the write lock up front)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise self._translate(exc) from exc
            try:
                yield self._db
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                self._rollback()
                raise self._translate(exc) from exc
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def _read(self, query: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            try:
                return self._db.execute(query, params).fetchall()
            except sqlite3.Error as exc:
                raise self._translate(exc) from exc

    @staticmethod
    def _bump(db: sqlite3.Connection) -> None:
        db.execute("UPDATE meta SET value = value + 1 WHERE key = 'generation'")

    def _get_in(self, db: sqlite3.Connection, schema: str, table: str) -> TableReg:
        row = db.execute(
            "SELECT body FROM tables WHERE schema_name = ? AND table_name = ?", (schema, table)
        ).fetchone()
        if row is None:
            raise self._not_registered(schema, table)
        return _reg_from_json(row[0])

    def _put_in(self, db: sqlite3.Connection, reg: TableReg) -> None:
        db.execute(
            "INSERT OR REPLACE INTO tables (schema_name, table_name, body) VALUES (?, ?, ?)",
            (reg.schema, reg.table, _reg_to_json(reg)),
        )

    def _not_registered(self, schema: str, table: str) -> RegistryError:
        return RegistryError(
            f"table {schema}.{table} is not registered",
            fix=f"register it with `cdc tables add {cli_table_name(schema, table)}`, "
            "or see what is registered with `cdc tables list`",
            schema=schema,
            table=table,
        )

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads -------------------------------------------------------------------------------------
    def generation(self) -> int:
        """A counter that increases on every registration change (see the class docstring)."""
        rows = self._read("SELECT value FROM meta WHERE key = 'generation'")
        return int(rows[0][0])

    def list_tables(self) -> list[TableReg]:
        """Every registered table, sorted by (schema, table)."""
        regs = [_reg_from_json(body) for (body,) in self._read("SELECT body FROM tables")]
        return sorted(regs, key=lambda r: (r.schema, r.table))

    def get(self, schema: str, table: str) -> TableReg:
        """The registration of ``schema.table`` (exact names); RegistryError if not registered."""
        rows = self._read("SELECT body FROM tables WHERE schema_name = ? AND table_name = ?", (schema, table))
        if not rows:
            raise self._not_registered(schema, table)
        return _reg_from_json(rows[0][0])

    def find(self, name: str) -> TableReg:
        """The registration named ``name`` as the CLI receives it (``schema.table``, Postgres quoting
        rules, see :func:`cdc.names.parse_table_name`). As a convenience, a name that does not parse
        or match but equals exactly one table's unquoted ``schema.table`` also finds it."""
        try:
            schema, table = parse_table_name(name)
        except RegistryError as parse_error:
            exact = [r for r in self.list_tables() if r.qualified == name.strip()]
            if len(exact) == 1:
                return exact[0]
            raise parse_error
        rows = self._read("SELECT body FROM tables WHERE schema_name = ? AND table_name = ?", (schema, table))
        if rows:
            return _reg_from_json(rows[0][0])
        exact = [r for r in self.list_tables() if r.qualified == name.strip()]
        if len(exact) == 1:
            return exact[0]
        raise self._not_registered(schema, table)

    # -- writes ------------------------------------------------------------------------------------
    def add(self, reg: TableReg) -> TableReg:
        """Register a table; RegistryError if it is already registered. Bumps the generation."""
        if reg.snapshot_state not in SNAPSHOT_STATES:
            raise RegistryError(
                f"unknown snapshot state {reg.snapshot_state!r}", fix=f"use one of {SNAPSHOT_STATES}"
            )
        with self._write() as db:
            exists = db.execute(
                "SELECT 1 FROM tables WHERE schema_name = ? AND table_name = ?", (reg.schema, reg.table)
            ).fetchone()
            if exists:
                quoted = cli_table_name(reg.schema, reg.table)
                raise RegistryError(
                    f"table {reg.qualified} is already registered",
                    fix=f"to change its registration, remove it first: `cdc tables remove {quoted}`, "
                    f"then `cdc tables add {quoted} ...` again",
                    schema=reg.schema,
                    table=reg.table,
                )
            self._put_in(db, reg)
            self._bump(db)
        return reg

    def remove(self, schema: str, table: str) -> TableReg:
        """Delete a registration (only the registration: its topic and derived tables are kept).
        Returns what was removed; RegistryError if not registered. Bumps the generation."""
        with self._write() as db:
            reg = self._get_in(db, schema, table)
            db.execute("DELETE FROM tables WHERE schema_name = ? AND table_name = ?", (schema, table))
            self._bump(db)
        return reg

    def set_snapshot_state(
        self, schema: str, table: str, state: str, alignment: Alignment | None = None
    ) -> TableReg:
        """Record a table's snapshot progress: ``pending`` (a re-snapshot request: clears the
        alignment and bumps the generation), ``running``, ``done`` (with its alignment; when
        ``alignment`` is None the stored one is kept)."""
        if state not in SNAPSHOT_STATES:
            raise RegistryError(f"unknown snapshot state {state!r}", fix=f"use one of {SNAPSHOT_STATES}")
        with self._write() as db:
            reg = self._get_in(db, schema, table)
            if state == "pending":
                new = replace(reg, snapshot_state=state, alignment=alignment)
                self._bump(db)
            else:
                new = replace(reg, snapshot_state=state, alignment=alignment or reg.alignment)
            self._put_in(db, new)
        return new

    def set_columns(
        self, schema: str, table: str, columns: tuple[Column, ...], renamed: dict[str, str] | None = None
    ) -> TableReg:
        """Record the table's current columns (a column added, dropped, renamed or retyped at the
        source). When they differ from the stored ones (and some were stored): bumps the table's
        :attr:`TableReg.schema_version`, remembers the columns that are gone
        (:attr:`TableReg.dropped_columns`; a column that comes back is forgotten there), drops
        them from the search columns (the index stops indexing them), and bumps the generation.
        ``renamed`` (old name -> new name): a search column renamed at the source stays a search
        column under its new name, indexed in the field of its old one (:meth:`TableReg.search_field`);
        the old name counts as dropped (the warehouse keeps it, null from then on)."""
        columns = tuple(columns)
        with self._write() as db:
            reg = self._get_in(db, schema, table)
            if columns == reg.columns:
                return reg
            extra = dict(reg.extra)
            search = reg.search
            if reg.columns:
                names = {c.name for c in columns}
                gone = [c.name for c in reg.columns if c.name not in names]
                dropped = [n for n in reg.dropped_columns if n not in names]
                dropped += [n for n in gone if n not in dropped]
                types = {**dict(extra.get("dropped_types", {})), **{c.name: c.type for c in reg.columns}}
                if dropped:
                    extra["dropped_columns"] = dropped
                    extra["dropped_types"] = {n: types[n] for n in dropped if n in types}
                else:
                    extra.pop("dropped_columns", None)
                    extra.pop("dropped_types", None)
                extra["schema_version"] = reg.schema_version + 1
                renamed = {o: n for o, n in (renamed or {}).items() if n in names}
                fields = dict(extra.get("search_fields", {}))
                search = tuple(renamed.get(s, s) for s in reg.search if s in names or s in renamed)
                for old, new_name in renamed.items():
                    if old in reg.search:
                        fields[new_name] = fields.pop(old, old)
                fields = {c: f for c, f in fields.items() if c in search and c != f}
                if fields:
                    extra["search_fields"] = fields
                else:
                    extra.pop("search_fields", None)
            new = replace(reg, columns=columns, extra=extra, search=search)
            self._put_in(db, new)
            self._bump(db)
        return new

    def get_state(self, name: State | str) -> str | None:
        """A value of the small key/value store (the pipeline's bookkeeping), or None. Callers
        name an entry by :class:`State` (per table: :meth:`get_table_state`), never by a string of
        their own."""
        rows = self._read("SELECT value FROM state WHERE name = ?", (name,))
        return str(rows[0][0]) if rows else None

    def set_state(self, name: State | str, value: str | None) -> None:
        """Set (or with None delete) a key/value entry; durable on return."""
        with self._write() as db:
            if value is None:
                db.execute("DELETE FROM state WHERE name = ?", (name,))
            else:
                db.execute("INSERT OR REPLACE INTO state (name, value) VALUES (?, ?)", (name, value))

    def slot_dropped(self, slot: str, reason: str, **facts: Any) -> dict[str, Any]:
        """The slot is gone (dropped or lost): mark every registered table for a re-snapshot
        (``pending``) and record why and when (:attr:`State.SLOT_DROPPED`, with ``facts``, which
        ``cdc status`` shows); returns the record."""
        tables = []
        for reg in self.list_tables():
            self.set_snapshot_state(reg.schema, reg.table, "pending")
            tables.append(reg.qualified)
        at = time.time()
        record = {
            "slot": slot,
            "at_ms": int(at * 1000),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)),
            "reason": reason,
            **facts,
            "tables": tables,
        }
        self.set_state(State.SLOT_DROPPED, orjson.dumps(record).decode())
        return record

    def get_table_state(self, entry: TableState, schema: str, table: str) -> str | None:
        """The table's value of ``entry``, or None."""
        return self.get_state(entry.key(schema, table))

    def set_table_state(self, entry: TableState, schema: str, table: str, value: str | None) -> None:
        """Set (or with None delete) the table's value of ``entry``; durable on return."""
        self.set_state(entry.key(schema, table), value)

    # -- views (cdc.views) -------------------------------------------------------------------------
    def list_views(self) -> list[ViewReg]:
        """Every registered view, sorted by name."""
        return [ViewReg.from_json(body) for (body,) in self._read("SELECT body FROM views ORDER BY name")]

    def get_view(self, name: str) -> ViewReg:
        """The view ``name``; RegistryError if there is none."""
        rows = self._read("SELECT body FROM views WHERE name = ?", (name,))
        if not rows:
            raise RegistryError(
                f"view {name} is not registered", fix="see the views with `cdc views list`", view=name
            )
        return ViewReg.from_json(rows[0][0])

    def add_view(self, view: ViewReg) -> ViewReg:
        """Register a view; RegistryError if one has that name. Bumps the generation."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM views WHERE name = ?", (view.name,)).fetchone():
                raise RegistryError(
                    f"view {view.name} is already registered",
                    fix=f"remove it first (`cdc views remove {view.name}`), or choose another name",
                    view=view.name,
                )
            db.execute("INSERT INTO views (name, body) VALUES (?, ?)", (view.name, view.to_json()))
            self._bump(db)
        return view

    def remove_view(self, name: str) -> ViewReg:
        """Delete a view's registration; RegistryError if there is none. Bumps the generation."""
        with self._write() as db:
            row = db.execute("SELECT body FROM views WHERE name = ?", (name,)).fetchone()
            if row is None:
                raise RegistryError(
                    f"view {name} is not registered", fix="see the views with `cdc views list`", view=name
                )
            db.execute("DELETE FROM views WHERE name = ?", (name,))
            self._bump(db)
        return ViewReg.from_json(row[0])

    def set_view_refused(self, name: str, refused: dict[str, Any] | None) -> None:
        """Record (or with None clear) why the apply cannot maintain the view ``name`` now (JSON
        ``{"reason", "fix"}`` in its ``extra["refused"]``); nothing if the view is gone."""
        with self._write() as db:
            row = db.execute("SELECT body FROM views WHERE name = ?", (name,)).fetchone()
            if row is None:
                return
            view = ViewReg.from_json(row[0])
            extra = {k: v for k, v in view.extra.items() if k != "refused"}
            if refused is not None:
                extra["refused"] = refused
            db.execute(
                "UPDATE views SET body = ? WHERE name = ?", (replace(view, extra=extra).to_json(), name)
            )
