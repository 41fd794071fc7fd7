"""The non-finite recorder (installing it; its messages are decoded by :mod:`cdc.codec.nonfinite`): float and numeric NaN/+-Infinity carried by a wal2json that sends null.

wal2json 2.5 (Debian 12's) prints a scalar ``real``, ``double precision`` or ``numeric`` NaN,
Infinity or -Infinity as JSON ``null`` and has no option to do otherwise (2.6+ has
``numeric-data-types-as-string``, which the reader asks for first). So that such a value is never
changed into a null in silence, the reader keeps, on each captured table with such columns, a row
trigger that writes the row's non-finite values into the WAL as a transactional logical message,
prefix :data:`~cdc.codec.NONFINITE_PREFIX` (``cdc.nonfinite``), just before the row's
change:

* ``zzz_cdc_nonfinite`` -- ``BEFORE INSERT OR UPDATE ... FOR EACH ROW WHEN (NEW.a IN ('NaN',
  'Infinity', '-Infinity') OR NEW.b IN (...) ...)``, one test per tracked column: the new row's
  values (the event's ``after``);
* ``zzz_cdc_nonfinite_old`` -- ``BEFORE UPDATE OR DELETE ... WHEN (OLD.a IN (...) OR ...)``, only
  on a table with ``REPLICA IDENTITY FULL``: the old row's (the event's ``before``).

Both call ``public.cdc_record_nonfinite()`` with the arguments ``image`` and the key columns. The
tracked columns are the table's ``real``, ``double precision`` and ``numeric`` columns, and domains
over them, as the source has them when the triggers are installed (:func:`_when_columns`), less
the excluded ones; the untyped literals take each column's type (``'NaN'`` equals ``'NaN'`` for
both float and numeric in Postgres; a NULL makes its test NULL, not true). The ``WHEN`` clause is
evaluated by the executor without calling the function, so a row without such a value costs one
comparison per tracked column, whatever the row's width, and writes nothing; the function runs only
for the others and writes one message (about 150 bytes of WAL). Arrays are not tested: wal2json
sends them as text, NaN included. The names start with ``zzz`` because BEFORE triggers fire in
name order: these run after the table's own BEFORE triggers, so they see the row as it is written.

The ``WHEN`` clause has two forms (``nonfinite_recorder_when`` in cdc.toml, :data:`When`).

``"row"``, the default: ``WHEN (NEW::text ~ 'NaN|Infinity')``. It never gets in a DBA's way and
covers a column added later at once, but costs the row's text output on every write and, on an
UPDATE, the reading back of its unchanged out-of-line values (up to 11x the write's CPU,
``docs/benchmarks/nonfinite.md``); on a table with stored generated columns, where Postgres refuses
a whole-row ``NEW`` in the ``WHEN``, its new-row trigger has none, and the function runs the same
test as its first statement for every written row.

``"columns"``: one comparison per tracked column, whatever the row's width. It is the default only
once a DBA accepts its two consequences:

* Postgres records that the trigger depends on each tested column, so it refuses ``ALTER COLUMN
  ... TYPE`` of one (``cannot alter type of a column used in a trigger definition``, naming the
  trigger) and ``DROP COLUMN`` of one without ``CASCADE``. The DBA drops the triggers in the same
  transaction (``DROP TRIGGER zzz_cdc_nonfinite ON t``, and ``zzz_cdc_nonfinite_old``); ``cdc run``
  puts them back over the table's columns then (at its next session, or when it sees the changed
  columns in the stream), as does ``cdc check --fix``.
* A float or numeric column added later is tested once the triggers are replaced: when ``cdc run``
  starts a session or sees the column in the stream (:meth:`_State.table_ok` compares the columns
  a trigger's ``WHEN`` reads, from ``pg_depend``, with those it should read). A NaN written into
  the new column before that reaches the topic as null.

The default is the form that can neither block the source's DDL nor lose a value in silence.
Changing the setting replaces the triggers as outdated.

Tables with stored generated columns (in the table or, Postgres 15 allowing it, in one of its
partitions): Postgres refuses a BEFORE trigger whose ``WHEN`` reads a generated column of ``NEW``
(``cannot reference NEW generated columns``, 42P17) -- and computes them after every BEFORE trigger
anyway -- so the new-row trigger's ``WHEN`` leaves them out (``WHEN (false)`` when no other column
is left) and tests the others; the old-row trigger tests them too. A generated float or numeric
column's NaN/Infinity in a new row is therefore not recorded (in an old row it is): ``cdc tables
add``, ``cdc run`` and ``cdc check`` say so, with the fix (wal2json 2.6+, or excluding the column).
The function tests a copy of ``NEW`` on UPDATE: reading ``NEW`` itself whole would detoast its
out-of-line values in place and the row it returns would store them anew, a new TOAST value (and
its WAL) for every UPDATE. An AFTER trigger could read generated columns, but its message would
land after the statement's changes in the WAL, and the reader takes a message with the table's
*next* change.

Upgrading: a trigger whose ``WHEN`` is the whole-row test of earlier versions, or that has none
(tables with generated columns had none), is outdated: ``cdc check`` says so and ``cdc run``,
``cdc tables add`` and ``cdc check --fix`` replace it (``CREATE OR REPLACE TRIGGER``).

The message (JSON): ``{"v": 1, "image": "new"|"old", "schema", "table", "key": [text, ...],
"values": {column: "NaN"|"Infinity"|"-Infinity"}}``; ``schema``/``table`` name the relation the
row is in (a leaf partition for a partitioned table, as wal2json names its changes), ``key`` the
key columns' values as JSON text (``to_jsonb(row) ->> column``), ``values`` every column whose
value is one of the three words (a text column holding one too: the reader takes only float and
numeric columns).

The stream side (:mod:`cdc.codec.nonfinite`, :meth:`cdc.codec.envelope.EventBuilder.nonfinite`): a message is held for its
table and taken by the table's next change in the same transaction; its values replace that
change's nulls -- only nulls, only in float and numeric columns, and only when the change's key is
the message's (compared where both sides print the key alike: integers, numerics, text, uuid,
date). A message no change takes (the row was not written after all: ``INSERT ... ON CONFLICT DO
NOTHING``, or a later trigger returned NULL) is dropped at the next change of its table or at the
end of its transaction. The one case this cannot tell apart: a write of key *k* skipped that way,
followed in the same transaction, as the table's very next change, by a write of the same key *k*
setting that column to NULL (the null would become the skipped row's value).

Installing: creating the function needs CREATE on schema ``public``; creating a trigger needs the
TRIGGER privilege on the table (``CREATE OR REPLACE TRIGGER``). ``cdc run`` installs or updates
the triggers of the tables it streams when the role may (each session, and when a table gets its
first float or numeric column), ``cdc tables add`` at registration, ``cdc check --fix`` for every
registered table; otherwise ``cdc check`` reports them with the SQL for the owner (``cdc check
--nonfinite-recorder-sql``). A table the triggers cannot go on (no TRIGGER privilege, locked, a
shape Postgres refuses them on) is reported for that table, with the fix and what is lost; the
others go on, and the table's state (:attr:`cdc.registry.TableState.NONFINITE_RECORDER`) shows in ``cdc tables list``. ``cdc tables remove`` leaves them (another deployment may capture the
same table); the owner drops them with ``DROP TRIGGER zzz_cdc_nonfinite ON ...``.

:attr:`cdc.registry.State.WAL2JSON_NUMERIC_AS_STRING` (registry state): ``"1"`` once the reader found that wal2json sends the
values itself (2.6+; nothing is installed then), ``"0"`` once it found it does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import psycopg
from psycopg import sql

from cdc.pgtypes import type_kind
from cdc.registry import Registry, TableReg, TableState

__all__ = [
    "FUNCTION",
    "TRIGGERS",
    "Outcome",
    "check_nonfinite",
    "ensure_nonfinite",
    "install_script",
    "remember",
    "tracked_columns",
]

#: the triggers' function (schema, name)
FUNCTION = ("public", "cdc_record_nonfinite")
#: trigger name -> (image, events, row variable)
TRIGGERS = {
    "zzz_cdc_nonfinite": ("new", "INSERT OR UPDATE", "NEW"),
    "zzz_cdc_nonfinite_old": ("old", "UPDATE OR DELETE", "OLD"),
}
#: the trigger only tables under REPLICA IDENTITY FULL get (the others' events carry no old row)
OLD_TRIGGER = "zzz_cdc_nonfinite_old"
#: how long a trigger change may wait for the table's lock (an open write transaction holds one)
LOCK_TIMEOUT = "2s"

#: the function's body (``prosrc``): compared by :func:`check_nonfinite` to tell an outdated one
BODY = """
DECLARE
    rec record;
    r jsonb;
    k jsonb;
    vals jsonb;
    i int;
