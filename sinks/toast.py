"""Where an unavailable (unchanged TOAST) value of a batch's event comes from, for every sink.

An UPDATE that leaves an out-of-line TOASTed column unchanged carries no value for it
(``ChangeEvent.unavailable``): the value is the one the row held just before. For an update that is
the key's own previous state: its previous event in the batch, else what the sink stored. A
primary-key change is ``d`` of the old key + ``c`` of the new key, sharing one version
(``docs/events.md``); its ``c`` lacks the unchanged columns too, and the row it continues is the *old*
key's: the ``c``'s ``before`` when that holds them (REPLICA IDENTITY FULL), else the old key's state
just before the change -- its previous event in the batch, else what the sink stored for it (a
warehouse: the old key's newest history row older than the change, also when its delete was applied
by an earlier batch). The old key is the ``d`` of the same version in the batch, else the key in the
``c``'s ``before`` (the reader writes the old identity there). Pure: the sink hands in what it stored.

Cost: linear in the batch. A hot key's updates that each lack the same unchanged value form a
chain as long as the key's events; each event's values are resolved once per lookup and reused by
the next event of the chain (:meth:`Chains.values` with a memo), and a key's previous event is found
by bisection -- resolving each event by walking its whole chain back was quadratic in a key's events
(minutes for a catch-up batch of a few hot keys).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import orjson

from cdc.events import Version
from sinks import ChangeEvent, Stored

__all__ = ["Chains", "Stored"]


class Chains:
    """A batch's events (version order) per key, and its deletes per version."""

    def __init__(self, events: Sequence[ChangeEvent], key_cols: Sequence[str]) -> None:
        self.key_cols = tuple(key_cols)
        self.by_key: dict[str, list[ChangeEvent]] = {}
        self.deletes: dict[Version, list[ChangeEvent]] = {}
        for ev in events:
            if ev.op == "t":
                continue
            self.by_key.setdefault(ev.key_json, []).append(ev)
            if ev.op == "d":
                self.deletes.setdefault(ev.version, []).append(ev)
        #: per key whose events are in version order (the usual case: one partition, in order), their
        #: versions, for bisection; the other keys are searched linearly
        self._versions: dict[str, list[Version]] = {}
        for key, evs in self.by_key.items():
            versions = [e.version for e in evs]
            if all(a <= b for a, b in itertools.pairwise(versions)):
                self._versions[key] = versions

    @staticmethod
    def is_moved(ev: ChangeEvent) -> bool:
        """An insert lacking columns: only the ``c`` of a primary-key change does."""
        return bool(ev.unavailable) and ev.op in ("c", "r")

    def old_key(self, ev: ChangeEvent) -> str | None:
        """The old key of a primary-key change's ``c`` (None: unknown): the ``d`` of the same version
        in the batch, else the key in its ``before``."""
        for d in self.deletes.get(ev.version, ()):
            if d.key_json != ev.key_json:
                return d.key_json
        b = ev.before
        if b is not None and all(k in b for k in self.key_cols):
            old = orjson.dumps({k: b[k] for k in self.key_cols}).decode()
            if old != ev.key_json:
                return old
        return None

    def old_keys(self, events: Sequence[ChangeEvent]) -> list[str]:
        """The old keys of the primary-key changes among ``events`` that lack columns."""
        return sorted({k for ev in events if self.is_moved(ev) and (k := self.old_key(ev)) is not None})

    def _previous(self, key: str, v: Version) -> ChangeEvent | None:
        """The key's newest event of the batch older than ``v``."""
        evs = self.by_key.get(key, ())
        versions = self._versions.get(key)
        if versions is not None:
            i = bisect.bisect_left(versions, v)
            return evs[i - 1] if i > 0 else None
        for e in reversed(evs):
            if e.version < v:
                return e
        return None

    def values(
        self, ev: ChangeEvent, stored: Stored, memo: dict[int, dict[str, Any] | None] | None = None
    ) -> dict[str, Any] | None:
        """``ev``'s values with its unavailable columns filled (None: no row holds them). Follows
        the row back -- through the key's earlier events and the primary-key changes that moved it --
        to the first event or stored row that holds every value; a loop, however long the chain.
        ``memo``: the values of events resolved before with the same ``stored`` (by ``id``), read
        and filled, so that resolving every event of a batch costs one step per event."""
        assert ev.after is not None
        chain: list[ChangeEvent] = []
        e: ChangeEvent | None = ev
        key, v = ev.key_json, ev.version
        base: dict[str, Any] | None = None
        while True:
            if e is None:
                base = stored(key, v)
                break
            if memo is not None and id(e) in memo:
                base = memo[id(e)]
                if base is None:
                    break
                if e is ev:
                    return dict(base)
                break
            if e.op == "d":
                break
            if not e.unavailable:
                base = e.after
                break
            chain.append(e)
            if self.is_moved(e):
                b = e.before
                if b is not None and all(c in b for c in e.unavailable):
                    base = b
                    break
                old = self.old_key(e)
                if old is None:
                    break
                key = old
            else:
                key = e.key_json
            v = e.version
            e = self._previous(key, v)
        if base is None:
            if memo is not None:
                memo.update((id(c), None) for c in chain)
            return None
        for e in reversed(chain):
            assert e.after is not None
            base = {**e.after, **{c: base.get(c) for c in e.unavailable}}
            if memo is not None:
                memo[id(e)] = base
        return base

    def stored_keys(self, events: Iterable[ChangeEvent]) -> set[str]:
        """The keys whose stored rows resolving ``events`` may ask for (to read them in one go)."""
        asked: set[str] = set()

        def note(key: str, _v: Version) -> None:
            asked.add(key)

        memo: dict[int, dict[str, Any] | None] = {}
        for ev in events:
            if ev.unavailable and ev.op != "d":
                self.values(ev, note, memo)
        return asked

    def unresolved(
        self, stored: Stored, applied: Callable[[ChangeEvent], bool] = lambda ev: False
    ) -> list[ChangeEvent]:
        """The events lacking columns that no row holds (``stored`` may answer with any dict for
        "a row exists": only presence counts), except those the sink ``applied`` already (a replay:
        its version guard skips them)."""
        memo: dict[int, dict[str, Any] | None] = {}
        return [
            ev
            for evs in self.by_key.values()
            for ev in evs
            if ev.unavailable and ev.op != "d" and not applied(ev) and self.values(ev, stored, memo) is None
        ]
