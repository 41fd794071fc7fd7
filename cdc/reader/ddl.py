"""The optional DDL recorder: schema changes told by the source, not inferred from rows.

Logical decoding carries no DDL. Where the DBA allows it, an event trigger (as pgstream does) writes
every DDL command on a table into the WAL as a transactional logical message, prefix
:data:`~cdc.codec.DDL_PREFIX` (``cdc.ddl``), so the reader sees it in the stream, in commit
order, exactly where it happened among the changes (docs/schema-changes.md, "The DDL recorder").

Source objects (:func:`install_statements`): the function ``public.cdc_record_ddl()`` and the event
triggers ``cdc_ddl_command_end`` (``ddl_command_end``) and ``cdc_ddl_sql_drop`` (``sql_drop``).
Creating an event trigger needs a superuser; ``cdc check`` reports a missing recorder (severity
``info``: column inference is the fallback) and ``cdc check --fix`` installs it when the role may.

The message (JSON): ``{"v": 1, "tag": "ALTER TABLE", "event": "ddl_command_end", "objects": [...]}``;
one object per table the command touched (plain or partitioned, not temporary, not in a system
schema): ``type`` (``table``, or ``table column`` for a command on one column such as RENAME
COLUMN), ``identity``, ``schema``, ``table``, ``oid``, ``subid`` (the column's attnum for ``table
column``, else 0) and, after ``ddl_command_end``, ``columns``: the table's columns after the
command, in attnum order (``name``, ``type`` from ``format_type``, ``attnum``, ``notnull``). A
``sql_drop`` message lists the dropped tables without columns. The SQL text of the command is not
recorded (it may hold literals the captured tables never carry).

The function has no exception block on purpose: a subtransaction makes Postgres decode the message
after the next change of the transaction, so the message would come after the row it explains.

:class:`DdlFollower` is the stream side: it applies each message to the tables being streamed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
import psycopg
from psycopg import sql

from cdc.codec import DDL_PREFIX, Message
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.errors import DecodeError, SourceError
from cdc.registry import Column, TableReg

__all__ = [
    "DDL_PREFIX",
    "FUNCTION",
    "TRIGGERS",
    "DdlFollower",
    "DdlMessage",
    "DdlObject",
    "check_ddl_recorder",
    "install_ddl_recorder",
    "install_script",
    "parse_ddl",
]

#: the recorder's function (schema, name)
FUNCTION = ("public", "cdc_record_ddl")
#: the recorder's event triggers: name -> event
TRIGGERS = {"cdc_ddl_command_end": "ddl_command_end", "cdc_ddl_sql_drop": "sql_drop"}
#: the version of the message format (``v``) the reader understands
FORMAT_VERSION = 1

#: the function's body (``prosrc``); ``cdc check`` compares it to tell an outdated recorder
BODY = """
DECLARE
    objs jsonb;
BEGIN
    IF tg_event = 'sql_drop' THEN
        SELECT jsonb_agg(jsonb_build_object(
                   'type', d.object_type, 'identity', d.object_identity, 'schema', d.schema_name,
                   'table', d.object_name, 'oid', d.objid::bigint, 'subid', d.objsubid))
          INTO objs
          FROM pg_event_trigger_dropped_objects() d
         WHERE d.object_type = 'table' AND NOT d.is_temporary
           AND d.schema_name NOT IN ('pg_catalog', 'pg_toast', 'information_schema');
    ELSE
        SELECT jsonb_agg(jsonb_build_object(
                   'type', x.object_type, 'identity', x.object_identity, 'schema', n.nspname,
                   'table', c.relname, 'oid', c.oid::bigint, 'subid', x.objsubid,
                   'columns', (SELECT jsonb_agg(jsonb_build_object(
                                   'name', a.attname, 'type', format_type(a.atttypid, a.atttypmod),
                                   'attnum', a.attnum, 'notnull', a.attnotnull) ORDER BY a.attnum)
                                 FROM pg_attribute a
                                WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped)))
          INTO objs
          FROM (SELECT DISTINCT ON (e.objid, e.objsubid) e.*
                  FROM pg_event_trigger_ddl_commands() e
                 WHERE e.classid = 'pg_catalog.pg_class'::regclass) x
          JOIN pg_class c ON c.oid = x.objid AND c.relkind IN ('r', 'p') AND c.relpersistence <> 't'
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname NOT IN ('pg_catalog', 'pg_toast', 'information_schema');
    END IF;
    IF objs IS NOT NULL THEN
        PERFORM pg_logical_emit_message(true, 'cdc.ddl',
            jsonb_build_object('v', 1, 'tag', tg_tag, 'event', tg_event, 'objects', objs)::text);
    END IF;
