"""The test oracle of the warehouse's writes: delta-rs' MERGE (the product's write method until
issue 33; the product now writes files only, :mod:`sinks.warehouse.files`). :class:`MergeWarehouseSink`
is the warehouse with every table written by a MERGE, committed by each write; the file writes must
give the same tables (``tests/sinks/test_file_writes.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake.table import TableMerger

from cdc.events import Version
from cdc.names import sql_ident as _q
from sinks.warehouse import WarehouseSink
from sinks.warehouse.delta import Commit, Truncate, arrow_schema, ts_literal
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


class MergeCommit(Commit):
    """:class:`sinks.warehouse.delta.Commit` through delta-rs' MERGE: each write commits at once
    (no deferred writes, no shards)."""

    def tombstones(self, tombs: DeltaTable, source: pa.Table) -> None:
        _merge_tombstones(tombs, source, self)

    def history(
        self,
        history: DeltaTable,
        source: pa.Table,
        match: Iterable[int] | None,
        truncates: Sequence[Truncate],
    ) -> dict[str, Any]:
        return _merge_history(history, source, match, truncates, self)

    def current(
        self, current: DeltaTable, source: pa.Table, match: Iterable[int] | None, trunc: Version | None
    ) -> dict[str, Any]:
        return _merge_current(current, source, match, trunc, self)


class MergeWarehouseSink(WarehouseSink):
    """The warehouse written with MERGE (one table at a time, never deferred nor sharded)."""

    commit_type: ClassVar[type[Commit]] = MergeCommit

    def defer_commits(self, into: list[Any] | None) -> None:
        raise AssertionError("the MERGE oracle commits its own writes")


def _col(alias: str, name: str) -> str:
    return f"{alias}.{_q(name)}"


def _newer(a: str, b: str) -> str:
    """SQL: version of alias ``a`` is strictly newer than version of alias ``b``."""
    return (
        f"({_col(a, LSN)} > {_col(b, LSN)} OR "
        f"({_col(a, LSN)} = {_col(b, LSN)} AND {_col(a, SEQ)} > {_col(b, SEQ)}))"
    )


def _older_than(alias: str, v: Version) -> str:
    return f"({_col(alias, LSN)} < {v.commit_lsn} OR ({_col(alias, LSN)} = {v.commit_lsn} AND {_col(alias, SEQ)} < {v.seq}))"


def _in_list(alias: str, column: str, values: Iterable[int]) -> str:
    return f"{_col(alias, column)} IN ({', '.join(str(v) for v in sorted(set(values)))})"


def _merger(table: DeltaTable, source: pa.Table, predicate: str, commit: Commit) -> TableMerger:
    """A merge of ``source`` (alias ``s``) into ``table`` (alias ``t``), committed with ``commit``."""
    return table.merge(
        source,
        predicate,
        source_alias="s",
        target_alias="t",
        streamed_exec=False,
        commit_properties=commit.properties,
    )


def _merge_tombstones(tombs: DeltaTable, source: pa.Table, commit: Commit) -> None:
    """Upsert the batch's delete (and TRUNCATE marker) versions, keeping the newer one per key."""
    pred = "t.key_json = s.key_json AND t._cdc_bucket = s._cdc_bucket AND " + _in_list(
        "t", BUCKET, source.column(BUCKET).unique().to_pylist()
    )
    newer = "(s.commit_lsn > t.commit_lsn OR (s.commit_lsn = t.commit_lsn AND s.seq > t.seq))"
    (
        _merger(tombs, source, pred, commit)
        .when_matched_update_all(predicate=newer)
        .when_not_matched_insert_all()
        .execute()
    )


