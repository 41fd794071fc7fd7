"""The warehouse's Delta writes and reads (``deltalake``): the file writes of the three tables
(:class:`Commit`, each carrying the batch's app transaction), and the bucket-pruned reads they need."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable

from cdc.errors import ApplyError
from cdc.events import Version
from cdc.registry import TableReg
from sinks.warehouse import files as file_writes
from sinks.warehouse.layout import (
    BUCKET,
    HISTORY_META,
    KEY,
    LAYOUT_CONF,
    LSN,
    SEQ,
    TRUNCATE_MARKER,
    Layout,
)
from sinks.warehouse.plan import NONE, Stored, versions_of

#: rows the lookups (:func:`read_rows`) read from Delta, per kind of table (``current``, ``history``,
#: ``tombstones``; from the table's name) -- before the in-memory key filter: what they cost. Tests
#: and the loop benchmark (``bench/warehouse_loop.py``) read it; nothing resets it but them.
ROWS_READ: Counter[str] = Counter()

#: a TRUNCATE as the Delta writes take it: its version and source commit time (ms)
Truncate = tuple[Version, int]


@dataclass
class Commit:
    """How a batch's writes reach a table: the copy-on-write of :mod:`.files` (whole buckets
    rewritten in Arrow), committed by each write with ``properties`` (the batch's application
    transaction) when ``pending`` is None, else only written and appended to ``pending`` for a
    committer elsewhere (the apply's driver). An empty write commits nothing."""

    properties: CommitProperties
    pending: list[file_writes.TableWrite] | None = None
    #: (shard, shards): the batch is one shard's slice; a TRUNCATE rewrites only that shard's buckets
    shard: tuple[int, int] | None = None

    def finish(self, table: DeltaTable, write: file_writes.TableWrite) -> dict[str, Any]:
        """Commit ``write`` now (:func:`.files.commit`), or defer it to commit in its stage
        (:attr:`.files.TableWrite.stage`: see :func:`.files.commit_all`)."""
        if self.pending is None:
            file_writes.commit(table, write, self.properties)
        else:
            self.pending.append(write)
        return write.metrics()

    def tombstones(self, tombs: DeltaTable, source: pa.Table) -> None:
        """Upsert the batch's delete (and TRUNCATE marker) versions, keeping the newer one per key."""
        self.finish(tombs, file_writes.write_tombstones(tombs, source))

    def history(
        self,
        history: DeltaTable,
        source: pa.Table,
        match: Iterable[int] | None,
        truncates: Sequence[Truncate],
    ) -> dict[str, Any]:
        """Write the history's source rows in one commit: ``close`` rows (``SRC_KIND``) close the
        stored open row of the same key and version, ``move`` rows move it to the version they carry
        in the end columns (a snapshot read that found the row unchanged: it stays open), ``new``
        rows are inserted unless an open row of that version is stored; the batch's truncates close
        every open row older than them. Only open rows are read and rewritten (only the
        ``is_current=true`` partitions' files). ``match``: the buckets of the close and move rows
        (None: any, as with truncates); when empty, the new rows are appended."""
        at = [((v.commit_lsn, v.seq), ts) for v, ts in truncates]
        write = file_writes.write_history(history, source, match, at, self.shard)
        return self.finish(history, write)

    def current(
        self, current: DeltaTable, source: pa.Table, match: Iterable[int] | None, trunc: Version | None
    ) -> dict[str, Any]:
        """Write the current table's source rows (every column of the table; ``_cdc_op`` 'd' for a
        delete, each already version-guarded against tombstones) in one commit; ``trunc``: the
        batch's newest TRUNCATE. ``match``: the buckets of the source's keys that have a current row
        (None with a TRUNCATE: any); only those are read and rewritten; when empty, the upserts are
        appended."""
        at = None if trunc is None else (trunc.commit_lsn, trunc.seq)
        write = file_writes.write_current(current, source, match, at, self.shard)
        return self.finish(current, write)


def ts_literal(ms: int) -> str:
    return f"arrow_cast({ms * 1000}, 'Timestamp(Microsecond, Some(\"UTC\"))')"


def not_applied(table: DeltaTable, app_id: str, batch_id: int) -> bool:
    """Whether the table has no commit of ``(app_id, batch_id)`` or later (batch ids start at 0)."""
    done = table.transaction_version(app_id)
    return done is None or done < batch_id


def layout_of(table: DeltaTable) -> Layout:
    raw = table.metadata().configuration.get(LAYOUT_CONF)
    try:
        if raw is not None:
            return Layout.parse(raw)
    except ValueError:
        pass
    raise ApplyError(
        f"{table.table_uri} was not created by cdc (no valid {LAYOUT_CONF} in its configuration)",
        fix="move it aside and re-snapshot the table",
    )


def read_rows(
    table: DeltaTable,
    keys: Sequence[str],
    buckets: Iterable[int],
    *,
    key: str = KEY,
    columns: list[str] | None = None,
) -> pa.Table:
    """Rows of the given keys (only ``columns`` when given), reading only the files of ``buckets``
    (which must hold every bucket of ``keys``). Memory: the rows found plus one record batch of the
    scan, however large the buckets are."""
    if not keys:
        empty = arrow_schema(table).empty_table()
        return empty.select(columns) if columns else empty
    in_buckets = sorted({int(b) for b in buckets})
    # only the files of those buckets (the Delta log's partition values); the key filter runs in
    # memory on each record batch of the scan, never inside it: delta-rs writes some string columns
    # as string_view, and with the key filter inside the scan pyarrow's statistics pruning skipped
    # row groups that held the keys (rows lost; reverted in a62f9f4)
    ds = file_writes.bucket_dataset(table, in_buckets)
    wanted = pa.array(sorted(set(keys)), pa.string())
    schema = ds.schema if columns is None else pa.schema([ds.schema.field(c) for c in columns])
    kept: list[pa.RecordBatch] = []
    read = 0
    for rb in ds.to_batches(columns=columns):
        read += rb.num_rows
        got = rb.filter(pc.is_in(rb.column(key).cast(pa.string()), value_set=wanted))
        if got.num_rows:
            kept.append(got)
    ROWS_READ[table_kind(table)] += read
    return pa.Table.from_batches(kept, schema=schema)


def read_spans(
    table: DeltaTable, reg: TableReg, spans: Sequence[tuple[Any, Any]], columns: Sequence[str]
) -> tuple[pa.Table, int]:
    """The rows of the current table ``table`` whose keys lie in ``spans`` (``[lo, hi)`` key tuples,
    None unbounded: :class:`sinks.KeyRanges`), only ``columns`` (those the table has), and the
    whole table's row count (from the log's record counts, else the files' footers). A range layout
    reads only the buckets the spans reach; each record batch read is filtered to the spans in
    memory (a single-column key; a composite key's rows are all kept: the caller filters them).
    Memory: the rows kept plus one record batch.

    A local table of plain Parquet files (no deletion vectors, no column mapping) is read file by
    file with ``pyarrow.parquet``, not as a ``pyarrow.dataset``: that module imports pandas, ~0.2 s
    of CPU that an incremental ``cdc verify`` of a few ranges would spend on it alone; other tables
    go through the dataset."""
    root = _local_root(table)
    if root is None:
        return _read_spans_dataset(table, reg, spans, columns)
    files = add_actions(table)
    schema = arrow_schema(table)
    cols = [c for c in columns if c in schema.names]
    out_schema = pa.schema([schema.field(c) for c in cols])
    wanted = _bucket_set(table, reg, spans, files)
    counts = files.column("num_records").to_pylist() if "num_records" in files.column_names else []
    parts = (
        files.column(f"partition.{BUCKET}").to_pylist() if f"partition.{BUCKET}" in files.column_names else []
    )
    total = 0
    chosen: list[Path] = []
    for i, rel in enumerate(files.column("path").to_pylist()):
        path = root / unquote(rel)
        if i < len(counts) and counts[i] is not None:
            total += int(counts[i])
        else:
            total += pq.ParquetFile(path).metadata.num_rows
        if wanted is None or (i < len(parts) and parts[i] is not None and int(parts[i]) in wanted):
            chosen.append(path)
    return _keep_spans(table, reg, spans, _file_batches(chosen, out_schema), out_schema), total


def _file_batches(files: Iterable[Path], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The record batches of ``files``, one file open at a time, each in ``schema`` (the table's
    types; a column a file lacks, as nulls)."""
    for path in files:
        reader = pq.ParquetFile(path)
        present = [c for c in schema.names if c in reader.schema_arrow.names]
        for rb in reader.iter_batches(columns=present):
            yield _conform(rb, schema)  # before the filter: no take kernel reads string_view


def _keep_spans(
    table: DeltaTable,
    reg: TableReg,
    spans: Sequence[tuple[Any, Any]],
    batches: Iterable[pa.RecordBatch],
    schema: pa.Schema,
) -> pa.Table:
    """The rows of ``batches`` (of ``table``, in ``schema``) whose one-column key lies in ``spans``
    (a composite key's rows are all kept: the caller filters them); counts the rows read."""
    kept: list[pa.RecordBatch] = []
    read = 0
    single = len(reg.key) == 1 and reg.key[0] in schema.names
    mask = SpanMask(spans)
    for rb in batches:
        read += rb.num_rows
        got = rb.filter(bool_array(mask(rb.column(reg.key[0])))) if single else rb
        if got.num_rows:
            kept.append(got)
    ROWS_READ[table_kind(table)] += read
    return pa.Table.from_batches(kept, schema=schema)


def bool_array(mask: np.ndarray) -> pa.Array:
    """A numpy bool array as an Arrow one, from its bits: ``pa.array()`` of a numpy array first asks
    whether it is a masked array, which imports ``numpy.ma`` (~8 ms of an incremental ``cdc verify``)."""
    bits = np.packbits(mask, bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(mask), [None, pa.py_buffer(bits)])


def add_actions(table: DeltaTable) -> pa.Table:
    """The table's files (``get_add_actions(flatten=True)``) as a pyarrow table, through the Arrow
    stream interface: ``pa.table()`` of it would first ask whether it is a pandas DataFrame, which
    imports pandas (~0.2 s of CPU)."""
    return pa.RecordBatchReader.from_stream(table.get_add_actions(flatten=True)).read_all()


def _local_root(table: DeltaTable) -> Path | None:
    """The directory of a table whose files :func:`read_spans` can read one by one: a local one
    whose protocol asks readers for nothing (no deletion vectors, no column mapping). None: read it
    as a dataset."""
    uri = table.table_uri
    if uri.startswith("file://"):
        uri = unquote(uri[len("file://") :])
    elif "://" in uri:
        return None
    protocol = table.protocol()
    if protocol.min_reader_version > 1 or protocol.reader_features:
        return None
    return Path(uri)


def _conform(rb: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """A file's record batch in the table's schema: its columns cast to the table's types (a file
    may store a string column as string_view), a column the file lacks (added later) as nulls."""
    arrays = []
    for f in schema:
        i = rb.schema.get_field_index(f.name)
        if i < 0:
            arrays.append(pa.nulls(rb.num_rows, f.type))
        else:
            col = rb.column(i)
            arrays.append(col if col.type == f.type else col.cast(f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _read_spans_dataset(
    table: DeltaTable, reg: TableReg, spans: Sequence[tuple[Any, Any]], columns: Sequence[str]
) -> tuple[pa.Table, int]:
    """:func:`read_spans` through ``pyarrow.dataset`` (any table deltalake can read)."""
    ds = table.to_pyarrow_dataset()
    total = int(ds.count_rows())
    cols = [c for c in columns if c in ds.schema.names]
    schema = pa.schema([ds.schema.field(c) for c in cols])
    flt = _bucket_filter(table, reg, spans)
    return _keep_spans(table, reg, spans, ds.to_batches(filter=flt, columns=cols), schema), total


def _bucket_filter(
    table: DeltaTable, reg: TableReg, spans: Sequence[tuple[Any, Any]]
) -> pc.Expression | None:
    """Partition pruning for ``spans`` as a dataset filter (:func:`_bucket_set`)."""
    wanted = _bucket_set(table, reg, spans, add_actions(table))
    return None if wanted is None else pc.field(BUCKET).isin(sorted(wanted))


def _bucket_set(
    table: DeltaTable, reg: TableReg, spans: Sequence[tuple[Any, Any]], files: pa.Table
) -> set[int] | None:
    """Partition pruning for ``spans``: with a range layout (a bucket holds the keys ``[base * W,
    (base + 1) * W)``, ``bucket = base * shards + shard``), the buckets of ``files`` (the table's
    add actions) whose keys meet a span; None (every bucket) with a hash layout."""
    layout = layout_of(table)
    if layout.mode != "range" or len(reg.key) != 1:
        return None
    if not files.num_rows:
        return None
    existing = {int(b) for b in files.column(f"partition.{BUCKET}").to_pylist() if b is not None}
    width = layout.size
    meets = _Meets(spans)
    return {b for b in existing if meets((b // layout.shards) * width, (b // layout.shards + 1) * width)}


class _Meets:
    """Does an integer interval ``[lo, hi)`` meet one of ``spans`` (one-column integer keys; sorted,
    disjoint, as :class:`sinks.KeyRanges` holds them)? By bisection over the spans' upper bounds: an
    incremental verify asks for thousands of spans, and testing each bucket against every one cost
    ~0.1 s of its CPU."""

    def __init__(self, spans: Sequence[tuple[Any, Any]]) -> None:
        self.los = [None if s_lo is None else s_lo[0] for s_lo, _ in spans]
        self.his = [math.inf if s_hi is None else s_hi[0] for _, s_hi in spans]

    def __call__(self, lo: int, hi: int) -> bool:
        i = bisect.bisect_right(self.his, lo)  # the first span ending past lo
        if i == len(self.his):
            return False
        start = self.los[i]
        return start is None or bool(start < hi)


class SpanMask:
    """Called with the values of a one-column key (an Arrow array): does each lie in one of ``spans``
    (sorted, disjoint ``[lo, hi)`` key tuples, None unbounded)? Integers compared by value, text by
    code point (Python's order of ``str``). The bounds are put in arrays once (a read of thousands of
    spans filters each of its record batches against them)."""

    def __init__(self, spans: Sequence[tuple[Any, Any]]) -> None:
        self.count = len(spans)
        self.los = [s[0][0] if s[0] is not None else None for s in spans]
        self.his = [s[1][0] if s[1] is not None else None for s in spans]
        self.hi_open = np.array([v is None for v in self.his], dtype=bool)
        self._ints: tuple[np.ndarray, np.ndarray] | None = None
        self._texts: tuple[np.ndarray, np.ndarray] | None = None

    def _bounds(self, ints: bool) -> tuple[np.ndarray, np.ndarray]:
        if ints:
            if self._ints is None:
                lo = np.array([np.iinfo(np.int64).min if v is None else v for v in self.los], dtype=np.int64)
                self._ints = (lo, np.array([0 if v is None else v for v in self.his], dtype=np.int64))
            return self._ints
        if self._texts is None:  # only the first span's lo can be open: "" is at or below every text
            lo_arr, hi_arr = np.empty(self.count, dtype=object), np.empty(self.count, dtype=object)
            lo_arr[:] = ["" if v is None else v for v in self.los]
            hi_arr[:] = ["" if v is None else v for v in self.his]
            self._texts = (lo_arr, hi_arr)
        return self._texts

    def __call__(self, column: Any) -> np.ndarray:
        values = column.to_numpy(zero_copy_only=False)
        if not self.count or not len(values):
            return np.zeros(len(values), dtype=bool)
        lo_arr, hi_arr = self._bounds(values.dtype.kind in "iu")
        idx = np.searchsorted(lo_arr, values, side="right") - 1
        at = np.maximum(idx, 0)
        below = np.less(values, hi_arr[at]).astype(bool)
        out: np.ndarray = (idx >= 0) & (self.hi_open[at] | below)
        return out


def table_kind(table: DeltaTable) -> str:
    """``current``, ``history`` or ``tombstones``: which of a registered table's Delta tables it is
    (from its name, :func:`sinks.warehouse.layout.table_paths`)."""
    name = table.table_uri.rstrip("/").rsplit("/", 1)[-1]
    for kind in ("history", "tombstones"):
        if name.endswith(f"__{kind}"):
            return kind
    return "current"


def cast_to_field(f: pa.Field, types: dict[str, str | None], arr: pa.Array) -> pa.Array:
    """A column's converted values in the table's type (a type changed at the source: ApplyError)."""
    if arr.type != f.type:
        try:
            arr = arr.cast(f.type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise ApplyError(
                f"column {f.name} is {f.type} in the warehouse but the source now sends {types[f.name]}",
                fix="a column's type changed at the source: move the warehouse tables aside and re-snapshot",
                column=f.name,
            ) from exc
    return arr


def read_all(path: Path, reg: TableReg, meta: bool) -> pa.Table:
    if not DeltaTable.is_deltatable(str(path)):
        raise ApplyError(
            f"{reg.qualified} has no warehouse table at {path} yet",
            fix="run the apply job (`cdc apply --once`) after the table's snapshot",
            table=reg.qualified,
        )
    table = DeltaTable(str(path)).to_pyarrow_table()
    if not meta:
        table = table.select([n for n in table.column_names if n not in HISTORY_META.names])
    return table


def arrow_schema(table: DeltaTable) -> pa.Schema:
    """The table's schema as a pyarrow schema (deltalake returns an arro3 schema)."""
    return pa.schema(table.schema().to_arrow())


def stored_guards(
    tombs: DeltaTable, keys: pa.Array, buckets: Iterable[int], partitions: Sequence[int]
) -> Stored:
    """The tombstones table's state for ``keys`` (their buckets given): each key's tombstone version
    and the TRUNCATE marker of each log-store partition of ``partitions`` (distinct; a marker row's
    bucket is its partition), as the plan's :class:`Stored` (no open rows yet)."""
    key_list = keys.to_pylist()
    tomb = read_rows(tombs, [*key_list, TRUNCATE_MARKER], [*buckets, *partitions], key="key_json")
    is_marker = pc.equal(tomb.column("key_json").cast(pa.string()), TRUNCATE_MARKER)
    marker = tomb.filter(is_marker)
    markers: dict[int, tuple[int, int]] = {}
    for part, lsn, seq in zip(
        marker.column(BUCKET).to_pylist(),
        marker.column("commit_lsn").to_pylist(),
        marker.column("seq").to_pylist(),
        strict=True,
    ):
        if part in partitions:
            markers[int(part)] = max(markers.get(int(part), (-1, -1)), (int(lsn), int(seq)))
    t_lsn, t_seq = versions_of(keys, tomb.filter(pc.invert(is_marker)), "key_json", "commit_lsn", "seq")
    none = np.full(len(key_list), -1, dtype=np.int64)
    return Stored(t_lsn, t_seq, none, none, markers)


def unchanged(current: DeltaTable, rows: pa.Table, buckets: Iterable[int]) -> np.ndarray:
    """Which of ``rows`` (in the current table's columns, at most one per key) equal their key's stored
    current row in every data column, compared as stored (both null, both NaN: equal)."""
    keys = rows.column(KEY).cast(pa.string()).combine_chunks()
    stored = read_rows(current, keys.to_pylist(), buckets)
    idx = pc.index_in(keys, value_set=stored.column(KEY).cast(pa.string()).combine_chunks())
    same: np.ndarray = pc.is_valid(idx).to_numpy(zero_copy_only=False)
    if same.any():
        same &= equal_rows(rows, stored.take(pc.fill_null(idx, 0)))
    return same


def equal_rows(rows: pa.Table, other: pa.Table) -> np.ndarray:
    """Row by row: ``rows`` and ``other`` (same length; ``other`` holds at least ``rows``' columns)
    hold the same value in every data column of ``rows``, compared as stored (nulls and NaNs equal)."""
    same = np.ones(rows.num_rows, dtype=bool)
    for name in rows.column_names:
        if name in HISTORY_META.names or not same.any():
            continue
        same &= _equal(rows.column(name).combine_chunks(), other.column(name).combine_chunks())
    return same


def confirming(
    current: DeltaTable,
    reads: np.ndarray,
    against: np.ndarray,
    rows_of: Callable[[np.ndarray], pa.Table],
    buckets: Callable[[np.ndarray], Iterable[int]],
) -> np.ndarray:
    """Of the plan's snapshot reads (:meth:`Plan.snapshot_reads`), those equal to the row they compare
    with: the stored current row (``against`` NONE; only those keys' rows are read) or the batch's
    row ``against``. ``rows_of(positions)``: the batch's rows at those positions in the current table's
    columns; ``buckets(positions)``: their keys' buckets."""
    same = np.zeros(len(reads), dtype=bool)
    stored = against == NONE
    if stored.any():
        same[stored] = unchanged(current, rows_of(reads[stored]), buckets(reads[stored]))
    if not stored.all():
        same[~stored] = equal_rows(rows_of(reads[~stored]), rows_of(against[~stored]))
    out: np.ndarray = reads[same]
    return out


def _equal(a: pa.Array, b: pa.Array) -> np.ndarray:
    """Element-wise: ``a`` and ``b`` hold the same value (nulls and NaNs equal each other)."""
    if b.type != a.type:
        b = b.cast(a.type)
    both_null = pc.and_(pc.is_null(a), pc.is_null(b))
    try:
        eq = pc.fill_null(pc.equal(a, b), False)
    except pa.ArrowNotImplementedError:  # lists: compared as Python values
        eq = pa.array([x == y for x, y in zip(a.to_pylist(), b.to_pylist(), strict=True)], pa.bool_())
    if pa.types.is_floating(a.type):
        eq = pc.or_(eq, pc.fill_null(pc.and_(pc.is_nan(a), pc.is_nan(b)), False))
    out: np.ndarray = pc.or_(eq, both_null).to_numpy(zero_copy_only=False)
    return out


def current_versions(
    current: DeltaTable, keys: pa.Array, buckets: Iterable[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Per key, the version of its current row ((-1, -1): none) -- which is also the version of the
    key's open history row: a key has an open history row exactly when it has a current row, of the
    same version (both are written from the same plan, docs/warehouse.md). One row per live key is
    read (only the key and version columns), never the history."""
    stored = read_rows(current, keys.to_pylist(), buckets, columns=[KEY, LSN, SEQ])
    return versions_of(keys, stored, KEY, LSN, SEQ)
