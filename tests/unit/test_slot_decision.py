"""The slot decision (cdc.reader.slot.decide) over every combination of its inputs."""

from __future__ import annotations

import itertools

import pytest

from cdc.reader.slot import SlotFacts, decide

CASES = [
    # exists, wal_status, initial_state, any_table_done -> action
    (True, "reserved", None, False, "foreign"),
    (True, "lost", None, True, "foreign"),  # not ours: said before anything else
    (True, "lost", "done", True, "invalidated"),
    (True, "lost", "running", False, "invalidated"),
    (False, None, "done", True, "gone"),
    (False, None, "done", False, "recover"),  # `cdc snapshot --all` after a lost slot
    (False, None, None, False, "snapshot"),
    (False, None, "running", True, "snapshot"),
    (True, "reserved", "running", False, "recreate"),
    (True, "extended", "running", True, "recreate"),
    (True, "reserved", "done", True, "resume"),
    (True, "unreserved", "done", False, "resume"),
]


@pytest.mark.parametrize(("exists", "wal_status", "initial_state", "any_done", "action"), CASES)
def test_the_decision(
    exists: bool, wal_status: str | None, initial_state: str | None, any_done: bool, action: str
) -> None:
    assert decide(SlotFacts(exists, wal_status, initial_state, any_done)) == action


def test_only_a_slot_of_this_state_directory_is_ever_dropped_or_resumed() -> None:
    for exists, status, state, done in itertools.product(
        (True, False), ("reserved", "lost", None), (None, "running", "done"), (True, False)
    ):
        action = decide(SlotFacts(exists, status, state, done))
        if action in ("recreate", "resume"):
            assert exists and state is not None and status != "lost"
        if state is None:
            assert action in ("foreign", "snapshot")