def _merge_history(
    history: DeltaTable,
    source: pa.Table,
    match: Iterable[int] | None,
    truncates: Sequence[Truncate],
    commit: Commit,
) -> dict[str, Any]:
    """Write the history's source rows in one commit: ``close`` rows (``SRC_KIND``) close the stored
    open row of the same key and version, ``move`` rows move it to the version they carry in the end
    columns (a snapshot read that found the row unchanged: it stays open), ``new`` rows are inserted
    unless an open row of that version is stored; the batch's truncates close every open row older than them. Only open rows are read and
    rewritten (in a history partitioned by ``is_current`` too, only those partitions' files).
    ``match``: the buckets of the close and move rows (None: any, as with truncates); when empty, the new rows
    are appended."""
    target_cols = arrow_schema(history).names
    predicate = (
        f"{_col('t', KEY)} = {_col('s', KEY)} AND {_col('t', LSN)} = {_col('s', LSN)}"
        f" AND {_col('t', SEQ)} = {_col('s', SEQ)} AND {_col('t', BUCKET)} = {_col('s', BUCKET)}"
        f" AND {_col('t', IS_CURRENT)} = true"
    )
    if match is not None:
        match = set(match)
        if not match:  # only new keys: a plain append, one commit with the app transaction
            write_deltalake(
                history,
                source.drop_columns([SRC_KIND]).select(target_cols),
                mode="append",
                commit_properties=commit.properties,
            )
            return {
                "num_target_files_removed": 0,
                "num_target_rows_inserted": source.num_rows,
                "appended": True,
            }
        predicate += " AND " + _in_list("t", BUCKET, match)
    merger = _merger(history, source, predicate, commit)
    close_cols = (VALID_TO, IS_CURRENT, END_LSN, END_SEQ, END_OP)
    merger = (
        merger.when_matched_update(
            {c: _col("s", c) for c in close_cols}, predicate=f"{_col('s', SRC_KIND)} = 'close'"
        )
        .when_matched_update(
            {LSN: _col("s", END_LSN), SEQ: _col("s", END_SEQ)}, predicate=f"{_col('s', SRC_KIND)} = 'move'"
        )
        .when_not_matched_insert(
            {c: _col("s", c) for c in target_cols}, predicate=f"{_col('s', SRC_KIND)} = 'new'"
        )
    )
    if truncates:
        merger = merger.when_not_matched_by_source_update(
            _truncate_close_updates(truncates),
            predicate=f"{_col('t', IS_CURRENT)} AND {_older_than('t', truncates[-1][0])}",
        )
    return dict(merger.execute())


def _merge_current(
    current: DeltaTable,
    source: pa.Table,
    match: Iterable[int] | None,
    trunc: Version | None,
    commit: Commit,
) -> dict[str, Any]:
    """Merge the current table's source rows (every column of the table; ``_cdc_op`` 'd' for a delete,
    each already version-guarded against tombstones) in one commit; ``trunc``: the batch's newest
    TRUNCATE. ``match``: the buckets of the source's keys that have a current row (None with a
    TRUNCATE: any); only those are read and rewritten; when empty, the upserts are appended."""
    schema = source.schema
    predicate = f"{_col('t', KEY)} = {_col('s', KEY)} AND {_col('t', BUCKET)} = {_col('s', BUCKET)}"
    if trunc is None:
        # only the buckets of keys that have a current row can hold a match; a row of an absent key
        # is an insert (its version guard against deletes/truncates was applied by the caller)
        match = set(match or ())
        if not match:  # only absent keys: append their upserts (a delete of an absent key is a no-op)
            ups = source.filter(pc.not_equal(source.column(OP), "d"))
            if ups.num_rows == 0:
                return {}  # nothing to write: a replay computes the same nothing
            write_deltalake(current, ups, mode="append", commit_properties=commit.properties)
            return {"num_target_files_removed": 0, "num_target_rows_inserted": ups.num_rows, "appended": True}
        predicate += " AND " + _in_list("t", BUCKET, match)
    merger = _merger(current, source, predicate, commit)
    merger = (
        merger.when_matched_delete(predicate=f"{_col('s', OP)} = 'd' AND {_newer('s', 't')}")
        .when_matched_update(
            {c: _col("s", c) for c in schema.names},
            predicate=f"{_col('s', OP)} <> 'd' AND {_newer('s', 't')}",
        )
        .when_not_matched_insert({c: _col("s", c) for c in schema.names}, predicate=f"{_col('s', OP)} <> 'd'")
    )
    if trunc is not None:
        merger = merger.when_not_matched_by_source_delete(predicate=_older_than("t", trunc))
    return dict(merger.execute())


def _truncate_close_updates(truncates: Sequence[Truncate]) -> dict[str, str]:
    """Updates closing an open history row at the first truncate newer than it (CASE over truncates)."""

    def case(value: Any) -> str:
        arms = " ".join(f"WHEN {_older_than('t', v)} THEN {value(v, ts)}" for v, ts in truncates)
        return f"CASE {arms} END"

    return {
        VALID_TO: case(lambda v, ts: ts_literal(ts)),
        IS_CURRENT: "false",
        END_LSN: case(lambda v, ts: str(v.commit_lsn)),
        END_SEQ: case(lambda v, ts: str(v.seq)),
        END_OP: "'t'",
    }
