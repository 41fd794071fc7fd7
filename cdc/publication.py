"""pgoutput's publication: cdc's own, kept in step with the registered tables.

pgoutput filters the changes it sends by a publication, not by an option of the session (wal2json's
``add-tables``). The reader decodes with pgoutput (``decoder = "pgoutput"``) from a publication named
by ``publication`` in cdc.toml (default: the slot's name) that holds exactly the registered tables
that exist at the source, and the chunked snapshots' watermark table while one runs. It is created
``WITH (publish_via_partition_root = true)``: a partitioned table's changes arrive under the parent's
name, whatever leaf they were written to.

``cdc tables add`` / ``remove`` and every reader session bring it in step (:func:`sync_publication`).
Without the privilege (``CREATE`` on the database for ``CREATE PUBLICATION``, ownership of a table to
add it) the error carries the exact SQL for the DBA (:func:`publication_sql`); ``cdc check`` reports a
registered table missing from it (:func:`publication_tables`).

Membership is judged by Postgres with the catalog as of each change's WAL position: a table added
now is published for changes written after this commit. The reader snapshots a newly registered
table in chunks after its session has added it, so no change the snapshot does not hold is missed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psycopg
import psycopg.errors
from psycopg import sql

from cdc.catalog import is_table
from cdc.config import Settings
from cdc.errors import SourcePermanentError
from cdc.registry import Registry

__all__ = [
    "PublicationChange",
    "keep_publication",
    "publication_sql",
    "publication_tables",
    "published",
    "sync_publication",
]

Table = tuple[str, str]


@dataclass(frozen=True)
class PublicationChange:
    """What :func:`sync_publication` did: ``created`` the publication, tables ``added``/``dropped``;
    ``dba_sql``: the statements the role may not run, when they only drop tables no longer
    registered (nothing is lost: their changes are skipped; a DBA should still run them)."""

    created: bool
    added: tuple[Table, ...]
    dropped: tuple[Table, ...]
    dba_sql: str | None = None

    @property
    def changed(self) -> bool:
        return self.created or bool(self.added) or bool(self.dropped)


def published(registry: Registry, watermark: Table) -> list[Table]:
    """What the publication should hold: every registered table and the chunked snapshots'
    ``watermark`` table (both only where they exist at the source: :func:`sync_publication`)."""
    return [(r.schema, r.table) for r in registry.list_tables()] + [watermark]


def publication_tables(conn: psycopg.Connection[Any], name: str) -> set[Table] | None:
    """The tables the publication holds (as added: a partitioned parent, not its leaves); None
    when it does not exist."""
    row = conn.execute("SELECT oid FROM pg_publication WHERE pubname = %s", [name]).fetchone()
    if row is None:
        return None
    rows = conn.execute(
        "SELECT n.nspname::text, c.relname::text FROM pg_publication_rel pr "
        "JOIN pg_class c ON c.oid = pr.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE pr.prpubid = %s",
        [row[0]],
    ).fetchall()
    return {(str(s), str(t)) for s, t in rows}


def _table(t: Table) -> sql.Composable:
    return sql.Identifier(*t)


#: PostgreSQL 18 publishes stored generated columns when asked (``publish_generated_columns``)
GENERATED_COLUMNS_VERSION = 180000


def publication_options(server_version: int) -> dict[str, str]:
    """The publication's options: changes of a partition under its root's name, and, on
    PostgreSQL 18+, stored generated columns (earlier pgoutput never sends them: ``cdc tables add``
    leaves them out of the capture, :func:`unpublished_columns`)."""
    options = {"publish_via_partition_root": "true"}
    if server_version >= GENERATED_COLUMNS_VERSION:
        options["publish_generated_columns"] = "stored"
    return options


def _with(options: dict[str, str]) -> sql.Composed:
    return sql.SQL(", ").join(sql.SQL("{} = {}").format(sql.SQL(k), sql.SQL(v)) for k, v in options.items())


def _statements(
    name: str, have: set[Table] | None, want: set[Table], options: dict[str, str]
) -> tuple[list[sql.Composed], PublicationChange]:
    """``options``: every option to create the publication with, or (it exists) those to change."""
    pub = sql.Identifier(name)
    out: list[sql.Composed] = []
    if have is None:
        tables = sorted(want)
        target = (
            sql.SQL(" FOR TABLE {}").format(sql.SQL(", ").join(_table(t) for t in tables))
            if tables
            else sql.SQL("")
        )
        out.append(sql.SQL("CREATE PUBLICATION {}{} WITH ({})").format(pub, target, _with(options)))
        return out, PublicationChange(True, tuple(tables), ())
    added = tuple(sorted(want - have))
    dropped = tuple(sorted(have - want))
    if options:
        out.append(sql.SQL("ALTER PUBLICATION {} SET ({})").format(pub, _with(options)))
    if added:
        out.append(
            sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                pub, sql.SQL(", ").join(_table(t) for t in added)
            )
        )
    if dropped:
        out.append(
            sql.SQL("ALTER PUBLICATION {} DROP TABLE {}").format(
                pub, sql.SQL(", ").join(_table(t) for t in dropped)
            )
        )
    return out, PublicationChange(False, added, dropped)


def _plan(
    conn: psycopg.Connection[Any], name: str, tables: Iterable[Table]
) -> tuple[list[sql.Composed], PublicationChange]:
    have = publication_tables(conn, name)
    options = publication_options(conn.info.server_version)
    if have is not None:
        gencols = "pubgencols" if conn.info.server_version >= GENERATED_COLUMNS_VERSION else "'s'"
        row = conn.execute(
            sql.SQL("SELECT pubviaroot, {} = 's' FROM pg_publication WHERE pubname = %s").format(
                sql.SQL(gencols)
            ),
            [name],
        ).fetchone()
        now = {"publish_via_partition_root": "true" if row and row[0] else "false"}
        now["publish_generated_columns"] = "stored" if row and row[1] else "none"
        options = {k: v for k, v in options.items() if now.get(k) != v}
    return _statements(name, have, {t for t in tables if is_table(conn, t)}, options)


def unpublished_columns(conn: psycopg.Connection[Any], schema: str, table: str) -> list[str]:
    """The table's stored generated columns when pgoutput cannot send them (PostgreSQL < 18)."""
    if conn.info.server_version >= GENERATED_COLUMNS_VERSION:
        return []
    rows = conn.execute(
        "SELECT a.attname::text FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s "
        "AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated <> '' ORDER BY a.attnum",
        [schema, table],
    ).fetchall()
    return [str(r[0]) for r in rows]