BEGIN
    -- the trigger's WHEN test, again: the trigger has none on a table with generated columns
    IF tg_op = 'INSERT' THEN
        IF NEW::text !~ 'NaN|Infinity' THEN
            RETURN NEW;
        END IF;
        rec := NEW;
    ELSIF tg_argv[0] = 'new' THEN
        -- a copy: reading NEW whole would detoast its out-of-line values in place, and the row
        -- returned would then store them anew (a new TOAST value and its WAL on each UPDATE)
        rec := NEW;
    ELSE
        rec := OLD;
    END IF;
    IF rec::text ~ 'NaN|Infinity' THEN
        r := to_jsonb(rec);
        SELECT jsonb_object_agg(e.key, e.value) INTO vals
          FROM jsonb_each(r) e
         WHERE e.value IN ('"NaN"'::jsonb, '"Infinity"'::jsonb, '"-Infinity"'::jsonb);
        IF vals IS NOT NULL THEN
            k := '[]';
            FOR i IN 1 .. tg_nargs - 1 LOOP
                k := k || jsonb_build_array(r ->> tg_argv[i]);
            END LOOP;
            PERFORM pg_logical_emit_message(true, 'cdc.nonfinite',
                jsonb_build_object('v', 1, 'image', tg_argv[0], 'schema', tg_table_schema,
                                   'table', tg_table_name, 'key', k, 'values', vals)::text);
        END IF;
    END IF;
    IF tg_op = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
