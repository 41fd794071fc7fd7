"""Type changes at the source, as the warehouse follows them (docs/schema-changes.md).

A registered column whose type changed at the source (the reader records the new type and bumps the
table's schema version) is compared with the Delta column's type:

* the same Arrow type (``varchar(n)`` -> ``text``, both strings): nothing to do;
* a **safe widening** (:func:`widens`: a wider integer, ``real`` -> ``double precision``, a
  ``numeric(p,s)`` whose integer and fraction digits both grow, ``numeric(p,s)`` -> unconstrained
  ``numeric``): the Delta tables are rewritten once with the column cast (:func:`widen`), before the
  batch's commits; every stored value is kept exactly;
* anything else is **refused**: the Delta column keeps its type, and every event holding a non-null
  value of that column goes to the dead-letter topic with the reason and the fix
  (:func:`refusals`); events whose value is null still apply.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake

from cdc.registry import TableReg
from sinks import types as T
from sinks.warehouse.delta import arrow_schema

_INTS = (pa.int8(), pa.int16(), pa.int32(), pa.int64())


def widens(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether every value of ``old`` is held exactly, with the same meaning, by ``new``."""
    if old in _INTS and new in _INTS:
        return _INTS.index(new) >= _INTS.index(old)
    if old == pa.float32() and new == pa.float64():
        return True
    if pa.types.is_decimal(old) and pa.types.is_decimal(new):
        return bool(new.scale >= old.scale and new.precision - new.scale >= old.precision - old.scale)
    return bool(pa.types.is_decimal(old) and pa.types.is_string(new))  # numeric(p,s) -> numeric


#: the Postgres type whose Arrow mapping (:func:`sinks.types.arrow_type`) is the given Arrow type
def pg_type_of(at: pa.DataType) -> str | None:
    simple = {
        pa.int16(): "smallint",
        pa.int32(): "integer",
        pa.int64(): "bigint",
        pa.float32(): "real",
        pa.float64(): "double precision",
        pa.bool_(): "boolean",
        pa.string(): "text",
        pa.large_string(): "text",
        pa.binary(): "bytea",
        pa.date32(): "date",
        pa.timestamp("us", tz="UTC"): "timestamp with time zone",
        pa.timestamp("us"): "timestamp without time zone",
    }
    if at in simple:
        return simple[at]
    if pa.types.is_decimal(at):
        return f"numeric({at.precision},{at.scale})"
    return None


def changes(
    reg: TableReg, stored: dict[str, pa.DataType] | None
) -> tuple[dict[str, pa.DataType], dict[str, str]]:
    """``(widened, refused)``: the registered columns whose type differs from the stored Delta
    column's: those to widen (name -> new Arrow type) and those refused (name -> reason with the fix)."""
    widened: dict[str, pa.DataType] = {}
    refused: dict[str, str] = {}
    if not stored:
        return widened, refused
    for col in reg.columns:
        old = stored.get(col.name)
        if old is None or col.name in reg.exclude:
            continue
        new = T.arrow_type(col.type)
        if new == old:
            continue
        if widens(old, new):
            widened[col.name] = new
        else:
            refused[col.name] = (
                f"column {col.name} of {reg.qualified} changed type at the source to {col.type} "
                f"(schema version {reg.schema_version}), which the warehouse column ({old}) cannot hold "
                "without changing stored values; fix: re-snapshot the table into new warehouse tables "
                f"(stop `cdc apply`, move the table's Delta directories aside, `cdc snapshot {reg.qualified}`, "
                "then `cdc deadletters replay`)"
            )
    return widened, refused


def widen(path: Path, fields: dict[str, pa.DataType]) -> None:
    """Rewrite the Delta table at ``path`` with ``fields`` cast to their new (wider) types, in one
    commit keeping its partitioning and configuration. Idempotent: a column already of its new type
    is left as it is (a crash after the rewrite and before the batch's commits redoes nothing)."""
    table = DeltaTable(str(path))
    schema = arrow_schema(table)
    todo = {n: t for n, t in fields.items() if n in schema.names and schema.field(n).type != t}
    if not todo:
        return
    data = table.to_pyarrow_table()
    for name, at in todo.items():
        i = data.schema.get_field_index(name)
        data = data.set_column(i, pa.field(name, at), pc.cast(data.column(name), at))
    write_deltalake(
        table,
        data,
        mode="overwrite",
        schema_mode="overwrite",
        partition_by=list(table.metadata().partition_columns),
        configuration=dict(table.metadata().configuration),
    )