def publication_sql(conn: psycopg.Connection[Any], name: str, tables: Iterable[Table]) -> list[str]:
    """The statements that bring the publication in step with ``tables`` (for a DBA to run)."""
    statements, _ = _plan(conn, name, tables)
    return [s.as_string(conn) + ";" for s in statements]


def sync_publication(conn: psycopg.Connection[Any], name: str, tables: Iterable[Table]) -> PublicationChange:
    """Create the publication, or add and drop tables, so that it holds exactly those of ``tables``
    that exist at the source; committed before it returns. Without the privilege to create it or
    add a table: a :class:`~cdc.errors.SourcePermanentError` whose fix is the SQL for the DBA (only
    to drop tables: that SQL in :attr:`PublicationChange.dba_sql`)."""
    statements, change = _plan(conn, name, tables)
    if not statements:
        return change
    try:
        with conn.transaction():
            for statement in statements:
                conn.execute(statement)
    except psycopg.errors.InsufficientPrivilege as exc:
        text = " ".join(s.as_string(conn) + ";" for s in statements)
        if not change.created and not change.added:
            return PublicationChange(False, (), (), dba_sql=text)
        role = conn.execute("SELECT current_user::text").fetchone()
        raise SourcePermanentError(
            f"the source role {role[0] if role else '?'} may not keep the publication {name!r} in step "
            f"with the registered tables ({str(exc).strip()})",
            fix=f"have the DBA run: {text} (or grant CREATE on the database and make the role the "
            "tables' owner)",
            publication=name,
        ) from None
    if not conn.autocommit:
        conn.commit()
    return change


def keep_publication(
    conn: psycopg.Connection[Any],
    registry: Registry,
    settings: Settings,
    watermark: Table,
    log: Callable[[str], None],
    also: Iterable[Table] = (),
) -> None:
    """Bring ``settings.publication`` in step with :func:`published` and ``also`` (a table being
    registered); what changed, and the SQL a DBA still has to run, go to ``log``."""
    name = settings.publication
    change = sync_publication(conn, name, [*published(registry, watermark), *also])
    if change.dba_sql:
        log(
            f"warning: the publication {name} still holds tables no longer registered (their "
            f"changes are skipped); fix: have the DBA run: {change.dba_sql}"
        )
    if change.changed:
        added = [f"{s}.{t}" for s, t in change.added]
        dropped = [f"{s}.{t}" for s, t in change.dropped]
        log(f"publication {name}: {'created; ' if change.created else ''}added {added}, dropped {dropped}")