"""


def tracked_columns(reg: TableReg) -> tuple[str, ...]:
    """The scalar float and numeric columns of a registration (excluded ones never reach a sink)."""
    excluded = set(reg.exclude)
    return tuple(
        c.name for c in reg.columns if c.name not in excluded and type_kind(c.type) in ("float", "numeric")
    )


def _args(reg: TableReg, image: str) -> list[str]:
    return [image, *reg.key]


#: the ``WHEN`` clause's form (``nonfinite_recorder_when`` in cdc.toml): each tracked column, or the
#: whole row as text (the form of earlier versions, which never blocks a DDL command)
When = Literal["columns", "row"]
#: a trigger's WHEN as :class:`_State` reads it: the columns it tests, or one of these
NO_WHEN, ROW_WHEN = "none", "row"

#: the values the ``WHEN`` clause looks for (as untyped literals: each takes its column's type)
_SPECIALS = sql.SQL("('NaN', 'Infinity', '-Infinity')")


def _when_columns(
    reg: TableReg, name: str, generated: frozenset[str], present: Sequence[str] | None = None
) -> tuple[str, ...]:
    """The columns trigger ``name``'s ``WHEN`` clause tests: the tracked ones -- those the source
    has now when known (``present``: its float and numeric columns, domains over them too; the
    registry learns a column added or dropped only from the stream), less the excluded ones --
    but for the new-row trigger not the stored generated ones (Postgres refuses a BEFORE
    trigger's ``WHEN`` that reads them in ``NEW``; they are computed after it anyway,
    :meth:`_State.uncovered`)."""
    skip = generated if TRIGGERS[name][2] == "NEW" else frozenset()
    cols = tracked_columns(reg) if present is None else tuple(c for c in present if c not in reg.exclude)
    return tuple(c for c in cols if c not in skip)


def _expected(
    reg: TableReg, name: str, generated: frozenset[str], present: Sequence[str] | None, when: When
) -> str | frozenset[str]:
    """Trigger ``name``'s ``WHEN`` as it should be: the columns it tests, or in the ``row`` form
    :data:`ROW_WHEN`, but :data:`NO_WHEN` for the new-row trigger of a table with stored generated
    columns (Postgres refuses a whole-row ``NEW`` there; the function runs the same test first)."""
    if when == "row":
        return NO_WHEN if generated and TRIGGERS[name][2] == "NEW" else ROW_WHEN
    return frozenset(_when_columns(reg, name, generated, present))


def _when_clause(row: str, expected: str | frozenset[str], ordered: Sequence[str]) -> sql.Composable:
    """The trigger's ``WHEN`` clause (``ordered``: the tested columns in the table's order)."""
    if expected == NO_WHEN:
        return sql.SQL("")
    if expected == ROW_WHEN:
        return sql.SQL("WHEN ({}::text ~ 'NaN|Infinity') ").format(sql.SQL(row))
    return sql.SQL("WHEN ({}) ").format(_when(row, ordered))


def _when(row: str, columns: Sequence[str]) -> sql.Composable:
    """``NEW.a IN ('NaN', 'Infinity', '-Infinity') OR NEW.b IN (...)``: per column, so a row costs
    one comparison per tracked column, whatever its width (``false`` when no column is left)."""
    if not columns:
        return sql.SQL("false")
    return sql.SQL(" OR ").join(
        sql.SQL("{}.{} IN {}").format(sql.SQL(row), sql.Identifier(c), _SPECIALS) for c in columns
    )


def _wanted(reg: TableReg, full_identity: bool) -> list[str]:
    """The triggers a table should have (none without float or numeric columns)."""
    if not tracked_columns(reg):
        return []
    return [n for n in TRIGGERS if n != OLD_TRIGGER or full_identity]


# --- the source objects --------------------------------------------------------------------------
def _function() -> sql.Identifier:
    return sql.Identifier(*FUNCTION)


def function_statement() -> sql.Composed:
    return sql.SQL(
        "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql "
        "SET search_path = pg_catalog, pg_temp AS {}"
    ).format(_function(), sql.Literal(BODY))


def _table(reg: TableReg) -> sql.Identifier:
    return sql.Identifier(reg.schema, reg.table)


def trigger_statements(
    reg: TableReg,
    full_identity: bool,
    generated: frozenset[str] = frozenset(),
    present: Sequence[str] | None = None,
    when: When = "row",
) -> list[sql.Composed]:
    """``CREATE OR REPLACE TRIGGER`` of the triggers the table should have (needs the TRIGGER
    privilege); none for a table without float or numeric columns. ``generated``: the table's
    stored generated columns (those of its partitions too); ``present``: its float and numeric
    columns at the source (see :func:`_when_columns`); ``when``: the ``WHEN`` clause's form."""
    out = []
    for name in _wanted(reg, full_identity):
        image, events, row = TRIGGERS[name]
        out.append(
            sql.SQL(
                "CREATE OR REPLACE TRIGGER {} BEFORE {} ON {} FOR EACH ROW {}EXECUTE FUNCTION {}({})"
            ).format(
                sql.Identifier(name),
                sql.SQL(events),
                _table(reg),
                _when_clause(
                    row,
                    _expected(reg, name, generated, present, when),
                    _when_columns(reg, name, generated, present),
                ),
                _function(),
                sql.SQL(", ").join(sql.Literal(a) for a in _args(reg, image)),
            )
        )
    return out


