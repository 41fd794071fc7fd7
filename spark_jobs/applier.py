"""The Spark-free part of a micro-batch: :class:`BatchApplier`, Arrow records in, :class:`BatchOutcome` out.

It imports no pyspark (an import-linter contract in ``pyproject.toml`` says so): the apply job's
``foreachBatch`` (:mod:`spark_jobs.apply`) hands it the micro-batch's records as an Arrow table of
:data:`cdc.logstore.records.RECORDS`, and it could as well run inside a Spark task over one slice of
a batch, or in a test without a JVM (``tests/sinks/test_applier.py``). What a micro-batch does around
it -- writing the dead letters, committing the consumer positions, the ledger and the metrics -- is
the caller's (``docs/apply.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from cdc.events import Version
from cdc.registry import TableReg
from sinks import ChangeBatch, DeadLetter, Sink
from sinks.parse import Parsed, parse

if TYPE_CHECKING:
    from cdc.config import Settings
    from sinks.warehouse.views import ViewOutcome

__all__ = ["AFTER_SINK", "BatchApplier", "BatchOutcome", "Prepared", "TableOutcome", "open_sinks", "reject"]

#: the fault-injection point the apply job offers (:mod:`cdc.faults`): after every task applied
#: micro-batch ARG, before the driver's commits
AFTER_SINK = "apply.after_sink"


def open_sinks(settings: Settings) -> list[Sink]:
    """The job's sinks: every one of :data:`sinks.all.SINKS`, in its order (a sink acts only on the
    tables it keeps: the search index on those with search columns)."""
    from sinks.all import SINKS  # deferred: the sinks import deltalake and tantivy

    return [cls.from_settings(settings) for cls in SINKS]


@dataclass(frozen=True)
class TableOutcome:
    """What one table's batch of a micro-batch held once parsed and its rejected events removed."""

    table: str  # qualified name
    events: int
    columnar: bool  # parsed in columns (sinks.columnar); else record by record
    newest_ts_ms: int | None  # source commit time of its newest event


@dataclass
class Prepared:
    """A micro-batch parsed and cleared of what a sink cannot hold (:meth:`BatchApplier.prepare`):
    per table the batch every sink applies, and the dead letters of the whole micro-batch."""

    records: int
    batches: list[ChangeBatch]
    dead: list[DeadLetter]
    seconds: float  # parsing and asking the sinks' reject


@dataclass
class BatchOutcome:
    """What :meth:`BatchApplier.run` did to one micro-batch: plain values (no handle, no Spark), so it
    pickles, e.g. out of the Spark task that applied one slice of a batch, for the driver to sum."""

    batch_id: int
    records: int  # log-store records in (tombstones included)
    tables: list[TableOutcome]
    dead: list[DeadLetter]  # in topic, partition, offset order per table
    prepare_seconds: float  # parse + reject + the dead-letter hand-over, before any sink ran
    sink_seconds: dict[str, float] = field(default_factory=dict)  # per sink name (they run concurrently)
    event_ts_ms: list[int] = field(default_factory=list)  # every applied event's ts (keep_event_ts)
    #: per view (``after``): keys recomputed (-1: the whole view), rows found, seconds
    views: dict[str, tuple[int, int, float]] = field(default_factory=dict)

    @property
    def events(self) -> int:
        return sum(t.events for t in self.tables)

    @property
    def columnar(self) -> int:
        return sum(t.columnar for t in self.tables)

    @property
    def newest_ts_ms(self) -> int | None:
        return max((t.newest_ts_ms for t in self.tables if t.newest_ts_ms is not None), default=None)


