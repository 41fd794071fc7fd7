"""Where an unchanged TOAST value comes from (:mod:`sinks.toast`): pure, on the columns of hand-made
events (a row is its position in the batch)."""

from __future__ import annotations

from typing import Any

import orjson

from cdc.events import Version
from sinks import ChangeEvent, columns_of
from sinks.toast import Chains
from tests.sinks.feed import table

REG = table(columns=(("id", "bigint"), ("n", "bigint"), ("body", "text")))


def chains(evs: list[ChangeEvent]) -> Chains:
    return Chains(columns_of(REG, evs), ["id"])


_offset = iter(range(1_000_000))


def ev(op: str, key: int, lsn: int, after: dict[str, Any] | None = None, **kw: Any) -> ChangeEvent:
    k = {"id": key}
    return ChangeEvent(
        key=k,
        key_json=orjson.dumps(k).decode(),
        op=op,
        version=Version(lsn, 1),
        ts_ms=0,
        after=None if op == "d" else {"id": key, **(after or {})},
        before=kw.get("before", k if op == "d" else None),
        unavailable=tuple(kw.get("unavailable", ())),
        partition=0,
        offset=next(_offset),
        snapshot=False,
    )


def moved(old: int, new: int, lsn: int, before: Any = "key") -> list[ChangeEvent]:
    b = {"id": old} if before == "key" else before
    return [ev("d", old, lsn), ev("c", new, lsn, {"n": new}, unavailable=["body"], before=b)]


def nothing_stored(key: str, v: Version) -> None:
    return None


def test_a_key_change_takes_the_value_from_the_old_keys_earlier_events() -> None:
    evs = [
        ev("c", 1, 10, {"n": 0, "body": "B"}),
        ev("u", 1, 20, {"n": 1}, unavailable=["body"]),
        *moved(1, 2, 30),
        *moved(2, 3, 40, before=None),  # a legacy event: paired by the delete of its version
    ]
    c = chains(evs)
    assert c.values(len(evs) - 1, nothing_stored) == {"id": 3, "n": 3, "body": "B"}
    assert c.unresolved(nothing_stored) == []


def test_the_stored_row_of_the_old_key_as_of_just_before_the_change() -> None:
    evs = moved(5, 6, 100)
    asked: list[tuple[str, Version]] = []

    def stored(key: str, v: Version) -> dict[str, Any]:
        asked.append((key, v))
        return {"id": 5, "body": "S"}

    assert chains(evs).values(len(evs) - 1, stored) == {"id": 6, "n": 6, "body": "S"}
    assert asked == [('{"id":5}', Version(100, 1))]
    # the delete in an earlier batch: the create alone names the old key in its before
    assert chains(evs[1:]).values(0, stored) == {"id": 6, "n": 6, "body": "S"}


def test_a_full_before_image_holds_the_value() -> None:
    evs = moved(5, 6, 100, before={"id": 5, "body": "F"})
    assert chains(evs).values(len(evs) - 1, nothing_stored) == {"id": 6, "n": 6, "body": "F"}


def test_nowhere_is_unresolved_not_the_new_keys_own_old_row() -> None:
    evs = [*moved(5, 6, 100, before=None)[1:], ev("u", 6, 110, {"n": 7}, unavailable=["body"])]
    own = {'{"id":6}': {"id": 6, "body": "stale"}}
    c = chains(evs)
    assert c.values(0, lambda k, v: own.get(k)) is None  # the old key is unknown
    assert c.unresolved(lambda k, v: own.get(k)) == [0, 1]  # the update follows the lost row
    deleted = [ev("c", 1, 1, {"body": "B"}), ev("d", 1, 2), *moved(1, 2, 3)[1:]]
    assert chains(deleted).unresolved(nothing_stored) == [len(deleted) - 1]


def test_a_long_chain_of_key_changes_is_a_loop() -> None:
    evs = [ev("c", 0, 1, {"body": "B"})]
    for i in range(1, 3001):
        evs.extend(moved(i - 1, i, 1 + i))
    assert chains(evs).values(len(evs) - 1, nothing_stored) == {"id": 3000, "n": 3000, "body": "B"}


def test_a_hot_keys_chain_is_resolved_once_per_event() -> None:
    """A catch-up batch of one key updated 3,000 times, each update lacking the same unchanged
    value, then moved to a new key: each event continues the previous one, so resolving them all asks
    the stored row once and walks one step per event (walking each event's whole chain back was
    quadratic: minutes for the fault suite's catch-up batches)."""
    n = 3000
    evs = [ev("u", 1, 10 + i, {"n": i}, unavailable=["body"]) for i in range(n)]
    evs += moved(1, 2, 10 + n)
    asked: list[str] = []
    steps = 0
    c = chains(evs)
    previous = c._previous

    def counted(key: str, v: tuple[int, int]) -> int | None:
        nonlocal steps
        steps += 1
        return previous(key, v)

    c._previous = counted  # type: ignore[method-assign]

    def stored(key: str, v: Version) -> dict[str, Any]:
        asked.append(key)
        return {"id": 1, "n": -1, "body": "B"}

    assert c.unresolved(stored) == []
    assert asked == ['{"id":1}'] and steps <= 2 * (n + 1)
    assert c.stored_keys(c.lacking) == {'{"id":1}'}
    memo: dict[int, dict[str, Any] | None] = {}
    assert c.values(len(evs) - 1, stored, memo) == {"id": 2, "n": 2, "body": "B"}
    assert c.values(n - 1, stored, memo) == {"id": 1, "n": n - 1, "body": "B"}


def test_events_out_of_version_order_are_still_chained_right() -> None:
    """A key whose events are not in version order (bisection would not hold): the linear search."""
    evs = [
        ev("u", 1, 30, {"n": 3}, unavailable=["body"]),
        ev("c", 1, 10, {"n": 1, "body": "old"}),
        ev("u", 1, 20, {"n": 2, "body": "new"}),
    ]
    c = chains(evs)
    assert c.values(0, nothing_stored) == {"id": 1, "n": 3, "body": "new"}


def test_only_the_rows_of_the_chains_keys_are_read() -> None:
    """The rows lacking values and the keys their chains run through are found in Arrow: of a batch
    of 1,000 other keys' rows, only the chain's keys (2 moved from 1, its earlier update, and 1's
    own rows) are read into Python; a batch lacking nothing reads none."""
    others = [ev("c", 100 + i, 5, {"body": "o"}) for i in range(1000)]
    evs = [
        *others,
        ev("c", 1, 10, {"n": 0, "body": "B"}),
        ev("u", 1, 20, {"n": 1}, unavailable=["body"]),
        *moved(1, 2, 30, before=None),
    ]
    c = chains(evs)
    assert sorted(c.by_key) == ['{"id":1}', '{"id":2}']
    assert sum(len(rows) for rows in c.by_key.values()) == 4
    assert c.values(len(evs) - 1, nothing_stored) == {"id": 2, "n": 2, "body": "B"}
    assert chains(others).by_key == {}
