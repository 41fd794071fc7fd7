"""The warehouse's apply plan alone (no Delta): its decisions against a plain reference loop over
randomly generated batches with repeats, out-of-order events, deletes, TRUNCATEs and stored state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pyarrow as pa

from sinks.warehouse.plan import NONE, Plan, Stored, ranks

V = tuple[int, int]
NO: V = (-1, -1)


def _reference(
    events: list[dict[str, Any]],
    truncates: list[V],
    tomb: dict[str, V],
    markers: dict[int, V],
    open_: dict[str, V],
) -> dict[str, Any]:
    """The per-event rules written as the obvious loop (what the warehouse did before the plan); an
    event is guarded by its own partition's stored marker (``markers``)."""
    new: dict[tuple[str, V], Any] = {}
    closed_open: dict[str, Any] = {}
    keys = sorted({e["key"] for e in events})
    for key in keys:
        evs = sorted((e for e in events if e["key"] == key), key=lambda e: (e["v"], e["p"], e["o"]))
        merged = sorted(
            [(e["v"], 1, e) for e in evs] + [(t, 0, None) for t in truncates], key=lambda x: (x[0], x[1])
        )
        guard = max(tomb.get(key, NO), open_.get(key, NO))
        target: tuple[str, V] | None = ("open", open_[key]) if key in open_ else None

        def close(by: Any, target: tuple[str, V] | None = target, key: str = key) -> None:
            assert target is not None
            if target[0] == "open":
                closed_open[key] = by
            else:
                new[(key, target[1])] = by

        for v, is_ev, e in merged:
            if not is_ev:
                if target is not None and target[1] < v:
                    close(("t", v), target)
                    target = None
                guard = max(guard, v)
                continue
            if v <= max(guard, markers.get(e["p"], NO)):
                continue
            guard = v
            if target is not None:
                close(("e", v), target)
                target = None
            if e["op"] != "d":
                new[(key, v)] = None
                target = ("new", v)
    last_t = max(truncates) if truncates else NO
    current, tombstones = [], []
    for key in keys:
        newest = max((e for e in events if e["key"] == key), key=lambda e: (e["v"], e["p"], e["o"]))
        if newest["v"] > last_t and (
            newest["op"] == "d" or newest["v"] > max(tomb.get(key, NO), markers.get(newest["p"], NO))
        ):
            current.append((key, newest["v"], newest["o"]))
        if newest["op"] == "d":
            tombstones.append((key, newest["v"], newest["o"]))
    return {"new": new, "closed_open": closed_open, "current": current, "tombstones": tombstones}


def _batch(
    rng: random.Random,
) -> tuple[list[dict[str, Any]], list[V], dict[str, V], dict[int, V], dict[str, V]]:
    keys = [f'{{"id":{i}}}' for i in range(rng.randint(1, 6))]
    events = []
    for o in range(rng.randint(1, 25)):
        v = (rng.randint(1, 8) * 16, rng.randint(0, 2))
        key = rng.choice(keys)  # a key's events are in one partition, as the reader writes them
        events.append({"key": key, "v": v, "op": rng.choice("rcuud"), "p": keys.index(key) % 2, "o": o})
    for e in rng.sample(events, k=min(3, len(events))):  # exact repeats (redelivery)
        events.append({**e, "o": e["o"] + 1000})
    truncates = sorted({(rng.randint(1, 8) * 16, rng.randint(0, 2)) for _ in range(rng.choice([0, 0, 1, 2]))})
    tomb = {k: (rng.randint(0, 5) * 16, 1) for k in keys if rng.random() < 0.3}
    # each partition's marker apart: one may be past a truncate whose marker the other has not brought
    markers = {p: (rng.randint(0, 3) * 16, 0) for p in (0, 1) if rng.random() < 0.3}
    open_ = {k: (rng.randint(0, 6) * 16, 2) for k in keys if rng.random() < 0.5}
    return events, truncates, tomb, markers, open_