END
"""


# --- the source objects --------------------------------------------------------------------------
def _function() -> sql.Identifier:
    return sql.Identifier(*FUNCTION)


def install_statements() -> list[sql.Composed]:
    """The statements that install (or replace) the recorder; run them in one transaction."""
    out = [
        sql.SQL(
            "CREATE OR REPLACE FUNCTION {}() RETURNS event_trigger LANGUAGE plpgsql "
            "SET search_path = pg_catalog, pg_temp AS {}"
        ).format(_function(), sql.Literal(BODY))
    ]
    for name, event in TRIGGERS.items():
        out.append(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(name)))
        out.append(
            sql.SQL("CREATE EVENT TRIGGER {} ON {} EXECUTE FUNCTION {}()").format(
                sql.Identifier(name), sql.SQL(event), _function()
            )
        )
    return out


def install_script(conn: psycopg.Connection[Any]) -> str:
    """The install statements as a psql script (``cdc check --ddl-recorder-sql``)."""
    return "BEGIN;\n" + "".join(s.as_string(conn) + ";\n" for s in install_statements()) + "COMMIT;\n"


_STATE = """
SELECT (SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = %(schema)s AND p.proname = %(name)s AND p.pronargs = 0),
       coalesce((SELECT jsonb_object_agg(t.evtname, jsonb_build_array(t.evtevent, t.evtenabled <> 'D',
                                         pn.nspname = %(schema)s AND p.proname = %(name)s))
                   FROM pg_catalog.pg_event_trigger t
                   JOIN pg_catalog.pg_proc p ON p.oid = t.evtfoid
                   JOIN pg_catalog.pg_namespace pn ON pn.oid = p.pronamespace
                  WHERE t.evtname = ANY(%(triggers)s)), '{}'::jsonb),
       (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user),
       current_database()
