"""The embedded log store: one SQLite file per topic on local disk, no server (the default backend).

Guarantees beyond those of :class:`cdc.logstore.LogStore` (the full page: ``docs/logstore.md``):

* Durability: each append is committed with ``synchronous=FULL`` in WAL mode, so
  :meth:`EmbeddedLogStore.append_many` returns only after the WAL is fsync'd. A crash keeps every
  acknowledged batch and shows no part of an unacknowledged one (atomic per topic; a batch spanning
  several topics is committed topic by topic, in sorted topic order).
* One writing process per topic (``<topic>.lock``, taken on the first write and held until
  :meth:`~EmbeddedLogStore.close`); another gets :class:`~cdc.errors.WriterLockedError` with the
  holder's pid. Any number of ``writer=False`` instances read concurrently and see whole committed
  batches only. Readers and the writer must share one machine and a local file system.
* Compaction and retention run in a writer's background thread and on demand
  (:mod:`~cdc.logstore.embedded.maintenance`); offsets never change.
* A corrupt or truncated file raises :class:`~cdc.errors.StoreCorruptError` with its path and a fix;
  nothing is rewritten or dropped. A full disk raises :class:`~cdc.logstore.StoreFullError`: the
  failed append is not visible, nothing acknowledged is lost, and writing goes on once space is freed.

Modules: :mod:`~cdc.logstore.embedded.store` (the :class:`EmbeddedLogStore` class),
:mod:`~cdc.logstore.embedded.files` (file layout, SQLite connections, error mapping),
:mod:`~cdc.logstore.embedded.codec` (how a batch of records is stored),
:mod:`~cdc.logstore.embedded.maintenance` (compaction and retention).
"""

from cdc.logstore.embedded.store import EmbeddedLogStore

__all__ = ["EmbeddedLogStore"]
