"""The warehouse's three writes as copy-on-write of whole partitions in Arrow, with no Delta MERGE.

:mod:`.delta` merges a batch's source rows into a table with delta-rs' MERGE, which reads, writes and
commits in one call. This module computes the same result -- the same clauses, version guards and
truncate handling, row for row (``tests/sinks/test_file_writes.py`` runs both on the same batches) --
as new Parquet data files written under the table's location plus the Delta actions that swap them in
(:class:`TableWrite`). The files can then be written in one process (a Spark task, owning a set of
buckets) and committed in another (the driver: :func:`commit`, one transaction per table for all of a
batch's tasks, with the application transaction that makes a replayed batch commit nothing twice).

A write reads every row of the partitions it rewrites (``_cdc_bucket`` in the buckets that hold a
matched key; in the history only the open partition ``is_current = true`` of those buckets) at the
table's version when the :class:`~deltalake.DeltaTable` was opened, and removes exactly the files it
read. A new key's rows are appended (no file removed). A commit refuses, without writing anything,
when a file it removes is no longer in the table (another writer -- a compaction, a vacuum's
companion optimize, an external job -- replaced it since it was read): :class:`WriteConflict`; the
batch is then computed again from the new version (Spark replays it), so no commit is ever lost and
no row doubled.

Files a write leaves uncommitted (a task killed between its write and the driver's commit, a commit
that refused) are referenced by no version; ``vacuum`` removes them once older than its retention.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import AddAction, RemoveAction

from cdc.errors import ApplyError
from sinks.warehouse.handles import refresh
from sinks.warehouse.layout import (
    BUCKET,
    END_LSN,
    END_OP,
    END_SEQ,
    IS_CURRENT,
    KEY,
    LSN,
    OP,
    SEQ,
    SRC_KIND,
    VALID_TO,
)

#: the threads a batch's tables commit on (:func:`commit_all`): under pgbench a batch commits 8 Delta
#: tables (current and history of 4), about 20 ms each, one after another 92-232 ms a batch
#: (docs/benchmarks/freshness.md, Sustained), while the executors' cores wait for the next batch
COMMIT_THREADS = 4

#: the order a batch's tables commit in (:attr:`TableWrite.stage`, :func:`commit_all`). Each table's
#: write is computed from the tables of later stages as they were before the batch: the history from
#: the current table's versions and the tombstones, the current table from the tombstones. So a table
#: commits only once every table of an earlier stage has: a replay after a refusal then finds the
#: later tables as the first computation did (a current table committed before its history would make
#: the replay take the batch's versions as applied and leave them out of the history).
HISTORY, CURRENT, TOMBSTONES = 0, 1, 2

#: how a data file is written: snappy, and plain encoding. A batch rewrites whole partitions
#: (copy-on-write), and pyarrow's default dictionary encoding first builds a dictionary of each column,
#: which for the unique columns (the key, the LSN) is then dropped: on a pgbench_accounts-like
#: shard of 50,000 rows the defaults took 1.8x the CPU of these, for a file 3% smaller
#: (``python -m bench.warehouse_batch``)
PARQUET_OPTIONS: dict[str, Any] = {"compression": "snappy", "use_dictionary": False}

if TYPE_CHECKING:  # pyarrow.dataset imports pandas: only the functions that scan import it
    import pyarrow.dataset as pds

#: a TRUNCATE as the writes take it: (commit_lsn, seq) and its source commit time in ms
TruncateAt = tuple[tuple[int, int], int]
#: (shard, shards): the write is one shard's (a TRUNCATE rewrites only its buckets)
Shard = tuple[int, int]


def bucket_dataset(
    table: DeltaTable, buckets: Iterable[int] | None, *, open_only: bool = False
) -> pds.Dataset:
    """``table`` as a pyarrow dataset of only the files of the partitions ``_cdc_bucket`` in
    ``buckets`` (None: every file), and with ``open_only`` (a history partitioned by
    ``is_current``) only those of its open rows. delta-rs builds one fragment per file it includes,
    at a cost per file that a history table's thousands of files make the larger part of a small
    read: the closed partitions, which grow by a file per touched bucket at every batch, are never
    listed by a write that rewrites only the open ones."""
    pruning: list[tuple[str, str, Any]] = []
    if buckets is not None:
        pruning.append((BUCKET, "in", sorted({int(b) for b in buckets})))
    if open_only and IS_CURRENT in table.metadata().partition_columns:
        pruning.append((IS_CURRENT, "=", True))
    return table.to_pyarrow_dataset(file_pruning_predicate=pruning) if pruning else table.to_pyarrow_dataset()


class WriteConflict(ApplyError):
    """A file a write read (and would remove) left the table before the commit: the batch must be
    computed again from the table's new version."""


