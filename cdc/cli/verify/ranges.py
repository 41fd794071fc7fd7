"""The key ranges of ``cdc verify``'s last clean run, and which of them changed since.

A clean verify records per table (:func:`cdc.paths.verify_ranges`): the bounds of its key ranges
(the first key of each range, in key order, ``range_rows`` keys each at the time of the last full
verify), each range's hash (of its (key, row hash) pairs, equal on the source and the warehouse),
the topic's end offsets noted *before* the consistent point was taken, and a scrub cursor; the file
names its :data:`FORMAT` and the :data:`DIGEST` of its hashes (a record of another digest has its
hashes read as unknown: each range is checked against the source anyway). The registry's
``TableState.VERIFIED_CLEAN`` holds a summary (when, at which LSN, how) for ``cdc status``
(:meth:`RangeRecord.summary`, read by :func:`cdc.cli.status.gather.last_clean`).

An incremental verify reads the keys of the topic's records from those offsets on (a compacted topic
keeps each key's newest record, so every key changed since is there), maps them to ranges, and
checks those ranges in full, plus a rotating sample of unchanged ranges (the scrub). Why the offsets
are noted before the point: a change committed before it but captured after it lands past them, and
the next run checks its range.

Ranges are read at the source by key-range queries, so the key order must be the same in Postgres
and here: keys of integer and text columns (text compared ``COLLATE "C"``, code point order).
Other key types are verified in full every time (``fallback`` says why).

Costs and limits (figures: ``docs/benchmarks/verify_incremental.md``): the source reads only the
checked ranges (an integer key's by index range scans; text keys by a scan, as no index of another
collation serves ``COLLATE "C"``) plus a ``count(*)``; the sinks are asked for the checked ranges
only (:class:`sinks.KeyRanges`): the warehouse reads the data columns of the range buckets the
ranges reach (with changes spread over the table, that is every bucket: the rows are read, only the
checked ranges' kept and hashed), the search index looks up the documents of the keys the source
and the warehouse hold in those ranges, and of every key of an integer range of at most
:data:`SPANNED_MAX` values (:func:`spanned_keys`). What the topics do not name -- a change lost
before them, a value edited in a derived table -- is found in a range without changes only by the
scrub or ``--full`` (or, for a row missing or extra, by the row counts; so is a document the source
and the warehouse lack in a wide or text-keyed range).

Why text keys stay a scan at the source: the ranges are cut in code point order because the
warehouse's rows and the topic's keys are placed in them here, in Python, which knows no other
collation; a range read in the column's own collation (what its index serves) would hold other
keys than the range placed here. Reading the source by the keys the warehouse and the topic name
(equality, which the index serves) would miss a row the source holds that neither names, unless
the counts differ.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from psycopg import sql

from cdc.errors import UnknownTopicError
from cdc.paths import ensure_private_dir, verify_ranges
from cdc.pgtypes import VARCHAR_TYPES, type_kind
from cdc.registry import Registry, TableReg, TableState

Key = tuple[Any, ...]

#: the record file's layout (:meth:`RangeRecord.to_json`); format 1 (before it was named) is read too
FORMAT = 2
#: the range hashes' digest: blake2b (16 bytes) over each key's canonical JSON and its row hash
#: (:func:`cdc.cli.verify.compare.row_hash`); a record of another digest has its hashes read as unknown
DIGEST = "blake2b-16/v1"


def sort_key(key: Key) -> tuple[Any, ...]:
    """The order of keys here and at the source (``COLLATE "C"`` for text); same as
    :func:`cdc.cli.verify.compare._sort_key` for the supported key types."""
    return tuple((0, v) if isinstance(v, int) else (1, str(v)) for v in key)


def unsupported(reg: TableReg) -> str | None:
    """Why the table's ranges cannot be read by key-range queries (None: they can)."""
    types = {c.name: c.type.strip().lower() for c in reg.columns}
    for k in reg.key:
        t = types.get(k, "")
        base = t.split("(")[0].strip()
        if type_kind(t) != "int" and base not in VARCHAR_TYPES:
            return f"key column {k} is {t or 'unknown'}: only integer and text keys have ranges"
    return None