def _table(events: list[dict[str, Any]], truncates: list[V]) -> pa.Table:
    rows = [(e["key"], e["op"], *e["v"], e["p"], e["o"]) for e in events]
    rows += [('{"__truncate__":0}', "t", *t, 0, 5000 + i) for i, t in enumerate(truncates)]
    cols = list(zip(*rows, strict=True))
    return pa.table(
        {
            "key_json": pa.array(cols[0], pa.string()),
            "op": pa.array(cols[1], pa.string()),
            "commit_lsn": pa.array(cols[2], pa.int64()),
            "seq": pa.array(cols[3], pa.int64()),
            "ts_ms": pa.array([c * 10 for c in cols[2]], pa.int64()),
            "partition": pa.array(cols[4], pa.int32()),
            "offset": pa.array(cols[5], pa.int64()),
        }
    )


def test_ranks_order_versions_and_tie_equal_ones() -> None:
    lsn = np.array([5, 1, 5, -1, 1], dtype=np.int64)
    seq = np.array([0, 9, 0, -1, 2], dtype=np.int64)
    assert ranks(lsn, seq).tolist() == [3, 2, 3, 0, 1]


def _planned(
    events: Any, truncates: Any, tomb: dict[str, V], markers: dict[int, V], open_: dict[str, V]
) -> tuple[Plan, list[str], Stored]:
    """The plan of a random batch, its keys, and the stored state ``tomb``/``open_``/``markers`` as
    the plan's arrays (:data:`NO` where a key has none)."""
    plan = Plan(_table(events, truncates))
    keys = plan.keys.to_pylist()

    def arr(d: dict[str, V], i: int) -> np.ndarray:
        return np.array([d.get(k, NO)[i] for k in keys], dtype=np.int64)

    return plan, keys, Stored(arr(tomb, 0), arr(tomb, 1), arr(open_, 0), arr(open_, 1), markers)


def test_plan_decides_what_the_reference_loop_decides() -> None:
    for seed in range(400):
        rng = random.Random(seed)
        events, truncates, tomb, markers, open_ = _batch(rng)
        plan, keys, stored = _planned(events, truncates, tomb, markers, open_)
        want = _reference(events, truncates, tomb, markers, open_)
        t = plan.t
        key_at = t.column("key_json").to_pylist()
        v_at = list(zip(t.column("commit_lsn").to_pylist(), t.column("seq").to_pylist(), strict=True))
        off_at = t.column("offset").to_pylist()
        tr = list(
            zip(
                plan.truncates.column("commit_lsn").to_pylist(),
                plan.truncates.column("seq").to_pylist(),
                strict=True,
            )
        )
        hp = plan.history(stored)

        def closer(ev: int, tt: int, v_at: list[V] = v_at, tr: list[V] = tr) -> Any:
            if ev != NONE:
                return ("e", v_at[ev])
            if tt != NONE:
                return ("t", tr[tt])
            return None

        got_new = {
            (key_at[r], v_at[r]): closer(n, tt)
            for r, n, tt in zip(hp.new, hp.new_next, hp.new_truncate, strict=True)
        }
        assert got_new == want["new"], seed
        got_closed = {
            keys[k]: closer(e, tt)
            for k, e, tt in zip(hp.closed_keys, hp.close_event, hp.close_truncate, strict=True)
        }
        assert got_closed == want["closed_open"], seed
        assert [(key_at[r], v_at[r], off_at[r]) for r in plan.current(stored)] == want["current"], seed
        assert [(key_at[r], v_at[r], off_at[r]) for r in plan.tombstones()] == want["tombstones"], seed


