"""The pure parts of an incremental verify's ranges (:mod:`cdc.cli.verify.ranges`): placing keys,
merging ranges into key intervals, the scrub's rotation, which key types have ranges; which keys of
a span the index is asked for, and the warehouse's filter of a record batch to the spans."""

from __future__ import annotations

import random

import numpy as np
import orjson
import pyarrow as pa
import pytest

from cdc.cli.verify.ranges import (
    DIGEST,
    SPANNED_MAX,
    Bounds,
    FlatBounds,
    RangeRecord,
    intervals,
    scrub_sample,
    spanned_keys,
    unsupported,
)
from cdc.registry import Column, TableReg
from sinks.warehouse.delta import SpanMask, _Meets, bool_array


def record(bounds: list[tuple[object, ...]]) -> RangeRecord:
    return RangeRecord(0.0, "0/0", "full", {0: 0}, bounds, [""] * max(len(bounds), 1))


def test_keys_fall_in_the_range_of_the_last_bound_at_or_below_them() -> None:
    rec = record([(1,), (33,), (65,)])
    assert [rec.range_of((k,)) for k in (-5, 1, 32, 33, 64, 65, 10**12)] == [0, 0, 0, 1, 1, 2, 2]
    text = record([("A",), ("a",), ("é",)])  # code point order: "B" < "a", "z" < "é"
    assert [text.range_of((k,)) for k in ("", "B", "a", "z", "é", "日")] == [0, 0, 1, 1, 2, 2]
    composite = record([("a", 1), ("a", 5), ("b", 0)])
    assert [composite.range_of(k) for k in (("a", 4), ("a", 5), ("a", 99), ("b", -1))] == [0, 1, 1, 1]
    assert record([]).range_of((7,)) == 0 and record([]).ranges == 1


def test_many_keys_are_placed_as_one_key_at_a_time_is() -> None:
    """``Bounds.of_many`` (one numpy search for one-column integer keys) places every key where
    ``of`` (bisection over the sort keys) does, at the ends and past int64 too."""
    cases: list[tuple[list[tuple[object, ...]], list[tuple[object, ...]]]] = [
        ([(1,), (33,), (65,)], [(k,) for k in (-(2**63), -5, 0, 1, 32, 33, 64, 65, 2**63 - 1)]),
        ([(-(2**62),), (0,), (2**62,)], [(-(2**63),), (-1,), (0,), (2**62,), (2**64,)]),  # past int64
        ([("A",), ("a",), ("é",)], [(k,) for k in ("", "B", "a", "z", "é", "日")]),
        ([("a", 1), ("a", 5), ("b", 0)], [("a", 4), ("a", 5), ("a", 99), ("b", -1)]),
        ([], [(7,), (-7,)]),
    ]
    for firsts, keys in cases:
        bounds = Bounds(firsts)
        assert (
            bounds.of_many(keys) == [bounds.of(k) for k in keys] == [record(firsts).range_of(k) for k in keys]
        )
    assert Bounds([(1,), (33,)]).ints is not None and Bounds([("a",)]).ints is None
    assert Bounds([(1,), (33,)]).of_many([]) == []


def test_adjacent_ranges_merge_into_one_interval_and_the_ends_are_open() -> None:
    rec = record([(1,), (33,), (65,), (97,)])
    assert intervals(rec, [1, 2]) == [((33,), (97,))]
    assert intervals(rec, [0, 2, 3]) == [(None, (33,)), ((65,), None)]
    assert intervals(rec, [0, 1, 2, 3]) == [(None, None)]
    assert intervals(rec, []) == []


def test_the_scrub_rotates_over_the_unchanged_ranges_and_wraps() -> None:
    rec = record([(i,) for i in range(10)])
    rec.scrub_next = 8
    assert scrub_sample(rec, {9, 0}, 3) == [8, 1, 2]
    assert scrub_sample(rec, set(range(10)), 3) == []
    assert scrub_sample(rec, set(), 0) == []
    assert sorted(scrub_sample(rec, set(), 50)) == list(range(10))  # at most every range once


def test_only_integer_and_text_keys_have_ranges() -> None:
    def reg(*types: str) -> TableReg:
        cols = tuple(Column(f"k{i}", t) for i, t in enumerate(types))
        return TableReg("public", "t", "cdc.public.t", tuple(c.name for c in cols), columns=cols)

    assert unsupported(reg("bigint")) is None and unsupported(reg("text", "integer")) is None
    assert unsupported(reg("character varying(20)")) is None
    assert unsupported(reg("uuid")) == "key column k0 is uuid: only integer and text keys have ranges"
    assert unsupported(reg("integer", "numeric(10,2)")) is not None


def test_the_keys_of_narrow_integer_spans_are_listed_for_the_index() -> None:
    def reg(*types: str) -> TableReg:
        cols = tuple(Column(f"k{i}", t) for i, t in enumerate(types))
        return TableReg("public", "t", "cdc.public.t", tuple(c.name for c in cols), columns=cols)

    spans = [(None, (3,)), ((10,), (13,)), ((100,), (100 + SPANNED_MAX + 1,)), ((5000,), None)]
    assert spanned_keys(reg("bigint"), spans) == [(10,), (11,), (12,)]  # the open and wide ones: none
    assert spanned_keys(reg("text"), [(("a",), ("b",))]) == []
    assert spanned_keys(reg("integer", "integer"), [((1, 1), (2, 1))]) == []