@dataclass
class TableWrite:
    """One batch's write to one Delta table: files already written under ``uri`` (``adds``) and the
    files they replace (``removes``: paths relative to the table, read at ``read_version``).

    ``rows_read`` and ``rows_written`` are the write's cost, for the batch's metrics."""

    uri: str
    read_version: int
    partition_by: list[str]
    #: :data:`HISTORY`, :data:`CURRENT` or :data:`TOMBSTONES`: when it commits in its batch (each
    #: ``write_*`` gives its table's; no default, which would commit a write in the first stage)
    stage: int
    adds: list[dict[str, Any]] = field(default_factory=list)
    removes: list[dict[str, Any]] = field(default_factory=list)
    rows_read: int = 0
    rows_written: int = 0
    #: the rows the write updated, inserted and deleted (MERGE's ``num_target_rows_*``)
    counts: dict[str, int] = field(default_factory=dict)

    def merge(self, other: TableWrite) -> None:
        """Fold another task's write to the same table into this one. The tasks of a batch may have
        read the table at different versions (the maintenance thread's compaction of closed rows
        committed between them: :mod:`.background`); the merged write is read at the earliest, so
        that :func:`commit` checks every file it removes is still in the table."""
        if (other.uri, other.stage) != (self.uri, self.stage):
            raise ApplyError(
                f"writes of {other.uri} and {self.uri} cannot be committed together",
                fix="report this: a table's writes are merged by its uri",
            )
        self.read_version = min(self.read_version, other.read_version)
        self.adds.extend(other.adds)
        self.removes.extend(other.removes)
        self.rows_read += other.rows_read
        self.rows_written += other.rows_written
        for name, n in other.counts.items():
            self.counts[name] = self.counts.get(name, 0) + n

    @property
    def empty(self) -> bool:
        """Nothing written and nothing replaced: a write that commits nothing (:func:`commit`)."""
        return not self.adds and not self.removes

    def metrics(self) -> dict[str, Any]:
        """The keys delta-rs' MERGE reports that the batch metrics use."""
        return {
            "num_target_files_removed": len(self.removes),
            "num_target_files_added": len(self.adds),
            "num_target_rows_copied": max(self.rows_written - self.rows_read, 0),
            "rows_read": self.rows_read,
            "rows_written": self.rows_written,
            "appended": not self.removes,
            **{f"num_target_rows_{name}": n for name, n in self.counts.items()},
        }


def commit(table: DeltaTable, write: TableWrite, properties: CommitProperties) -> bool:
    """Commit ``write`` to ``table`` in one transaction (with ``properties``' application transaction);
    whether it committed.

    An empty write (:attr:`TableWrite.empty`) commits nothing, not even its application
    transaction: the one rule for every caller (a write committed at once, or deferred and
    committed by :func:`commit_all`); a replay of that batch computes the same nothing. Refuses with
    :class:`WriteConflict`, committing nothing, when a file to remove is no longer in the table's
    latest version: the micro-batch fails, and its replay (the job restarted from its checkpoint)
    computes it again from the new version."""
    if write.empty:
        return False
    refresh(table)
    if write.removes and table.version() != write.read_version:
        live = {a for a in pa.table(table.get_add_actions(flatten=False)).column("path").to_pylist()}
        gone = [r["path"] for r in write.removes if r["path"] not in live]
        if gone:
            raise WriteConflict(
                f"{len(gone)} file(s) of {write.uri} read at version {write.read_version} were replaced "
                f"before the commit (now version {table.version()}), e.g. {gone[0]}",
                fix="nothing to do: restarted, the job applies the batch again from the new version",
                table=write.uri,
            )
    now = int(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = [AddAction(**a) for a in write.adds]
    actions += [RemoveAction(r["path"], True, now, r["size"], r["partition_values"]) for r in write.removes]
    table.create_write_transaction(
        actions,
        mode="append",
        schema=table.schema(),
        partition_by=write.partition_by,
        commit_properties=properties,
    )
    return True


# -- reading and writing partitions -----------------------------------------------------------------
def _partition_text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool | np.bool_):
        return "true" if value else "false"
    return str(value)


