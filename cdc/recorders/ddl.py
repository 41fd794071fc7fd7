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

The stream side, which applies each message to the tables being streamed, is
:class:`cdc.reader.ddl.DdlFollower`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from cdc.errors import SourceError

__all__ = [
    "FORMAT_VERSION",
    "FUNCTION",
    "TRIGGERS",
    "RecorderState",
    "check_ddl_recorder",
    "install_ddl_recorder",
    "install_script",
    "install_statements",
    "recorder_state",
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
