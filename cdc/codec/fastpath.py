"""The compiled per-change path (issue #34): a pgoutput message's bytes (or a wal2json message's
JSON) straight to its records, and the initial snapshot's ``COPY`` rows to theirs
(:func:`copy_plan`, ``snapshot.exported``).

:func:`native_changes` builds what takes a pgoutput ``I``/``U``/``D`` message as the stream gives
it and returns what :meth:`cdc.codec.envelope.EventBuilder.change` returns for it (the topic and its records, or
None for a change the table's snapshot contains), without building the :class:`~cdc.codec.Message`,
its columns or the row dicts: :mod:`cdc.codec._native` (Cython, C) reads the tuples and writes the
event's key, value and image. It answers :data:`PYTHON` for every change it leaves to the Python
path (decode, then ``EventBuilder.change``), which stays the reference: the two give the same bytes
(``tests/unit/test_native.py``), and every change the compiled path declines is one the Python path
takes as it always did -- an unchanged TOAST value to fill in, a key change, a table whose columns
changed, a relation not registered (or the watermark table), a malformed message.

Which path runs: :func:`cdc.codec.compiled.native_status` (``cdc check`` says it). ``CDC_NATIVE=0`` forces the Python
path; a machine where the extension did not build runs it too, with a warning.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson

from cdc.codec import Converter
from cdc.codec.compiled import native_module
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.codec.pgoutput import PgOutput
from cdc.codec.values import _identity, _text_bool, _text_bytea, _text_int, _text_numeric
from cdc.codec.wal2json import Wal2Json, _int_any, _numeric
from cdc.logstore import Record

__all__ = [
    "PYTHON",
    "build_plan",
    "build_wal2json_plan",
    "copy_plan",
    "native_changes",
]

#: the compiled path's answer for a change the Python path takes
PYTHON: Any = object()


def _kind(native: Any, conv: Converter | None) -> int:
    """The compiled counterpart of a column's converter (KIND_PY: none, the converter runs)."""
    if conv is None or conv is _identity or conv is _text_numeric:
        return int(native.KIND_TEXT)
    if conv is _text_int:
        return int(native.KIND_INT)
    if conv is _text_bool:
        return int(native.KIND_BOOL)
    if conv is _text_bytea:
        return int(native.KIND_BYTEA)
    return int(native.KIND_PY)


def build_plan(native: Any, rel: Any, codec: TableCodec) -> Any:
    """The compiled plan of a relation's changes for ``codec``, or None when its changes take the
    Python path: the relation's columns are not exactly the codec's (a column added, dropped or
    retyped: the general path records it), or a key column is not carried."""
    types = codec.types
    if rel.ncols != codec.ncols or any(types.get(n) != t for n, t in rel.pairs):
        return None
    return _plan(native, codec, list(rel.names), codec.converters, list(rel.key))


def copy_plan(native: Any, codec: TableCodec, names: list[str]) -> Any:
    """The compiled plan of the snapshot's rows of ``codec``'s table: the columns ``names`` (the
    included ones, as ``COPY`` reads them), Postgres' text output through the text converters."""
    plan = _plan(native, codec, names, codec.text_converters, [False] * len(names))
    if plan is None:
        raise ValueError(f"a key column of {codec.reg.qualified} is not among the columns read")
    return plan


def build_wal2json_plan(native: Any, codec: TableCodec) -> Any:
    """The compiled plan of a table's wal2json changes (``cdc.codec._native.WPlan``), or None
    when they take the Python path (a key column excluded). Its columns are the codec's; a change
    whose columns are others (by name and type as wal2json sends them) is the Python path's. A
    string value becomes its JSON as the column's converter turns Postgres' text into it (numeric:
    the text itself); numbers by ``NUM_*`` (ints: their text; numeric: a string of their exact
    text; floats: their converter); ``true``/``false`` as they are for columns with no converter."""
    names = [c.name for c in codec.columns]
    convs = codec.converters
    plan = _plan(native, codec, names, convs, [False] * len(names), _wal2json_kind)
    if plan is None:
        return None
    nmodes = [
        native.NUM_COPY
        if convs[n] is None or convs[n] is _int_any
        else native.NUM_STRING
        if convs[n] is _numeric
        else native.NUM_PY
        for n in names
    ]
    return native.WPlan(
        plan,
        [orjson.dumps(n)[1:-1] for n in names],
        [orjson.dumps(codec.types[n])[1:-1] for n in names],
        nmodes,
        [convs[n] is None for n in names],
    )


def _wal2json_kind(native: Any, conv: Converter | None) -> int:
    """:func:`_kind` of a wal2json converter given a string (numeric's keeps it as it is)."""
    return int(native.KIND_TEXT) if conv is _numeric else _kind(native, conv)


def _plan(
    native: Any,
    codec: TableCodec,
    names: list[str],
    converters: dict[str, Converter | None],
    relkey: list[bool],
    kind: Any = _kind,
) -> Any:
    pos = {n: i for i, n in enumerate(names)}
    if any(k not in pos or k in codec.exclude for k in codec.key):
        return None
    dynamic: list[tuple[int, int] | None] = [None] * len(names)
    bound = codec.row_bound
    if bound.dynamic is not None:
        for name, factor, extra in bound.dynamic:
            if name in pos:
                dynamic[pos[name]] = (factor, extra)
    return native.Plan(
        [orjson.dumps(n) for n in names],
        [kind(native, converters[n]) for n in names],
        [converters[n] for n in names],
        [n in codec.exclude for n in names],
        relkey,
        [pos[k] for k in codec.key],
        dynamic,
        bound.static,
        bound.dynamic is None,
        [(pos[n], enc) for n, enc in codec.imaged if n in pos],
    )


def native_changes(
    decoder: Any, builder: EventBuilder, skip: tuple[Any, Any] = (None, None), native: Any = None
) -> Any:
    """The session's compiled path, or None: the decoder is neither pgoutput nor wal2json, or the
    compiled module is not there (see :func:`cdc.codec.compiled.native_status`). Called with an ``I``/``U``/``D``
    message (pgoutput's, or wal2json's JSON) and its ``data_start``, it returns what
    ``EventBuilder.change(decoder.decode(data, lsn))`` returns, or :data:`PYTHON`; ``pump`` drains
    runs of them into a batch; ``python_values`` and ``declined`` count its fallbacks (values
    through a Python converter; changes handed to the Python path). ``skip``: a (schema, table) it
    never takes (the chunked snapshots' watermark table, which the stream loop handles);
    ``native``: the compiled module (:func:`cdc.codec.compiled.native_module` by default)."""
    native = native if native is not None else native_module()
    if native is None:
        return None
    if isinstance(decoder, PgOutput):
        return native.Changes(decoder, builder, skip, functools.partial(build_plan, native), Record, PYTHON)
    if isinstance(decoder, Wal2Json):
        plan_for = functools.partial(build_wal2json_plan, native)
        return native.Wal2JsonChanges(builder, skip, plan_for, Record, PYTHON)
    return None
