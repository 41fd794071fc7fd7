"""The output plugins cdc reads and what each implies, in one object per plugin (as Debezium's
``LogicalDecoder`` carries each decoder's capabilities): no caller compares plugin names.

:func:`plugin` turns a name (``decoder`` in cdc.toml, a slot's ``plugin``) into its
:class:`OutputPlugin`, :data:`PLUGINS` lists them, and :func:`plugin_in_use` says which one a
deployment reads (resolved once, from the slot, by the reader, which records it in the registry). Each holds:

* whether it is part of the server (pgoutput) or a library to install and allow (wal2json: its
  library file, where to get it), and whether a slot was made with it (:meth:`OutputPlugin.made`);
* whether it streams from a publication that cdc keeps (pgoutput), or is told the tables by name
  in the session's options (wal2json's ``add-tables``);
* whether NaN and ±Infinity can arrive as null (wal2json before 2.6, whose numbers are JSON
  numbers unless ``numeric-data-types-as-string`` is accepted): the non-finite recorder's concern;
* how to count, without consuming, the changes an inactive slot holds (:meth:`OutputPlugin.peek`,
  for ``cdc status`` and ``cdc wait``), which reads the plugin's own messages;
* whether its changes have a compiled per-change path (both: pgoutput's messages and wal2json's
  JSON, :mod:`cdc.codec.fastpath`);
* the session decoder (:meth:`OutputPlugin.decoder`: :mod:`cdc.codec.wal2json`'s, or a
  :class:`cdc.codec.pgoutput.PgOutput` per session).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
import psycopg

from cdc.codec.wal2json import add_tables_option
from cdc.events import commit_ts_ms, int_to_lsn, pg_time_ms
from cdc.names import sql_ident

if TYPE_CHECKING:
    from cdc.codec import Decoder
    from cdc.config import Settings
    from cdc.registry import Registry, TableReg

__all__ = ["PGOUTPUT", "PLUGINS", "WAL2JSON", "OutputPlugin", "Pending", "plugin", "plugin_in_use"]

_CHANGES = frozenset("IUDT")


@dataclass(frozen=True)
class Pending:
    """What an inactive slot holds before a position: the changes (of the tables asked, or of every
    published table for pgoutput) and the commit time of the oldest (epoch ms; None without one)."""

    changes: int
    oldest_ms: int | None


@dataclass(frozen=True)
class OutputPlugin:
    """One output plugin's facts. Compare plugins by identity (``plugin is PGOUTPUT``) only inside
    this module: elsewhere ask the attribute that says what differs."""

    name: str
    #: part of the server (pgoutput); else a library that must be installed and allowed (wal2json)
    built_in: bool
    #: streams the tables of a publication, which cdc creates and keeps in line with the registry
    #: (a change of a table not registered, published meanwhile, is skipped, not refused)
    uses_publication: bool
    #: may send NaN/±Infinity of numeric columns as null (wal2json < 2.6, which refuses the
    #: ``numeric-data-types-as-string`` option): the non-finite recorder's triggers fill them in
    may_send_nonfinite_as_null: bool
    #: where to get it, for a server without it ("" for a built-in one)
    install_hint: str = ""

    @property
    def setting(self) -> str:
        """``decoder = "pgoutput"``: the cdc.toml line that chooses it."""
        return f'decoder = "{self.name}"'

    @property
    def library_file(self) -> str:
        """The file of its library in the server's ``PKGLIBDIR`` (``wal2json.so``)."""
        return f"{self.name}.so"

    def made(self, slot_plugin: str | None) -> bool:
        """Whether a slot whose ``pg_replication_slots.plugin`` is ``slot_plugin`` is one of this plugin."""
        return slot_plugin == self.name

    def describe(self, publication: str) -> str:
        """``pgoutput (publication cdc)`` or ``wal2json``: the decoder as ``cdc tables list`` shows it."""
        return f"{self.name} (publication {publication})" if self.uses_publication else self.name

    def peek(
        self,
        conn: psycopg.Connection[Any],
        slot: str,
        upto: int,
        tables: Sequence[TableReg],
        publication: str,
    ) -> Pending:
        """The changes ``slot`` (inactive: a peek fails with ``ObjectInUse`` on an active one) holds
        before ``upto``, nothing consumed: of ``tables`` (wal2json filters by name), or of every table
        of ``publication`` (pgoutput: it holds the registered tables and the watermark table)."""
        if self.uses_publication:
            return _peek_pgoutput(conn, slot, upto, publication)
        return _peek_wal2json(conn, slot, upto, tables)

    def decoder(self, conn: psycopg.Connection[Any], publication: str, spool_dir: Path) -> Decoder:
        """The decoder of one session: pgoutput's keeps per-session state (its relation cache, type
        names looked up on ``conn``, streamed transactions spooled under ``spool_dir``)."""
        if not self.uses_publication:
            from cdc.codec.wal2json import DECODER

            return DECODER
        from cdc.catalog import type_namer
        from cdc.codec.pgoutput import PgOutput

        spool_dir.mkdir(exist_ok=True)
        return PgOutput(type_namer(conn), publication, conn.info.server_version, spool_dir=str(spool_dir))


