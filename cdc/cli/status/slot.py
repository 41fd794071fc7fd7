"""Slot safety: how close the retained WAL is to losing the slot, and the ``drop`` policy.

:func:`judge_slot` is pure: the slot's verdict from its facts and the thresholds. The critical
threshold is the lower of ``retained_wal_critical_bytes`` and 80 % of the server's
``max_slot_wal_keep_size`` (when that is set), so status goes critical *before* Postgres invalidates
the slot; ``wal_status`` ``unreserved`` (WAL beyond ``max_wal_size``, removed at the next
checkpoint) is critical too, ``extended`` a warning.

:func:`drop_slot` carries out the ``drop`` policy (``slot_policy = "drop"``): when the retained WAL
reaches ``slot_drop_at_bytes`` while no process streams from the slot, or Postgres already
invalidated it (``wal_status = lost``), it drops the slot, marks every registered table for
re-snapshot (``pending``) and records why and when in the registry (:attr:`cdc.registry.State.SLOT_DROPPED`); the next
``cdc run`` finds no slot and every table pending, creates a new slot and snapshots them again (the
reader's own path after a lost slot). Status shows the record while any table still waits for its
re-snapshot, and as a note afterwards. Never in silence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg

from cdc.cli.status.judge import ERROR, OK, WARN, Judgement
from cdc.preflight import human_bytes

if TYPE_CHECKING:
    from cdc.catalog import SlotInfo
    from cdc.cli.status.options import StatusOptions
    from cdc.registry import Registry


def critical_at(options: StatusOptions, max_keep: int | None) -> int:
    limit = options.retained_wal_critical_bytes
    if max_keep is not None and max_keep >= 0:
        limit = min(limit, int(max_keep * 0.8))
    if options.slot_policy == "drop" and options.slot_drop_at_bytes is not None:
        limit = min(limit, int(options.slot_drop_at_bytes * 0.8))
    return limit


def judge_slot(
    info: SlotInfo | None,
    options: StatusOptions,
    *,
    max_keep: int | None,
    expected: bool,
    dropped: dict[str, Any] | None,
    awaiting_resnapshot: bool,
) -> tuple[Judgement, str | None]:
    """(verdict, fix in words) of the slot. ``expected``: the registry says a slot must exist
    (initial snapshot done); ``dropped``: the last policy drop record."""
    name = info.name if info else "?"
    if dropped is not None and awaiting_resnapshot:
        return (
            Judgement(
                ERROR,
                "critical",
                f"slot {dropped.get('slot')!r} was dropped at {dropped.get('at')} ({dropped.get('reason')}); "
                f"{len(dropped.get('tables', []))} table(s) wait for their re-snapshot",
            ),
            "run `cdc run`: it creates a new slot and re-snapshots the marked tables; then `cdc verify`",
        )
    if info is None:
        return Judgement(WARN, "warn", "source not reachable: slot unknown"), "check the source (CDC_SOURCE)"
    if not info.exists:
        if expected:
            return (
                Judgement(ERROR, "critical", f"replication slot {name!r} does not exist any more"),
                "re-snapshot every table: `cdc snapshot --all`, then `cdc run` (it creates a new slot)",
            )
        return Judgement(OK, "ok", "no slot yet (the first `cdc run` creates it)"), None
    if info.wal_status == "lost":
        return (
            Judgement(ERROR, "critical", f"slot {name!r} was invalidated by Postgres (wal_status = lost)"),
            're-snapshot every table: `cdc snapshot --all`, then `cdc run`; or set slot_policy = "drop" '
            "so that status drops the dead slot and marks the tables itself",
        )
    retained = info.retained_bytes or 0
    crit = critical_at(options, max_keep)
    limit_txt = (
        f"max_slot_wal_keep_size ({human_bytes(max_keep)})"
        if max_keep is not None and max_keep >= 0
        else "the source's free disk (max_slot_wal_keep_size is unlimited)"
    )
    fix = (
        f"the slot retains {human_bytes(retained)} of WAL because capture is behind or not running: start `cdc run` "
        f"(or find why it does not advance in `cdc status`); if it cannot catch up before {limit_txt} is "
        f"reached, the slot is lost and every table must be re-snapshotted. To free the WAL now, drop the "
        f"slot (SELECT pg_drop_replication_slot('{name}')) and run `cdc snapshot --all` then `cdc run`, "
        'or set slot_policy = "drop" with slot_drop_at_bytes in [status] to do that automatically'
    )
    if retained >= crit or info.wal_status == "unreserved":
        why = "wal_status = unreserved" if info.wal_status == "unreserved" else f"over {human_bytes(crit)}"
        return Judgement(WARN, "critical", f"retained WAL {human_bytes(retained)} ({why})"), fix
    if retained >= options.retained_wal_warn_bytes or info.wal_status == "extended":
        return Judgement(
            WARN,
            "warn",
            f"retained WAL {human_bytes(retained)} (over {human_bytes(options.retained_wal_warn_bytes)})",
        ), fix
    state = "active" if info.active else "inactive"
    recovered = (
        f"; recovered from the loss of slot {dropped.get('slot')!r} at {dropped.get('at')}: "
        f"{dropped['reread_rows']} rows re-read from {len(dropped.get('reread', {}))} table(s)"
        if dropped and "reread_rows" in dropped
        else ""
    )
    return Judgement(
        OK, "ok", f"{state}, wal_status {info.wal_status}, retained WAL {human_bytes(retained)}{recovered}"
    ), None


def should_drop(info: SlotInfo, options: StatusOptions) -> str | None:
    """The reason to drop the slot under the policy now, or None."""
    if options.slot_policy != "drop" or not info.exists or info.active:
        return None
    if info.wal_status == "lost":
        return "Postgres invalidated the slot (wal_status = lost)"
    limit = options.slot_drop_at_bytes
    if limit is not None and (info.retained_bytes or 0) >= limit:
        return (
            f"retained WAL {info.retained_bytes} bytes reached slot_drop_at_bytes {limit} with capture down"
        )
    return None


def drop_slot(
    conn: psycopg.Connection[Any], registry: Registry, info: SlotInfo, reason: str
) -> dict[str, Any]:
    """Drop the slot, mark every registered table ``pending`` and record why and when."""
    conn.execute("SELECT pg_drop_replication_slot(%s)", [info.name])
    return registry.slot_dropped(
        info.name, reason, retained_wal_bytes=info.retained_bytes, wal_status=info.wal_status
    )