def install_script(conn: psycopg.Connection[Any], regs: Sequence[TableReg], when: When = "row") -> str:
    """The SQL that installs the function and the triggers of ``regs`` (for the owner's ``psql``)."""
    state = _state(conn, regs)
    stmts = [function_statement()] + [
        s for reg in regs for s in trigger_statements(reg, *state.shape(reg), when)
    ]
    return "BEGIN;\n" + "".join(s.as_string(conn) + ";\n" for s in stmts) + "COMMIT;\n"


_STATE = """
SELECT (SELECT p.prosrc FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = %(fschema)s AND p.proname = %(fname)s AND p.pronargs = 0),
       current_database()
"""

#: per table: under REPLICA IDENTITY FULL, its stored generated columns (in any partition), and
#: its float and numeric columns (a domain over one, or over such a domain, too), in order
_TABLES = """
SELECT n.nspname::text, c.relname::text, c.relreplident = 'f',
       ARRAY(SELECT DISTINCT a.attname::text FROM pg_catalog.pg_attribute a
              WHERE (a.attrelid = c.oid OR a.attrelid IN (SELECT relid FROM pg_catalog.pg_partition_tree(c.oid)))
                AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated <> ''),
       ARRAY(SELECT a.attname::text FROM pg_catalog.pg_attribute a
               JOIN pg_catalog.pg_type t1 ON t1.oid = a.atttypid
               LEFT JOIN pg_catalog.pg_type t2 ON t2.oid = t1.typbasetype
              WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                AND (CASE WHEN t1.typtype <> 'd' THEN t1.oid WHEN t2.typtype <> 'd' THEN t2.oid
                          ELSE t2.typbasetype END) IN ('pg_catalog.float4'::regtype,
                         'pg_catalog.float8'::regtype, 'pg_catalog.numeric'::regtype)
              ORDER BY a.attnum)
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE (n.nspname, c.relname) IN (SELECT * FROM unnest(%(schemas)s::text[], %(tables)s::text[]))
"""

