"""The recorders: triggers on the source that tell the reader what logical decoding does not carry.

* :mod:`cdc.recorders.ddl`: schema changes, as logical messages from an event trigger;
* :mod:`cdc.recorders.nonfinite`: NaN and infinity in float and numeric columns, which wal2json 2.5
  sends as null.

``cdc check`` and ``cdc tables add`` install and check them, and so does the reader at the start of a
session; the messages are decoded by :mod:`cdc.codec`. Nothing here imports the reader, so the verbs
that only install or check a recorder start without it.
"""
