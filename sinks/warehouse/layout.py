"""The warehouse's schema and layout: meta columns, table paths, options and bucket clustering.

See ``docs/warehouse.md`` for the tables and what each meta column means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from cdc import paths
from cdc.config import Settings, WarehouseConfig, section_options
from cdc.errors import ApplyError
from cdc.logstore.partition_arrays import partition_array
from cdc.logstore.partitioner import murmur2
from cdc.registry import TableReg
from sinks import types as T

KEY = "_cdc_key"
BUCKET = "_cdc_bucket"
LSN = "_cdc_commit_lsn"
SEQ = "_cdc_seq"
TS = "_cdc_ts"
OP = "_cdc_op"
VALID_FROM = "valid_from"
VALID_TO = "valid_to"
IS_CURRENT = "is_current"
HISTORY_RESERVED = (VALID_FROM, VALID_TO, IS_CURRENT)
END_LSN = "_cdc_end_commit_lsn"
END_SEQ = "_cdc_end_seq"
END_OP = "_cdc_end_op"
META_PREFIX = "_cdc_"
TRUNCATE_MARKER = "*"
LAYOUT_CONF = "cdc.layout"  # "range:<width>" or "hash:<buckets>"
INT_KEY_TYPES = frozenset({"smallint", "integer", "bigint"})
SRC_KIND = "__cdc_src_kind"  # merge-source-only column of the history merge

#: the history's partition columns: its open rows (``is_current``) apart from the closed ones, so that
#: closing a row rewrites only files of open rows (the closed ones are only ever appended to); the
#: current and tombstone tables are partitioned by ``_cdc_bucket`` alone
HISTORY_PARTITIONS = (BUCKET, IS_CURRENT)

#: a range bucket is never narrower than this many key values (:func:`range_width_for`)
MIN_RANGE_WIDTH = 1_024

TS_TYPE = pa.timestamp("us", tz="UTC")
CURRENT_META = pa.schema(
    [
        (KEY, pa.string()),
        (BUCKET, pa.int64()),
        (LSN, pa.int64()),
        (SEQ, pa.int64()),
        (TS, TS_TYPE),
        (OP, pa.string()),
    ]
)
HISTORY_META = pa.schema(
    [
        *CURRENT_META,
        (VALID_FROM, TS_TYPE),
        (VALID_TO, TS_TYPE),
        (IS_CURRENT, pa.bool_()),
        (END_LSN, pa.int64()),
        (END_SEQ, pa.int64()),
        (END_OP, pa.string()),
    ]
)
TOMBSTONES = pa.schema(
    [
        ("key_json", pa.string()),
        (BUCKET, pa.int64()),
        ("commit_lsn", pa.int64()),
        ("seq", pa.int64()),
        ("deleted_at", TS_TYPE),
    ]
)


class WarehouseOptions(WarehouseConfig):
    """Tuning of the warehouse sink: ``[warehouse]`` in cdc.toml, whose model
    (:class:`cdc.config.WarehouseConfig`) holds each key's default and bounds.

    ``clustering`` (``auto``, ``range``, ``hash``), ``range_width`` and ``buckets`` choose the
    :class:`Layout` of tables created afterwards (an existing table keeps the layout it was created
    with, stored in its configuration ``cdc.layout``); ``range_width`` is the widest range bucket, a
    table of wide rows gets a narrower one (:func:`range_width_for`). ``maintain_every``: run
    :meth:`WarehouseSink.maintain` on a table after every K-th batch id (0: never). ``vacuum_every``: delete a table's unreferenced files
    after every K-th batch id (0: only in ``maintain``). ``vacuum_retention_hours``: files unreferenced
    for longer are deleted by vacuum (keep it above the longest read of the warehouse: a `cdc sql` query,
    a `cdc verify`; the history table, not Delta time travel, keeps the past). Every batch's merge
    rewrites the files it touches, so the superseded files are what grows the disk: the fault suite's
    full-size workload left 67 GB of them beside 3.3 GB of live data in 80 minutes under Delta's
    7-day default. ``vacuum_garbage_ratio`` bounds them: after every batch, a table whose superseded
    bytes exceed this many times its live bytes has them deleted at once (0: never), except those a
    cdc reader's lease holds (:mod:`.leases`); those a commit of the last ``vacuum_min_retention_s``
    seconds removed go last, only as far as the ratio needs (best-effort protection for readers
    outside cdc; :mod:`.reclaim`). ``lease_max_age_s``: the longest a cdc reader's lease lasts (a
    read that takes longer may lose files; a lease whose process died ends at once).
    ``tombstone_retention_hours``:
    how long a delete's version guards against older late events. ``target_file_size``: the files
    ``maintain`` compacts small files into (bytes; a file already that large is never rewritten by it,
    so a compaction's cost stays bounded however large a table grows: default 8 MiB, None: delta-rs's
    100 MiB). A batch's rows reach a table as files (:mod:`sinks.warehouse.files`: whole buckets
    rewritten in Arrow, then committed as add/remove actions -- what a Spark task does for its
    buckets, with the driver committing).
    ``shards``: the :class:`Layout` shards of tables created afterwards (default: the log store's
    ``partitions``, so that one Spark task per topic partition owns one shard).
    ``compact_budget_s``: after every batch, its tables' partitions holding at least
    ``compact_min_files`` small files (under half ``target_file_size``) are compacted, the most
    first, for up to this many seconds in all (:mod:`.compact`; 0: only ``maintain`` compacts)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> WarehouseOptions:
        return section_options(cls, settings, "warehouse", shards=settings.partitions)


