"""The search index of a view from joins (``cdc views add NAME --sql ... --search COLS``).

The index is derived from the view's Delta table, not from the recompute: after the view's commit
of a batch, the view rows of the batch's affected keys are read from that table and handed to a
:class:`~sinks.search.SearchSink` of their own as the events of a table keyed by ``_cdc_key``
(:func:`view_search_reg`): an upsert per row found, a delete per affected key without a row. Their
version is the view table's Delta version (``seq``: the row's position), which only grows, so the
search sink's version guard orders them; its ``(app_id, batch_id)`` record makes a replay a no-op.
A whole build (the view's first, a TRUNCATE, the tasks path, a replay whose keys are unknown, or
the first batch after a view built at ``cdc views add`` while the apply ran) is a TRUNCATE event
followed by every row of the view table.

``cdc search VIEW`` (:func:`search_view`) gives a view's hits as a table's: keyed by the driving
row's key as an object (``{"id": 6000}``, not the ``_cdc_key`` text the index is keyed by).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from cdc import paths
from cdc.events import Version
from cdc.registry import Column, TableReg, ViewReg
from sinks import ChangeBatch, ChangeEvent, columns_of
from sinks.search import SearchSink
from sinks.search.query import Hit, search
from sinks.warehouse import leases
from sinks.warehouse.handles import refresh

VIEW_KEY = "_cdc_key"


def view_search_reg(view: ViewReg) -> TableReg:
    """The table registration the search sink keeps a view's index under: schema ``_views``, the
    view's name, topic ``_views.<name>`` (its index: ``<state>/search/_views.<name>``), key
    ``_cdc_key``, the view's search columns (text)."""
    return TableReg(
        schema="_views",
        table=view.name,
        topic=f"_views.{view.name}",
        key=(VIEW_KEY,),
        search=view.search,
        columns=(Column(VIEW_KEY, "text"), *(Column(c, "text") for c in view.search)),
        snapshot_state="done",
    )


def search_view(state_dir: Path, view: ViewReg, query: str, *, limit: int = 10) -> list[Hit]:
    """The view's hits for ``query`` (:func:`sinks.search.query.search` over its index), each keyed
    as a table's hit is: by the driving row's key as an object (its ``_cdc_key``, which the index
    holds as canonical key JSON, parsed), with the view's search columns as its document."""
    return [
        dataclasses.replace(
            hit,
            key=orjson.loads(hit.key[VIEW_KEY]),
            document={c: v for c, v in hit.document.items() if c != VIEW_KEY},
        )
        for hit in search(state_dir, view_search_reg(view), query, limit=limit)
    ]


def _text(value: Any) -> Any:
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)


def _event(op: str, key: str, after: dict[str, Any] | None, version: Version, i: int, ts: int) -> ChangeEvent:
    key_dict = {VIEW_KEY: key}
    return ChangeEvent(
        key=key_dict,
        key_json=orjson.dumps(key_dict).decode(),
        op=op,
        version=version,
        ts_ms=ts,
        after=after,
        before=key_dict if op == "d" else None,
        unavailable=(),
        partition=0,
        offset=i,
        snapshot=False,
    )


def index_view(
    sink: SearchSink,
    state_dir: Path,
    view: ViewReg,
    keys: set[str] | None,
    batch_id: int,
    app_id: str,
    lease_s: float | None = None,
    *,
    table: DeltaTable | None = None,
) -> int:
    """Index the view rows of ``keys`` (None: every row, after a TRUNCATE of the index) as they
    are in the view's table now; a replay of ``batch_id`` the index applied does nothing. Returns
    the events handed to the sink. The view's table is read under a lease of at most ``lease_s``
    (:mod:`sinks.warehouse.leases`) -- a reader outside the apply (``cdc views add``); None: none,
    the apply's own read within its batch (its reclaim runs after, in the same process).
    ``table``: the view's Delta table as the batch opened it already (brought to its latest
    version here, not opened again)."""
    reg = view_search_reg(view)
    done = sink.applied_batch(reg, app_id)
    if not view.search or (done is not None and done >= batch_id):
        return 0
    path = paths.view_table(state_dir, view.name)
    if not DeltaTable.is_deltatable(str(path)):
        return 0
    if keys is not None and not paths.search_index(state_dir, reg.topic).exists():
        keys = None  # no index yet (the view was built at `cdc views add`): every row
    with leases.lease(path, lease_s) if lease_s is not None else contextlib.nullcontext():
        if table is None:
            table = DeltaTable(str(path))
        else:
            refresh(table)
        columns = [VIEW_KEY, *view.search]
        rows = table.to_pyarrow_dataset().to_table(columns=columns)
    rows = rows.cast(pa.schema([f.with_type(pa.string()) if f.name == VIEW_KEY else f for f in rows.schema]))
    if keys is not None:
        rows = rows.filter(pc.is_in(rows.column(VIEW_KEY), value_set=pa.array(sorted(keys), pa.string())))
    lsn, ts = table.version() + 1, int(time.time() * 1000)
    events: list[ChangeEvent] = []
    if keys is None:
        truncate = ChangeEvent(
            {}, '{"__truncate__":0}', "t", Version(lsn, 0), ts, None, None, (), 0, 0, False
        )
        events.append(truncate)
    found = rows.to_pylist()
    for row in found:
        key = str(row[VIEW_KEY])
        events.append(
            _event(
                "u", key, {c: _text(row[c]) for c in columns}, Version(lsn, len(events) + 1), len(events), ts
            )
        )
    for key in sorted((keys or set()) - {str(r[VIEW_KEY]) for r in found}):
        events.append(_event("d", key, None, Version(lsn, len(events) + 1), len(events), ts))
    if events:
        sink.apply(ChangeBatch(reg, columns_of(reg, events)), batch_id, app_id)
    return len(events)