class Bounds:
    """The first keys of ranges, in key order, and which range a key lies in (the last bound at or
    below it; a key below the first bound is in range 0). ``order`` puts keys in key order
    (:func:`sort_key` by default). A one-column integer key's bounds are searched as one numpy array
    (a record holds tens of thousands of bounds: putting each in a Python sort key costs more than
    the keys it places); other keys by bisection over their sort keys, made on first use."""

    def __init__(self, firsts: Sequence[Key], order: Callable[[Key], Any] = sort_key) -> None:
        self.firsts = firsts
        self.order = order
        self.ints = firsts.ints() if isinstance(firsts, FlatBounds) else _int_column(firsts)
        self._sorted: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.firsts)

    def _sort_keys(self) -> list[Any]:
        if self._sorted is None:
            self._sorted = [self.order(b) for b in self.firsts]
        return self._sorted

    def of(self, key: Key) -> int:
        """The range of ``key``."""
        if (
            self.ints is not None
            and len(key) == 1
            and type(key[0]) is int
            and _INT64[0] <= key[0] <= _INT64[1]
        ):
            return max(int(np.searchsorted(self.ints, key[0], side="right")) - 1, 0)
        return max(bisect.bisect_right(self._sort_keys(), self.order(key)) - 1, 0)

    def of_many(self, keys: Sequence[Key]) -> list[int]:
        """The range of each of ``keys`` (in their order)."""
        if self.ints is not None and keys:
            values = _int_column(keys)
            if values is not None:
                idx = np.searchsorted(self.ints, values, side="right") - 1
                out: list[int] = np.maximum(idx, 0).tolist()
                return out
        return [self.of(k) for k in keys]


_INT64 = (-(2**63), 2**63 - 1)


def _int_column(keys: Sequence[Key]) -> np.ndarray | None:
    """One-column integer keys as an int64 array (None: other keys, or a value past int64)."""
    arr = _int64(keys, 2)
    return None if arr is None or arr.shape[1] != 1 else arr[:, 0]


def _int64(values: Sequence[Any], ndim: int) -> np.ndarray | None:
    """``values`` as an int64 array of ``ndim`` dimensions (None: none, not all integers within
    int64, or another shape)."""
    if not values:
        return None
    try:
        arr: np.ndarray = np.array(values)
    except (ValueError, OverflowError, TypeError):
        return None
    return arr.astype(np.int64) if arr.dtype.kind == "i" and arr.ndim == ndim else None


class FlatBounds(Sequence[Key]):
    """One-column bounds as read from a record file (:meth:`RangeRecord.from_json`): the values as
    the file holds them, each made a key only when asked for. A record holds a bound per 8 keys
    (125,000 at 1M rows), and an incremental run reads only a few of them as keys: making every one
    a tuple, then an array of the tuples, cost more than the rest of reading the file."""

    def __init__(self, values: list[Any]) -> None:
        self.values = values

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self) -> Iterator[Key]:
        return ((v,) for v in self.values)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [(v,) for v in self.values[i]]
        return (self.values[i],)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FlatBounds):
            return self.values == other.values
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def ints(self) -> np.ndarray | None:
        """The values as an int64 array (None: not all integers within int64)."""
        return _int64(self.values, 1)


@dataclass
class RangeRecord:
    """What a clean verify recorded for one table (the file's JSON, see the module docstring)."""

    at: float
    lsn: str
    mode: str
    offsets: dict[int, int]
    bounds: Sequence[Key]
    hashes: list[str]
    scrub_next: int = 0

    @property
    def ranges(self) -> int:
        return max(len(self.bounds), 1)

    @functools.cached_property
    def placed(self) -> Bounds:
        """The bounds, to place keys in ranges (made once: ``bounds`` is not changed after)."""
        return Bounds(self.bounds)

    def range_of(self, key: Key) -> int:
        return self.placed.of(key)

    def to_json(self) -> bytes:
        """The file's JSON (:data:`FORMAT` 2): one-column bounds as a flat array, the hashes as one
        comma-separated string (a record holds a bound and a hash per 8 keys: ~5 MB at 1M rows,
        read and written by every run), and the :data:`DIGEST` they were computed with."""
        if isinstance(self.bounds, FlatBounds):
            flat, values = True, self.bounds.values
        else:
            flat = all(len(b) == 1 for b in self.bounds)
            values = [b[0] for b in self.bounds] if flat else []
        return orjson.dumps(
            {
                "format": FORMAT,
                "digest": DIGEST,
                "at": self.at,
                "lsn": self.lsn,
                "mode": self.mode,
                "offsets": {str(p): o for p, o in self.offsets.items()},
                "width": 1 if flat else None,
                "bounds": values if flat else self.bounds,  # tuples: arrays
                "hashes": ",".join(self.hashes),
                "scrub_next": self.scrub_next,
            }
        )

    @classmethod
    def from_json(cls, body: bytes) -> RangeRecord:
        """A record of either format (1: bounds as arrays, hashes as an array; no digest named, which
        was :data:`DIGEST`). Hashes of another digest are unknown (empty): a range is checked against
        the source whatever its recorded hash, and its hash is recorded anew when it is clean. A
        newer format is a ValueError (:func:`load`: no record, the run is full)."""
        d = orjson.loads(body)
        if int(d.get("format", 1)) > FORMAT:
            raise ValueError(f"record format {d['format']} is newer than this cdc's ({FORMAT})")
        raw = d["bounds"]
        bounds = FlatBounds(raw) if d.get("width") == 1 else list(map(tuple, raw))
        hashes = d["hashes"].split(",") if isinstance(d["hashes"], str) else list(d["hashes"])
        if d.get("digest", DIGEST) != DIGEST:
            hashes = [""] * len(hashes)
        return cls(
            at=float(d["at"]),
            lsn=str(d["lsn"]),
            mode=str(d["mode"]),
            offsets={int(p): int(o) for p, o in d["offsets"].items()},
            bounds=bounds,
            hashes=hashes,
            scrub_next=int(d.get("scrub_next", 0)),
        )

    def summary(self) -> str:
        return json.dumps({"at": self.at, "lsn": self.lsn, "mode": self.mode, "ranges": self.ranges})