def test_confirmed_snapshot_reads_move_the_open_row() -> None:
    """A confirmed read (a key's first applied event, op r, with an open row) acts as the open row
    moved to its version: what the reference loop decides for that stored state, and the keys whose
    moved row no later event or truncate closes are ``moved_keys``."""
    seen = 0
    for seed in range(400):
        rng = random.Random(seed)
        events, truncates, tomb, markers, open_ = _batch(rng)
        plan, keys, stored = _planned(events, truncates, tomb, markers, open_)
        reads, against = plan.snapshot_reads(stored)
        reads = reads[against == NONE]  # those compared with the stored row
        key_at = plan.t.column("key_json").to_pylist()
        v_at = list(zip(plan.lsn.tolist(), plan.seq.tolist(), strict=True))
        applied = plan.history(stored).applied
        first = {key_at[r]: r for r in reversed(applied.tolist())}  # each key's first applied event
        assert sorted(reads.tolist()) == sorted(
            r for k, r in first.items() if k in open_ and plan.t.column("op")[r].as_py() == "r"
        ), seed
        confirmed = np.array([r for r in reads if rng.random() < 0.7], dtype=np.int64)
        seen += len(confirmed)
        moved_open = {**open_, **{key_at[r]: v_at[r] for r in confirmed}}
        want = _reference(events, truncates, tomb, markers, moved_open)
        hp = plan.history(stored, confirmed)
        got_new = {(key_at[r], v_at[r]) for r in hp.new}
        assert got_new == set(want["new"]), seed
        assert {keys[k] for k in hp.closed_keys} == set(want["closed_open"]), seed
        want_moved = {key_at[r] for r in confirmed} - set(want["closed_open"])
        assert {keys[k]: v_at[r] for k, r in zip(hp.moved_keys, hp.moved_to, strict=True)} == {
            k: moved_open[k] for k in want_moved
        }, seed
    assert seen > 50


def _reference_confirming(
    events: list[dict[str, Any]], truncates: list[V], open_: dict[str, V], stored_val: dict[str, int]
) -> dict[str, Any]:
    """The rules with confirming reads, as the obvious loop over each key's events and the truncates:
    an applied read (op r) equal to the row its key has when it comes (``val``) opens nothing, that row
    takes its version, and a truncate whose key's next applied event is such a read closes nothing."""
    new: dict[tuple[str, V], Any] = {}  # (key, first version) -> [version now, closer]
    closed_open: dict[str, Any] = {}
    moved: dict[str, V] = {}
    for key in sorted({e["key"] for e in events}):
        evs = sorted((e for e in events if e["key"] == key), key=lambda e: (e["v"], e["p"], e["o"]))
        merged = sorted(
            [(e["v"], 1, e) for e in evs] + [(t, 0, None) for t in truncates], key=lambda x: (x[0], x[1])
        )
        guard = open_.get(key, NO)
        target: list[Any] | None = ["open", open_[key], stored_val.get(key)] if key in open_ else None

        def confirms(e: dict[str, Any] | None, target: list[Any] | None) -> bool:
            return e is not None and e["op"] == "r" and target is not None and e["val"] == target[2]

        def next_applied(i: int, guard: V, merged: list[Any] = merged) -> dict[str, Any] | None:
            for v, is_ev, e in merged[i + 1 :]:
                if is_ev and v > guard:
                    return e  # type: ignore[no-any-return]
                guard = max(guard, v)
            return None

        def close(by: Any, target: list[Any], key: str = key) -> None:
            if target[0] == "open":
                closed_open[key] = by
                moved.pop(key, None)  # a moved row closed later is a closed row
            else:
                new[(key, target[0])][1] = by

        for i, (v, is_ev, e) in enumerate(merged):
            if not is_ev:
                if (
                    target is not None
                    and target[1] < v
                    and not confirms(next_applied(i, max(guard, v)), target)
                ):
                    close(("t", v), target)
                    target = None
                guard = max(guard, v)
                continue
            if v <= guard:
                continue
            guard = v
            if confirms(e, target):
                assert target is not None
                target[1] = v
                if target[0] == "open":
                    moved[key] = v
                else:
                    new[(key, target[0])][0] = v
                continue
            if target is not None:
                close(("e", v), target)
                target = None
            if e["op"] != "d":
                new[(key, v)] = [v, None]
                target = [v, v, e["val"]]
    return {"new": {k: tuple(x) for k, x in new.items()}, "closed_open": closed_open, "moved": moved}


