"""The compiled per-change path of pgoutput (issue #34): a message's bytes straight to its records.

:class:`NativeChanges` takes a pgoutput ``I``/``U``/``D`` message as the stream gives it and returns
what :meth:`cdc.codec.envelope.EventBuilder.change` returns for it (the topic and its records, or
None for a change the table's snapshot contains), without building the :class:`~cdc.codec.Message`,
its columns or the row dicts: :mod:`cdc.codec._native` (Cython, C) reads the tuples and writes the
event's key, value and image. It answers :data:`PYTHON` for every change it leaves to the Python
path (decode, then ``EventBuilder.change``), which stays the reference: the two give the same bytes
(``tests/unit/test_native.py``), and every change the compiled path declines is one the Python path
takes as it always did -- an unchanged TOAST value to fill in, a key change, a table whose columns
changed, a relation not registered (or the watermark table), a malformed message.

Which path runs: :func:`native_status` (``cdc check`` says it). ``CDC_NATIVE=0`` forces the Python
path; a machine where the extension did not build runs it too, with a warning.
"""

from __future__ import annotations

import importlib
import os
import struct
from collections.abc import Callable
from typing import Any

import orjson

from cdc.codec import Converter
from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.codec.pgoutput import PgOutput
from cdc.codec.values import _identity, _text_bool, _text_bytea, _text_int, _text_numeric
from cdc.logstore import Record

__all__ = ["PYTHON", "NativeChanges", "native_module", "native_status"]

#: :meth:`NativeChanges.__call__`'s answer for a change the Python path takes
PYTHON: Any = object()

_U32 = struct.Struct(">I").unpack_from


def _load() -> tuple[Any, str]:
    """(the compiled module or None, why not)."""
    if os.environ.get("CDC_NATIVE", "1") == "0":
        return None, "CDC_NATIVE=0"
    try:
        return importlib.import_module("cdc.codec._native"), ""
    except ImportError as exc:
        return None, f"not built: {exc}"


def native_module() -> Any:
    """The compiled module, or None (not built, or ``CDC_NATIVE=0``)."""
    return _load()[0]


def native_status() -> tuple[bool, str]:
    """(compiled, what to say): which per-change path a reader started now would run."""
    module, why = _load()
    if module is not None:
        return True, "compiled per-change path (cdc.codec._native)"
    if why == "CDC_NATIVE=0":
        return False, "Python per-change path (CDC_NATIVE=0)"
    return False, (
        f"Python per-change path: the compiled one (cdc.codec._native) is {why}; "
        "fix: install gcc and python3-dev, then `make setup` (or `pip install -e .`) again"
    )


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
    pos = {n: i for i, n in enumerate(rel.names)}
    if any(k not in pos or k in codec.exclude for k in codec.key):
        return None
    dynamic: list[tuple[int, int] | None] = [None] * rel.ncols
    bound = codec.row_bound
    if bound.dynamic is not None:
        for name, factor, extra in bound.dynamic:
            dynamic[pos[name]] = (factor, extra)
    kinds = [_kind(native, codec.converters[n]) for n in rel.names]
    return native.Plan(
        [orjson.dumps(n) for n in rel.names],
        kinds,
        [codec.converters[n] for n in rel.names],
        [n in codec.exclude for n in rel.names],
        list(rel.key),
        [pos[k] for k in codec.key],
        dynamic,
        bound.static,
        bound.dynamic is None,
        [(pos[n], enc) for n, enc in codec.imaged],
    )


class NativeChanges:
    """The compiled path of one stream session (see the module docstring): call it with a pgoutput
    ``I``/``U``/``D`` message and its ``data_start``. ``skip``: a (schema, table) it never takes
    (the chunked snapshots' watermark table, which the stream loop handles)."""

    def __init__(
        self, native: Any, decoder: PgOutput, builder: EventBuilder, skip: tuple[Any, Any] = (None, None)
    ) -> None:
        self.native = native
        self.encoder = native.Encoder()
        self.decoder = decoder
        self.builder = builder
        self.skip = skip
        #: relid -> (relation, codec, its types dict, plan or None)
        self._plans: dict[int, tuple[Any, TableCodec, dict[str, str], Any]] = {}

    @property
    def python_values(self) -> int:
        """Values converted by their Python converter (a type without a compiled converter)."""
        return int(self.encoder.py_values)

    @property
    def declined(self) -> int:
        """Changes the compiled path handed to the Python path."""
        return int(self.encoder.declined)

    def _plan(self, relid: int) -> tuple[TableCodec, Any] | None:
        rel = self.decoder.relations.get(relid)
        if rel is None:
            return None
        codec = self.builder.codecs.get((rel.schema, rel.table))
        if codec is None or (rel.schema, rel.table) == self.skip:
            return None
        entry = self._plans.get(relid)
        if entry is None or entry[0] is not rel or entry[1] is not codec or entry[2] is not codec.types:
            entry = (rel, codec, codec.types, build_plan(self.native, rel, codec))
            self._plans[relid] = entry
        return codec, entry[3]

    def __call__(self, data: bytes, lsn: int) -> Any:
        """What ``EventBuilder.change(decoder.decode(data, lsn))`` returns, or :data:`PYTHON`."""
        b = self.builder
        found = self._plan(_U32(data, 1)[0]) if len(data) >= 5 else None
        if found is None or found[1] is None or b.nonfinite_held:
            return PYTHON
        codec, plan = found
        seq = b.seq + 1
        if b.commit_lsn < codec.snapshot_lsn or seq <= b._skip_seq:
            b.seq = seq
            return None
        st = b.staging
        out = self.encoder.change(
            data, plan, codec.source_head, b.tx_part, lsn, b.commit_lsn, seq, b.now, st is not None
        )
        if out is None:
            return PYTHON
        b.seq = seq
        op, key, value, image = out
        topic = codec.topic
        if op == b"d":
            if st is not None:
                st.version = (b.commit_lsn, seq)
                if codec.imaged:
                    st.put(topic, key, None)
            return topic, [Record(key, value), Record(key, None)]
        if st is not None:
            st.version = (b.commit_lsn, seq)
            if image is not None:
                st.put(topic, key, image)
        return topic, [Record(key, value)]


def native_changes(
    decoder: Any, builder: EventBuilder, skip: tuple[Any, Any] = (None, None)
) -> Callable[[bytes, int], Any] | None:
    """The session's compiled path (:class:`NativeChanges`), or None: the decoder is not pgoutput,
    or the compiled module is not there (see :func:`native_status`)."""
    native = native_module()
    if native is None or not isinstance(decoder, PgOutput):
        return None
    return NativeChanges(native, decoder, builder, skip)