class Partitions:
    """The files and rows of some partitions of a table at its opened version."""

    def __init__(self, table: DeltaTable) -> None:
        self.table = table
        self.schema = pa.schema(table.schema().to_arrow())
        self.partition_by: list[str] = list(table.metadata().partition_columns)
        self.version = table.version()

    def new_write(self, stage: int) -> TableWrite:
        """An empty write to this table, committing in ``stage`` (:attr:`TableWrite.stage`)."""
        return TableWrite(self.table.table_uri, self.version, list(self.partition_by), stage=stage)

    def read(
        self,
        write: TableWrite,
        buckets: Iterable[int] | None,
        *,
        open_only: bool = False,
        shard: Shard | None = None,
    ) -> pa.Table:
        """Every row of the partitions ``_cdc_bucket`` in ``buckets`` (None: all; with ``shard``,
        all of that shard's: ``bucket % shards == shard``), only those with ``is_current`` when
        ``open_only``; their files join ``write.removes``."""
        files = pa.table(self.table.get_add_actions(flatten=True))
        if not files.num_rows:
            return self.schema.empty_table()
        keep = np.ones(files.num_rows, dtype=bool)
        flt: pc.Expression | None = None
        if buckets is None and shard is not None:
            all_buckets = pc.unique(files.column(f"partition.{BUCKET}")).to_pylist()
            buckets = [b for b in all_buckets if b % shard[1] == shard[0]]
        if buckets is not None:
            wanted = sorted(set(buckets))
            keep &= pc.is_in(files.column(f"partition.{BUCKET}"), pa.array(wanted, pa.int64())).to_numpy(
                zero_copy_only=False
            )
            flt = pc.field(BUCKET).isin(wanted)
        if open_only and IS_CURRENT in self.partition_by:
            keep &= pc.fill_null(files.column(f"partition.{IS_CURRENT}"), False).to_numpy(
                zero_copy_only=False
            )
            open_ = pc.field(IS_CURRENT) == True  # noqa: E712 - an Arrow expression
            flt = open_ if flt is None else flt & open_
        chosen = files.filter(pa.array(keep))
        for row in chosen.to_pylist():
            parts = {c: _partition_text(row[f"partition.{c}"]) for c in self.partition_by}
            write.removes.append({"path": row["path"], "size": row["size_bytes"], "partition_values": parts})
        if not chosen.num_rows:
            return self.schema.empty_table()
        rows = bucket_dataset(self.table, buckets, open_only=open_only).to_table(filter=flt)
        write.rows_read += rows.num_rows
        return rows.cast(self.schema) if rows.schema != self.schema else rows

    def write(self, write: TableWrite, rows: pa.Table) -> None:
        """Write ``rows`` (the table's columns) as one new file per partition; their adds join
        ``write``."""
        if not rows.num_rows:
            return
        rows = rows.select(self.schema.names).cast(self.schema)
        data_cols = [n for n in self.schema.names if n not in self.partition_by]
        for part, in_part in _partitions(rows, self.partition_by):
            chunk = in_part.select(data_cols)
            texts = {c: _partition_text(part[c]) for c in self.partition_by}
            rel = "/".join(
                f"{c}={'__HIVE_DEFAULT_PARTITION__' if v is None else v}" for c, v in texts.items()
            )
            rel = f"{rel}/part-{uuid.uuid4()}-c000.snappy.parquet"
            path = os.path.join(self.table.table_uri.removeprefix("file://"), rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            pq.write_table(chunk, path, **PARQUET_OPTIONS)
            write.adds.append(
                {
                    "path": rel,
                    "size": os.path.getsize(path),
                    "partition_values": texts,
                    "modification_time": int(time.time() * 1000),
                    "data_change": True,
                    "stats": _stats(chunk),
                }
            )
            write.rows_written += chunk.num_rows


def _partitions(rows: pa.Table, columns: Sequence[str]) -> Iterator[tuple[dict[str, Any], pa.Table]]:
    """``rows`` split by each distinct combination of ``columns``' values (nulls a value of their
    own): the combination and its rows, in their order, the combinations in the order of their
    first rows. One stable sort of the rows' combined codes and one ``take``, not a scan of every
    row per partition."""
    code = np.zeros(rows.num_rows, dtype=np.int64)
    for name in columns:
        enc = pc.dictionary_encode(rows.column(name).combine_chunks())
        idx = pc.fill_null(enc.indices, -1).to_numpy().astype(np.int64) + 1  # 0: null
        code = code * (len(enc.dictionary) + 1) + idx
    order = np.argsort(code, kind="stable")
    ordered, sorted_code = rows.take(pa.array(order)), code[order]
    bounds = [*np.flatnonzero(np.r_[True, sorted_code[1:] != sorted_code[:-1]]).tolist(), len(order)]
    runs = sorted(itertools.pairwise(bounds), key=lambda r: int(order[r[0]]))
    for start, end in runs:
        first = int(order[start])
        yield {c: rows.column(c)[first].as_py() for c in columns}, ordered.slice(start, end - start)


def _stats(rows: pa.Table) -> str:
    """Delta file statistics: the row count, null counts, and min/max of the integer columns (strings
    and timestamps are left out: a reader then never prunes on them, which is always correct)."""
    mins: dict[str, int] = {}
    maxs: dict[str, int] = {}
    nulls: dict[str, int] = {}
    for name in rows.column_names:
        col = rows.column(name)
        nulls[name] = col.null_count
        if pa.types.is_integer(col.type) and col.null_count < len(col):
            mm = pc.min_max(col).as_py()
            mins[name], maxs[name] = mm["min"], mm["max"]
    return json.dumps(
        {"numRecords": rows.num_rows, "minValues": mins, "maxValues": maxs, "nullCount": nulls},
        separators=(",", ":"),
    )


# -- the three writes --------------------------------------------------------------------------------
def _newer(s_lsn: np.ndarray, s_seq: np.ndarray, t_lsn: np.ndarray, t_seq: np.ndarray) -> np.ndarray:
    out: np.ndarray = (s_lsn > t_lsn) | ((s_lsn == t_lsn) & (s_seq > t_seq))
    return out


def _ints(table: pa.Table, name: str) -> np.ndarray:
    out: np.ndarray = pc.fill_null(table.column(name), -1).to_numpy().astype(np.int64)
    return out


def _match(
    stored: pa.ChunkedArray | pa.Array, source: pa.ChunkedArray | pa.Array, among: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Match ``stored``'s keys and ``source``'s both ways: for each stored key whether it is in
    ``source`` and its first position there, and for each source key whether it is among the stored
    keys (only those where ``among`` is True, when given) and its first position there (0 when not
    found). One hash table, of the source's keys (a batch's, small), is built and the stored keys
    (a whole partition's) are probed against it once: the source side is that probe read backwards.
    The source's own keys are probed in the same pass (a key it holds twice is found at its first)."""
    s_keys, t_keys = source.cast(pa.string()), stored.cast(pa.string())
    n = len(s_keys)
    both = pc.index_in(pa.chunked_array([*_chunks(s_keys), *_chunks(t_keys)], pa.string()), value_set=s_keys)
    idx = both.slice(n)
    t_found: np.ndarray = pc.is_valid(idx).to_numpy(zero_copy_only=False)
    t_at: np.ndarray = pc.fill_null(idx, 0).to_numpy().astype(np.int64)
    hits = np.flatnonzero(t_found if among is None else t_found & among)[::-1]
    s_found = np.zeros(n, dtype=bool)
    s_at = np.zeros(n, dtype=np.int64)
    s_found[t_at[hits]] = True
    s_at[t_at[hits]] = hits  # in reverse: the first stored position is written last and wins
    # a key the source holds twice was found (above) at its first position only
    first = pc.fill_null(both.slice(0, n), 0).to_numpy().astype(np.int64)
    return t_found, t_at, s_found[first], s_at[first]


def _chunks(arr: pa.ChunkedArray | pa.Array) -> list[pa.Array]:
    return list(arr.chunks) if isinstance(arr, pa.ChunkedArray) else [arr]


def _gather(values: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``values[pos]``; when ``values`` is empty (nothing to find there), -1 everywhere for versions
    and False for flags."""
    if not len(values):
        return np.full(len(pos), False if values.dtype == bool else -1, dtype=values.dtype)
    out: np.ndarray = values[pos]
    return out


def write_current(
    table: DeltaTable,
    source: pa.Table,
    match: Iterable[int] | None,
    trunc: tuple[int, int] | None,
    shard: Shard | None = None,
) -> TableWrite:
    """:func:`sinks.warehouse.delta.write_current` as files: a newer source row replaces (or, a delete,
    removes) its key's stored row; a source row of an absent key is inserted unless a delete; with a
    truncate, every stored row older than it and not in the source is removed."""
    parts = Partitions(table)
    out = parts.new_write(CURRENT)
    if trunc is None and not set(match or ()):
        ups = source.filter(pc.not_equal(source.column(OP), "d"))
        parts.write(out, ups)
        out.counts = {"inserted": ups.num_rows}
        return out
    stored = parts.read(out, None if trunc is not None else match, shard=shard)
    s_key, t_key = source.column(KEY), stored.column(KEY)
    s_lsn, s_seq, t_lsn, t_seq = (
        _ints(source, LSN),
        _ints(source, SEQ),
        _ints(stored, LSN),
        _ints(stored, SEQ),
    )
    s_del = pc.equal(source.column(OP), "d").to_numpy(zero_copy_only=False)
    # each stored row's source row, and each source row's stored row
    t_found, t_at, s_found, s_at = _match(t_key, s_key)
    t_replaced = t_found & _newer(_gather(s_lsn, t_at), _gather(s_seq, t_at), t_lsn, t_seq)
    keep = ~t_replaced
    if trunc is not None:
        older = (t_lsn < trunc[0]) | ((t_lsn == trunc[0]) & (t_seq < trunc[1]))
        keep &= t_found | ~older
    s_wins = ~s_found | _newer(s_lsn, s_seq, _gather(t_lsn, s_at), _gather(t_seq, s_at))
    insert = s_wins & ~s_del
    updated = int((t_replaced & ~_gather(s_del, t_at)).sum())
    out.counts = {
        "updated": updated,
        "deleted": int((~keep).sum()) - updated,
        "inserted": int((insert & ~s_found).sum()),
    }
    rows = pa.concat_tables(
        [stored.filter(pa.array(keep)), source.filter(pa.array(insert)).cast(stored.schema)]
    )
    parts.write(out, rows)
    return out


def write_tombstones(table: DeltaTable, source: pa.Table) -> TableWrite:
    """:func:`sinks.warehouse.delta.write_tombstones` as files: per key the newer of the stored and the
    source tombstone."""
    parts = Partitions(table)
    out = parts.new_write(TOMBSTONES)
    stored = parts.read(out, pc.unique(source.column(BUCKET)).to_pylist())
    s_lsn, s_seq = _ints(source, "commit_lsn"), _ints(source, "seq")
    t_lsn, t_seq = _ints(stored, "commit_lsn"), _ints(stored, "seq")
    s_keys, t_keys = _bucket_keys(source), _bucket_keys(stored)  # a TRUNCATE marker per shard's bucket
    t_found, t_at, s_found, s_at = _match(t_keys, s_keys)
    keep = ~(t_found & _newer(_gather(s_lsn, t_at), _gather(s_seq, t_at), t_lsn, t_seq))
    insert = ~s_found | _newer(s_lsn, s_seq, _gather(t_lsn, s_at), _gather(t_seq, s_at))
    rows = pa.concat_tables(
        [stored.filter(pa.array(keep)), source.filter(pa.array(insert)).cast(stored.schema)]
    )
    parts.write(out, rows)
    return out


def _bucket_keys(table: pa.Table) -> pa.Array:
    """One string per tombstone: its key and bucket (the tombstones' match)."""
    return pc.binary_join_element_wise(
        table.column("key_json").cast(pa.string()), table.column(BUCKET).cast(pa.string()), "\x00"
    )


def _version_keys(table: pa.Table) -> pa.Array:
    """One string per row: key, LSN and sequence (the history's match on a row version)."""
    return pc.binary_join_element_wise(
        table.column(KEY).cast(pa.string()),
        table.column(LSN).cast(pa.string()),
        table.column(SEQ).cast(pa.string()),
        "\x00",
    )


def write_history(
    table: DeltaTable,
    source: pa.Table,
    match: Iterable[int] | None,
    truncates: Sequence[TruncateAt],
    shard: Shard | None = None,
) -> TableWrite:
    """:func:`sinks.warehouse.delta.write_history` as files: ``close`` rows close the open row of their
    key and version, ``move`` rows move it to their end version, ``new`` rows are inserted unless an
    open row of that key and version is stored; the truncates close every open row older than the
    last one, at the first one newer than it. Only the open partitions of the touched buckets are
    rewritten; closed rows are appended."""
    parts = Partitions(table)
    out = parts.new_write(HISTORY)
    kind = source.column(SRC_KIND)
    target = source.drop_columns([SRC_KIND])
    if match is not None and not set(match):
        parts.write(out, target.filter(pc.equal(kind, "new")))
        return out
    stored = parts.read(out, match, open_only=True, shard=shard)
    cols = {name: stored.column(name).combine_chunks() for name in stored.column_names}
    # a history partitioned by bucket alone gives its closed rows too: they never match
    is_open = pc.fill_null(stored.column(IS_CURRENT), False).to_numpy(zero_copy_only=False)
    t_found = np.zeros(stored.num_rows, dtype=bool)
    insert = np.zeros(source.num_rows, dtype=bool)
    if source.num_rows:
        t_found, t_at, s_found, _ = _match(_version_keys(stored), _version_keys(source), among=is_open)
        t_found &= is_open
        kinds = np.asarray(kind.to_pylist(), dtype=object)
        at = pa.array(t_at)
        close = pa.array(t_found & (kinds[t_at] == "close"))
        move = pa.array(t_found & (kinds[t_at] == "move"))
        for name in (VALID_TO, IS_CURRENT, END_LSN, END_SEQ, END_OP):
            got = target.column(name).combine_chunks().take(at).cast(cols[name].type)
            cols[name] = pc.if_else(close, got, cols[name])
        for name, end in ((LSN, END_LSN), (SEQ, END_SEQ)):
            cols[name] = pc.if_else(move, target.column(end).combine_chunks().take(at), cols[name])
        insert = ~s_found & (kinds == "new")
        changed = np.asarray(close) | np.asarray(move)
        out.counts = {"updated": int(changed.sum()), "inserted": int(insert.sum())}
    if truncates:
        cols = _close_truncated(cols, ~t_found, truncates)
    updated = pa.table(cols, schema=stored.schema)
    parts.write(out, pa.concat_tables([updated, target.filter(pa.array(insert)).cast(stored.schema)]))
    return out


def _close_truncated(
    cols: dict[str, pa.Array], unmatched: np.ndarray, truncates: Sequence[TruncateAt]
) -> dict[str, pa.Array]:
    """Close each open row (not matched by the source) older than the last truncate, at the first
    truncate newer than it."""
    lsn = pc.fill_null(cols[LSN], -1).to_numpy().astype(np.int64)
    seq = pc.fill_null(cols[SEQ], -1).to_numpy().astype(np.int64)
    is_open = pc.fill_null(cols[IS_CURRENT], False).to_numpy(zero_copy_only=False)
    n = len(lsn)
    which = np.full(n, -1, dtype=np.int64)
    for i in range(len(truncates) - 1, -1, -1):  # the first (oldest) newer truncate wins
        (t_lsn, t_seq), _ts = truncates[i]
        older = (lsn < t_lsn) | ((lsn == t_lsn) & (seq < t_seq))
        which = np.where(older, i, which)
    hit = unmatched & is_open & (which >= 0)
    if not hit.any():
        return cols
    sel = np.where(hit, which, 0)
    t_lsns = np.array([t[0][0] for t in truncates], dtype=np.int64)[sel]
    t_seqs = np.array([t[0][1] for t in truncates], dtype=np.int64)[sel]
    t_ts = np.array([t[1] * 1000 for t in truncates], dtype=np.int64)[sel]
    mask = pa.array(hit)
    out = dict(cols)
    out[VALID_TO] = pc.if_else(mask, pa.array(t_ts).cast(cols[VALID_TO].type), cols[VALID_TO])
    out[IS_CURRENT] = pc.if_else(mask, pa.scalar(False), cols[IS_CURRENT])
    out[END_LSN] = pc.if_else(mask, pa.array(t_lsns), cols[END_LSN])
    out[END_SEQ] = pc.if_else(mask, pa.array(t_seqs), cols[END_SEQ])
    out[END_OP] = pc.if_else(mask, pa.scalar("t", cols[END_OP].type), cols[END_OP])
    return out


def commit_all(
    writes: Sequence[TableWrite],
    properties: CommitProperties,
    open_table: Callable[[str], DeltaTable | None] = DeltaTable,
) -> None:
    """Commit a batch's writes (from any number of tasks): one transaction per table, each with
    ``properties`` (the batch's application transaction), stage after stage (:data:`HISTORY`, then
    :data:`CURRENT`, then :data:`TOMBSTONES`). A stage's tables commit side by side, on up to
    :data:`COMMIT_THREADS` threads (each table's own handle; delta-rs writes the log entry with the
    GIL released): a stage waits for its slowest table, not for their sum. A table whose commit
    refuses (:class:`WriteConflict`) fails the batch once the other commits of its stage have ended,
    committed or not, and before any table of a later stage commits; the batch is then applied
    again, and a table already committed recognises it by its application transaction and writes
    nothing twice.
    ``open_table``: how a table is opened (:meth:`.handles.Handles.get`: the caller's handles),
    called on this thread only."""
    by_uri: dict[str, TableWrite] = {}
    for w in writes:
        if w.uri not in by_uri:
            by_uri[w.uri] = TableWrite(w.uri, w.read_version, list(w.partition_by), stage=w.stage)
        by_uri[w.uri].merge(w)
    stages: dict[int, list[tuple[DeltaTable, TableWrite]]] = {}
    for uri, write in sorted(by_uri.items()):
        table = open_table(uri)
        if table is None:
            raise ApplyError(
                f"the Delta table {uri} that this batch wrote to is gone; nothing of it was committed",
                fix="nothing to do if it was removed on purpose (`cdc tables remove`); else see `cdc status`",
                table=uri,
            )
        stages.setdefault(write.stage, []).append((table, write))
    for _stage, todo in sorted(stages.items()):
        with ThreadPoolExecutor(max_workers=min(COMMIT_THREADS, len(todo))) as pool:
            done = [pool.submit(commit, table, write, properties) for table, write in todo]
        for future in done:  # every commit of the stage has ended: the first table's error, in order
            future.result()