def load(state_dir: Path, reg: TableReg) -> RangeRecord | None:
    """The table's record, None when there is none (or it cannot be read: verify in full)."""
    path = verify_ranges(state_dir, reg.schema, reg.table)
    try:
        return RangeRecord.from_json(path.read_bytes())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(state_dir: Path, reg: TableReg, record: RangeRecord) -> None:
    """Write the record (atomically: a temporary file renamed), then the registry's summary."""
    path = verify_ranges(state_dir, reg.schema, reg.table)
    ensure_private_dir(path.parent)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(record.to_json())
    os.replace(tmp, path)
    with Registry(state_dir) as registry:
        registry.set_table_state(TableState.VERIFIED_CLEAN, reg.schema, reg.table, record.summary())


def topic_ends(store: Any, reg: TableReg) -> dict[int, int]:
    try:
        return dict(store.end_offsets(reg.topic))
    except UnknownTopicError:
        return {}


@dataclass
class Changes:
    """The ranges with changes since the record (``all_ranges``: a TRUNCATE, or keys that cannot be
    placed), and how many records were read."""

    ranges: set[int]
    records: int
    all_ranges: bool = False
    reason: str = ""


def changed_ranges(store: Any, reg: TableReg, record: RangeRecord) -> Changes:
    """Read the keys of the topic's records after the record's offsets (module docstring)."""
    try:
        starts, ends = store.start_offsets(reg.topic), store.end_offsets(reg.topic)
    except UnknownTopicError:
        return Changes(set(), 0)
    out = Changes(set(), 0)
    for p, end in sorted(ends.items()):
        since = record.offsets.get(p, 0)
        if starts.get(p, 0) > since:
            return Changes(
                set(), out.records, True, f"partition {p}: records after offset {since} were removed"
            )
        for rec in store.iter_partition(reg.topic, p, since, end):
            out.records += 1
            key = _key_of(reg, rec.key)
            if key is None:
                out.all_ranges, out.reason = True, f"a record at {p}:{rec.offset} changes the whole table"
                return out
            out.ranges.add(record.range_of(key))
    return out


def _key_of(reg: TableReg, raw: bytes | None) -> Key | None:
    if raw is None:
        return None
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(d, dict) or any(k not in d for k in reg.key):
        return None  # a TRUNCATE's key ({"__truncate__": p})
    return tuple(d[k] for k in reg.key)


def scrub_sample(record: RangeRecord, changed: set[int], count: int) -> list[int]:
    """``count`` unchanged ranges from the record's scrub cursor on (wrapping around)."""
    out: list[int] = []
    n = record.ranges
    i = record.scrub_next % n
    for _ in range(n):
        if len(out) >= count:
            break
        if i not in changed:
            out.append(i)
        i = (i + 1) % n
    return out


def intervals(record: RangeRecord, ranges: Iterable[int]) -> list[tuple[Key | None, Key | None]]:
    """The ranges as merged ``[lo, hi)`` key intervals (None: unbounded)."""
    out: list[tuple[Key | None, Key | None]] = []
    b = record.bounds
    for i in sorted(set(ranges)):
        lo = b[i] if 0 < i < len(b) else None
        hi = b[i + 1] if i + 1 < len(b) else None
        if out and out[-1][1] is not None and lo is not None and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