_TRIGGERS = """
SELECT n.nspname::text, c.relname::text, t.tgname::text, t.tgenabled <> 'D', t.tgargs,
       fn.nspname = %(fschema)s AND f.proname = %(fname)s,
       -- its WHEN clause: none, the whole-row test, or the columns it reads
       t.tgqual IS NOT NULL, position('NaN|Infinity' in pg_catalog.pg_get_triggerdef(t.oid)) > 0,
       ARRAY(SELECT a.attname::text FROM pg_catalog.pg_depend d
               JOIN pg_catalog.pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
              WHERE d.classid = 'pg_catalog.pg_trigger'::regclass AND d.objid = t.oid
                AND d.refclassid = 'pg_catalog.pg_class'::regclass AND d.refobjsubid > 0
              ORDER BY a.attname)
  FROM pg_catalog.pg_trigger t
  JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_catalog.pg_proc f ON f.oid = t.tgfoid
  JOIN pg_catalog.pg_namespace fn ON fn.oid = f.pronamespace
 WHERE t.tgname = ANY(%(names)s) AND t.tgparentid = 0
   AND (n.nspname, c.relname) IN (SELECT * FROM unnest(%(schemas)s::text[], %(tables)s::text[]))
"""


@dataclass(frozen=True)
class _State:
    body: str | None
    database: str
    #: (schema, table) -> {trigger: (enabled, calls ours, args, the columns its WHEN tests, or
    #: :data:`NO_WHEN` / :data:`ROW_WHEN`)}
    triggers: dict[tuple[str, str], dict[str, tuple[bool, bool, list[str], str | frozenset[str]]]]
    #: the tables under REPLICA IDENTITY FULL
    full: frozenset[tuple[str, str]]
    #: (schema, table) -> its stored generated columns (those of its partitions too), when any
    generated_columns: dict[tuple[str, str], frozenset[str]]
    #: (schema, table) -> its float and numeric columns at the source (tables that exist)
    present: dict[tuple[str, str], tuple[str, ...]]

    @property
    def function_ok(self) -> bool:
        return self.body is not None and self.body.strip() == BODY.strip()

    def full_identity(self, reg: TableReg) -> bool:
        return (reg.schema, reg.table) in self.full

    def generated(self, reg: TableReg) -> frozenset[str]:
        return self.generated_columns.get((reg.schema, reg.table), frozenset())

    def shape(self, reg: TableReg) -> tuple[bool, frozenset[str], tuple[str, ...] | None]:
        """:func:`trigger_statements`' arguments after ``reg``."""
        return self.full_identity(reg), self.generated(reg), self.present.get((reg.schema, reg.table))

    def uncovered(self, reg: TableReg) -> tuple[str, ...]:
        """The tracked columns that are generated: a BEFORE trigger sees them null (Postgres
        computes them after), so their NaN/Infinity in a new row is not recorded."""
        gen = self.generated(reg)
        return tuple(c for c in tracked_columns(reg) if c in gen)

    def table_ok(self, reg: TableReg, when: When = "row") -> bool:
        """The table has the triggers it should, up to date and enabled, their ``WHEN`` testing
        the columns it should (a column added, dropped or now generated since makes it outdated;
        so does the whole-row ``WHEN`` of earlier versions). An old-row trigger left on a table no
        longer under REPLICA IDENTITY FULL does no harm and is not required."""
        have = self.triggers.get((reg.schema, reg.table), {})
        return all(
            have.get(name)
            == (
                True,
                True,
                _args(reg, TRIGGERS[name][0]),
                _expected(reg, name, *self.shape(reg)[1:], when),
            )
            for name in _wanted(reg, self.full_identity(reg))
        )