class BatchApplier:
    """Applies micro-batches of log-store records to ``sinks``; no Spark, no ledger, no log store.

    ``tables(topic)``: the registration of a topic, None when it is not registered (its records are
    then dead letters). ``app_id``: the job's identity, handed to every :meth:`sinks.Sink.apply`.
    ``keep_event_ts``: the outcome lists every applied event's source commit time (freshness).
    ``after``: called with the batches and the batch id once every sink committed them, e.g.
    :meth:`sinks.warehouse.views.ViewMaintainer.maintain`, which recomputes the views from the
    committed tables (its failure fails the call like a sink's: the batch is replayed).

    Guarantees:

    * **When called.** :meth:`run` (or :meth:`prepare` then :meth:`apply`) once per micro-batch,
      from any thread, one micro-batch at a time. Each sink is only ever called on its own thread
      (one per sink, kept for the applier's life): sinks hold thread-bound handles (SQLite, index
      writers), and the sinks of a batch run concurrently, each taking the tables in topic order.
    * **Dead letters.** A record that does not parse, of a topic ``tables`` does not know, or holding
      a value some sink cannot store (:meth:`sinks.Sink.reject`, asked until no sink rejects more)
      is a dead letter, in no sink; the rest of the micro-batch applies. They are handed to the
      caller (``dead_letters`` of :meth:`run`) *before* any sink applies, and returned in the
      outcome; writing them is the caller's.
    * **Failure.** :meth:`prepare` writes nothing. A sink that raises in :meth:`apply` fails the
      call with its error, after every sink has finished (no sink is still writing when it
      returns); what the other sinks committed stays. The caller must then fail the micro-batch and
      apply the same records again under the same batch id (Spark's replay does).
    * **Idempotent per (app_id, batch_id).** Every sink treats an ``apply`` of a batch id at or
      below its :meth:`sinks.Sink.applied_batch` for ``app_id`` as a replay that changes nothing, and
      is version-guarded per key; so applying the same records under the same ``(app_id,
      batch_id)`` again, after a success or a partial failure, leaves the sinks as one apply does,
      and gives the same dead letters while no sink's stored state has moved in between.
    """

    def __init__(
        self,
        sinks: Sequence[Sink],
        tables: Callable[[str], TableReg | None],
        app_id: str,
        *,
        keep_event_ts: bool = False,
        after: Callable[[Sequence[ChangeBatch], int], dict[str, ViewOutcome]] | None = None,
    ) -> None:
        self.sinks = list(sinks)
        self.after = after
        self.tables = tables
        self.app_id = app_id
        self.keep_event_ts = keep_event_ts
        self._threads = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cdc-sink-{i}")
            for i in range(len(self.sinks))
        ]

    # -- one micro-batch -----------------------------------------------------------------------------
    def run(
        self,
        records: pa.Table,
        batch_id: int,
        *,
        dead_letters: Callable[[Sequence[DeadLetter]], None] | None = None,
    ) -> BatchOutcome:
        """Apply one micro-batch: :meth:`prepare`, hand its dead letters (if any) to
        ``dead_letters``, then :meth:`apply`."""
        started = time.monotonic()
        prepared = self.prepare(records)
        if prepared.dead and dead_letters is not None:
            dead_letters(prepared.dead)
        return self.apply(prepared, batch_id, prepare_seconds=time.monotonic() - started)

    def prepare(
        self, records: pa.Table, *, complete: Callable[[ChangeBatch], ChangeBatch] | None = None
    ) -> Prepared:
        """Group ``records`` (:data:`~cdc.logstore.records.RECORDS`) by topic, parse each table's
        (:func:`sinks.parse.parse`) and remove what a sink rejects; writes nothing. ``complete``:
        given each per-event batch before the sinks' reject, returns it with values filled in (a
        Spark task's slice: :func:`spark_jobs.tasks.complete_moves`)."""
        started = time.monotonic()
        batches: list[ChangeBatch] = []
        dead: list[DeadLetter] = []
        topic = records.column("topic")
        for name in sorted(topic.unique().to_pylist()) if records.num_rows else []:
            parsed = parse(self.tables(name), records.filter(pc.equal(topic, name)))
            dead.extend(parsed.dead)
            if parsed.batch is not None:
                if complete is not None and parsed.batch.columns.lacks_values():
                    parsed.batch = complete(parsed.batch)
                batch, rejected = reject(self.sinks, parsed)
                dead.extend(rejected)
                batches.append(batch)
        return Prepared(records.num_rows, batches, dead, time.monotonic() - started)

    def apply(
        self, prepared: Prepared, batch_id: int, *, prepare_seconds: float | None = None
    ) -> BatchOutcome:
        """Every sink applies every table's batch of ``prepared`` under ``(app_id, batch_id)``."""
        batches = prepared.batches
        sink_seconds = self._apply_sinks(batches, batch_id)
        views = self.after(batches, batch_id) if self.after is not None else {}
        return BatchOutcome(
            batch_id=batch_id,
            records=prepared.records,
            tables=[
                TableOutcome(b.table.qualified, len(b), b.columns.plain, b.newest_ts_ms()) for b in batches
            ],
            dead=prepared.dead,
            prepare_seconds=prepared.seconds if prepare_seconds is None else prepare_seconds,
            sink_seconds=sink_seconds,
            event_ts_ms=[t for b in batches for t in b.ts_ms()] if self.keep_event_ts else [],
            views={name: (v.keys, v.rows, v.seconds) for name, v in views.items()},
        )

    def _apply_sinks(self, batches: Sequence[ChangeBatch], batch_id: int) -> dict[str, float]:
        """The sinks concurrently (each on its own thread), the tables of one sink in order. Returns
        seconds per sink; re-raises the first failure after every sink finished."""

        def one(sink: Sink) -> float:
            t0 = time.monotonic()
            for batch in batches:
                sink.apply(batch, batch_id, self.app_id)
            return time.monotonic() - t0

        futures = [self._threads[i].submit(one, sink) for i, sink in enumerate(self.sinks)]
        wait(futures)
        out: dict[str, float] = {}
        for sink, fut in zip(self.sinks, futures, strict=True):
            out[sink_name(sink)] = fut.result()  # raises the sink's error
        return out

    # -- the end -------------------------------------------------------------------------------------
    def close(self, *, close_sinks: bool, timeout: float | None) -> None:
        """Close the sinks (``close_sinks``), each on its own thread, then end the threads. A sink
        that does not close within ``timeout`` raises :class:`concurrent.futures.TimeoutError` naming
        it, after :meth:`abandon`."""
        if close_sinks:
            for i, sink in enumerate(self.sinks):
                try:
                    self._threads[i].submit(sink.close).result(timeout)
                except FuturesTimeout as exc:
                    self.abandon()
                    raise FuturesTimeout(f"closing the sink {sink_name(sink)} did not finish") from exc
        for pool in self._threads:
            pool.shutdown(wait=True)

    def abandon(self) -> None:
        """End the threads without waiting for a stuck sink (the process is about to exit)."""
        for pool in self._threads:
            pool.shutdown(wait=False, cancel_futures=True)