def test_a_record_batch_is_filtered_to_the_spans_in_the_keys_order() -> None:
    ints = pa.array([-(2**63), 1, 5, 10, 33, 34, 64, 100, 2**63 - 1], pa.int64())
    spans = [(None, (5,)), ((10,), (34,)), ((100,), None)]
    assert SpanMask(spans)(ints).tolist() == [True, True, False, True, True, False, False, True, True]
    assert SpanMask([((5,), (6,))])(ints).tolist() == [False, False, True] + [False] * 6
    assert SpanMask([])(ints).tolist() == [False] * 9
    # text in code point order (COLLATE "C"): "B" < "a" < "z" < "é"
    texts = pa.array(["", "B", "a", "it's", "z", "é", "日本"])
    assert SpanMask([(("a",), ("z",)), (("é",), None)])(texts).tolist() == [
        False,
        False,
        True,
        True,
        False,
        True,
        True,
    ]
    assert SpanMask([(None, ("a",))])(texts).tolist() == [True, True] + [False] * 5


def test_a_bucket_meets_the_spans_as_testing_every_span_says() -> None:
    """The warehouse's bucket pruning (bisection over the spans) against its definition: some span
    with ``lo < bucket_hi`` and ``hi > bucket_lo`` (open ends unbounded), on random merged spans."""
    rnd = random.Random(35)
    for _ in range(300):
        cuts = sorted(rnd.sample(range(-50, 150), rnd.randint(0, 12)))
        pairs = [(cuts[i], cuts[i + 1]) for i in range(0, len(cuts) - 1, 2)]
        spans: list[tuple[tuple[int, ...] | None, tuple[int, ...] | None]] = [((a,), (b,)) for a, b in pairs]
        if spans and rnd.random() < 0.3:
            spans[0] = (None, spans[0][1])
        if spans and rnd.random() < 0.3:
            spans[-1] = (spans[-1][0], None)
        meets = _Meets(spans)
        for lo in range(-60, 160, 7):
            hi = lo + rnd.randint(1, 20)
            want = any((s is None or s[0] < hi) and (e is None or e[0] > lo) for s, e in spans)
            assert meets(lo, hi) == want, (spans, lo, hi)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000])
def test_a_mask_becomes_an_arrow_array_bit_for_bit(n: int) -> None:
    mask = np.arange(n) % 3 == 1
    assert bool_array(mask).to_pylist() == mask.tolist()
    assert bool_array(~mask).null_count == 0


def test_a_record_reads_back_as_written_and_an_older_format_or_digest_is_understood() -> None:
    """Format 2 (flat one-column bounds, the hashes as one string) reads back equal; a format 1
    record (before the format was named) reads the same; hashes of another digest read as unknown."""
    for bounds in ([(1,), (9,), (17,)], [("a",), ("é",)], [("a", 1), ("b", 2)], []):
        rec = RangeRecord(
            5.0, "0/1", "full", {0: 7}, bounds, [f"{i:032x}" for i in range(max(len(bounds), 1))]
        )
        rec.hashes[0] = ""  # a range not hashed yet
        back = RangeRecord.from_json(rec.to_json())
        assert (back.bounds, back.hashes, back.offsets) == (rec.bounds, rec.hashes, rec.offsets)
        assert orjson.loads(rec.to_json())["digest"] == DIGEST
    old = {
        "at": 1.0,
        "lsn": "0/1",
        "mode": "full",
        "offsets": {"0": 3},
        "bounds": [[1], [9]],
        "hashes": ["ab", "cd"],
    }
    rec = RangeRecord.from_json(orjson.dumps(old))
    assert rec.bounds == [(1,), (9,)] and rec.hashes == ["ab", "cd"] and rec.range_of((10,)) == 1
    other = RangeRecord.from_json(orjson.dumps({**old, "digest": "another/v9"}))
    assert other.bounds == rec.bounds and other.hashes == ["", ""]
    with pytest.raises(ValueError, match="newer"):
        RangeRecord.from_json(orjson.dumps({**old, "format": 99}))


def test_a_read_record_places_keys_without_making_every_bound_a_key() -> None:
    """A record read back keeps one-column bounds as the file's values (:class:`FlatBounds`): they
    still read as keys, place keys as the tuples did (numpy for integers, bisection for texts and for
    integers of another shape), and are written back unchanged."""
    cases = [[(1,), (9,), (17,)], [("a",), ("b",), ("é",)], [(-(2**63),), (0,), (2**63 - 1,)]]
    for bounds in cases:
        rec = RangeRecord(1.0, "0/1", "full", {0: 1}, bounds, ["", "", ""])
        back = RangeRecord.from_json(rec.to_json())
        assert isinstance(back.bounds, FlatBounds)
        assert back.bounds == bounds and list(back.bounds) == bounds and back.bounds[1] == bounds[1]
        assert back.bounds[1:] == bounds[1:]
        probes = [bounds[0], bounds[1], bounds[2], (bounds[2][0],)]
        assert [back.range_of(k) for k in probes] == [rec.range_of(k) for k in probes] == [0, 1, 2, 2]
        assert back.to_json() == rec.to_json()
    assert FlatBounds([1, 9]).ints() is not None and FlatBounds(["a"]).ints() is None
    assert FlatBounds([1, 2**70]).ints() is None and FlatBounds([]).ints() is None
