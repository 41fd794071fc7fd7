"""The one list of sinks. Every part that handles sinks loops over :data:`SINKS`: the apply job
(:func:`spark_jobs.applier.open_sinks`), ``cdc verify``, ``cdc status`` and ``cdc tables list``.

A new sink is a module implementing :class:`sinks.Sink` (its tests beside the others in
``tests/sinks/``) and one entry here; nothing registers itself on import. The order is the order
the job applies them in and ``cdc verify`` reports them in: the first is the primary copy, whose
differences ``cdc verify`` reports at the top level of a table's report.
"""

from __future__ import annotations

from sinks import Sink
from sinks.search import SearchSink
from sinks.warehouse import WarehouseSink

__all__ = ["SINKS"]

SINKS: tuple[type[Sink], ...] = (WarehouseSink, SearchSink)
