"""Building change events (the Debezium-style envelope of :mod:`cdc.events`) from decoded changes
(:class:`cdc.codec.Message`) and snapshot rows.

Decisions (extending :mod:`cdc.events`):

* ``unavailable`` is always present (``[]`` when every column was sent).
* ``source.sequence`` is ``'["<commit_lsn>","<lsn>"]'`` with both LSNs as decimal integers, as
  Debezium writes it. ``source.txId`` is the xid (``null`` for snapshot rows).
* One wal2json change gets one ``seq``; the events derived from it (``d`` + tombstone + ``c`` of a
  primary-key change, the ``t`` markers of a TRUNCATE) share it.
* Snapshot rows: ``commit_lsn`` = ``lsn`` = the snapshot's consistent point, ``seq`` 0,
  ``source.ts_ms`` the time the snapshot started, ``source.snapshot`` ``"true"`` except the last row
  *of each table*, which is ``"last"``.
* ``before``: the identity wal2json sent (the old key under REPLICA IDENTITY DEFAULT, the old row
  under FULL), ``null`` when it sent none. Excluded columns are dropped from ``before`` and ``after``.
  The ``c`` of a primary-key change carries it too (the ``d``'s ``before``): it names the old key,
  whose row holds the unchanged TOAST values the ``c`` lists in ``unavailable``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from cdc.codec import Col, Converter, Decoder, Message
from cdc.codec.nonfinite import NonFinite, key_comparable, parse_nonfinite
from cdc.codec.values import (
    TOAST_TUPLE_THRESHOLD,
    out_of_line_columns,
    row_bound,
    text_converter_for,
)
from cdc.codec.wal2json import DECODER
from cdc.errors import DecodeError
from cdc.events import CONNECTOR_VERSION, TRUNCATE_KEY_FIELD, encode_key, int_to_lsn
from cdc.logstore import Record
from cdc.logstore.images import Alter, Image, Images, Staging, pack
from cdc.pgtypes import type_kind
from cdc.registry import Column, TableReg

_dumps = orjson.dumps
_Fragment = orjson.Fragment
_MISSING = object()
#: the per-change end of ``source``: (head, transaction part, lsn, commit_lsn, lsn, seq)
_SOURCE_TAIL = b'%b%b"lsn":%d,"sequence":"[\\"%d\\",\\"%d\\"]","seq":%d}'


@dataclass(eq=False, slots=True)
class ColumnsSeen:
    """A change whose columns the codec cannot take as they are, returned by
    :meth:`EventBuilder.change` in place of its records: the codec never settles a column change
    itself (that writes the registry, asks the source's catalog). The reader settles it
    (:mod:`cdc.reader.schema`), then :meth:`EventBuilder.resume` goes on with the change, which
    nothing has touched meanwhile (no event, no image staged), so its events carry the table's new
    columns and ``schema_version``.

    * ``unsent`` None: the change ``sent`` these columns (its new row, or its identity), of which
      one is not the codec's or has another type, or an INSERT that lacks a known column
      (``is_insert``): the table's columns are now those;
    * ``unsent``: the change left out these known columns, which an unchanged out-of-line value and
      a column dropped at the source look alike in: the reader asks the catalog, and takes those
      gone (and a column that a rename brought) out of the table's columns.
    """

    codec: TableCodec
    sent: list[Col]
    is_insert: bool
    unsent: list[str] | None
    # where the change stands: what :meth:`EventBuilder.resume` goes on from
    msg: Message
    lsn: int
    head: bytes
    source: bytes
    #: the new row, its unavailable columns and key, when the change's identity was the one seen
    row: tuple[dict[str, Any], list[str], dict[str, Any]] | None = None


def renamed_columns(old: Sequence[Column], new: Sequence[Column]) -> dict[str, str]:
    """A non-key column renamed at the source, as the stream sees it: in one change, exactly one
    column gone and one new column of the same type ({old: new}); else {} (a drop, an add)."""
    names = {c.name for c in new}
    before = {c.name for c in old}
    gone = [c for c in old if c.name not in names]
    added = [c for c in new if c.name not in before]
    if old and len(gone) == 1 and len(added) == 1 and gone[0].type == added[0].type:
        return {gone[0].name: added[0].name}
    return {}


#: types whose values keep their text through a change between them (no rewrite changes a value)
_SAME_TEXT = frozenset({"text", "character varying"})


def retyped_columns(old: Sequence[Column], new: Sequence[Column]) -> list[str]:
    """Columns whose type changed so that a stored value's text may no longer be the value's (the
    ALTER rewrote it at the source, where no change reaches the stream)."""
    types = {c.name: c.type for c in new}

    def base(t: str) -> str:
        return t.split("(", 1)[0].strip().lower()

    return [
        c.name
        for c in old
        if c.name in types
        and types[c.name] != c.type
        and not (base(types[c.name]) in _SAME_TEXT and base(c.type) in _SAME_TEXT)
    ]


def images_alter(old: Sequence[Column], new: Sequence[Column], renamed: dict[str, str] | None) -> Alter:
    """How a table's stored images read once its columns changed from ``old`` to ``new``
    (``renamed``: as the DDL recorder told, else inferred): a renamed column's values under its new
    name; a dropped column's gone, and a retyped one's (:func:`retyped_columns`): the images cannot
    know the values the ALTER rewrote, so a change that leaves it out keeps it in ``unavailable``
    until the table is snapshotted again (the reader asks for that)."""
    renamed = renamed_columns(old, new) if renamed is None else renamed
    names = {c.name for c in new}
    out: Alter = {}
    for name, to in renamed.items():
        out[_dumps(name)] = _dumps(to)
    for c in old:
        if c.name not in renamed and c.name not in names:
            out[_dumps(c.name)] = None
    for name in retyped_columns(old, new):
        out[_dumps(name)] = None
    return out


def transaction_part(ts_ms: int | None, xid: int | None, commit_lsn: int) -> bytes:
    """The part of ``source`` that every change of one transaction shares (commit time, xid, commit
    LSN); :meth:`TableCodec.change_source` completes it per change."""
    return (
        f'"ts_ms":{"null" if ts_ms is None else ts_ms},"snapshot":"false",'
        f'"txId":{"null" if xid is None else xid},"commit_lsn":{commit_lsn},'
    ).encode()


def event_value(
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
    source: bytes,
    op: bytes,
    unavailable: Sequence[str],
    now: bytes,
) -> bytes:
    """An event's value: rows in the event encoding (excluded columns dropped), ``source`` from
    :meth:`TableCodec.change_source` or :meth:`TableCodec.snapshot_source`, ``now`` the envelope's
    ``ts_ms`` (processing time)."""
    return b"".join(
        (
            b'{"before":',
            b"null" if before is None else _dumps(before),
            b',"after":',
            b"null" if after is None else _dumps(after),
            b',"source":',
            source,
            b',"op":"',
            op,
            b'","ts_ms":',
            now,
            b',"unavailable":',
            _dumps(unavailable) if unavailable else b"[]",
            b"}",
        )
    )


@dataclass
class TableCodec:
    """Everything needed to encode one table's events. ``snapshot_lsn``: stream changes of this
    table whose commit LSN is below it are already contained in its snapshot and are dropped."""

    reg: TableReg
    prefix: str
    db: str
    partitions: int
    types: dict[str, str] = field(default_factory=dict)
    converters: dict[str, Converter | None] = field(default_factory=dict)
    text_converters: dict[str, Converter | None] = field(default_factory=dict)
    source_head: bytes = b""
    numeric_as_string: bool = False  # the stream sends numeric-family values as strings (wal2json 2.6+)
    decoder: Decoder = DECODER  # whose values the stream's changes carry (:mod:`cdc.codec`)

    def __post_init__(self) -> None:
        self.topic = self.reg.topic
        self.key = self.reg.key
        self.exclude = frozenset(self.reg.exclude)
        self.snapshot_lsn = self.reg.alignment.consistent_lsn if self.reg.alignment else 0
        self.key_prefix = b"{" + _dumps(self.key[0]) + b":" if len(self.key) == 1 else None
        self.set_columns(self.reg.columns)
        self._set_head()

    def follow(self, reg: TableReg) -> None:
        """Take a newer registration of the same table (its columns changed at the source): the
        events from now on carry its ``source.schema_version``."""
        self.reg = reg
        self._set_head()

    def _set_head(self) -> None:
        self.source_head = (
            b'{"version":'
            + _dumps(CONNECTOR_VERSION)
            + b',"connector":"postgresql","name":'
            + _dumps(self.prefix)
            + b',"db":'
            + _dumps(self.db)
            + b',"schema":'
            + _dumps(self.reg.schema)
            + b',"table":'
            + _dumps(self.reg.table)
            + b',"schema_version":'
            + str(self.reg.schema_version).encode()
            + b","
        )

    def fast_row(self, cols: list[Col]) -> dict[str, Any] | None:
        """:meth:`row` for the common case; None when a column is unknown or changed type, or one
        is missing (TOAST): the caller then takes the general path."""
        types = self.types
        conv = self.converters
        out: dict[str, Any] = {}
        for c in cols:
            name = c.name
            if types.get(name) != c.type:
                return None
            f = conv[name]
            v = c.value
            out[name] = v if f is None or v is None else f(v)
        if len(out) != self.ncols:
            return None
        if self.exclude:
            for n in self.exclude:
                out.pop(n, None)
        return out

    def key_bytes(self, row: dict[str, Any], lsn: int) -> bytes:
        """:func:`cdc.events.encode_key` of the row's key columns."""
        if self.key_prefix is not None:
            try:
                return self.key_prefix + _dumps(row[self.key[0]]) + b"}"
            except KeyError:
                pass
        return encode_key(self.key_of(row, lsn))

    def set_columns(self, columns: Sequence[Column]) -> None:
        self.columns = tuple(columns)
        self.ncols = len(self.columns)
        # ``types``: as wal2json names them (a domain by its name), to tell a changed column;
        # wal2json sends a domain's values as text: they take the base type's text converter
        self.types = {c.name: c.domain or c.type for c in columns}
        self.converters = {
            c.name: text_converter_for(c.type)
            if c.domain
            else self.decoder.converter_for(c.type, numeric_as_string=self.numeric_as_string)
            for c in columns
        }
        self.text_converters = {c.name: text_converter_for(c.type) for c in columns}
        self.included = [c.name for c in columns if c.name not in self.exclude]
        self.key_comparable = key_comparable(self.key, {c.name: c.type for c in columns})
        #: the columns an UPDATE may leave out (unchanged out-of-line values), whose values the
        #: reader keeps per key (:mod:`cdc.logstore.images`) and fills in: (name, JSON-encoded name)
        outside = set(self.key) | self.exclude
        types = {c.name: c.type for c in columns}
        self.imaged = [(n, _dumps(n)) for n in out_of_line_columns(types) if n not in outside]
        self.imaged_json = dict(self.imaged)  # name -> its JSON, as the images key it
        #: the upper bound of a row's stored length: a row under ``TOAST_TUPLE_THRESHOLD`` holds no
        #: value out of line, so its image is not kept (:meth:`holds_out_of_line`)
        self.row_bound = row_bound(types, set(self.included))
        self._bound_dynamic = (
            None
            if self.row_bound.dynamic is None
            else [(n, _dumps(n), f, b) for n, f, b in self.row_bound.dynamic]
        )

    def holds_out_of_line(self, after: dict[str, Any], kept: Image | None = None) -> bool:
        """Whether the row may hold a value stored out of line (then its image is kept): Postgres
        toasts a row only when it is longer than ``TOAST_TUPLE_THRESHOLD``, and a value it moved out
        of line then was written by this change (an UPDATE sends it: its chunks are new) or is one
        filled in from ``kept``. Bounded from above (:func:`cdc.codec.values.row_bound`)."""
        dynamic = self._bound_dynamic
        if dynamic is None:
            return True
        total = self.row_bound.static
        for name, enc, factor, extra in dynamic:
            v = after.get(name, _MISSING)
            if v is None:
                continue
            if v is _MISSING:
                return True  # unknown (left out, and not filled in)
            if isinstance(v, str):
                n = len(v) if v.isascii() else 4 * len(v)
            elif isinstance(v, _Fragment):
                n = len(kept[enc]) if kept is not None and enc in kept else 1 << 30
            else:
                n = len(_dumps(v))
            total += factor * n + extra
            if total > TOAST_TUPLE_THRESHOLD:
                return True
        return False

    def image(self, after: dict[str, Any], kept: Image | None = None) -> bytes:
        """The packed image of an ``after`` row: its imaged columns' JSON; ``kept``: the values
        filled in from the key's image (``after`` holds them as fragments), taken as they are."""
        out: Image = {}
        for name, enc in self.imaged:
            if kept is not None and enc in kept and isinstance(after.get(name), _Fragment):
                out[enc] = kept[enc]
            elif name in after:
                out[enc] = _dumps(after[name])
        return pack(out)

    def image_of_event(self, after: dict[str, Any]) -> Image:
        """The image of a parsed event's ``after`` (rebuilding the images from a topic): empty for
        a row that holds no value out of line."""
        if not self.holds_out_of_line(after):
            return {}
        return {enc: _dumps(after[name]) for name, enc in self.imaged if name in after}

    # -- rows -----------------------------------------------------------------------------------
    def row(self, cols: list[Col]) -> dict[str, Any]:
        """Encode a wal2json column list (excluded columns dropped). Columns must be known
        (a change of other columns is a :class:`ColumnsSeen`)."""
        conv = self.converters
        exclude = self.exclude
        out: dict[str, Any] = {}
        for c in cols:
            name = c.name
            if name in exclude:
                continue
            f = conv[name]
            v = c.value
            out[name] = v if f is None or v is None else f(v)
        return out

    def key_of(self, row: dict[str, Any], lsn: int) -> dict[str, Any]:
        try:
            return {k: row[k] for k in self.key}
        except KeyError as exc:
            raise DecodeError(
                f"a change of {self.reg.qualified} at LSN {lsn} lacks key column {exc.args[0]!r}",
                fix="give the table REPLICA IDENTITY FULL or a primary key covering the key columns",
                lsn=lsn,
                reason="missing key column",
            ) from exc

    def value(
        self,
        before: Any,
        after: Any,
        source: bytes,
        op: bytes,
        unavailable: list[str],
        now: bytes | None = None,
    ) -> bytes:
        return event_value(
            before, after, source, op, unavailable, now or str(int(time.time() * 1000)).encode()
        )

    def change_source(self, tx_part: bytes, lsn: int, commit_lsn: int, seq: int) -> bytes:
        """``source`` of a streamed change: ``tx_part`` from :func:`transaction_part`, ``lsn`` the
        change's WAL position, ``seq`` its number within the transaction (from 1)."""
        return _SOURCE_TAIL % (self.source_head, tx_part, lsn, commit_lsn, lsn, seq)

    def change_records(
        self,
        op: bytes,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        source: bytes,
        now: bytes,
        unavailable: Sequence[str] = (),
        lsn: int = 0,
        new_key: dict[str, Any] | None = None,
    ) -> list[Record]:
        """The log-store records of one change, from rows in the event encoding (excluded columns
        dropped) -- what the reader appends, and the only place events are put together:

        * ``c``: the new row; ``u``: the new row, or, when ``before`` holds another key, a ``d`` of
          the old key, its tombstone and a ``c`` of the new one whose ``before`` is the old identity
          (all sharing ``source``);
        * ``d``: the delete of ``before``'s key and its tombstone;
        * ``t``: one marker per partition.

        ``new_key``: the new row's key when ``after`` lacks a key column (an unchanged TOAST value).
        """
        if op == b"t":
            value = event_value(None, None, source, b"t", (), now)
            return [
                Record(encode_key({TRUNCATE_KEY_FIELD: p}), value, partition=p)
                for p in range(self.partitions)
            ]
        if op == b"d":
            if before is None:
                raise ValueError("a delete needs the old row (its key at least)")
            key = self.key_bytes(before, lsn)
            return [Record(key, event_value(before, None, source, b"d", (), now)), Record(key, None)]
        if after is None:
            raise ValueError(f"an {op.decode()!r} change needs the new row")
        new = self.key_bytes(after, lsn) if new_key is None else encode_key(new_key)
        if op == b"u" and before is not None:
            old = self.key_bytes(before, lsn)
            if old != new:
                return [
                    Record(old, event_value(before, None, source, b"d", (), now)),
                    Record(old, None),
                    # ``before``: the old key's identity (Debezium's ``__debezium.oldkey`` header), so a
                    # sink can take the unchanged TOAST values ``unavailable`` lists from the old row
                    Record(new, event_value(before, after, source, b"c", unavailable, now)),
                ]
        return [Record(new, event_value(before, after, source, op, unavailable, now))]

    def snapshot_source(self, consistent_lsn: int, ts_ms: int, last: bool) -> bytes:
        seq = _dumps(f'["{consistent_lsn}","{consistent_lsn}"]')
        return (
            self.source_head
            + (
                f'"ts_ms":{ts_ms},"snapshot":"{"last" if last else "true"}","txId":null,'
                f'"lsn":{consistent_lsn},"sequence":'
            ).encode()
            + seq
            + f',"commit_lsn":{consistent_lsn},"seq":0}}'.encode()
        )

    def snapshot_record(self, after: dict[str, Any], source: bytes, now: bytes) -> Record:
        """An ``op=r`` record for a row already encoded (excluded columns dropped)."""
        return Record(self.key_bytes(after, 0), event_value(None, after, source, b"r", (), now))


class EventBuilder:
    """Turns decoded wal2json messages into log-store records, tracking the open transaction.

    Call :meth:`begin` for ``B``, :meth:`change` for ``I``/``U``/``D``/``T`` (returns the topic and
    records to append, in order), :meth:`commit` for ``C``. A change whose columns are not its
    table's (a column added, dropped, renamed or retyped at the source) returns a
    :class:`ColumnsSeen` instead: the caller settles it, then takes the records from :meth:`resume`.
    The table's new columns come back through :meth:`follow_columns`. Nothing here writes the
    registry or asks the source: the reader does (:mod:`cdc.reader.schema`).
    """

    def __init__(
        self,
        codecs: dict[tuple[str, str], TableCodec],
        *,
        skip_unlisted: bool = False,
        images: Images | None = None,
        staging: Staging | None = None,
        report_left_out: bool = False,
    ) -> None:
        self.codecs = codecs
        #: a change that leaves known columns out is reported (:attr:`ColumnsSeen.unsent`): only
        #: the source's catalog tells a dropped column from an unchanged out-of-line value; off (no
        #: catalog to ask): they are taken as unchanged values
        self.report_left_out = report_left_out
        #: each key's long values (:mod:`cdc.logstore.images`): an UPDATE's unchanged out-of-line
        #: values are filled in from them, and every event's changes are staged into ``staging``
        #: (the stream's batch commits them once its records are durable)
        self.images = images
        self.staging = staging
        #: changes up to this version are durable in their topics and in the images already (the
        #: slot sent them again after a crash): skipped, since the images hold later values
        self.replayed = images.high if images is not None else (0, 0)
        self._skip_seq = 0
        #: per table, the events written with a value the images could not give (``unavailable``)
        self.unknown: dict[str, int] = {}
        #: a change of a table not in ``codecs`` is skipped (counted in :attr:`unlisted`), not an
        #: error: the decoder's filter is shared server state (pgoutput's publication) that may
        #: hold a table registered after this session started, which restarts with it
        self.skip_unlisted = skip_unlisted
        self.unlisted = 0
        #: tables no longer decoded (dropped, renamed or refused at the source, told by the DDL
        #: recorder): their changes are skipped
        self.detached: dict[tuple[str, str], TableCodec] = {}
        self.xid: int | None = None
        self.commit_lsn = 0
        self.seq = 0
        self.tx_part = b""
        self.now = b"0"
        # the table of the previous change (most changes follow one of the same table)
        self._last_schema: str | None = None
        self._last_table: str | None = None
        self._last_codec: TableCodec | None = None
        #: the non-finite recorder's messages not yet taken by a change: (schema, table) -> {image: message}
        self.nonfinite_held: dict[tuple[str, str], dict[str, NonFinite]] = {}
        self.tick()

    def tick(self) -> None:
        """Refresh the envelope's ``ts_ms`` (processing time); the stream loop calls it often."""
        self.now = str(int(time.time() * 1000)).encode()

    def begin(self, msg: Message) -> None:
        self.nonfinite_held.clear()
        self.xid = msg.xid
        self.commit_lsn = msg.lsn or 0
        self.seq = 0
        self.tx_part = transaction_part(msg.ts_ms, self.xid, self.commit_lsn)
        high_lsn, high_seq = self.replayed
        self._skip_seq = (
            0 if self.commit_lsn > high_lsn else high_seq if self.commit_lsn == high_lsn else 1 << 62
        )

    def commit(self, msg: Message) -> int:
        """Close the transaction; return the position to confirm once its events are durable
        (``nextlsn``, the end of the commit record)."""
        self.xid = None
        return msg.nextlsn or msg.lsn or 0

    @staticmethod
    def _differs(codec: TableCodec, cols: list[Col], is_insert: bool) -> bool:
        """Whether the columns a change sent are not ``codec``'s: one unknown or of another type, or
        an INSERT (which sends every column) without one of them."""
        types = codec.types
        for c in cols:
            if types.get(c.name, _MISSING) != c.type:
                return True
        return is_insert and len(cols) < len(types)

    def follow_columns(
        self,
        codec: TableCodec,
        cols: tuple[Column, ...],
        reg: TableReg | None,
        renamed: dict[str, str] | None = None,
    ) -> None:
        """The table's columns are ``cols`` from the next event on (domains resolved), registered
        as ``reg`` (its ``schema_version``; None: ``codec``'s stays). ``renamed``: the columns the
        DDL recorder told renamed, else inferred from the columns (:func:`images_alter`)."""
        if self.staging is not None:
            self.staging.alter(codec.topic, images_alter(codec.columns, cols, renamed))
        codec.set_columns(cols)
        if reg is not None:
            codec.follow(reg)

    # -- the non-finite recorder (cdc.recorders.nonfinite) ------------------------------------------
    def nonfinite(self, msg: Message) -> None:
        """A ``cdc.nonfinite`` message: held for the next change of its table in this transaction."""
        nf = parse_nonfinite(msg.content, int_to_lsn(msg.lsn or 0))
        self.nonfinite_held.setdefault((nf.schema, nf.table), {})[nf.image] = nf

    @staticmethod
    def _patch(codec: TableCodec, msg: Message, held: dict[str, NonFinite]) -> None:
        """Put the held values into the change's nulls of float and numeric columns (``after`` from
        the ``new`` image, the identity from the ``old`` one), when the change's key is the
        message's."""
        for image, nf in held.items():
            cols = msg.columns if image == "new" else msg.identity
            if not cols or not nf.values:
                continue
            if codec.key_comparable:
                have = {c.name: c.value for c in cols}
                got = [None if have.get(k) is None else str(have[k]) for k in codec.key]
                if got != nf.key:
                    continue  # not this change's row (see cdc.recorders.nonfinite)
            values = nf.values
            for c in cols:
                # by the type wal2json sent: a column added since the codec's columns counts too
                if c.value is None and c.name in values and type_kind(c.type) in ("float", "numeric"):
                    c.value = values[c.name]

    # -- the DDL recorder (cdc.reader.ddl) ------------------------------------------------------
    def detach(self, codec: TableCodec) -> None:
        """Stop decoding the table's changes (its leaf partitions' too): they are skipped."""
        for key in [k for k, c in self.codecs.items() if c is codec]:
            self.detached[key] = self.codecs.pop(key)
        self._last_schema = self._last_table = self._last_codec = None

    def reattach(self, key: tuple[str, str]) -> TableCodec | None:
        """A detached table back under its name (created again): decoded again; None if it was
        not detached."""
        codec = self.detached.pop(key, None)
        if codec is None:
            return None
        for k in [k for k, c in self.detached.items() if c is codec]:
            self.codecs[k] = self.detached.pop(k)
        self.codecs[key] = codec
        self._last_schema = self._last_table = self._last_codec = None
        return codec

    def change(self, msg: Message) -> tuple[str, list[Record]] | ColumnsSeen | None:
        """Records for one I/U/D/T message, or None when the change is already contained in the
        table's snapshot (commit LSN below the snapshot's consistent point), or a
        :class:`ColumnsSeen` when its columns are not the table's: settle it, then :meth:`resume`."""
        action = msg.action
        table = msg.table
        if table == self._last_table and msg.schema == self._last_schema:
            codec: TableCodec | None = self._last_codec
        else:
            codec = self.codecs.get((msg.schema or "", table or ""))
            self._last_schema, self._last_table, self._last_codec = msg.schema, table, codec
        if self.nonfinite_held:
            held = self.nonfinite_held.pop((msg.schema or "", table or ""), None)
            if held is not None and codec is not None:
                self._patch(codec, msg, held)
        if codec is None:
            if self.skip_unlisted or (msg.schema or "", table or "") in self.detached:
                self.seq += 1
                self.unlisted += self.skip_unlisted
                return None
            raise DecodeError(
                f"the stream sent a change of {msg.schema}.{msg.table}, which is not registered",
                fix="this is a bug: the add-tables filter and the registry disagree",
                lsn=int_to_lsn(msg.lsn or 0),
                reason="unregistered table",
            )
        self.seq += 1
        if self.commit_lsn < codec.snapshot_lsn or self.seq <= self._skip_seq:
            return None
        st = self.staging
        if st is not None:
            st.version = (self.commit_lsn, self.seq)
        lsn = msg.lsn or 0
        head = codec.source_head
        source = _SOURCE_TAIL % (head, self.tx_part, lsn, self.commit_lsn, lsn, self.seq)  # change_source
        if action == "I":
            after = codec.fast_row(msg.columns or [])
            if after is not None:  # change_records, inline (the common case)
                value = event_value(None, after, source, b"c", (), self.now)
                key_b = codec.key_bytes(after, lsn)
                if st is not None and codec.imaged and codec.holds_out_of_line(after):
                    st.put(codec.topic, key_b, codec.image(after))
                return codec.topic, [Record(key_b, value)]
        elif action == "U":
            after = codec.fast_row(msg.columns or [])
            identity = msg.identity
            if after is not None and identity is not None:
                fast_before: dict[str, Any] | None
                try:
                    fast_before = codec.row(identity)
                except KeyError:  # a column not seen before: the general path records it
                    fast_before = None
                if fast_before is not None:
                    key_b = codec.key_bytes(after, lsn)
                    if key_b == codec.key_bytes(fast_before, lsn):  # else: a key change, below
                        value = event_value(fast_before, after, source, b"u", (), self.now)
                        if st is not None and codec.imaged and codec.holds_out_of_line(after):
                            st.put(codec.topic, key_b, codec.image(after))
                        return codec.topic, [Record(key_b, value)]
        if action == "T":
            if st is not None:
                st.clear(codec.topic)
            return codec.topic, codec.change_records(b"t", None, None, source, self.now)
        return self._general(codec, msg, lsn, head, source)

    def resume(self, seen: ColumnsSeen) -> tuple[str, list[Record]] | ColumnsSeen:
        """Go on with the change ``seen`` stopped (once the reader settled it: the table's columns
        followed, :meth:`follow_columns`): its records, or the next :class:`ColumnsSeen` of it."""
        return self._general(seen.codec, seen.msg, seen.lsn, seen.head, seen.source, seen)

    def _general(
        self,
        codec: TableCodec,
        msg: Message,
        lsn: int,
        head: bytes,
        source: bytes,
        seen: ColumnsSeen | None = None,
    ) -> tuple[str, list[Record]] | ColumnsSeen:
        """:meth:`change` of an I/U/D off its fast path: a DELETE, a column missing (TOAST) or not
        known (the columns changed), a key change. ``head``: the table's ``source_head`` that
        ``source`` was built with (a new one: the columns changed, ``source`` is built again).
        ``seen``: where :meth:`resume` goes on from; every :class:`ColumnsSeen` is returned before
        anything of the change is recorded, in the order the change's columns are looked at (its
        new row, the columns it left out, its identity)."""
        action = msg.action
        identity = msg.identity
        if action == "D":
            if identity is None:
                raise DecodeError(
                    f"a DELETE of {codec.reg.qualified} at LSN {int_to_lsn(msg.lsn or 0)} carries no old key",
                    fix="give the table a primary key or REPLICA IDENTITY FULL",
                    lsn=int_to_lsn(msg.lsn or 0),
                    reason="no identity",
                )
            if self._differs(codec, identity, False):
                return ColumnsSeen(codec, identity, False, None, msg, lsn, head, source)
            if codec.source_head is not head:  # the columns changed: the new schema version
                source = codec.change_source(self.tx_part, lsn, self.commit_lsn, self.seq)
            records = codec.change_records(b"d", codec.row(identity), None, source, self.now, lsn=lsn)
            if self.staging is not None and codec.imaged:
                self.staging.put(codec.topic, records[0].key, None)
            return codec.topic, records
        cols = msg.columns or []
        is_insert = action == "I"
        unavailable: list[str]
        if seen is not None and seen.row is not None:  # the identity was seen: its row stands
            after, unavailable, new_key = seen.row
        else:
            if self._differs(codec, cols, is_insert):
                return ColumnsSeen(codec, cols, is_insert, None, msg, lsn, head, source)
            after = codec.row(cols)
            unavailable = []
            if len(after) < len(codec.included):
                # left out: unchanged out-of-line values, or dropped at the source (then no longer
                # in the events: the warehouse keeps the column, null); asked once per change
                unavailable = [n for n in codec.included if n not in after]
                if self.report_left_out and (seen is None or seen.unsent is None):
                    return ColumnsSeen(codec, cols, is_insert, unavailable, msg, lsn, head, source)
            new_key = (
                codec.key_of(after, lsn)
                if not unavailable
                else self._key_with_identity(codec, after, identity, lsn)
            )
        if action not in ("I", "U"):
            raise DecodeError(
                f"unknown wal2json action {action!r}",
                fix="report this message",
                lsn=int_to_lsn(msg.lsn or 0),
                reason="unknown action",
            )
        before: dict[str, Any] | None = None
        if not is_insert and identity is not None:
            if self._differs(codec, identity, False):
                row = (after, unavailable, new_key)
                return ColumnsSeen(codec, identity, False, None, msg, lsn, head, source, row)
            before = codec.row(identity)
        if codec.source_head is not head:  # the columns changed: the new schema version
            source = codec.change_source(self.tx_part, lsn, self.commit_lsn, self.seq)
        new_b = encode_key(new_key)
        old_b = codec.key_bytes(before, lsn) if before is not None else new_b
        kept: Image | None = None
        sent = any(name in after for name, _ in codec.imaged)  # else the image stands as it was
        if unavailable:
            after, unavailable, kept = self._fill(codec, after, unavailable, new_key, old_b)
        records = codec.change_records(
            b"c" if is_insert else b"u", before, after, source, self.now, unavailable, lsn, new_key
        )
        st = self.staging
        if st is not None:
            if old_b != new_b:
                st.put(codec.topic, old_b, None)
            if kept is not None and not sent and old_b == new_b:
                pass  # every value the image holds was left out, unchanged: so is the image
            elif codec.imaged and codec.holds_out_of_line(after, kept):
                st.put(codec.topic, new_b, codec.image(after, kept))
        return codec.topic, records

    def _fill(
        self,
        codec: TableCodec,
        after: dict[str, Any],
        unavailable: list[str],
        key: dict[str, Any],
        src: bytes,
    ) -> tuple[dict[str, Any], list[str], Image | None]:
        """``after`` with the columns it lacks filled in, in the table's column order: key columns
        from ``key`` (an unchanged out-of-line key value), the others from the image of the key
        ``src`` (the row's own, or the old key's for a key change). Returns the row, the columns
        still unknown (the images lack them: they stay in ``unavailable``) and the image used."""
        image = self.images.get(codec.topic, src) if self.images is not None else None
        names = codec.imaged_json
        still: list[str] = []
        for name in unavailable:
            if name in key:
                after[name] = key[name]
                continue
            enc = names.get(name)  # a column not imaged is never left out, nor in an image
            value = None if image is None or enc is None else image.get(enc)
            if value is None:
                still.append(name)
            else:
                after[name] = _Fragment(value)
        if still:
            self.unknown[codec.reg.qualified] = self.unknown.get(codec.reg.qualified, 0) + 1
        return {n: after[n] for n in codec.included if n in after}, still, image

    def _key_with_identity(
        self, codec: TableCodec, after: dict[str, Any], identity: list[Col] | None, lsn: int
    ) -> dict[str, Any]:
        if all(k in after for k in codec.key):
            return codec.key_of(after, lsn)
        old = codec.row(identity) if identity else {}
        return {k: after[k] if k in after else codec.key_of(old, lsn)[k] for k in codec.key}