def _state(conn: psycopg.Connection[Any], regs: Sequence[TableReg]) -> _State:
    params = {"fschema": FUNCTION[0], "fname": FUNCTION[1]}
    row = conn.execute(_STATE, params).fetchone()
    assert row is not None
    triggers: dict[tuple[str, str], dict[str, tuple[bool, bool, list[str], str | frozenset[str]]]] = {}
    full: set[tuple[str, str]] = set()
    generated: dict[tuple[str, str], frozenset[str]] = {}
    present: dict[tuple[str, str], tuple[str, ...]] = {}
    if regs:
        tables = {"schemas": [r.schema for r in regs], "tables": [r.table for r in regs]}
        for schema, table, is_full, gen, floats in conn.execute(_TABLES, tables).fetchall():
            present[(str(schema), str(table))] = tuple(floats)
            if is_full:
                full.add((str(schema), str(table)))
            if gen:
                generated[(str(schema), str(table))] = frozenset(gen)
        for schema, table, name, enabled, args, ours, qual, row_form, when_columns in conn.execute(
            _TRIGGERS, {**params, "names": list(TRIGGERS), **tables}
        ).fetchall():
            parts = bytes(args).split(b"\x00")[:-1]
            triggers.setdefault((schema, table), {})[name] = (
                bool(enabled),
                bool(ours),
                [p.decode("utf-8", "replace") for p in parts],
                NO_WHEN if not qual else ROW_WHEN if row_form else frozenset(when_columns),
            )
    return _State(row[0], str(row[1]), triggers, frozenset(full), generated, present)


def _fix(database: str) -> str:
    return (
        "run `cdc check --fix` as the tables' owner (--source), or have the owner run "
        f"`cdc check --nonfinite-recorder-sql | psql -d {database}` (creates the function "
        f"{FUNCTION[0]}.{FUNCTION[1]}() and the triggers {', '.join(TRIGGERS)}); "
        "or upgrade wal2json to 2.6+, which needs none of them"
    )


#: the fix for a table Postgres refuses the trigger on
_UPGRADE_FIX = "upgrade wal2json to 2.6+ (it sends NaN/Infinity itself, and the reader asks for it)"
#: the fix for a generated column the recorder cannot cover
_GENERATED_FIX = (
    f"{_UPGRADE_FIX}, or leave the column out of the capture (`cdc tables remove`, then "
    "`cdc tables add ... --exclude COLUMN`) and compute it downstream"
)


def _uncovered_text(reg: TableReg, cols: Sequence[str]) -> str:
    return (
        f"{reg.qualified} ({', '.join(cols)}: generated, computed after the recorder's BEFORE "
        "trigger ran, so a NaN/Infinity computed into a new row is not recorded)"
    )


def check_nonfinite(
    conn: psycopg.Connection[Any], regs: Sequence[TableReg], when: When = "row"
) -> tuple[str, str, str] | None:
    """``cdc check``'s view: None when every registered table with float/numeric columns has
    up-to-date triggers covering all of them, else ``("warning", message, fix)`` naming the tables
    and columns whose NaN/Infinity a wal2json older than 2.6 would turn into null."""
    need = [r for r in regs if tracked_columns(r)]
    if not need:
        return None
    state = _state(conn, need)
    bad = [r for r in need if not (state.function_ok and state.table_ok(r, when))]
    partial = [(r, state.uncovered(r)) for r in need if r not in bad and state.uncovered(r)]
    if not bad and not partial:
        return None
    messages, fixes = [], []
    if bad:
        tables = "; ".join(f"{r.qualified} ({', '.join(tracked_columns(r))})" for r in bad)
        messages.append(f"the non-finite recorder is missing or outdated for {tables}")
        fixes.append(_fix(state.database))
    if partial:
        tables = "; ".join(_uncovered_text(r, cols) for r, cols in partial)
        messages.append(f"the non-finite recorder cannot cover {tables}")
        fixes.append(_GENERATED_FIX)
    return (
        "warning",
        "; ".join(messages) + ": with wal2json < 2.6 a NaN, Infinity or -Infinity written there "
        "reaches the topics as null",
        "; for the generated columns: ".join(fixes) if bad else fixes[0],
    )


