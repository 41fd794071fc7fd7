"""The slot decision: what a reader session does with its replication slot, from what it found.

A pure function of the facts (:func:`decide`), so every case is unit-tested without a server
(``tests/unit/test_slot_decision.py``); the reader reads the facts and carries the decision out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: ``resume``: stream from the slot's confirmed position; ``snapshot``: create the slot with an
#: exported snapshot and take the initial snapshot; ``recreate``: the same, after dropping the slot
#: this state directory created but whose initial snapshot never completed; ``recover``: a new slot
#: after a lost one, every table snapshotted in chunks while streaming; the others are refusals:
#: ``foreign`` (the slot is not this state directory's), ``invalidated`` (``wal_status = 'lost'``),
#: ``gone`` (the slot of a completed initial snapshot no longer exists, and tables relied on it)
Action = Literal["resume", "snapshot", "recreate", "recover", "foreign", "invalidated", "gone"]


@dataclass(frozen=True)
class SlotFacts:
    """What the session found: the slot (:func:`cdc.catalog.slot_info`) and the registry."""

    exists: bool
    wal_status: str | None
    #: registry state ``initial_snapshot``: None (this state directory never created the slot),
    #: ``running`` (created, initial snapshot under way) or ``done``
    initial_state: str | None
    #: some registered table's snapshot is done (its later changes come from the slot)
    any_table_done: bool


def decide(facts: SlotFacts) -> Action:
    """The action for ``facts`` (see :data:`Action`); refusals first, in this order."""
    initial_done = facts.initial_state == "done"
    if facts.exists and facts.initial_state is None:
        return "foreign"
    if facts.exists and facts.wal_status == "lost":
        return "invalidated"
    if not facts.exists and initial_done and facts.any_table_done:
        return "gone"
    if not facts.exists and initial_done:
        return "recover"
    if not facts.exists:
        return "snapshot"
    if not initial_done:
        return "recreate"
    return "resume"
