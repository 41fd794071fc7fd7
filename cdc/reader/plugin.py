"""The reader's output plugin and what goes with it: which plugin a session decodes with, its
decoder, and the recovery from a lost slot (``slot_lost = "resnapshot"``).

The plugin is fixed when the slot is created (``decoder`` in cdc.toml; ``docs/decoders.md``): a
session takes the existing slot's, and refuses a configured one that differs rather than decode a
stream it was not asked for. The registry records it (:attr:`cdc.registry.State.DECODER`) for the
verbs that do not connect.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson
import psycopg

from cdc.catalog import slot_info
from cdc.codec.plugins import PLUGINS, OutputPlugin, plugin
from cdc.errors import SourcePermanentError
from cdc.registry import Registry, State

__all__ = ["choose_plugin", "note_reread", "resnapshot_after_lost_slot"]


def choose_plugin(conn: psycopg.Connection[Any], slot: str, wanted: str) -> OutputPlugin:
    """The session's output plugin: the existing slot's (a slot cannot change plugin), else
    ``wanted`` (the configured ``decoder``). A slot of the other decoder is refused, with the way
    to switch; a slot of a plugin cdc does not read is left to the slot decision (foreign)."""
    info, chosen = slot_info(conn, slot), plugin(wanted)
    if not info.exists or info.plugin not in PLUGINS or chosen.made(info.plugin):
        return chosen
    raise SourcePermanentError(
        f"decoder = {wanted!r} is configured, but replication slot {slot!r} was created with "
        f"{info.plugin!r}, and a slot cannot change its output plugin",
        fix=f"keep decoder = {info.plugin!r} (CDC_DECODER), or switch: stop `cdc run`, drop the "
        f"slot (SELECT pg_drop_replication_slot('{slot}')), run `cdc snapshot --all`, then `cdc run` "
        f"(a new {wanted} slot; every table is snapshotted again in chunks while streaming)",
        slot=slot,
        plugin=info.plugin,
        decoder=wanted,
    )


def resnapshot_after_lost_slot(
    conn: psycopg.Connection[Any],
    registry: Registry,
    slot: str,
    action: str,
    wal_status: str | None,
    log: Callable[[str], None],
) -> None:
    """``slot_lost = "resnapshot"``: drop an ``invalidated`` slot (the caller made sure no process
    streams from it), mark every table for a chunked re-snapshot (each ends with a TRUNCATE marker,
    so rows deleted while no slot existed go) and record why and when
    (:attr:`State.SLOT_DROPPED`, which ``cdc status`` shows). The caller then creates the slot."""
    if action == "invalidated":
        conn.execute("SELECT pg_drop_replication_slot(%s)", [slot])
    why = (
        "Postgres invalidated the slot (wal_status = lost)"
        if action == "invalidated"
        else "the slot does not exist on the source any more (a failover to a server without it, "
        "or dropped by hand)"
    )
    reason = f"{why}; slot_lost = resnapshot: every table is snapshotted again"
    record = registry.slot_dropped(slot, reason, wal_status=wal_status)
    log(f"warning: replication slot {slot!r}: {reason} ({len(record['tables'])} table(s))")


def note_reread(registry: Registry, table: str, rows: int) -> None:
    """The cost of a recovery from a lost slot: the rows of ``table``'s chunked re-snapshot, in the
    :attr:`State.SLOT_DROPPED` record (``reread``), once per table it marked; with the last, the
    total (``reread_rows``) and when it finished (``reread_done_at``)."""
    raw = registry.get_state(State.SLOT_DROPPED)
    record = orjson.loads(raw) if raw else None
    if not record or table not in record.get("tables", []) or table in record.get("reread", {}):
        return
    reread = {**record.get("reread", {}), table: rows}
    record["reread"] = reread
    if set(reread) >= set(record["tables"]):
        record["reread_rows"] = sum(reread.values())
        record["reread_done_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    registry.set_state(State.SLOT_DROPPED, orjson.dumps(record).decode())