def range_width_for(options: WarehouseOptions, row_bytes: float) -> int:
    """The range width of a new table whose rows take ``row_bytes`` each (0: unknown):
    ``range_width``, narrowed for wide rows so that a bucket of dense keys holds about
    ``target_file_size`` -- the largest power of two of rows that fits, at least
    :data:`MIN_RANGE_WIDTH`, at most ``range_width``. A bucket is what a batch changing one of its
    keys rewrites (``docs/warehouse.md``, Write amplification)."""
    target = options.target_file_size or 100 << 20  # None: delta-rs's default
    fit = int(target // row_bytes) if row_bytes > 0 else options.range_width
    if fit >= options.range_width:
        return options.range_width
    return min(options.range_width, max(MIN_RANGE_WIDTH, 1 << (max(fit, 1).bit_length() - 1)))


def table_paths(state_dir: Path, reg: TableReg) -> tuple[Path, Path, Path]:
    """``(current, history, tombstones)``: ``<state>/warehouse/<schema>/<table>``, ``...__history`` and
    ``...__tombstones`` (:func:`cdc.paths.warehouse_tables`: characters outside ``[A-Za-z0-9._-]``
    replaced by ``_``, as in topic names)."""
    return paths.warehouse_tables(Path(state_dir), reg.schema, reg.table)


def bucket_of(key_json: str, buckets: int) -> int:
    """The bucket of a key: ``(murmur2(key bytes) & 0x7fffffff) % buckets`` (stable, Kafka's hash)."""
    return (murmur2(key_json.encode()) & 0x7FFFFFFF) % buckets


@dataclass(frozen=True)
class Layout:
    """How a table's rows are clustered into ``_cdc_bucket`` partitions (a table keeps the layout it
    was created with, in its configuration ``cdc.layout``).

    * ``range`` (width W): a single integer key column; bucket = ``key // W`` (Iceberg's
      ``truncate[W]``). Neighbouring keys share files, so the usual CDC pattern -- recent rows change
      -- rewrites only the newest buckets' files.
    * ``hash`` (N buckets): ``murmur2(_cdc_key) % N`` (Iceberg's ``bucket[N]``); any key type. A batch
      of K keys touches ``min(N, ~K)`` buckets wherever its keys are.

    ``shards`` (S > 1): every bucket belongs to one shard, ``bucket % S``, the key's
    :func:`sinks.shard_of` -- the log-store partition of its records when the topic has S
    partitions: bucket = ``base * S + shard``, ``base`` as above. A Spark task applying one
    partition's records then rewrites only its shard's files (``docs/apply.md``). A table created
    before shards (configuration ``mode:size``) has one shard.
    """

    mode: str
    size: int
    shards: int = 1

    def conf(self) -> str:
        base = f"{self.mode}:{self.size}"
        return base if self.shards == 1 else f"{base}:{self.shards}"

    @classmethod
    def parse(cls, raw: str) -> Layout:
        parts = raw.split(":")
        if (
            len(parts) not in (2, 3)
            or parts[0] not in ("range", "hash")
            or not all(p.isdigit() and int(p) >= 1 for p in parts[1:])
        ):
            raise ValueError(raw)
        return cls(parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 1)

    @classmethod
    def choose(
        cls,
        reg: TableReg,
        options: WarehouseOptions,
        key_values: Callable[[], Sequence[Any]],
        row_bytes: Callable[[], float] = lambda: 0.0,
        sampled: float = 1.0,
    ) -> Layout:
        """The layout of a new table. ``auto``: range for a single integer key column unless the first
        batch's keys are sparse (fewer than 1 key per 64 key values, e.g. snowflake ids: range buckets
        would hold a row or two each), else hash. ``key_values()``: the first batch's values of the key
        column; ``row_bytes()``: the size of its rows, which narrows the range width for wide rows
        (:func:`range_width_for`).

        ``sampled``: the fraction of the batch's records ``key_values()`` and ``row_bytes()`` come
        from (1.0: all), a sample spread over the batch (``spark_jobs.tasks.Planner``): its distinct
        keys count for ``1 / sampled`` each. A spread sample keeps about the batch's key span and
        mean row size, and its distinct keys scaled estimate the batch's (exactly when no key
        repeats; more when keys repeat, which leans to range); the rule tells dense keys (about 1
        key per value) from sparse ones (thousands of values per key) far from its threshold of 64,
        so a sample of a few thousand records decides as the whole batch does but for a batch near
        that threshold (``tests/apply/test_tasks.py``). A layout only clusters: any layout holds
        the same rows."""
        hashed = cls("hash", options.buckets, options.shards)
        types = {c.name: T.base_type(c.type) for c in reg.columns}
        int_key = len(reg.key) == 1 and types.get(reg.key[0]) in INT_KEY_TYPES
        if options.clustering == "hash" or not int_key:
            if options.clustering == "range":
                raise ApplyError(
                    f'[warehouse] clustering = "range" needs a single integer key; {reg.qualified} has '
                    f"key {list(reg.key)}",
                    fix='use clustering = "auto" or "hash"',
                    table=reg.qualified,
                )
            return hashed
        ranged = cls("range", range_width_for(options, row_bytes()), options.shards)
        if options.clustering == "range":
            return ranged
        values = [v for v in key_values() if type(v) is int]
        if len(values) > 1 and max(values) - min(values) + 1 > 64 * len(set(values)) / sampled:
            return hashed
        return ranged

    def buckets(self, reg: TableReg, keys: Sequence[str], key_values: Sequence[Any]) -> np.ndarray:
        """The bucket of each key (int64), given each key's value of the first key column (what the
        range layout divides)."""
        base = self._base(reg, keys, key_values)
        if self.shards == 1:
            return base
        shards: np.ndarray = partition_array([k.encode() for k in keys], self.shards)
        out: np.ndarray = base * self.shards + shards
        return out

    def _base(self, reg: TableReg, keys: Sequence[str], key_values: Sequence[Any]) -> np.ndarray:
        if self.mode == "hash":
            return partition_array([k.encode() for k in keys], self.size)
        bad = next((k for k, v in zip(keys, key_values, strict=True) if type(v) is not int), None)
        if bad is not None:
            raise ApplyError(
                f"{reg.qualified}: key {bad} is not an integer, but the warehouse table is range-clustered on it",
                fix="check the registration's key column against the source",
                key=bad,
            )
        out: np.ndarray = np.floor_divide(np.asarray(key_values, dtype=np.int64), self.size)
        return out
