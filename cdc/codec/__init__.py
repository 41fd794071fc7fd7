"""Decoding: from what a logical decoding output plugin sends to the change events of :mod:`cdc.events`.

The package root is the interface every decoder implements; beside it, one module per decoder:

* :mod:`cdc.codec.wal2json` -- wal2json format-version 2 (the one the reader uses today);
* :mod:`cdc.codec.pgoutput` -- PostgreSQL's built-in pgoutput (issue #18): the same
  :class:`Message` for the same change, streamed transactions spooled until their commit.

Beside them, the compiled per-change path (issue #34): :mod:`cdc.codec._native` (Cython, built by
``setup.py``) turns pgoutput's changes and the snapshot's ``COPY`` rows into event bytes, driven by
:mod:`cdc.codec.fastpath`; the Python path stays the reference and the fallback.

Shared by every decoder: :mod:`cdc.codec.values` (Postgres' text output of a column type to its
event value; the snapshot's ``COPY`` uses it too), :mod:`cdc.codec.envelope` (a decoded change to
its event) and :mod:`cdc.codec.nonfinite` (the non-finite recorder's messages; installing the
recorder is the reader's, :mod:`cdc.recorders.nonfinite`).

Nothing here imports the reader or the snapshot: they import it (``docs/architecture.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec

__all__ = [
    "DDL_PREFIX",
    "HEARTBEAT_PREFIX",
    "MESSAGE_PREFIXES",
    "NONFINITE_PREFIX",
    "Col",
    "Converter",
    "Decoder",
    "Message",
]

#: prefix of the reader's heartbeat messages (non-transactional, empty)
HEARTBEAT_PREFIX = "cdc_heartbeat"
#: prefix of the DDL recorder's messages (transactional, JSON; :mod:`cdc.recorders.ddl`)
DDL_PREFIX = "cdc.ddl"
#: prefix of the non-finite recorder's messages (transactional, JSON; :mod:`cdc.recorders.nonfinite`)
NONFINITE_PREFIX = "cdc.nonfinite"

#: every logical-message prefix the reader reads (a decoder leaves out the others)
MESSAGE_PREFIXES = (HEARTBEAT_PREFIX, DDL_PREFIX, NONFINITE_PREFIX)

#: turns a column value as a decoder (or ``COPY``) gives it into its event value
Converter = Callable[[Any], Any]


class Col(msgspec.Struct, gc=False):
    """One column of a change: ``value`` is absent from ``pk`` entries. (Structs here are not
    tracked by the cyclic GC: one message per change, never in a reference cycle.)"""

    name: str
    type: str
    value: Any = None


class Message(msgspec.Struct, gc=False):
    """One decoded message (the fields of wal2json v2 that this service reads; a decoder fills
    what it has). ``action``: ``B``/``C`` (begin/commit), ``I``/``U``/``D``, ``T`` (truncate), ``M``
    (a logical message). Positions and times are integers, as pgoutput sends them: ``lsn`` and
    ``nextlsn`` LSNs, ``ts_ms`` the commit time in epoch milliseconds, of a ``B`` and a ``C`` only (a
    change's is its transaction's: wal2json repeats it in every change, its decoder reads it once).
    wal2json's text is parsed once, by its decoder; text only where a person reads it
    (:func:`cdc.events.int_to_lsn`)."""

    action: str
    xid: int | None = None
    ts_ms: int | None = None
    lsn: int | None = None
    nextlsn: int | None = None
    schema: str | None = None
    table: str | None = None
    columns: list[Col] | None = None
    identity: list[Col] | None = None
    transactional: bool | None = None
    prefix: str | None = None
    content: str | None = None  # of an ``M``: the message (wal2json sends it as text)


class Decoder(Protocol):
    """What the reader needs of an output plugin's decoder (:data:`cdc.codec.wal2json.DECODER`)."""

    #: the output plugin's name (``CREATE_REPLICATION_SLOT ... LOGICAL <plugin>``)
    plugin: str

    def decode(self, data: bytes, lsn: int) -> Message | None:
        """One message from the stream; ``lsn``: its position (the XLogData's ``data_start``: a
        change's own LSN, which pgoutput does not repeat inside the message). None when it
        carries nothing for the reader (pgoutput's Relation/Type/Origin messages, which only
        update the decoder's state; a logical message of another prefix).
        :class:`~cdc.errors.DecodeError` (with the raw bytes) if it is not a message."""
        ...

    def source(self, read: Callable[[], Any]) -> Callable[[], Any]:
        """What the stream loop reads raw messages with, given the cursor's ``read_message``: each
        call returns an object with ``payload`` and ``data_start``, or None when nothing is ready.
        wal2json: ``read`` itself. A decoder whose plugin streams in-progress transactions spools
        them and returns them at their commit, as one transaction."""
        ...

    def source_idle(self) -> bool:
        """Whether the last :meth:`source` holds nothing right now (no open stream block, no
        spooled transaction being returned), so the next raw message is the next it returns: a
        reader may take row changes from the raw stream itself, and hands the first message it does
        not take back to the source (cdc.codec._native.Changes.pump). wal2json: always."""
        ...

    def close(self) -> None:
        """End of the session: release what :meth:`source` holds (spool files)."""
        ...

    def replication_options(
        self, tables: Iterable[tuple[str, str]], *, numeric_as_string: bool = False
    ) -> dict[str, str]:
        """``START_REPLICATION`` options that stream the changes of ``tables`` (schema, table)
        and the :data:`MESSAGE_PREFIXES` messages."""
        ...

    def converter_for(self, pg_type: str, *, numeric_as_string: bool = False) -> Converter | None:
        """How a value of ``pg_type`` as this decoder gives it becomes its event value; None when
        it already is."""
        ...