def reject(sinks: Sequence[Sink], parsed: Parsed) -> tuple[ChangeBatch, list[DeadLetter]]:
    """The batch of ``parsed`` without the events one of ``sinks`` cannot hold
    (:meth:`sinks.Sink.reject`, asked until none rejects more), and their dead letters, each reason
    ``"<sink>: <why>"`` joined by ``"; "``: a poison record never stops the others. Writes nothing."""
    batch = parsed.batch
    assert batch is not None
    reasons: dict[tuple[int, int], list[str]] = {}
    rest = batch
    while True:  # until no sink rejects more: an event may need one rejected before it (TOAST)
        new = False
        for sink in sinks:
            for r in sink.reject(rest):
                new = new or (r.partition, r.offset) not in reasons
                reasons.setdefault((r.partition, r.offset), []).append(f"{sink.name}: {r.reason}")
        if not new:
            break
        rest = batch.without(set(reasons))
    if not reasons:
        return batch, []
    positions = set(reasons)
    raw = parsed.raw(positions)
    rows = batch.columns.table.select(["partition", "offset", "key_json", "commit_lsn", "seq"])
    rows = rows.filter(
        pc.is_in(rows.column("offset"), pa.array(sorted({o for _p, o in positions}), pa.int64()))
    )
    events = {
        (p, o): (k, Version(lsn, seq))
        for p, o, k, lsn, seq in zip(*(c.to_pylist() for c in rows.columns), strict=True)
        if (p, o) in positions
    }
    dead = []
    for pos in sorted(positions):
        rec, (key_json, version) = raw[pos], events[pos]
        dead.append(
            DeadLetter(
                rec.topic,
                rec.partition,
                rec.offset,
                rec.key,
                rec.value,
                "; ".join(reasons[pos]),
                table=batch.table.qualified,
                key_json=key_json,
                version=version,
            )
        )
    return batch.without(positions), dead


def sink_name(sink: Sink) -> str:
    return getattr(sink, "name", type(sink).__name__)
