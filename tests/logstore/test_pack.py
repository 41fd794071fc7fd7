"""The embedded store's compiled append (cdc.logstore.embedded._pack) against its reference path
(partition_array, stored_rows, msgspec's encoder): the same records give byte-identical stored
batches, the same placement and tombstone counts, for ugly inputs (empty, 0- to 3-byte keys,
multi-MB values, every msgpack length boundary of bin/str/int, tombstones, long topic names), and
an append it does not take (a record with headers, a partition, a timestamp, a non-bytes key) is
left to the reference path, which names what is wrong."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc.logstore import Record
from cdc.logstore.embedded.codec import ENCODER
from cdc.logstore.embedded.placing import stored_rows
from cdc.logstore.partition_arrays import partition_array
from cdc.logstore.partitioner import partition_for

native = pytest.importorskip("cdc.logstore.embedded._pack")


def reference(
    name: str, n: int, end: list[int], records: list[Record], now: int
) -> list[tuple[int, int, int, bytes]]:
    parts = partition_array([r.key for r in records], n)
    groups, tombstones = stored_rows(name, n, dict(enumerate(end)), parts, records, now)
    return [(p, len(rows), tombstones[p], ENCODER.encode(rows)) for p, rows in enumerate(groups) if rows]


SIZES = [0, 1, 2, 3, 4, 5, 31, 32, 127, 128, 255, 256, 65535, 65536, 3_000_000]
#: records the compiled append leaves to the reference path: headers, a partition, a timestamp, a
#: key or value that is not bytes
UNUSUAL = [
    Record(b"k", b"v", headers=(("h", b"x"),)),
    Record(b"k", b"v", partition=0),
    Record(b"k", b"v", timestamp_ms=5),
    Record("k", b"v"),  # type: ignore[arg-type]
    Record(b"k", "v"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("size", SIZES)
def test_lengths_at_every_msgpack_boundary(size: int) -> None:
    records = [
        Record(b"k" * min(size, 70_000), b'"q\\n' * (size // 4) + b"x" * (size % 4)),
        Record(bytes(range(256)) * 3, None),
        Record(b"", b""),
        Record(b"\xff", b"v"),
    ]
    for name, end, now in [
        ("cdc.public.t", [0, 0, 0], 1_764_000_000_000),
        ("t" * 31, [5, 127, 128], 0),
        ("t" * 32, [255, 256, 65_535], 127),
        ("t" * 200, [65_536, 2**32 - 1, 2**32], 2**32),
        ("é" * 200, [2**40, 0, 1], 2**62),
    ]:
        assert native.group_pack(name, 3, end, records, now) == reference(name, 3, end, records, now)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.binary(max_size=40), st.none() | st.binary(max_size=600)), min_size=1, max_size=60),
    st.integers(1, 12),
    st.integers(0, 2**50),
)
def test_random_appends_are_byte_identical(rows: list[tuple[bytes, bytes | None]], n: int, base: int) -> None:
    records = [Record(k, v) for k, v in rows]
    end = [base + 7 * p for p in range(n)]
    assert native.group_pack("cdc.s.t", n, end, records, 1_764_000_000_123) == reference(
        "cdc.s.t", n, end, records, 1_764_000_000_123
    )


@given(st.binary(max_size=64), st.integers(1, 64))
def test_placement_is_kafkas(key: bytes, n: int) -> None:
    assert native.partition_of(key, n) == partition_for(key, n)


def test_unusual_records_are_left_to_the_reference_path() -> None:
    usual = Record(b"k", b"v")
    for odd in UNUSUAL:
        assert native.group_pack("t", 2, [0, 0], [usual, odd], 1) is None
    assert native.group_pack("t", 2, [0, 0], [], 1) is None


# -- the batch's compiled records (cdc.logstore._records.Records): what the compiled per-change path
# fills and the append reads as it is; a Sequence[Record] to everyone else

records_native = pytest.importorskip("cdc.logstore._records")


def ugly_records() -> list[Record]:
    """Every length boundary, tombstones, empty keys and values, quotes, newlines, backslashes and
    multi-MB values."""
    out = []
    for size in SIZES:
        out.append(Record(b"k" * min(size, 70_000), b'{"a":"q\\"\\n\\\\' + b"\n\x00" * (size // 2) + b'"}'))
        out.append(Record(bytes(range(256))[: size % 256], None))
    return [*out, Record(b"", b""), Record(b"", None), Record(b"\xff", b"v")]


def test_records_are_the_sequence_of_the_records_added() -> None:
    given_records = ugly_records()
    recs = records_native.Records(given_records)
    assert len(recs) == len(given_records)
    assert list(recs) == given_records
    assert [recs[i] for i in range(len(recs))] == given_records
    assert recs[-1] == given_records[-1] and recs[2:7] == given_records[2:7]
    with pytest.raises(IndexError):
        recs[len(given_records)]
    more = records_native.Records()
    more.extend(recs)  # a Records from a Records: the bytes copied as they are
    more.append(Record(b"z", b"last"))
    assert list(more) == [*given_records, Record(b"z", b"last")]
    assert not records_native.Records() and recs.usual


def test_records_pack_byte_identical_to_their_list() -> None:
    given_records = ugly_records()
    for name, n, end in [("cdc.public.t", 3, [0, 5, 2**32]), ("t" * 40, 1, [7]), ("é" * 9, 12, [0] * 12)]:
        assert native.group_pack(name, n, end, records_native.Records(given_records), 11) == reference(
            name, n, end, given_records, 11
        )


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.binary(max_size=40), st.none() | st.binary(max_size=600)), min_size=1, max_size=60),
    st.integers(1, 12),
)
def test_random_records_pack_byte_identical(rows: list[tuple[bytes, bytes | None]], n: int) -> None:
    records = [Record(k, v) for k, v in rows]
    end = [3 * p for p in range(n)]
    assert native.group_pack("cdc.s.t", n, end, records_native.Records(records), 9) == reference(
        "cdc.s.t", n, end, records, 9
    )


def test_unusual_records_in_records_are_kept_and_left_to_the_reference_path() -> None:
    usual = Record(b"k", b"v")
    for odd in UNUSUAL:
        recs = records_native.Records([usual, odd, usual])
        assert not recs.usual
        assert list(recs) == [usual, odd, usual] and recs[1] is odd
        assert native.group_pack("t", 2, [0, 0], recs, 1) is None


def test_the_batch_holds_records_in_the_compiled_form_or_a_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from cdc.logstore.batch import records_form

    assert records_form() is records_native.Records
    monkeypatch.setenv("CDC_NATIVE", "0")  # the reference path: a list
    assert records_form() is list