#: one read of source rows: (FROM clause or None for the table, WHERE clause or None, parameters)
Read = tuple[sql.Composable | None, sql.Composable | None, Sequence[Any]]
WHOLE: Read = (None, None, ())


def reads(reg: TableReg, spans: Sequence[tuple[Key | None, Key | None]]) -> list[Read]:
    """The reads of the source rows of ``spans``. An integer key's bounded spans are one lateral join
    over the arrays of their bounds (an index range scan each: a WHERE of hundreds of ORs is a scan
    of the whole table testing each row against every one); the rest (the first and last spans,
    text and composite keys) one WHERE of key comparisons (text ``COLLATE "C"``: no index of the
    column's own collation serves it, so that is a scan of the table at the source)."""
    types = {c.name: c.type.strip().lower() for c in reg.columns}
    single = len(reg.key) == 1 and type_kind(types.get(reg.key[0], "")) == "int"
    bounded = [(lo, hi) for lo, hi in spans if lo is not None and hi is not None] if single else []
    rest = [(lo, hi) for lo, hi in spans if not single or lo is None or hi is None]
    out: list[Read] = []
    if bounded:
        k, t = sql.Identifier(reg.key[0]), sql.SQL(types[reg.key[0]])
        from_ = sql.SQL(
            "unnest({lo}::{t}[], {hi}::{t}[]) AS _cdc_r(_cdc_lo, _cdc_hi) CROSS JOIN LATERAL "
            "(SELECT * FROM {table} WHERE {k} >= _cdc_r._cdc_lo AND {k} < _cdc_r._cdc_hi) AS _cdc_t"
        ).format(
            lo=sql.Placeholder(), hi=sql.Placeholder(), t=t, table=sql.Identifier(reg.schema, reg.table), k=k
        )
        out.append((from_, None, [[lo[0] for lo, _ in bounded], [hi[0] for _, hi in bounded]]))
    if rest:
        clause, params = where(reg, rest)
        out.append((None, clause, params))
    return out


def where(reg: TableReg, spans: Sequence[tuple[Key | None, Key | None]]) -> tuple[sql.Composable, list[Any]]:
    """A WHERE clause selecting the rows of ``spans`` (key-range comparisons; text ``COLLATE "C"``)."""
    types = {c.name: c.type.strip().lower() for c in reg.columns}
    cols = sql.SQL(", ").join(
        sql.SQL("{}").format(sql.Identifier(k))
        if type_kind(types.get(k, "")) == "int"
        else sql.SQL('{} COLLATE "C"').format(sql.Identifier(k))
        for k in reg.key
    )
    row = sql.SQL("({})").format(cols)
    one = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() for _ in reg.key))
    parts: list[sql.Composable] = []
    params: list[Any] = []
    for lo, hi in spans:
        conds: list[sql.Composable] = []
        if lo is not None:
            conds.append(sql.SQL("{} >= {}").format(row, one))
            params.extend(lo)
        if hi is not None:
            conds.append(sql.SQL("{} < {}").format(row, one))
            params.extend(hi)
        if not conds:
            return sql.SQL("TRUE"), []
        parts.append(sql.SQL("(") + sql.SQL(" AND ").join(conds) + sql.SQL(")"))
    if not parts:
        return sql.SQL("FALSE"), []
    return sql.SQL(" OR ").join(parts), params


def now() -> float:
    return time.time()


#: an integer key's span of at most this many values has its keys listed (:func:`spanned_keys`)
SPANNED_MAX = 1024


def spanned_keys(reg: TableReg, spans: Sequence[tuple[Key | None, Key | None]]) -> list[Key]:
    """Every key a one-column integer key's bounded spans of at most :data:`SPANNED_MAX` values can
    hold: a sink that can only look keys up (the search index) is then asked for the keys of the
    whole span, so a document the source and the warehouse lack there is found too. Other spans and
    keys: none (such a document is found by the counts, or by ``--full``)."""
    types = {c.name: c.type.strip().lower() for c in reg.columns}
    if len(reg.key) != 1 or type_kind(types.get(reg.key[0], "")) != "int":
        return []
    out: list[Key] = []
    for lo, hi in spans:
        if lo is not None and hi is not None and 0 < hi[0] - lo[0] <= SPANNED_MAX:
            out.extend((v,) for v in range(lo[0], hi[0]))
    return out
