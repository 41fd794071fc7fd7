"""Snapshot rows from a plain ``COPY ... TO STDOUT (FORMAT csv)`` to event bytes, vectorised with Arrow.

Postgres only runs its output functions (what any ``COPY`` does); the JSON of each event is built
here, column by column, with Arrow compute kernels:

* :func:`copy_query` is the plain ``COPY (SELECT cols FROM t WHERE ...) TO STDOUT (FORMAT csv)``.
* :func:`read_csv_batches` parses the COPY stream with Arrow's CSV reader (every column as text:
  nothing is converted through a float or a decimal, so numeric keeps every digit and bigint stays
  exact). An unquoted empty field is NULL, a quoted one (``""``) the empty string.
* :class:`RowEncoder` turns a batch into the key bytes and the ``after`` object bytes, with the
  stream's encoding (:mod:`cdc.codec.wal2json`, :mod:`cdc.events`): integers and floats as JSON
  numbers (Postgres' text output is valid JSON and round-trips exactly; ``extra_float_digits=1``),
  numeric as a string with every digit, booleans, bytea as hex without ``\\x``, every other type
  (dates with ``BC``, ``infinity`` timestamps, json/jsonb text, uuid, ...) as its text output in a
  JSON string, escaped exactly as orjson escapes. The special values (float ``NaN``/``Infinity``/
  ``-Infinity``, numeric ``NaN``/``Infinity``/``-Infinity``) are encoded by the stream's own
  converter (:func:`cdc.codec.values.text_converter_for`), so both paths agree by construction.
  Array columns and strings holding control characters other than newline, carriage return and
  tab (rare) are encoded value by value with the same converter and orjson.

The bytes are the stream's bytes for the same row (key and ``after``), except for floats, whose
digits may be written differently (``1e+30`` here, ``1e30`` from the stream) but parse to the same
number.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from psycopg import sql

from cdc.codec.envelope import TableCodec
from cdc.codec.values import FLOAT_SPECIALS, TOAST_TUPLE_THRESHOLD, RowBound, text_converter_for
from cdc.errors import SourceError
from cdc.logstore.images import FIELD_SEP, NAME_SEP
from cdc.pgtypes import type_kind
from cdc.registry import Column
from snapshot import snapshot_error

__all__ = ["RowEncoder", "copy_query", "encoder_for", "read_csv_batches", "text_copy_query"]

_CONTROL = r"[\x00-\x08\x0b\x0c\x0e-\x1f]"  # escaped by orjson as \b, \f or \u00XX


def copy_query(
    schema: str,
    table: str,
    names: Sequence[str],
    where: sql.Composable | None = None,
    source: sql.Composable | None = None,
    *,
    order_by: Sequence[str] = (),
    limit: int | None = None,
) -> sql.Composed:
    """The plain ``COPY`` of the snapshot: the columns as they are, CSV. ``source``: what to read
    instead of the table (some of a partitioned table's leaves, :mod:`snapshot.chunked`); a chunk of
    a chunked snapshot adds its key order and its row limit."""
    return sql.SQL("COPY (SELECT {} FROM {}{}{}{}) TO STDOUT (FORMAT csv)").format(
        sql.SQL(", ").join(sql.Identifier(n) for n in names),
        sql.Identifier(schema, table) if source is None else source,
        sql.SQL("") if where is None else sql.SQL(" WHERE ") + where,
        sql.SQL(" ORDER BY ") + sql.SQL(", ").join(sql.Identifier(n) for n in order_by)
        if order_by
        else sql.SQL(""),
        sql.SQL("") if limit is None else sql.SQL(" LIMIT {}").format(sql.Literal(limit)),
    )


def text_copy_query(schema: str, table: str, names: Sequence[str]) -> sql.Composed:
    """The plain ``COPY`` of the compiled snapshot path (:mod:`cdc.codec._native`): text format,
    NULL as ``\\N``, a value's tab, newline and backslash escaped (a raw newline ends a row)."""
    return sql.SQL("COPY (SELECT {} FROM {}) TO STDOUT").format(
        sql.SQL(", ").join(sql.Identifier(n) for n in names), sql.Identifier(schema, table)
    )


#: Arrow's CSV block (its unit of parallel parsing): a row may span at most two of them, so a buffer
#: holding a longer row is parsed with blocks as long as that row (:func:`read_csv_batches`)
ARROW_BLOCK = 1 << 20


def _row_end(buf: bytes) -> int:
    """The end (after its newline) of the last complete CSV row in ``buf``, which starts at a row
    boundary; 0 if none. A newline ends a row when an even number of double quotes precede it
    (a quote inside a quoted value is doubled, which keeps the parity). Linear in ``len(buf)``
    however many newlines the values hold: each step counts only the quotes it walks back over."""
    nl = buf.rfind(b"\n")
    if nl < 0:
        return 0
    quotes = buf.count(b'"', 0, nl)
    while quotes % 2:
        prev = buf.rfind(b"\n", 0, nl)
        if prev < 0:
            return 0
        quotes -= buf.count(b'"', prev, nl)
        nl = prev
    return nl + 1


def _arrow_block(buf: bytes, size: int) -> int:
    """The smallest Arrow block size from ``size`` up whose block boundaries (Arrow reads a buffer
    ``size`` bytes at a time) never fall between the ``\r`` and the ``\n`` of a CRLF: Arrow 26's
    CSV reader then silently drops a byte of the quoted value holding it (COPY ends rows with a bare
    ``\n``, so a CRLF is always inside a value)."""
    n = len(buf)
    while size < n and any(buf[k - 1] == 13 and buf[k] == 10 for k in range(size, n, size)):
        size += 1
    return size


def read_csv_batches(
    copy: Any,
    names: Sequence[str],
    block_size: int = 4 << 20,
    arrow_block: int = ARROW_BLOCK,
    *,
    table: str = "",
) -> Iterator[pa.RecordBatch]:
    """Arrow record batches (every column ``string``) of a running ``COPY ... (FORMAT csv)``: the
    output is cut into buffers of whole rows of about ``block_size`` bytes, each parsed by Arrow's
    (multi-threaded) CSV reader in blocks of ``arrow_block`` bytes, or of the buffer's longest row
    when that is longer (Arrow refuses a row that spans more than two of its blocks), so a row of any
    size parses, and only the buffer holding a long row pays for its long blocks. The block size is
    nudged so that no block boundary splits a CRLF (:func:`_arrow_block`).

    The longest row is the longest piece of the COPY output: psycopg yields one row per piece (libpq
    returns one data row at a time). Pieces that are not whole rows are still read exactly: a buffer
    Arrow refuses with such blocks is parsed again as one block. A buffer Arrow cannot parse at all
    raises :class:`snapshot.SnapshotError` naming ``table``."""
    parse_options = pacsv.ParseOptions(newlines_in_values=True, double_quote=True)
    convert_options = pacsv.ConvertOptions(
        column_types={n: pa.string() for n in names},
        null_values=[""],
        strings_can_be_null=True,
        quoted_strings_can_be_null=False,
    )

    def read(block: bytes, arrow_size: int) -> pa.Table:
        options = pacsv.ReadOptions(
            column_names=list(names), use_threads=True, block_size=_arrow_block(block, arrow_size)
        )
        return pacsv.read_csv(
            pa.BufferReader(block),
            read_options=options,
            parse_options=parse_options,
            convert_options=convert_options,
        )

    def parse(block: bytes, longest: int) -> Iterator[pa.RecordBatch]:
        try:
            try:
                parsed = read(block, max(arrow_block, longest))
            except pa.ArrowInvalid:
                if max(arrow_block, longest) >= len(block):
                    raise
                parsed = read(block, len(block))  # a row longer than its longest piece
        except pa.ArrowException as exc:
            raise snapshot_error(table, None, exc) from exc
        yield from parsed.combine_chunks().to_batches()

    parts: list[bytes] = []
    size = 0
    longest = 0  # the longest piece in parts
    scan_at = block_size  # the size at which to look for the last row end
    for data in copy:
        piece = bytes(data)
        parts.append(piece)
        n = len(piece)
        size += n
        if n > longest:
            longest = n
        if size < scan_at:
            continue
        buf = b"".join(parts)
        cut = size if buf.endswith(b"\n") and buf.count(b'"') % 2 == 0 else _row_end(buf)
        if cut == 0:  # one row longer than the buffer: keep reading, look again when it doubled
            parts, longest, scan_at = [buf], size, 2 * size
            continue
        yield from parse(buf[:cut] if cut < size else buf, longest)
        rest = buf[cut:]
        parts, size, longest, scan_at = ([rest] if rest else []), len(rest), len(rest), block_size
    if size:
        buf = b"".join(parts)
        if _row_end(buf) != len(buf):
            raise SourceError("COPY output ended in the middle of a row", fix="retry the snapshot")
        yield from parse(buf, longest)


def _lit(text: str | bytes) -> pa.Scalar:
    return pa.scalar(text.decode() if isinstance(text, bytes) else text, pa.string())


def _quote(arr: pa.Array) -> pa.Array:
    return pc.binary_join_element_wise(_lit('"'), arr, _lit('"'), _lit(""))


def _escape(arr: pa.Array) -> pa.Array:
    """JSON string bodies (no quotes), as orjson escapes them (control characters excepted:
    see :func:`_text`)."""
    for old, new in (("\\", "\\\\"), ('"', '\\"'), ("\n", "\\n"), ("\r", "\\r"), ("\t", "\\t")):
        if pc.any(pc.match_substring(arr, old)).as_py():
            arr = pc.replace_substring(arr, old, new)
    return arr


class RowEncoder:
    """Encodes batches of one table's rows (columns ``names``, Postgres types ``types``) into key
    bytes and ``after`` bytes (see the module docstring). ``key``: the key columns, in key order. A
    value that cannot be encoded raises :class:`snapshot.SnapshotError` naming ``table`` and its
    column."""

    def __init__(
        self,
        names: Sequence[str],
        types: dict[str, str],
        key: Sequence[str],
        *,
        table: str = "",
        imaged: Sequence[tuple[str, bytes]] = (),
        bound: RowBound | None = None,
    ) -> None:
        self.table = table
        #: the columns whose values the reader keeps per key (``TableCodec.imaged``): (name, JSON
        #: name), kept for the rows that may hold one out of line (``bound``: ``TableCodec.row_bound``)
        self.imaged = list(imaged)
        self.bound = bound
        self.names = list(names)
        self.key = list(key)
        self.kinds = {n: type_kind(types[n]) for n in self.names}
        self.converters = {n: text_converter_for(types[n]) for n in self.names}
        # the special values as the stream encodes them
        self.specials: dict[str, dict[str, str]] = {}
        for n in self.names:
            if self.kinds[n] in ("float", "numeric"):
                conv = self.converters[n]
                self.specials[n] = {
                    s: orjson.dumps(conv(s) if conv is not None else s).decode() for s in FLOAT_SPECIALS
                }
        self._after_parts = [orjson.dumps(n).decode() for n in self.names]
        self._key_parts = [orjson.dumps(n).decode() for n in self.key]

    def fragment(self, name: str, arr: pa.Array) -> pa.Array:
        """The JSON text of each value of column ``name`` (``null`` for NULL)."""
        kind = self.kinds[name]
        out: pa.Array
        if kind == "int":
            out = arr
        elif kind == "float":
            out = self._special(name, arr, arr)
        elif kind == "numeric":
            out = self._special(name, arr, _quote(arr))
        elif kind == "bool":
            out = pc.if_else(pc.equal(arr, "t"), _lit("true"), _lit("false"))
        elif kind == "bytea":
            out = _quote(pc.utf8_slice_codeunits(arr, 2))
        elif kind == "array":
            conv = self.converters[name]
            assert conv is not None
            out = pa.array(
                [None if v is None else orjson.dumps(conv(v)).decode() for v in arr.to_pylist()], pa.string()
            )
        else:
            out = self._text(arr)
        return pc.fill_null(out, _lit("null"))

    def _special(self, name: str, arr: pa.Array, plain: pa.Array) -> pa.Array:
        out = plain
        for text, encoded in self.specials[name].items():
            mask = pc.equal(arr, text)
            if pc.any(mask).as_py():
                out = pc.if_else(mask, _lit(encoded), out)
        return out

    def _text(self, arr: pa.Array) -> pa.Array:
        out = _quote(_escape(arr))
        control = pc.match_substring_regex(arr, _CONTROL)
        if pc.any(control).as_py():
            values = arr.to_pylist()
            flags = control.to_pylist()
            fixed = [orjson.dumps(v).decode() if f else None for v, f in zip(values, flags, strict=True)]
            out = pc.if_else(control, pa.array(fixed, pa.string()), out)
        return out

    def encode(self, batch: pa.RecordBatch) -> tuple[pa.Array, pa.Array]:
        """(key bytes, ``after`` bytes) of every row of ``batch``, as Arrow binary arrays."""
        keys, afters, _ = self.encode_rows(batch)
        return keys, afters

    def encode_rows(self, batch: pa.RecordBatch) -> tuple[pa.Array, pa.Array, pa.Array | None]:
        """:meth:`encode`, and each row's packed image of the :attr:`imaged` columns
        (:func:`cdc.logstore.images.pack`; None when none are imaged)."""
        frags: dict[str, pa.Array] = {}
        for i, n in enumerate(self.names):
            try:
                frags[n] = self.fragment(n, batch.column(i))
            except Exception as exc:  # unforeseen: say which table and column, then stop
                raise snapshot_error(self.table, n, exc) from exc
        images = None
        if self.imaged:
            parts: list[Any] = []
            for i, (name, enc) in enumerate(self.imaged):
                parts.append(pa.scalar((FIELD_SEP if i else b"") + enc + NAME_SEP, pa.binary()))
                parts.append(pc.cast(frags[name], pa.binary()))
            parts.append(pa.scalar(b"", pa.binary()))  # the separator
            images = pc.binary_join_element_wise(*parts)
            if self.bound is not None and self.bound.dynamic is not None:
                # as TableCodec.holds_out_of_line: a row under the threshold holds no value out of line
                total: Any = pa.scalar(self.bound.static, pa.int64())
                for name, factor, extra in self.bound.dynamic:
                    size = pc.cast(pc.binary_length(pc.cast(frags[name], pa.binary())), pa.int64())
                    total = pc.add(total, pc.add(pc.multiply(size, factor), extra))
                images = pc.if_else(
                    pc.greater(total, TOAST_TUPLE_THRESHOLD), images, pa.scalar(None, pa.binary())
                )
        return (
            self._object(self._key_parts, [frags[k] for k in self.key]),
            self._object(self._after_parts, [frags[n] for n in self.names]),
            images,
        )

    @staticmethod
    def _object(names: list[str], frags: list[pa.Array]) -> pa.Array:
        parts: list[Any] = []
        for i, (name, frag) in enumerate(zip(names, frags, strict=True)):
            parts.append(_lit(("{" if i == 0 else ",") + name + ":"))
            parts.append(frag)
        parts.append(_lit("}"))
        parts.append(_lit(""))  # the separator
        return pc.cast(pc.binary_join_element_wise(*parts), pa.binary())


def encoder_for(codec: TableCodec, columns: Sequence[Column]) -> RowEncoder:
    """The encoder of ``codec``'s table (its included columns, typed by ``columns``: the catalog's
    now), keeping the images the codec keeps; a :class:`~cdc.errors.SourceError` when a key column
    is not among them (dropped at the source, or excluded)."""
    table = codec.reg.qualified
    names = list(codec.included)
    missing = [k for k in codec.key if k not in names]
    if missing:
        raise SourceError(
            f"key column(s) {missing} of {table} are not in the table (or are excluded)",
            fix=f"register {table} again with a key of existing, not excluded columns",
            table=table,
        )
    return RowEncoder(
        names,
        {c.name: c.type for c in columns},
        codec.key,
        table=table,
        imaged=codec.imaged,
        bound=codec.row_bound,
    )
