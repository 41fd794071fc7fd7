"""The history (SCD type 2) of a view from joins (``cdc views add NAME --sql ... --history``).

Beside the view's current table (``<state>/warehouse/_views/<name>``), ``<name>__history`` holds one
row per version of each view row: the view's columns and ``_cdc_key``, plus the validity columns of
the tables' history (``docs/warehouse.md``), partitioned by ``is_current`` as theirs is (a batch's
MERGE matches open versions only, so it rewrites no file of closed ones): ``valid_from``, ``valid_to`` (null while current),
``is_current``, ``_cdc_op`` (``c`` a new view row, ``u`` a changed one) and ``_cdc_end_op`` (``u``
replaced, ``d`` left the view; null while current).

A version is a change of the view row itself: an affected key whose recomputed row equals its
current row (a change to a column the view does not show, a joined row rewritten with the same
values) opens no version. Its times are the apply's clock at the batch's view commit (UTC): a view
row joins rows committed at different times, and the one that changed it may be a delete, which no
current row records.

Exactly once, as the tables' history: the history is written before the current view table, in one
Delta commit carrying the batch's ``(app_id, batch_id)``, and computed only from the recomputed rows
(a function of the committed base tables) and the view's current table (written after it). After
every complete batch the history's open rows are the current table's rows; a crash between the two
commits is replayed with the history skipped (its app transaction) and the current table written
as the history already says.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, write_deltalake

from cdc import paths
from cdc.names import sql_ident as _q
from cdc.views import VIEW_KEY
from sinks.warehouse.delta import not_applied

_CLOSE = "__cdc_close"  # merge-source-only column: the row closes the key's open version
TS = pa.timestamp("us", tz="UTC")
#: the history's columns after the view's (and ``_cdc_key``)
VALIDITY = pa.schema(
    [
        ("_cdc_op", pa.string()),
        ("valid_from", TS),
        ("valid_to", TS),
        ("is_current", pa.bool_()),
        ("_cdc_end_op", pa.string()),
    ]
)


def _by_key(rows: pa.Table) -> dict[str, str]:
    """Per ``_cdc_key``: the row's values, compared as their repr (NaN equals NaN)."""
    keys = rows.column(VIEW_KEY).to_pylist()
    values = rows.drop_columns([VIEW_KEY]).to_pylist()
    return {str(k): repr(sorted(v.items())) for k, v in zip(keys, values, strict=True)}


def write_history(
    state_dir: Path,
    name: str,
    before: pa.Table | None,
    after: pa.Table,
    keys: set[str] | None,
    props: CommitProperties,
    app: tuple[str, int] | None,
    *,
    mode: Literal["overwrite", "error"] = "overwrite",
) -> int:
    """The history's versions for one batch of the view ``name``: ``before`` the current view rows
    of the keys considered (None: the view has no current table yet: the history's open versions,
    if it has any -- a build at ``cdc views add`` that stopped between its two commits), ``after``
    their recomputed rows (the view table's schema), ``keys`` the affected keys (None: every key, a
    whole recompute). Skipped when the history committed ``app`` = ``(app_id, batch_id)`` already
    (None: no application transaction, the build at add). ``mode``: how a history that does not
    exist is created (``error``: never over one created meanwhile). Returns the versions opened."""
    path = paths.view_history(state_dir, name)
    table = DeltaTable(str(path)) if DeltaTable.is_deltatable(str(path)) else None
    if table is not None and app is not None and not not_applied(table, *app):
        return 0
    if before is None and table is not None:
        stored = table.to_pyarrow_table(filters=[("is_current", "=", True)])
        before = stored.select(after.column_names)
    old = _by_key(before) if before is not None else {}
    new = _by_key(after)
    gone = sorted(k for k in old if k not in new and (keys is None or k in keys))
    changed = sorted(k for k, v in new.items() if old.get(k) != v)
    closes = [k for k in changed if k in old] + gone
    now = datetime.now(UTC)
    column = after.column(VIEW_KEY).cast(pa.string())
    opened = after.filter(pc.is_in(column, value_set=pa.array(changed, pa.string())))
    n = int(opened.num_rows)
    source = opened
    for f in VALIDITY:
        values: pa.Array = pa.nulls(n, f.type)
        if f.name == "_cdc_op":
            ops = ["u" if k in old else "c" for k in opened.column(VIEW_KEY).to_pylist()]
            values = pa.array(ops, pa.string())
        elif f.name == "valid_from":
            values = pa.array([now] * n, TS)
        elif f.name == "is_current":
            values = pa.array([True] * n, pa.bool_())
        source = source.append_column(f, values)
    if table is None:
        paths.ensure_private_dir(path.parent)
        write_deltalake(str(path), source, mode=mode, partition_by=["is_current"], commit_properties=props)
        return n
    if not closes and not n:
        return 0
    markers = key_markers(closes, source.schema)
    markers["valid_from"] = pa.array([now] * len(closes), TS)
    markers["_cdc_end_op"] = pa.array(["u" if k in new else "d" for k in closes], pa.string())
    marked = pa.table(markers, schema=source.schema)
    marked = marked.append_column(_CLOSE, pa.array([True] * len(closes), pa.bool_()))
    merged = pa.concat_tables([source.append_column(_CLOSE, pa.array([False] * n, pa.bool_())), marked])
    cols = {c: f"s.{_q(c)}" for c in source.column_names}
    (
        table.merge(
            merged,
            f"t.is_current = true AND t.{_q(VIEW_KEY)} = s.{_q(VIEW_KEY)} AND s.{_q(_CLOSE)}",
            source_alias="s",
            target_alias="t",
            streamed_exec=False,
            commit_properties=props,
        )
        .when_matched_update(
            {"is_current": "false", "valid_to": "s.valid_from", "_cdc_end_op": "s._cdc_end_op"}
        )
        .when_not_matched_insert(cols, predicate=f"NOT s.{_q(_CLOSE)}")
        .execute()
    )
    return n


def key_markers(keys: list[str], schema: pa.Schema) -> dict[str, pa.Array]:
    """The columns of one marker row per key of ``keys`` (a view row to close or delete): the view's
    key set, every other column of ``schema`` null."""
    return {
        f.name: pa.array(keys, f.type) if f.name == VIEW_KEY else pa.nulls(len(keys), f.type) for f in schema
    }