"""


@dataclass(frozen=True)
class RecorderState:
    """What the source has of the recorder. ``triggers``: name -> (event, enabled, calls ours)."""

    body: str | None
    triggers: dict[str, tuple[str, bool, bool]]
    superuser: bool
    database: str

    @property
    def installed(self) -> bool:
        return self.body is not None and self.body.strip() == BODY.strip() and self.triggers_ok

    @property
    def triggers_ok(self) -> bool:
        return all(self.triggers.get(n) == (e, True, True) for n, e in TRIGGERS.items())


def recorder_state(conn: psycopg.Connection[Any]) -> RecorderState:
    row = conn.execute(
        _STATE, {"schema": FUNCTION[0], "name": FUNCTION[1], "triggers": list(TRIGGERS)}
    ).fetchone()
    assert row is not None
    body, triggers, superuser, database = row
    return RecorderState(
        body=body,
        triggers={str(k): (str(v[0]), bool(v[1]), bool(v[2])) for k, v in (triggers or {}).items()},
        superuser=bool(superuser),
        database=str(database),
    )


def _what_fix(state: RecorderState) -> str:
    objects = (
        f"the function {FUNCTION[0]}.{FUNCTION[1]}() and the event triggers {', '.join(TRIGGERS)} "
        f"in database {state.database}"
    )
    if state.superuser:
        return f"run `cdc check --fix` (creates {objects})"
    return (
        f"event triggers need a superuser: run `cdc check --fix` with a superuser's connection "
        f"(--source), or have a superuser run `cdc check --ddl-recorder-sql | psql -d {state.database}` "
        f"(creates {objects})"
    )


def check_ddl_recorder(conn: psycopg.Connection[Any]) -> tuple[str, str, str] | None:
    """``cdc check``'s view of the recorder: None when installed, else ``(severity, message, fix)``.
    A recorder that is absent is ``info`` (schema changes are then inferred from the rows); one
    that is half there, disabled or outdated is a ``warning``."""
    state = recorder_state(conn)
    if state.installed:
        return None
    if state.body is None and not state.triggers:
        return (
            "info",
            "the DDL recorder is not installed: schema changes are inferred from the rows (a column "
            "renamed is told from a drop and an add only by its type; a table dropped or renamed is "
            "noticed by polling) -- optional, see docs/schema-changes.md",
            _what_fix(state),
        )
    wrong = [n for n, e in TRIGGERS.items() if state.triggers.get(n) != (e, True, True)]
    why = []
    if state.body is None:
        why.append(f"the function {FUNCTION[0]}.{FUNCTION[1]}() is missing")
    elif state.body.strip() != BODY.strip():
        why.append(f"the function {FUNCTION[0]}.{FUNCTION[1]}() is not this cdc version's")
    if wrong:
        why.append(f"event trigger(s) {', '.join(wrong)} missing, disabled or calling another function")
    return ("warning", f"the DDL recorder is incomplete: {'; '.join(why)}", _what_fix(state))


def install_ddl_recorder(conn: psycopg.Connection[Any]) -> bool:
    """Install (or bring up to date) the recorder in one transaction; False when it already was.
    A role that may not gets a SourceError saying what a superuser must run."""
    state = recorder_state(conn)
    if state.installed:
        return False
    try:
        with conn.transaction():
            for stmt in install_statements():
                conn.execute(stmt)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise SourceError(
            f"this role may not install the DDL recorder ({exc.diag.message_primary})",
            fix=_what_fix(state),
        ) from exc
    return True


# --- the stream side -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DdlColumn:
    name: str
    type: str
    attnum: int
    notnull: bool


@dataclass(frozen=True)
class DdlObject:
    kind: str  # "table" or "table column"
    identity: str
    schema: str
    table: str
    oid: int
    subid: int
    columns: tuple[DdlColumn, ...] | None  # None: a dropped table


@dataclass(frozen=True)
class DdlMessage:
    tag: str
    event: str
    objects: tuple[DdlObject, ...]

    @property
    def drop(self) -> bool:
        return self.event == "sql_drop"


def parse_ddl(content: str | None, lsn: str | None = None) -> DdlMessage:
    """Decode a recorder message; DecodeError (with the fix) when it is not one this reader knows."""
    try:
        body = orjson.loads(content or "")
        if body.get("v") != FORMAT_VERSION:
            raise ValueError(f"format version {body.get('v')!r}, this reader knows {FORMAT_VERSION}")
        objects = tuple(
            DdlObject(
                kind=str(o["type"]),
                identity=str(o["identity"]),
                schema=str(o["schema"]),
                table=str(o["table"]),
                oid=int(o["oid"]),
                subid=int(o.get("subid") or 0),
                columns=None
                if o.get("columns") is None
                else tuple(
                    DdlColumn(str(c["name"]), str(c["type"]), int(c["attnum"]), bool(c["notnull"]))
                    for c in o["columns"]
                ),
            )
            for o in body["objects"]
        )
        return DdlMessage(str(body["tag"]), str(body["event"]), objects)
    except (orjson.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DecodeError(
            f"a {DDL_PREFIX} message at LSN {lsn} is not one this cdc understands: {exc}",
            fix="bring the recorder up to this cdc version: `cdc check --fix` (as a superuser)",
            lsn=lsn,
            reason="bad DDL message",
        ) from exc


#: (registration, "dropped" | "renamed", the new name of a renamed table, the command tag)
TableGone = Callable[[TableReg, str, str | None, str], None]
#: (registration, key columns the command took away)
KeyLost = Callable[[TableReg, list[str]], None]


class DdlFollower:
    """Applies the recorder's messages to the streamed tables (called by the stream loop for each
    ``cdc.ddl`` message, inside its transaction, in order with the changes):

    * a table dropped (``sql_drop``), or renamed / moved to another schema (the same ``oid`` under
      a new name): ``on_gone``; its changes are no longer decoded (``EventBuilder.detach``);
    * a command that took a key column away (dropped or renamed): ``on_key_lost``, detached too;
    * otherwise the table's columns after the command become its columns at once (schema version
      bumped before the next row). A column is **renamed** exactly when the command names one column
      (``table column`` object of an ALTER TABLE) whose name is new while exactly one known column is
      gone; anything else is a drop and/or an add, whatever the types.

    ``oids``: the streamed tables' oids when the session started ({oid: (schema, table)}). Messages
    of other tables are ignored, as are those older than a table's snapshot.
    """

    def __init__(
        self,
        builder: EventBuilder,
        oids: dict[int, tuple[str, str]],
        *,
        on_gone: TableGone,
        on_key_lost: KeyLost,
    ) -> None:
        self.builder = builder
        self.oids = dict(oids)
        self.on_gone = on_gone
        self.on_key_lost = on_key_lost

    def __call__(self, msg: Message) -> None:
        ddl = parse_ddl(msg.content, msg.lsn)
        for obj in ddl.objects:
            self._object(ddl, obj)

    def _codec(self, key: tuple[str, str]) -> TableCodec | None:
        codec = self.builder.codecs.get(key)
        if codec is None or self.builder.commit_lsn < codec.snapshot_lsn:
            return None  # not streamed, or the change is contained in the table's snapshot
        return codec if (codec.reg.schema, codec.reg.table) == key else None  # a leaf: its parent's

    def _object(self, ddl: DdlMessage, obj: DdlObject) -> None:
        key = (obj.schema, obj.table)
        known = self.oids.get(obj.oid)
        if ddl.drop:
            codec = self._codec(known or key)
            if codec is not None:
                self.oids.pop(obj.oid, None)
                self.builder.detach(codec)
                self.on_gone(codec.reg, "dropped", None, ddl.tag)
            return
        if known is not None and known != key:
            # the same table under a new name (ALTER TABLE ... RENAME TO / SET SCHEMA)
            del self.oids[obj.oid]
            codec = self._codec(known)
            if codec is not None:
                self.builder.detach(codec)
                self.on_gone(codec.reg, "renamed", obj.identity, ddl.tag)
        codec = self._codec(key) or self.builder.reattach(key)
        if codec is None or obj.columns is None or self.builder.commit_lsn < codec.snapshot_lsn:
            return
        self.oids[obj.oid] = key
        self._columns(ddl, obj, codec)

    def _columns(self, ddl: DdlMessage, obj: DdlObject, codec: TableCodec) -> None:
        assert obj.columns is not None
        before = {c.name: c for c in codec.columns}
        names = {c.name for c in obj.columns}
        lost = [k for k in codec.key if k not in names]
        if lost:
            self.builder.detach(codec)
            self.on_key_lost(codec.reg, lost)
            return
        renamed: dict[str, str] = {}
        if ddl.tag == "ALTER TABLE" and obj.kind == "table column" and obj.subid > 0:
            new = next((c.name for c in obj.columns if c.attnum == obj.subid), None)
            gone = [n for n in before if n not in names]
            if new is not None and new not in before and len(gone) == 1:
                renamed = {gone[0]: new}
        cols = self.builder.resolve(
            tuple(
                Column(c.name, c.type, before[c.name].nullable if c.name in before else not c.notnull)
                for c in obj.columns
            )
        )
        if cols == codec.columns:
            return
        self.builder.set_table_columns(codec, cols, renamed)