@dataclass(frozen=True)
class Outcome:
    """What :func:`ensure_nonfinite` did for one table: ``ok`` (already up to date),
    ``installed``, or ``failed`` (``why`` and ``fix`` say what the owner must do); ``uncovered``:
    tracked columns no trigger can cover (generated ones, :meth:`_State.uncovered`)."""

    reg: TableReg
    action: str
    why: str = ""
    fix: str = ""
    uncovered: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any] | None:
        """The per-table state kept in the registry (:attr:`cdc.registry.TableState.NONFINITE_RECORDER`): None when the recorder
        covers every tracked column, else ``{"state": "failed"|"partial", "reason", "fix"}``."""
        if self.action == "failed":
            return {"state": "failed", "reason": self.why, "fix": self.fix}
        if self.uncovered:
            return {
                "state": "partial",
                "reason": _uncovered_text(self.reg, self.uncovered),
                "fix": _GENERATED_FIX,
            }
        return None


#: a trigger Postgres refuses on this table's shape (not a privilege or a lock)
_REFUSED = (
    psycopg.errors.InvalidObjectDefinition,
    psycopg.errors.FeatureNotSupported,
    psycopg.errors.WrongObjectType,
    psycopg.errors.ObjectNotInPrerequisiteState,
)


def ensure_nonfinite(
    conn: psycopg.Connection[Any], regs: Sequence[TableReg], when: When = "row"
) -> list[Outcome]:
    """Install or update the function and the triggers of the tables with tracked columns, each
    table in its own transaction (waiting at most :data:`LOCK_TIMEOUT` for its lock). Never raises
    for a missing privilege, a busy table or a trigger Postgres refuses on the table's shape: that
    table's outcome is ``failed``, with the fix, and the other tables go on."""
    need = [r for r in regs if tracked_columns(r)]
    if not need:
        return []
    state = _state(conn, need)
    out: list[Outcome] = []
    function_ok = state.function_ok
    if not function_ok:
        try:
            with conn.transaction():
                conn.execute(function_statement())
            function_ok = True
        except psycopg.errors.InsufficientPrivilege as exc:
            why = f"this role may not create {FUNCTION[0]}.{FUNCTION[1]}(): {exc.diag.message_primary}"
            return [Outcome(r, "failed", why, _fix(state.database)) for r in need]
    for reg in need:
        if state.table_ok(reg, when):
            out.append(Outcome(reg, "ok", uncovered=state.uncovered(reg)))
            continue
        try:
            with conn.transaction():
                conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(LOCK_TIMEOUT)))
                for stmt in trigger_statements(reg, *state.shape(reg), when):
                    conn.execute(stmt)
            out.append(Outcome(reg, "installed", uncovered=state.uncovered(reg)))
        except psycopg.errors.InsufficientPrivilege as exc:
            why = f"this role may not create triggers on {reg.qualified}: {exc.diag.message_primary}"
            out.append(Outcome(reg, "failed", why, _fix(state.database)))
        except psycopg.errors.LockNotAvailable:
            why = f"{reg.qualified} stayed locked by other transactions for {LOCK_TIMEOUT}"
            out.append(Outcome(reg, "failed", why, "it is tried again when `cdc run` restarts"))
        except psycopg.errors.UndefinedTable:
            out.append(Outcome(reg, "failed", f"{reg.qualified} does not exist at the source", ""))
        except _REFUSED as exc:
            why = f"Postgres refuses the recorder's trigger on {reg.qualified}: {exc.diag.message_primary}"
            out.append(Outcome(reg, "failed", why, _UPGRADE_FIX))
    return out


def remember(registry: Registry, outcomes: Sequence[Outcome], regs: Sequence[TableReg] = ()) -> None:
    """Keep each table's recorder state where ``cdc tables list`` shows it; ``regs`` without an
    outcome (nothing to track, or wal2json sends the values itself) have none. Writes only what
    changed."""
    wanted: dict[tuple[str, str], dict[str, Any] | None] = {
        (o.reg.schema, o.reg.table): o.to_json() for o in outcomes
    }
    for reg in regs:
        wanted.setdefault((reg.schema, reg.table), None)
    for (schema, table), state in wanted.items():
        value = None if state is None else msgspec.json.encode(state).decode()
        if registry.get_table_state(TableState.NONFINITE_RECORDER, schema, table) != value:
            registry.set_table_state(TableState.NONFINITE_RECORDER, schema, table, value)
