"""Where an unavailable (unchanged TOAST) value of a batch's row comes from, for every sink.

An UPDATE that leaves an out-of-line TOASTed column unchanged carries no value for it (the row's
``unavailable`` column, :class:`sinks.columnar.Columns`): the value is the one the row held just
before. For an update that is the key's own previous state: its previous row in the batch, else what
the sink stored. A primary-key change is ``d`` of the old key + ``c`` of the new key, sharing one
version (``docs/events.md``); its ``c`` lacks the unchanged columns too, and the row it continues is
the *old* key's: the ``c``'s ``before`` when that holds them (REPLICA IDENTITY FULL), else the old
key's state just before the change -- its previous row in the batch, else what the sink stored for it
(a warehouse: the old key's newest history row older than the change, also when its delete was
applied by an earlier batch). The old key is the ``d`` of the same version in the batch, else the key
in the ``c``'s ``before`` (the reader writes the old identity there). Pure: the sink hands in what it
stored.

Which rows matter is decided in Arrow: the rows lacking values, and every row of the keys their
chains run through (the keys lacking values, then the old keys of the key changes among their rows,
until no new key turns up). Only those rows are read into Python, so a batch without a row lacking
values costs one vectorised test. A row is named by its position in the batch's columns.

Cost: linear in those rows. A hot key's updates that each lack the same unchanged value form a chain
as long as the key's rows; each row's values are resolved once per lookup and reused by the next row
of the chain (:meth:`Chains.values` with a memo), and a key's previous row is found by bisection --
resolving each row by walking its whole chain back was quadratic in a key's rows (minutes for a
catch-up batch of a few hot keys).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from cdc.events import Version
from sinks import Stored
from sinks.columnar import Columns

__all__ = ["Chains", "Stored", "lacking_rows"]


def lacking_rows(columns: Columns) -> np.ndarray:
    """Per row, whether it lacks unavailable (unchanged TOAST) columns: an upsert (``r``/``c``/``u``)
    whose ``unavailable`` list is not empty."""
    t = columns.table
    if columns.plain or "unavailable" not in t.column_names:
        return np.zeros(t.num_rows, dtype=bool)
    un = t.column("unavailable")
    lacks = pc.and_(pc.is_valid(un), pc.greater(pc.fill_null(pc.list_value_length(un), 0), 0))
    upsert = pc.is_in(t.column("op"), pa.array(["r", "c", "u"]))
    return np.asarray(pc.fill_null(pc.and_(lacks, upsert), False).to_numpy(zero_copy_only=False), dtype=bool)


class Chains:
    """The rows of a batch's columns that lacking values may be taken from (see the module
    docstring), per key in version order, and their deletes per version. Rows are positions in
    ``columns.table``; :attr:`lacking` lists those lacking values."""

    def __init__(self, columns: Columns, key_cols: Sequence[str]) -> None:
        self.columns = columns
        self.key_cols = tuple(key_cols)
        t = columns.table
        lacks = lacking_rows(columns)
        #: the positions of the rows lacking values, ascending
        self.lacking: list[int] = np.flatnonzero(lacks).tolist()
        self.by_key: dict[str, list[int]] = {}
        self.deletes: dict[tuple[int, int], list[int]] = {}  # per version (commit_lsn, seq)
        self._key: dict[int, str] = {}
        self._op: dict[int, str] = {}
        self._version: dict[int, tuple[int, int]] = {}
        self._unavailable: dict[int, tuple[str, ...]] = {}
        self._before: dict[int, str | None] = {}  # JSON text, decoded when asked (key changes only)
        self._after: dict[int, dict[str, Any] | None] | None = None  # read at the first ask
        self._rows_read = np.zeros(0, dtype=np.int64)
        self._versions: dict[str, list[tuple[int, int]]] = {}
        if not self.lacking:
            return
        rows = self._rows(t, lacks)
        sub = t.take(pa.array(rows, pa.int64()))
        self._load(rows, sub)

    # -- which rows matter (Arrow) --------------------------------------------------------------------
    def _rows(self, t: pa.Table, lacks: np.ndarray) -> np.ndarray:
        """The positions of every row of the keys the lacking rows' chains run through: the keys
        lacking values, then the old keys of the key changes among their rows, in turn."""
        key_json = t.column("key_json")
        op = t.column("op")
        moved = np.flatnonzero(lacks & pc.is_in(op, pa.array(["c", "r"])).to_numpy(zero_copy_only=False))
        edges: dict[str, set[str]] = {}  # a key change's new key -> its old keys
        if len(moved):
            lsn, seq = t.column("commit_lsn").to_numpy(), t.column("seq").to_numpy()
            new_keys = key_json.take(pa.array(moved)).to_pylist()
            at: dict[tuple[int, int], list[str]] = {}
            for i, k in zip(moved.tolist(), new_keys, strict=True):
                at.setdefault((int(lsn[i]), int(seq[i])), []).append(k)
            deletes = np.flatnonzero(
                pc.equal(op, "d").to_numpy(zero_copy_only=False) & np.isin(lsn, lsn[moved])
            )
            for i, old in zip(deletes.tolist(), key_json.take(pa.array(deletes)).to_pylist(), strict=True):
                for k in at.get((int(lsn[i]), int(seq[i])), ()):
                    edges.setdefault(k, set()).add(old)
            for k, b in zip(new_keys, t.column("before").take(pa.array(moved)).to_pylist(), strict=True):
                old = self._key_of(None if b is None else orjson.loads(b))
                if old is not None:
                    edges.setdefault(k, set()).add(old)
        keys = set(pc.unique(key_json.filter(pa.array(lacks))).to_pylist())
        todo = list(keys)
        while todo:
            for old in edges.get(todo.pop(), ()):
                if old not in keys:
                    keys.add(old)
                    todo.append(old)
        wanted = pc.is_in(key_json, value_set=pa.array(sorted(keys), pa.string()))
        return np.flatnonzero(pc.and_(wanted, pc.not_equal(op, "t")).to_numpy(zero_copy_only=False))

    def _key_of(self, before: dict[str, Any] | None) -> str | None:
        if before is None or not all(k in before for k in self.key_cols):
            return None
        return orjson.dumps({k: before[k] for k in self.key_cols}).decode()

    def _load(self, rows: np.ndarray, sub: pa.Table) -> None:
        """The chains' rows (positions ``rows``, their columns ``sub``) as Python values; their
        ``after`` values are read at the first :meth:`after`."""
        names = ("key_json", "op", "commit_lsn", "seq", "unavailable", "before")
        for i, kj, op, lsn, sq, un, b in zip(
            rows.tolist(), *(sub.column(c).to_pylist() for c in names), strict=True
        ):
            v = (lsn, sq)
            self._key[i], self._op[i], self._version[i] = kj, op, v
            self._unavailable[i] = tuple(un) if un else ()
            self._before[i] = b
            self.by_key.setdefault(kj, []).append(i)
            if op == "d":
                self.deletes.setdefault(v, []).append(i)
        self._rows_read = rows
        for key, evs in self.by_key.items():
            versions = [self._version[i] for i in evs]
            if all(a <= b for a, b in itertools.pairwise(versions)):
                self._versions[key] = versions

    # -- a row's facts --------------------------------------------------------------------------------
    def key_json(self, row: int) -> str:
        return self._key[row]

    def version(self, row: int) -> Version:
        return Version(*self._version[row])

    def op(self, row: int) -> str:
        return self._op[row]

    def unavailable(self, row: int) -> tuple[str, ...]:
        return self._unavailable[row]

    def after(self, row: int) -> dict[str, Any] | None:
        """The row's values as sent (lacking its unavailable columns)."""
        if self._after is None:  # every row of the chains at once: one take
            rows = self._rows_read
            self._after = dict(zip(rows.tolist(), self.columns.afters(rows), strict=True))
        return self._after[row]

    def _before_of(self, row: int) -> dict[str, Any] | None:
        b = self._before[row]
        out: dict[str, Any] | None = None if b is None else orjson.loads(b)
        return out

    def is_moved(self, row: int) -> bool:
        """An insert lacking columns: only the ``c`` of a primary-key change does."""
        return bool(self._unavailable.get(row)) and self._op[row] in ("c", "r")

    def before_holds(self, row: int) -> bool:
        """A key change whose ``before`` holds every column it lacks (REPLICA IDENTITY FULL)."""
        b = self._before_of(row)
        return b is not None and all(c in b for c in self._unavailable[row])

    def old_key(self, row: int) -> str | None:
        """The old key of a primary-key change's ``c`` (None: unknown): the ``d`` of the same version
        in the batch, else the key in its ``before``."""
        key = self._key[row]
        for d in self.deletes.get(self._version[row], ()):
            if self._key[d] != key:
                return self._key[d]
        old = self._key_of(self._before_of(row))
        return old if old is not None and old != key else None

    def old_keys(self, rows: Iterable[int]) -> list[str]:
        """The old keys of the primary-key changes among ``rows`` that lack columns."""
        return sorted({k for r in rows if self.is_moved(r) and (k := self.old_key(r)) is not None})

    def _previous(self, key: str, v: tuple[int, int]) -> int | None:
        """The key's newest row of the batch older than ``v``."""
        evs = self.by_key.get(key, ())
        versions = self._versions.get(key)
        if versions is not None:
            i = bisect.bisect_left(versions, v)
            return evs[i - 1] if i > 0 else None
        for e in reversed(evs):
            if self._version[e] < v:
                return e
        return None

    def values(
        self, row: int, stored: Stored, memo: dict[int, dict[str, Any] | None] | None = None
    ) -> dict[str, Any] | None:
        """The values of the lacking ``row`` with its unavailable columns filled (None: no row holds
        them). Follows the row back -- through the key's earlier rows and the primary-key changes
        that moved it -- to the first row or stored row that holds every value; a loop, however long
        the chain. ``memo``: the values of rows resolved before with the same ``stored``, read and
        filled, so that resolving every row of a batch costs one step per row."""
        chain, found = self._walk(row, stored, memo, full=True)
        base: dict[str, Any] | None = found
        if base is None:
            if memo is not None:
                memo.update((c, None) for c in chain)
            return None
        if not chain:  # the memo held the row itself
            return dict(base)
        for e in reversed(chain):
            after = self.after(e)
            assert after is not None
            base = {**after, **{c: base.get(c) for c in self._unavailable[e]}}
            if memo is not None:
                memo[e] = base
        return base

    def _walk(
        self, row: int, stored: Stored, memo: dict[int, Any] | None, *, full: bool
    ) -> tuple[list[int], Any]:
        """The rows from ``row`` back to the first that holds every value (the chain, newest first),
        and what holds them: a row's values, a stored row, a memo entry -- or, unless ``full``, True
        for a row of the batch (only presence asked); None: nothing holds them."""
        chain: list[int] = []
        e: int | None = row
        key, v = self._key[row], self._version[row]
        while True:
            if e is None:
                return chain, stored(key, Version(*v))
            if memo is not None and e in memo:
                return chain, memo[e]
            if self._op[e] == "d":
                return chain, None
            if not self._unavailable[e]:
                return chain, self.after(e) if full else True
            chain.append(e)
            if self._op[e] in ("c", "r"):  # a key change: its before, else the old key's row
                b = self._before_of(e)
                if b is not None and all(c in b for c in self._unavailable[e]):
                    return chain, b
                old = self.old_key(e)
                if old is None:
                    return chain, None
                key = old
            else:
                key = self._key[e]
            v = self._version[e]
            e = self._previous(key, v)

    def stored_keys(self, rows: Iterable[int]) -> set[str]:
        """The keys whose stored rows resolving the lacking ``rows`` may ask for (to read them in
        one go)."""
        asked: set[str] = set()

        def note(key: str, _v: Version) -> None:
            asked.add(key)

        memo: dict[int, dict[str, Any] | None] = {}
        for r in rows:
            self.values(r, note, memo)
        return asked

    def unresolved(self, stored: Stored, applied: Callable[[int], bool] = lambda row: False) -> list[int]:
        """The rows lacking columns that no row holds, ascending (``stored`` may answer with any dict
        for "a row exists": only presence counts, no value is read), except those the sink
        ``applied`` already (a replay: its version guard skips them)."""
        memo: dict[int, Any] = {}
        out = []
        for r in self.lacking:
            if applied(r):
                continue
            chain, base = self._walk(r, stored, memo, full=False)
            memo.update((c, base) for c in chain)
            if base is None:
                out.append(r)
        return out