def _confirmed(plan: Plan, stored: Stored, vals: list[int], stored_val: list[int | None]) -> np.ndarray:
    """What the caller does: the planned reads whose value equals the row they compare with."""
    reads, against = plan.snapshot_reads(stored)
    key = plan.key_of_row
    same = [
        vals[r] == (stored_val[key[r]] if a == NONE else vals[a])
        for r, a in zip(reads.tolist(), against.tolist(), strict=True)
    ]
    return reads[np.array(same, dtype=bool)] if len(reads) else reads


def test_reads_confirm_the_row_as_it_stands_after_the_batchs_earlier_events() -> None:
    """A read equal to the row its key has when it comes -- the stored row, or the one an earlier event
    of the same batch opened -- opens no history row; that row takes its version (against the loop)."""
    seen_in_batch = 0
    for seed in range(600):
        rng = random.Random(seed)
        events, truncates, _, _, open_ = _batch(rng)
        for e in events:
            e["val"] = rng.randint(0, 1)
        for e in events:  # redeliveries carry their original's value
            e["val"] = next(x["val"] for x in events if x["o"] == e["o"] % 1000 and x["key"] == e["key"])
        stored_val = {k: rng.randint(0, 1) for k in open_}
        plan, keys, stored = _planned(events, truncates, {}, {}, open_)
        by_pos = {(e["key"], e["o"]): e["val"] for e in events}
        t = plan.t
        key_at, off_at = t.column("key_json").to_pylist(), t.column("offset").to_pylist()
        vals = [by_pos[(k, o)] for k, o in zip(key_at, off_at, strict=True)]
        v_at = list(zip(plan.lsn.tolist(), plan.seq.tolist(), strict=True))
        confirmed = _confirmed(plan, stored, vals, [stored_val.get(k) for k in keys])
        seen_in_batch += sum(1 for r in confirmed if any(key_at[a] == key_at[r] for a in range(r)))
        hp = plan.history(stored, confirmed)
        tr = list(zip(*(plan.truncates.column(c).to_pylist() for c in ("commit_lsn", "seq")), strict=True))

        def closer(ev: int, tt: int, v_at: list[V] = v_at, tr: list[V] = tr) -> Any:
            return ("e", v_at[ev]) if ev != NONE else ("t", tr[tt]) if tt != NONE else None

        want = _reference_confirming(events, truncates, open_, stored_val)
        got_new = {
            (key_at[r], v_at[r]): (v_at[to], closer(n, tt))
            for r, to, n, tt in zip(hp.new, hp.new_version, hp.new_next, hp.new_truncate, strict=True)
        }
        assert got_new == want["new"], seed
        got_closed = {
            keys[k]: closer(e, tt)
            for k, e, tt in zip(hp.closed_keys, hp.close_event, hp.close_truncate, strict=True)
        }
        assert got_closed == want["closed_open"], seed
        assert {keys[k]: v_at[r] for k, r in zip(hp.moved_keys, hp.moved_to, strict=True)} == want["moved"], (
            seed
        )
    assert seen_in_batch > 30


def _one_key(ops: list[tuple[str, int]], truncates: list[V] | None = None) -> tuple[Plan, Stored]:
    """A batch of one key's events ``(op, commit_lsn)`` (offsets in that order), the key's stored
    open row at version (8, 0)."""
    events = [{"key": '{"id":1}', "v": (lsn, 0), "op": op, "p": 0, "o": o} for o, (op, lsn) in enumerate(ops)]
    plan = Plan(_table(events, truncates or []))
    one = np.array([8], dtype=np.int64)
    zero = np.array([0], dtype=np.int64)
    return plan, Stored(np.array([-1]), np.array([-1]), one, zero)


