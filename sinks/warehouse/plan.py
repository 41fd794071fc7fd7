"""The warehouse's apply plan: which events of a batch apply, what closes each history row, which rows
the current and tombstone tables get, where a row's unchanged TOAST value comes from -- decided once,
on columns.

Pure Arrow/numpy in, row positions out; no Delta (tested alone, like pyiceberg's ``upsert_util``).
Input: the batch's events as an Arrow table (:class:`sinks.columnar.Columns`) and the stored state
before the batch (:class:`Stored`: each key's tombstone, the last TRUNCATE, each key's open history row). The rules
(``docs/warehouse.md``): an event applies when it is newer than its key's tombstone, the last
TRUNCATE (stored, or earlier in the batch), the key's open history row and the key's previous applied
event (a repeat of a version counts once); each applied upsert opens a history row, closed by the
key's next applied event or by a TRUNCATE newer than it that comes first; the stored open row is
closed the same way by the key's first applied event or a TRUNCATE; the current table takes each
key's newest event when newer than the last TRUNCATE and (for an upsert) than the key's tombstone;
the tombstones take each key's newest event when it is a delete, and the last TRUNCATE. An applied
snapshot read equal to the row its key has when it comes -- the stored row for the key's first
applied event, else the row the key's previous applied upsert opens (the caller compares values:
``confirmed``) -- opens no row: that row's version moves to the read's and the read's closer closes
it (so a TRUNCATE older than the read does not close it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sinks.columnar import key_starts

__all__ = ["NONE", "HistoryPlan", "Plan", "Stored", "ranks", "versions_of"]

NONE = -1  #: "no row" in an index array


def ranks(lsn: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Dense ranks of versions ``(lsn, seq)``: equal versions get equal ranks, order is kept."""
    n = len(lsn)
    out = np.zeros(n, dtype=np.int64)
    if n == 0:
        return out
    order = np.lexsort((seq, lsn))
    ls, ss = lsn[order], seq[order]
    step = np.zeros(n, dtype=np.int64)
    step[1:] = (ls[1:] != ls[:-1]) | (ss[1:] != ss[:-1])
    out[order] = np.cumsum(step)
    return out


def versions_of(
    keys: pa.Array, table: pa.Table, key: str, lsn: str, seq: str
) -> tuple[np.ndarray, np.ndarray]:
    """Per key, the version held in ``table`` (one row per key), (-1, -1) where it holds none."""
    n = len(keys)
    out_lsn = np.full(n, -1, dtype=np.int64)
    out_seq = np.full(n, -1, dtype=np.int64)
    if table.num_rows:
        idx = pc.index_in(keys, value_set=table.column(key).combine_chunks().cast(pa.string()))
        found = pc.is_valid(idx).to_numpy(zero_copy_only=False)
        if found.any():
            at = idx.filter(pc.is_valid(idx))
            out_lsn[found] = table.column(lsn).take(at).to_numpy()
            out_seq[found] = table.column(seq).take(at).to_numpy()
    return out_lsn, out_seq