WAL2JSON = OutputPlugin(
    "wal2json",
    built_in=False,
    uses_publication=False,
    may_send_nonfinite_as_null=True,
    install_hint="Debian/Ubuntu: apt-get install postgresql-<version>-wal2json; RDS/Aurora/Cloud SQL ship it",
)
PGOUTPUT = OutputPlugin("pgoutput", built_in=True, uses_publication=True, may_send_nonfinite_as_null=False)
PLUGINS: dict[str, OutputPlugin] = {p.name: p for p in (WAL2JSON, PGOUTPUT)}


def plugin(name: str) -> OutputPlugin:
    """The plugin called ``name`` (validated by :mod:`cdc.config`: ``decoder`` is one of
    :data:`PLUGINS`; a slot of another plugin is not cdc's to read)."""
    try:
        return PLUGINS[name]
    except KeyError:
        raise ValueError(f"output plugin {name!r} is not one cdc reads ({', '.join(PLUGINS)})") from None


def plugin_in_use(registry: Registry | None, settings: Settings) -> OutputPlugin:
    """The output plugin of this deployment: the one its slot was created with (recorded in the
    registry by the reader, :func:`cdc.reader.plugin.choose_plugin`), else the configured
    ``decoder`` (the next slot's); ``registry`` None: none exists yet."""
    from cdc.registry import State

    recorded = registry.get_state(State.DECODER) if registry is not None else None
    return plugin(recorded or settings.decoder)


def _peek_wal2json(
    conn: psycopg.Connection[Any], slot: str, upto: int, tables: Sequence[TableReg]
) -> Pending:
    names = add_tables_option((t.schema, t.table) for t in tables)
    rows = conn.execute(
        "SELECT data FROM pg_logical_slot_peek_changes(%s, %s::pg_lsn, NULL, 'format-version', '2', "
        "'include-transaction', 'true', 'include-timestamp', 'true', 'add-tables', %s)",
        (slot, int_to_lsn(upto), names),
    ).fetchall()
    changes, oldest, begin_ms = 0, None, None
    for (data,) in rows:
        msg = orjson.loads(data)
        action = msg.get("action")
        if action == "B":
            begin_ms = commit_ts_ms(msg.get("timestamp"))
        elif action in _CHANGES:
            changes += 1
            if oldest is None:
                oldest = begin_ms
    return Pending(changes, oldest)


def _peek_pgoutput(conn: psycopg.Connection[Any], slot: str, upto: int, publication: str) -> Pending:
    # a message's first 17 bytes: its kind, and for a Begin its final LSN (8) and commit time (8:
    # µs since 2000-01-01)
    rows = conn.execute(
        "SELECT substr(data, 1, 17) FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, "
        "NULL, 'proto_version', '1', 'publication_names', %s)",
        (slot, int_to_lsn(upto), sql_ident(publication)),
    ).fetchall()
    changes, oldest, begin_ms = 0, None, None
    for (head,) in rows:
        head = bytes(head)
        kind = head[:1].decode("latin-1")
        if kind == "B":
            begin_ms = pg_time_ms(int.from_bytes(head[9:17], "big", signed=True))
        elif kind in _CHANGES:
            changes += 1
            if oldest is None:
                oldest = begin_ms
    return Pending(changes, oldest)