def test_a_read_equal_to_the_batchs_earlier_change_opens_no_version() -> None:
    """[u(k), r(k) equal to the u's row]: one history row (the u's), at the read's version, left open;
    different: two rows, the u's closed by the read. A replay of the batch plans nothing."""
    for truncates in ([], [(24, 0)]):  # the re-snapshot's marker between the change and the read
        plan, stored = _one_key([("u", 16), ("r", 32)], truncates)
        reads, against = plan.snapshot_reads(stored)
        assert reads.tolist() == [1] and against.tolist() == [0]  # compared with the u's row
        hp = plan.history(stored, reads)  # equal
        assert hp.new.tolist() == [0] and hp.new_version.tolist() == [1]
        assert hp.new_next.tolist() == [NONE] and hp.new_truncate.tolist() == [NONE]
        assert hp.closed_keys.tolist() == [0] and hp.close_event.tolist() == [0]  # the stored row, by u
        assert hp.moved_keys.tolist() == []
        hp = plan.history(stored, np.zeros(0, dtype=np.int64))  # different
        assert hp.new.tolist() == [0, 1] and hp.new_version.tolist() == [0, 1]
        assert hp.new_next.tolist()[0] == (1 if not truncates else NONE)
        # a replay against what the batch left (the open row at the read's version) plans nothing
        again = stored.with_open(np.array([32]), np.array([0]))
        assert [len(a) for a in _replayed(plan, again)] == [0, 0, 0, 0]


def _replayed(plan: Plan, stored: Stored) -> list[np.ndarray]:
    reads, _ = plan.snapshot_reads(stored)
    hp = plan.history(stored, reads)
    return [reads, hp.applied, hp.closed_keys, hp.moved_keys]


def _reference_fill(plan: Plan, stored: Stored, lacks: np.ndarray) -> list[Any]:
    """Where each applied row's value of a column some rows lack comes from, as the per-event
    resolver walked it: the key's previous applied upsert's value (``("row", r)``), else the stored
    row (``"stored"``) unless a delete or a TRUNCATE of the batch removed it first; None: nowhere."""
    hp = plan.history(stored)
    deleted = {int(k) for k, t in zip(hp.closed_keys, hp.close_truncate, strict=True) if t != NONE}
    closed_by_t = dict(zip(hp.new.tolist(), (hp.new_truncate != NONE).tolist(), strict=True))
    prev: dict[int, Any] = {}
    out: list[Any] = []
    for r in hp.applied.tolist():
        k = int(plan.key_of_row[r])
        if plan.is_delete[r]:
            prev.pop(k, None)
            deleted.add(k)
            out.append(None)
            continue
        src: Any = ("row", r)
        if lacks[r]:
            src = prev.get(k)
            if src is None and k not in deleted:
                src = "stored"
        out.append(src)
        if src is not None:
            prev[k] = src
        if closed_by_t[r]:
            prev.pop(k, None)
            deleted.add(k)
    return out


def test_fill_sources_take_what_the_per_event_resolver_took() -> None:
    for seed in range(400):
        rng = random.Random(seed)
        events, truncates, tomb, markers, open_ = _batch(rng)
        plan, _keys, stored = _planned(events, truncates, tomb, markers, open_)
        hp = plan.history(stored)
        lacks = np.array([rng.random() < 0.5 for _ in range(plan.t.num_rows)], dtype=bool)
        storable = np.ones(len(plan.keys), dtype=bool)
        storable[hp.closed_keys[hp.close_truncate != NONE]] = False
        src, from_stored = plan.fill_sources(hp, lacks, storable)
        got: list[Any] = []
        for j, r in enumerate(hp.applied.tolist()):
            if plan.is_delete[r]:
                got.append(None)
            elif src[j] != NONE:
                got.append(("row", int(src[j])))
            else:
                got.append("stored" if from_stored[j] else None)
        assert got == _reference_fill(plan, stored, lacks), seed