@dataclass(frozen=True)
class Stored:
    """The stored state before the batch, per key of :attr:`Plan.keys` (-1: none): the tombstone's
    version, the open history row's version; and per log-store partition, the version of the last
    TRUNCATE whose marker that partition brought (``markers``; none: (-1, -1)).

    A TRUNCATE's markers come one per partition, each after its partition's earlier events, but not
    in one batch: a batch may end past one partition's marker and before another's earlier events
    (each partition's appends become visible apart; a batch's record budget splits partitions). An
    event is therefore guarded by its own partition's marker only: the other partitions' events older
    than the truncate are still to come, and each is a version of the history."""

    tomb_lsn: np.ndarray
    tomb_seq: np.ndarray
    open_lsn: np.ndarray
    open_seq: np.ndarray
    markers: Mapping[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def empty(cls, n_keys: int) -> Stored:
        none = np.full(n_keys, -1, dtype=np.int64)
        return cls(none, none, none, none)

    def with_open(self, open_lsn: np.ndarray, open_seq: np.ndarray) -> Stored:
        return Stored(self.tomb_lsn, self.tomb_seq, open_lsn, open_seq, self.markers)


class Plan:
    """The decisions for one table's batch. ``t``: the non-TRUNCATE events sorted by key, then version,
    partition, offset (row positions below index it); ``truncates``: the batch's TRUNCATEs, one per
    version, in version order (columns ``commit_lsn``, ``seq``, ``ts_ms``)."""

    def __init__(self, events: pa.Table) -> None:
        is_t = pc.equal(events.column("op"), "t")
        t = events.filter(pc.invert(is_t))
        by_key = pc.sort_indices(
            t, sort_keys=[(c, "ascending") for c in ("key_json", "commit_lsn", "seq", "partition", "offset")]
        )
        self.t = t.take(by_key)
        #: the position in ``events`` of each row of :attr:`t`
        self.order = np.flatnonzero(~is_t.to_numpy(zero_copy_only=False))[by_key.to_numpy()]
        tr = events.filter(is_t).select(["commit_lsn", "seq", "ts_ms", "partition"])
        tr = tr.take(pc.sort_indices(tr, sort_keys=[("commit_lsn", "ascending"), ("seq", "ascending")]))
        #: per partition whose marker the batch holds, its newest TRUNCATE (``partition``,
        #: ``commit_lsn``, ``seq``, ``ts_ms``): what the tombstones' markers take (:class:`Stored`)
        self.marks = _newest_per(tr)
        tr = tr.drop_columns(["partition"])
        if tr.num_rows:
            lsn, seq = tr.column("commit_lsn").to_numpy(), tr.column("seq").to_numpy()
            first = np.ones(tr.num_rows, dtype=bool)
            first[1:] = (lsn[1:] != lsn[:-1]) | (seq[1:] != seq[:-1])
            tr = tr.filter(pa.array(first))
        self.truncates = tr
        n = self.t.num_rows
        key = self.t.column("key_json").combine_chunks()
        self.lsn = self.t.column("commit_lsn").to_numpy()
        self.seq = self.t.column("seq").to_numpy()
        self.partition = self.t.column("partition").to_numpy()
        self.is_delete = pc.equal(self.t.column("op"), "d").to_numpy(zero_copy_only=False)
        self.is_read = pc.equal(self.t.column("op"), "r").to_numpy(zero_copy_only=False)
        first = key_starts(key)
        self.first_of_key = first
        self.last_of_key = np.ones(n, dtype=bool)
        self.last_of_key[:-1] = first[1:]
        self.key_of_row = np.cumsum(first) - 1
        self.keys = key.filter(pa.array(first))
        self.first_of_version = first.copy()
        self.first_of_version[1:] |= (self.lsn[1:] != self.lsn[:-1]) | (self.seq[1:] != self.seq[:-1])

    # -- decisions -----------------------------------------------------------------------------------
    def _ranks(self, stored: Stored) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Ranks of: the events, the truncates, each event's guard (its key's tombstone or its
        partition's marker), each key's open row (-1 none) -- all in one version order."""
        n, k = self.t.num_rows, len(self.keys)
        t_lsn = self.truncates.column("commit_lsn").to_numpy()
        t_seq = self.truncates.column("seq").to_numpy()
        m = len(t_lsn)
        m_lsn, m_seq = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        for part, (lsn_at, seq_at) in stored.markers.items():
            at = self.partition == part
            m_lsn[at], m_seq[at] = lsn_at, seq_at
        lsn = np.concatenate([self.lsn, t_lsn, stored.tomb_lsn, stored.open_lsn, m_lsn, [-1]])
        seq = np.concatenate([self.seq, t_seq, stored.tomb_seq, stored.open_seq, m_seq, [-1]])
        r = ranks(lsn.astype(np.int64), seq.astype(np.int64))
        none = r[-1]  # the rank of (-1, -1): "nothing stored"
        r = r - none  # nothing stored -> 0, every real version > 0
        ev, tr = r[:n], r[n : n + m]
        tomb, open_ = r[n + m : n + m + k], r[n + m + k : n + m + 2 * k]
        guard = np.maximum(tomb[self.key_of_row], r[n + m + 2 * k : -1])
        return ev, tr, guard, np.where(open_ > 0, open_, -1), open_ > 0

    def _applied(self, stored: Stored) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """The applied events (row positions, key then version order) and the ranks they came from
        (:meth:`_ranks`)."""
        r = self._ranks(stored)
        ev, tr, guard, open_rank, _ = r
        # the last truncate at or before each event (equal: the truncate comes first and wins)
        t_le = np.searchsorted(tr, ev, side="right") - 1
        max_t = np.where(t_le >= 0, tr[np.maximum(t_le, 0)] if len(tr) else 0, 0)
        row_guard = np.maximum(guard, np.maximum(open_rank, 0)[self.key_of_row])
        applied = self.first_of_version & (ev > row_guard) & (ev > max_t)
        return np.flatnonzero(applied), r

    def _firsts(self, s: np.ndarray) -> np.ndarray:
        """Of the rows ``s`` (key order): which is the first of its key."""
        first = np.ones(len(s), dtype=bool)
        first[1:] = self.key_of_row[s][1:] != self.key_of_row[s][:-1]
        return first

    def snapshot_reads(self, stored: Stored) -> tuple[np.ndarray, np.ndarray]:
        """The snapshot reads (op ``r``) that may confirm the row their key has when they come, and
        what that row is: ``(reads, against)``. A key's first applied event compares with the stored
        current row when the key has one (``against`` NONE); a later applied read compares with the
        key's previous applied event, when that is an upsert (``against``: its row; a read after a
        delete opens a row). The reads whose values equal it (the caller compares them) go to
        :meth:`history` as ``confirmed``. Empty, at no cost, for a batch without such reads."""
        none = np.zeros(0, dtype=np.int64)
        key = self.key_of_row
        if not (self.is_read & ((stored.open_lsn[key] >= 0) | ~self.first_of_key)).any():
            return none, none  # no read that can confirm anything: nothing to plan twice
        s, _ = self._applied(stored)
        first = self._firsts(s)
        prev = np.full(len(s), NONE)
        prev[1:] = s[:-1]
        prev[first] = NONE
        upsert_before = (prev != NONE) & ~self.is_delete[np.maximum(prev, 0)]
        may = self.is_read[s] & np.where(first, stored.open_lsn[key[s]] >= 0, upsert_before)
        return s[may], prev[may]

    def _stored_confirms(self, stored: Stored, confirmed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Split ``confirmed`` into the reads that confirm their key's stored row (the last of each key's
        leading run of confirmed reads: the stored row moves to its version) and those that confirm a
        row opened earlier in the batch."""
        s, _ = self._applied(stored)
        first = self._firsts(s)
        conf = np.isin(s, confirmed)
        breaks = np.cumsum(~conf)
        # the breaks before each key's first applied event
        before_key: np.ndarray = (breaks - (~conf).astype(np.int64))[first]
        lead = conf & (breaks == before_key[np.cumsum(first) - 1])
        next_lead = np.zeros(len(s), dtype=bool)
        next_lead[:-1] = lead[1:] & ~first[1:]
        return s[lead & ~next_lead], s[conf & ~lead]

    def history(self, stored: Stored, confirmed: np.ndarray | None = None) -> HistoryPlan:
        """Which events open history rows, and what closes them and the stored open rows.
        ``confirmed``: reads of :meth:`snapshot_reads` equal to the row they compare with. One that
        confirms its key's stored row moves that row's version to its own instead of opening a row (so
        neither it nor a TRUNCATE older than it closes the stored row); one that confirms a row an
        earlier event of the batch opens is no row either: that row takes its version (``new_version``)
        and is closed by what would close the read."""
        c_first = c_in = np.zeros(0, dtype=np.int64)
        if confirmed is not None and len(confirmed):
            c_first, c_in = self._stored_confirms(stored, confirmed)
        c_key = self.key_of_row[c_first]
        if len(c_first):
            o_lsn, o_seq = stored.open_lsn.copy(), stored.open_seq.copy()
            o_lsn[c_key], o_seq[c_key] = self.lsn[c_first], self.seq[c_first]
            stored = stored.with_open(o_lsn, o_seq)
        s_all, (ev, tr, _, open_rank, has_open) = self._applied(stored)
        # a read confirming the row opened before it joins that row: the row ends at its version
        head = ~(np.isin(s_all, c_in) & ~self._firsts(s_all))
        s = s_all[head]
        ends = np.ones(len(head), dtype=bool)  # each row's last confirming read (or the row itself)
        ends[:-1] = head[1:]
        to = s_all[ends]
        key = self.key_of_row
        s_key = key[s]
        nxt = np.full(len(s), NONE)
        same = np.zeros(len(s), dtype=bool)
        same[:-1] = s_key[1:] == s_key[:-1]
        nxt[:-1] = np.where(same[:-1], s[1:], NONE)
        # first truncate strictly newer than each applied event (or the last read confirming it)
        t_gt = np.searchsorted(tr, ev[to], side="right")
        has_t = t_gt < len(tr)
        t_rank = np.where(has_t, tr[np.minimum(t_gt, max(len(tr) - 1, 0))] if len(tr) else 0, 0)
        by_t = has_t & ((nxt == NONE) | (t_rank < ev[np.maximum(nxt, 0)]))
        up = ~self.is_delete[s]
        new = s[up]
        new_next = np.where(by_t[up], NONE, nxt[up])
        new_trunc = np.where(by_t[up], t_gt[up], NONE)
        # the stored open rows: closed by the key's first applied event, or a truncate newer than them
        first_applied = self._firsts(s)
        first_ev = np.full(len(self.keys), NONE)
        first_ev[s_key[first_applied]] = s[first_applied]
        o_t = np.searchsorted(tr, open_rank, side="right")
        o_has_t = has_open & (o_t < len(tr))
        o_t_rank = np.where(o_has_t, tr[np.minimum(o_t, max(len(tr) - 1, 0))] if len(tr) else 0, 0)
        o_by_t = o_has_t & ((first_ev == NONE) | (o_t_rank < ev[np.maximum(first_ev, 0)]))
        o_by_ev = has_open & ~o_by_t & (first_ev != NONE)
        closed_keys = np.flatnonzero(o_by_t | o_by_ev)
        moved = ~(o_by_t | o_by_ev)[c_key]
        return HistoryPlan(
            applied=s,
            new=new,
            new_next=new_next,
            new_truncate=new_trunc,
            closed_keys=closed_keys,
            close_event=np.where(o_by_ev[closed_keys], first_ev[closed_keys], NONE),
            close_truncate=np.where(o_by_t[closed_keys], o_t[closed_keys], NONE),
            moved_keys=c_key[moved],
            moved_to=c_first[moved],
            new_version=to[up],
        )

    def fill_sources(
        self, hp: HistoryPlan, lacks: np.ndarray, storable: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For one column that rows lack (``lacks``, per row: an unchanged TOAST value not sent), per
        applied row (``hp.applied``): the row it takes the value from -- itself when it holds one, else
        the key's nearest earlier applied upsert holding one, since the key's last applied delete or
        the TRUNCATE that closed its row (NONE: none) -- and, lacking such a row, whether it takes the
        key's stored row: only in the key's first run of applied rows, when no TRUNCATE of the batch
        closed the stored row (``storable``, per key). A row lacking the value that gets neither is
        unresolved."""
        s = hp.applied
        m = len(s)
        if m == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        ar = np.arange(m)
        dele = self.is_delete[s]
        first = self._firsts(s)
        closed_by_t = np.zeros(m, dtype=bool)
        closed_by_t[~dele] = hp.new_truncate != NONE
        run = first.copy()  # where a run of rows that may pass a value on starts
        run[1:] |= dele[:-1] | closed_by_t[:-1]
        holds = ~lacks[s] & ~dele
        last = np.maximum.accumulate(np.where(holds, ar, -1))
        run_at = np.maximum.accumulate(np.where(run, ar, 0))
        found = last >= run_at
        src = np.where(found, s[np.maximum(last, 0)], NONE)
        from_stored = ~found & first[run_at] & storable[self.key_of_row[s]]
        return src, from_stored

    def current(self, stored: Stored) -> np.ndarray:
        """Rows for the current table: each key's newest event, when newer than the batch's last
        TRUNCATE and -- for an upsert -- than the key's tombstone and the stored TRUNCATE."""
        ev, tr, guard, _, _ = self._ranks(stored)
        last = np.flatnonzero(self.last_of_key)
        keep = self.is_delete[last] | (ev[last] > guard[last])
        if len(tr):
            keep &= ev[last] > tr[-1]
        out: np.ndarray = last[keep]
        return out

    def tombstones(self) -> np.ndarray:
        """Rows for the tombstones table: each key's newest event when it is a delete (the last
        TRUNCATE is ``truncates[-1]``)."""
        out: np.ndarray = np.flatnonzero(self.last_of_key & self.is_delete)
        return out


def _newest_per(truncates: pa.Table) -> pa.Table:
    """The last row of each ``partition`` of ``truncates`` (in version order)."""
    last = {int(p): i for i, p in enumerate(truncates.column("partition").to_pylist())}
    return truncates.take(pa.array(sorted(last.values()), pa.int64()))


@dataclass(frozen=True)
class HistoryPlan:
    """Row positions (into :attr:`Plan.t`) of the history's writes.

    ``applied``: every applied event, in key then version order. ``new``: the applied upserts (each
    opens a row); ``new_next[i]``: the row closing ``new[i]`` (NONE: none), or ``new_truncate[i]``: the
    position in :attr:`Plan.truncates` of the TRUNCATE closing it. ``closed_keys``: the keys (positions
    in :attr:`Plan.keys`) whose stored open row is closed, by ``close_event`` (a row) or
    ``close_truncate`` (a truncate), one of them NONE. ``moved_keys``: the keys whose stored open row
    stays open with its version moved to that of the row ``moved_to`` (a confirming snapshot read)."""

    applied: np.ndarray
    new: np.ndarray
    new_next: np.ndarray
    new_truncate: np.ndarray
    closed_keys: np.ndarray
    close_event: np.ndarray
    close_truncate: np.ndarray
    moved_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    moved_to: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    new_version: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
