"""``cdc verify``: compare each source table with its current-state Delta table and its search index.

How (for each registered table, or the one named):

1. **One consistent point for every table.** The source is read in one ``REPEATABLE READ``
   transaction whose first statement notes ``pg_current_wal_lsn()`` (L); every table is compared in
   it. A table equal to the source at L needs nothing more (the derived tables hold the source's
   state at L, however far the pipeline's positions are). For the tables that differ, verify then
   waits once (at most ``wait_s``, for all of them together) until the pipeline has caught up to L:
   the replication slot's ``confirmed_flush_lsn`` >= L (when the slot exists: every change up to L
   is durable in the log store), then the ``apply`` consumer's committed positions >= the topics' end
   offsets noted at that moment (every such record applied); and compares them again, in the same
   transaction. While it waits it also compares them again whenever the apply job has committed a
   new position (every second at most, and never for more than a third of the time): once they are
   all equal there is nothing left to wait for. If the deadline passes, the report says **not
   caught up** (exit 3), distinct from **different** (exit 1). (The slot's position moves only when
   the reader's feedback reaches the server, every 10 s -- its status interval -- even on an idle
   source: comparing first is what makes a verify of a caught-up pipeline take about a second
   instead of a wait per table.)
2. **Normalisation.** Source values are read in the event encoding (Postgres text output, UTC,
   ISO dates, ``char(n)`` with its blank padding, float and numeric NaN/Infinity as those strings;
   arrays through ``to_json``) and
   converted with the sinks' own converters (:func:`sinks.types.to_array`), so both sides are the
   exact Arrow values the warehouse stores: ``numeric(p,s)`` compares ``Decimal`` to ``Decimal``,
   timestamps to the microsecond, floats bit for bit (NaN equals NaN). A source value the
   warehouse cannot hold (a NaN for ``numeric(p,s)``, a BC date: the apply job dead-letters it)
   becomes a marker no stored value equals, so its row is reported as different.
3. **Per-key-range hashes.** Rows are hashed (blake2b of canonical JSON of the normalised values)
   and grouped into ranges of the source's key order (``range_rows`` keys each); each range gets a
   hash over its (key, row hash) pairs on both sides. Only ranges whose hashes differ are examined
   row by row: their source rows are fetched again (same transaction) and compared with the
   warehouse rows, giving the **missing** (in the source, not the warehouse), **extra** and
   **different** keys (lists capped at ``limit``, with exact counts).
4. **Search index** (tables with search columns): its document keys must equal the source's keys
   and each document's indexed search-column texts must equal the source's values (missing / extra /
   different documents are reported under ``search``).

5. **Incremental** (:mod:`cdc.cli.verify.ranges`; ``Verifier(full=False)``, the CLI's default). A clean
   run records each table's range bounds and hashes and the topic's end offsets noted before L. The
   next run reads the keys of the topic's records since, maps them to ranges, and compares only
   those ranges plus a rotating scrub sample of unchanged ones (1% by default): at the source by
   key-range queries, in the warehouse and the index the rows and documents of those ranges. The
   topics name every change before L only once capture has passed L: the run first waits for the
   slot (at most ``wait_s``), else it is full. Each sink reads only those ranges
   (:class:`sinks.KeyRanges`; the index the documents of the keys found there) and counts the whole
   table. The whole table's row counts (source ``count(*)``, the warehouse's rows, the index's
   documents) are compared too, and when they differ the run is full: a lost insert or delete
   anywhere is found. ``source_rows``, ``warehouse_rows`` and
   ``search_docs`` stay those whole-table counts; ``rows_checked`` is what was compared. It finds
   what the pipeline got wrong in the ranges it changed; a value changed behind the pipeline's
   back (in the warehouse, the index, or at the source with the change lost before the topic), in
   a range with no change and with the counts equal, is found only when the scrub reaches its
   range (every range within ``ranges / scrub`` runs) or by ``--full``. Without a record, after a
   TRUNCATE, when records past the recorded offsets were removed, or for key types other than
   integers and text, the run is full (``fallback`` says why).

6. **Views from joins** (:mod:`cdc.cli.verify.views`): compared like a table whose rows are the view's
   SQL run on the source (at the same point L) and whose key is the driving table's; always whole,
   waiting for the pipeline of the tables the view reads. A differing view is compared again at a
   fresh point while retries remain (its rows carry no source version to tell a newer change).

A difference caused by a change newer than L that was already applied (the warehouse row's version
is past L) is not a difference of the pipeline: verify retries with a fresh consistent point while
time remains, and reports what remains.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql

from cdc.cli.verify import ranges as verify_ranges
from cdc.cli.verify.ranges import RangeRecord
from cdc.cli.verify.views import ViewSubject, source_from, stored_docs, stored_rows
from cdc.cli.wait.lsn import slot_passed
from cdc.config import Settings
from cdc.connect import connect
from cdc.errors import ApplyError, UnknownTopicError
from cdc.events import int_to_lsn, lsn_to_int
from cdc.logstore import APPLY_CONSUMER
from cdc.pgtypes import is_blank_padded, type_kind
from cdc.registry import TableReg
from sinks import KeyRanges, StoredRows, StoredTexts

DEFAULT_RANGE_ROWS = 8
#: an incremental run also re-checks this share of the unchanged ranges (at least one): the scrub
DEFAULT_SCRUB_SHARE = 0.01
FETCH_CHUNK = 20_000
#: while waiting for the pipeline, the differing tables are compared again at most this often
RECHECK_S = 1.0

Key = tuple[Any, ...]


@dataclass
class SinkDiff:
    """One sink's comparison of a table with the source. ``stored``: the rows (or documents) the
    sink holds, None when it keeps nothing for the table (:meth:`sinks.Sink.locations` empty)."""

    name: str = ""
    unit: str = "rows"
    stored: int | None = None
    missing: list[Any] = field(default_factory=list)
    extra: list[Any] = field(default_factory=list)
    different: list[Any] = field(default_factory=list)
    missing_count: int = 0
    extra_count: int = 0
    different_count: int = 0

    @property
    def equal(self) -> bool:
        return not (self.missing_count or self.extra_count or self.different_count)

    @property
    def differences(self) -> int:
        return self.missing_count + self.extra_count + self.different_count

    def lists(self) -> dict[str, Any]:
        return {
            "missing": self.missing,
            "extra": self.extra,
            "missing_count": self.missing_count,
            "extra_count": self.extra_count,
            "different": self.different,
            "different_count": self.different_count,
        }


@dataclass
class TableReport:
    """One table's comparison (``to_dict`` is the ``--json`` shape). ``sinks``: one
    :class:`SinkDiff` per sink of :data:`sinks.all.SINKS`, in its order; the first is the primary."""

    table: str
    #: ``table`` or ``view`` (a view from joins, :mod:`cdc.cli.verify.views`)
    kind: str = "table"
    source_rows: int = 0
    sinks: dict[str, SinkDiff] = field(default_factory=dict)
    ranges: int = 0
    ranges_differing: int = 0
    newer_than_point: int = 0
    consistent_lsn: str = ""
    caught_up: bool = True
    lag: dict[str, Any] = field(default_factory=dict)
    #: ``full`` or ``incremental`` (:mod:`cdc.cli.verify.ranges`), and why full when it could not be
    mode: str = "full"
    fallback: str = ""
    #: an incremental run: the ranges it checked (index, first key, why, equal), records read
    #: (a full run checks every range: :attr:`ranges_checked`)
    checked: list[dict[str, Any]] = field(default_factory=list)
    changes_read: int = 0
    rows_checked: int = 0
    #: the source's range hashes (index -> hash) and bounds (full run), for the record
    range_hashes: dict[int, bytes] = field(default_factory=dict, repr=False)
    bounds: list[Key] | None = field(default=None, repr=False)
    bad_ranges: set[int] = field(default_factory=set, repr=False)

    @property
    def primary(self) -> tuple[str, SinkDiff]:
        return next(iter(self.sinks.items()))

    @property
    def others(self) -> list[tuple[str, SinkDiff]]:
        return list(self.sinks.items())[1:]

    @property
    def equal(self) -> bool:
        return all(d.equal for d in self.sinks.values())

    @property
    def ranges_checked(self) -> int:
        """The key ranges compared with the source: every range of a full run (one of a table with
        no rows), those of :attr:`checked` in an incremental one."""
        return len(self.checked) if self.mode == "incremental" else self.ranges

    @property
    def status(self) -> str:
        if not self.caught_up:
            return "not_caught_up"
        return "ok" if self.equal else "different"

    def to_dict(self) -> dict[str, Any]:
        """``table``, ``status``, ``source_rows``, ``<sink>_<unit>`` per sink (``warehouse_rows``,
        ``search_docs``), the primary sink's differences at the top level (``missing``, ``extra``,
        ``different`` and their counts), one object per other sink (``search``), then the ranges
        (``ranges``, ``ranges_differing``, ``ranges_checked``: how many were compared, and an
        incremental run's ``checked_ranges``: each one's index, first key, why and whether equal),
        the consistent point and the catch-up state, and ``kind``: ``table`` or ``view`` (a view's
        ``table`` is its name, its keys the driving table's: :mod:`cdc.cli.verify.views`)."""
        out: dict[str, Any] = {"table": self.table, "status": self.status, "source_rows": self.source_rows}
        out |= {f"{name}_{d.unit}": d.stored for name, d in self.sinks.items()}
        primary = self.primary[1].lists()
        out |= {k: primary[k] for k in ("missing", "extra", "different")}
        out |= {k: primary[k] for k in ("missing_count", "extra_count", "different_count")}
        out |= {name: d.lists() for name, d in self.others}
        return out | {
            "ranges": self.ranges,
            "ranges_differing": self.ranges_differing,
            "consistent_lsn": self.consistent_lsn,
            "caught_up": self.caught_up,
            "lag": self.lag,
            "mode": self.mode,
            "fallback": self.fallback,
            "changes_read": self.changes_read,
            "rows_checked": self.rows_checked,
            "ranges_checked": self.ranges_checked,
            "checked_ranges": self.checked,
            "kind": self.kind,
        }


# --- canonical values and hashes -------------------------------------------------------------------
def canonical(value: Any) -> Any:
    """A JSON-able form that is equal exactly when the stored values are equal."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "f:NaN"
        return f"f:{value!r}"
    if isinstance(value, Decimal):
        return f"d:{value}"
    if isinstance(value, bytes):
        return f"b:{value.hex()}"
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    iso = getattr(value, "isoformat", None)
    if iso is not None:
        return f"t:{iso()}"
    return f"s:{value}"


def row_hash(values: Sequence[Any]) -> bytes:
    """Stable hash of a row's normalised values (never Python's ``hash()``)."""
    return hashlib.blake2b(orjson.dumps([canonical(v) for v in values]), digest_size=16).digest()


def _sort_key(key: Key) -> tuple[Any, ...]:
    """A total order over keys (types per position are the same on both sides)."""
    return tuple((0, v) if isinstance(v, int | float | Decimal) else (1, str(canonical(v))) for v in key)


def _key_json(names: Sequence[str], key: Key) -> Any:
    from sinks.types import to_event_value

    return {n: to_event_value(v) for n, v in zip(names, key, strict=True)}


# --- reading the source ----------------------------------------------------------------------------
def _select_expr(column: str, pg_type: str) -> sql.Composable:
    c = sql.Identifier(column)
    t = pg_type.strip().lower()
    if t.endswith("[]"):
        return sql.SQL("to_json({})::text").format(c)
    if is_blank_padded(t):
        # char(n): a cast to text strips the blank padding that the type's output (hence the events
        # and the warehouse) carries; concat() uses the output function and keeps it
        return sql.SQL("CASE WHEN {c} IS NULL THEN NULL ELSE concat({c}) END").format(c=c)
    return sql.SQL("{}::text").format(c)


def _from_text(text: str | None, pg_type: str) -> Any:
    """A value as the source sent it (text) in the event encoding the converters accept."""
    return _decoder(pg_type)([text])[0]


def _decoder(pg_type: str) -> Callable[[list[str | None]], list[Any]]:
    """A column's :func:`_from_text`, for all its values at once (the type read once per column, not
    once per value: that was a fifth of the source rows' cost)."""
    t = pg_type.strip().lower()
    if t.endswith("[]"):
        return lambda texts: [None if x is None else json.loads(x, parse_float=str) for x in texts]
    if type_kind(t) == "float":  # events carry floats as JSON numbers (the special values as strings)
        return lambda texts: [
            x if x is None or x in ("NaN", "Infinity", "-Infinity") else float(x) for x in texts
        ]
    return lambda texts: texts


def _normalise(
    columns: Sequence[tuple[str, str]], rows: Sequence[Sequence[Any]], target: Any
) -> list[list[Any]]:
    """Rows of event-encoded values -> rows of the Arrow values the warehouse stores (cast to the
    warehouse column's type when it differs)."""
    import pyarrow as pa

    from sinks.types import to_array

    cols: list[list[Any]] = []
    for i, (name, pg_type) in enumerate(columns):
        values = _decoder(pg_type)([r[i] for r in rows])
        try:
            arr = to_array(values, pg_type)
        except ApplyError:  # a value the warehouse cannot hold: never equal to a stored one
            cols.append([_storable(v, pg_type) for v in values])
            continue
        want = target.field(name).type if target is not None and name in target.names else None
        if want is not None and arr.type != want:
            with contextlib.suppress(pa.ArrowInvalid, pa.ArrowNotImplementedError):
                arr = arr.cast(want)
        cols.append(arr.to_pylist())
    return [list(r) for r in zip(*cols, strict=True)] if cols else [[] for _ in rows]


def _storable(value: Any, pg_type: str) -> Any:
    from sinks.types import to_array

    try:
        return to_array([value], pg_type).to_pylist()[0]
    except ApplyError as exc:
        return f"<not storable as {pg_type}: {exc.message}>"


@dataclass
class _Side:
    """Per key: row hash (and the full normalised row, kept only for the warehouse)."""

    hashes: dict[Key, bytes] = field(default_factory=dict)
    rows: dict[Key, list[Any]] = field(default_factory=dict)
    versions: dict[Key, int] = field(default_factory=dict)


def _range_hashes(keys_sorted: list[Key], bounds: verify_ranges.Bounds, side: _Side) -> dict[int, bytes]:
    out: dict[int, Any] = {}
    for k, idx in zip(keys_sorted, bounds.of_many(keys_sorted), strict=True):
        h = out.get(idx)
        if h is None:
            h = out[idx] = hashlib.blake2b(digest_size=16)
        h.update(orjson.dumps([canonical(v) for v in k]))
        h.update(side.hashes[k])
    return {i: h.digest() for i, h in out.items()}


class Verifier:
    """Compares registered tables with their derived tables; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        *,
        wait_s: float,
        limit: int,
        range_rows: int = DEFAULT_RANGE_ROWS,
        retries: int = 3,
        full: bool = True,
        scrub: int | None = None,
    ) -> None:
        self.settings = settings
        self.state_dir = Path(settings.state_dir)
        self.wait_s = wait_s
        self.limit = limit
        self.range_rows = max(range_rows, 1)
        self.retries = max(retries, 1)
        #: False: check only the ranges changed since the last clean run where one is recorded
        self.full = full
        self.scrub = scrub
        self._plans: dict[str, _Plan] = {}
        self._fallback: dict[str, str] = {}
        #: the views being verified, by their registration's qualified name (:mod:`cdc.cli.verify.views`)
        self._views: dict[str, ViewSubject] = {}
        from sinks.all import SINKS  # deferred: the sinks import deltalake and tantivy

        self.sinks = [cls.from_settings(settings) for cls in SINKS]

    # -- catch-up -------------------------------------------------------------------------------------
    def _wait_for_slot(
        self,
        conn: psycopg.Connection[Any],
        lsn: int,
        tables: Sequence[TableReg],
        deadline: float,
        recheck: Callable[[], bool] | None = None,
    ) -> tuple[bool | None, dict[str, Any]]:
        """Poll :meth:`_slot_caught_up` until it answers yes or ``deadline`` (monotonic) passes:
        ``(ok, the slot's facts when not)``; ``(None, {})`` when ``recheck`` answered True first."""
        while True:
            ok, info = self._slot_caught_up(conn, lsn, tables)
            if ok or time.monotonic() > deadline:
                return ok, info
            if recheck is not None and recheck():
                return None, {}
            time.sleep(0.2)

    def _slot_caught_up(
        self, conn: psycopg.Connection[Any], lsn: int, tables: Sequence[TableReg]
    ) -> tuple[bool, dict[str, Any]]:
        """Is every change of ``tables`` committed before ``lsn`` durable in the log store
        (:func:`cdc.cli.wait.lsn.slot_passed`)? The slot's facts when not."""
        ok, facts = slot_passed(conn, self.settings, lsn, tables)
        if ok:
            return True, {}
        info: dict[str, Any] = {
            "slot": facts["slot"],
            "confirmed_flush_lsn": int_to_lsn(facts["confirmed_flush_lsn"]),
        }
        if "pending_changes" in facts:
            info["pending_changes"] = facts["pending_changes"]
        return False, info

    def _apply_lag(self, store: Any, topic: str, ends: dict[int, int]) -> dict[int, int]:
        try:
            done = store.committed(APPLY_CONSUMER, topic)
            starts = store.start_offsets(topic)
        except UnknownTopicError:
            return {}
        return {
            p: e - max(done.get(p, 0), starts.get(p, 0))
            for p, e in ends.items()
            if e - max(done.get(p, 0), starts.get(p, 0)) > 0
        }

    def wait_caught_up(
        self,
        conn: psycopg.Connection[Any],
        lsn: int,
        tables: Sequence[TableReg],
        settled: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        """Wait until the slot and the apply job reached ``lsn``; return the remaining lag (empty if
        caught up). ``settled`` (optional) is called while waiting, paced by :class:`_Paced` (once,
        then whenever the apply job has committed a new position); when it answers True the wait ends
        there, with no lag."""
        from cdc.logstore.factory import open_log_store

        deadline = time.monotonic() + self.wait_s
        with open_log_store(self.settings) as store:

            def progress() -> Any:
                out = {}
                for reg in tables:
                    try:
                        out[reg.topic] = store.committed(APPLY_CONSUMER, reg.topic)
                    except UnknownTopicError:
                        out[reg.topic] = {}
                return out

            recheck = _Paced(settled, progress)
            ok, info = self._wait_for_slot(conn, lsn, tables, deadline, recheck)
            if ok is None:
                return {}
            if not ok:
                return {"slot": info}
            ends: dict[str, dict[int, int]] = {}
            for reg in tables:
                try:
                    ends[reg.topic] = store.end_offsets(reg.topic)
                except UnknownTopicError:
                    ends[reg.topic] = {}
            while True:
                lag = {t: lag for t in ends if (lag := self._apply_lag(store, t, ends[t]))}
                if not lag or time.monotonic() > deadline:
                    return (
                        {"apply": {t: {str(p): n for p, n in v.items()} for t, v in lag.items()}}
                        if lag
                        else {}
                    )
                if recheck():
                    return {}
                time.sleep(0.2)

    # -- the comparison -------------------------------------------------------------------------------
    def verify(self, tables: Sequence[TableReg], views: Sequence[ViewSubject] = ()) -> list[TableReport]:
        """Compare ``tables``, then ``views`` (each with its SQL run on the source); record the key
        ranges of each clean table (:mod:`cdc.cli.verify.ranges`)."""
        dsn = self.settings.require_source()
        self._views = {v.reg.qualified: v for v in views}
        tables = [*tables, *(v.reg for v in views)]
        noted = self._topic_ends(tables)  # before the point: see cdc.cli.verify.ranges
        reports = self._verify_at_point(dsn, tables)
        plans = dict(self._plans)
        for _ in range(self.retries - 1):
            # a view row has no version to tell a change newer than the point: a differing view is
            # compared again at a fresh point while retries remain
            again = [
                i
                for i, r in enumerate(reports)
                if not r.equal and r.caught_up and (r.newer_than_point or r.kind == "view")
            ]
            if not again:
                break
            noted |= self._topic_ends([tables[i] for i in again])
            fresh = self._verify_at_point(dsn, [tables[i] for i in again])
            plans |= self._plans
            for i, report in zip(again, fresh, strict=True):
                reports[i] = report
        for reg, report in zip(tables, reports, strict=True):
            if report.status == "ok" and report.kind == "table":
                plan = plans.get(reg.qualified) if report.mode == "incremental" else None
                self._record(reg, report, plan, noted.get(reg.qualified, {}))
        return reports

    def _topic_ends(self, tables: Sequence[TableReg]) -> dict[str, dict[int, int]]:
        from cdc.logstore.factory import open_log_store

        with open_log_store(self.settings) as store:
            return {
                reg.qualified: verify_ranges.topic_ends(store, reg)
                for reg in tables
                if reg.qualified not in self._views  # a view has no topic (nor a range record)
            }

    def _plan(self, conn: psycopg.Connection[Any], dsn: str, lsn: int, tables: Sequence[TableReg]) -> None:
        """Which ranges to check per table, read from the topics once capture has passed the point
        ``lsn`` (then every change before it is there); a table without a usable record, or all of
        them when capture does not reach the point within the wait, is verified in full."""
        from cdc.logstore.factory import open_log_store

        self._plans, self._fallback = {}, {}
        if self.full:
            return
        for reg in tables:
            if reg.qualified in self._views:
                self._fallback[reg.qualified] = "a view is compared whole"
        tables = [t for t in tables if t.qualified not in self._views]
        records = {reg.qualified: verify_ranges.load(self.state_dir, reg) for reg in tables}
        if any(records.values()) and not self._capture_passed(conn, dsn, lsn, tables):
            behind = f"capture had not reached the consistent point {int_to_lsn(lsn)} within the wait"
            self._fallback |= {reg.qualified: behind for reg in tables}
            return
        with open_log_store(self.settings) as store:
            for reg in tables:
                record = records[reg.qualified]
                why = verify_ranges.unsupported(reg)
                if record is None or why:
                    self._fallback[reg.qualified] = why or "no clean verify recorded yet"
                    continue
                changes = verify_ranges.changed_ranges(store, reg, record)
                if changes.all_ranges:
                    self._fallback[reg.qualified] = changes.reason
                    continue
                count = (
                    self.scrub if self.scrub is not None else math.ceil(record.ranges * DEFAULT_SCRUB_SHARE)
                )
                scrub = verify_ranges.scrub_sample(record, changes.ranges, max(count, 0))
                self._plans[reg.qualified] = _Plan(record, changes.ranges, scrub, changes.records)

    def _capture_passed(
        self, conn: psycopg.Connection[Any], dsn: str, lsn: int, tables: Sequence[TableReg]
    ) -> bool:
        """Has the slot passed ``lsn`` (:meth:`_slot_caught_up`), waiting at most ``wait_s``? (An
        active reader confirms its position every status interval, 10 s: so long at most.) The
        slot's position is read first on ``conn`` (in the verify's transaction: no peek, whose
        error would abort it); only a slot short of ``lsn`` is waited for, or peeked, on a
        connection of its own (a connection costs the source a backend's start)."""
        if slot_passed(conn, self.settings, lsn, tables, peek=False)[0]:
            return True
        with connect(dsn, application_name="cdc verify") as side:
            ok, _info = self._wait_for_slot(side, lsn, tables, time.monotonic() + self.wait_s)
            return bool(ok)

    def _record(
        self, reg: TableReg, report: TableReport, plan: _Plan | None, offsets: dict[int, int]
    ) -> None:
        """Record a clean table's ranges: all of them after a full run; the checked ones' new hashes
        (and the scrub cursor) after an incremental one."""
        now = verify_ranges.now()
        if plan is None:
            bounds = report.bounds if report.bounds is not None and not verify_ranges.unsupported(reg) else []
            hashes = [report.range_hashes.get(i, b"").hex() for i in range(max(len(bounds), 1))]
            record = RangeRecord(now, report.consistent_lsn, "full", offsets, bounds, hashes)
        else:
            record = plan.record
            for i in plan.checked:
                record.hashes[i] = report.range_hashes.get(i, b"").hex()
            if plan.scrub:
                record.scrub_next = (plan.scrub[-1] + 1) % record.ranges
            record.at, record.lsn, record.offsets = now, report.consistent_lsn, offsets
            record.mode = "incremental"
        verify_ranges.save(self.state_dir, reg, record)

    def _columns(self, reg: TableReg) -> list[tuple[str, str]]:
        return [(c.name, c.type) for c in reg.columns if c.name not in reg.exclude]

    def _verify_at_point(self, dsn: str, tables: Sequence[TableReg]) -> list[TableReport]:
        """Every table of ``tables`` at one consistent point (step 1 of the module docstring)."""
        conn = connect(dsn, application_name="cdc verify")
        with conn:
            conn.execute("SET TimeZone = 'UTC'")
            conn.execute("SET DateStyle = 'ISO, YMD'")
            conn.execute("SET IntervalStyle = 'postgres'")
            conn.execute("SET extra_float_digits = 1")
            # the lateral read of an incremental run's ranges is estimated at ~100,000 rows a range
            # (the planner cannot see the bounds), far past jit_above_cost: compiling it cost ~125 ms
            # of the source's CPU, to read ~20,000 rows in 15 ms; no read here gains from JIT
            conn.execute("SET jit = off")
            with conn.transaction():
                conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
                row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
                assert row is not None
                lsn, point = lsn_to_int(str(row[0])), str(row[0])
                self._plan(conn, dsn, lsn, tables)
                reports = [self._compare_at(conn, reg, lsn, point) for reg in tables]
                pending = [i for i, r in enumerate(reports) if not r.equal]
                if not pending:
                    return reports

                def settled() -> bool:
                    """Compare the differing tables again (same snapshot): are they all equal now?"""
                    for i in pending:
                        reports[i] = self._compare_at(conn, tables[i], lsn, point)
                    pending[:] = [i for i in pending if not reports[i].equal]
                    return not pending

                with connect(dsn, application_name="cdc verify") as side:
                    waits = self._base([tables[i] for i in pending])
                    lag = self.wait_caught_up(side, lsn, waits, settled)
                for i in pending:  # caught up (or out of time): the answer is this comparison
                    reg = tables[i]
                    report = reports[i] = self._compare_at(conn, reg, lsn, point)
                    mine: dict[str, Any] = {}
                    for base in self._base([reg]):
                        mine |= _lag_of(lag, base)
                    if mine and not report.equal:
                        report.caught_up = False
                        report.lag = mine
        return reports

    def _base(self, tables: Sequence[TableReg]) -> list[TableReg]:
        """``tables`` with each view replaced by the tables it reads (their pipeline is the one a
        view waits for), each once."""
        out: dict[str, TableReg] = {}
        for reg in tables:
            view = self._views.get(reg.qualified)
            for t in view.base if view is not None else (reg,):
                out.setdefault(t.qualified, t)
        return list(out.values())

    def _read_back(self, sink: Any, reg: TableReg, only: KeyRanges | None) -> Any:
        """``sink``'s read-back of ``reg`` (of ``only``'s ranges); of a view, always whole: its Delta
        table (the warehouse's), its search documents (the search sink's, keyed like a table's),
        nothing of another sink."""
        view = self._views.get(reg.qualified)
        if view is None:
            return sink.read_back(reg, only)
        if sink.name == "warehouse":
            return stored_rows(self.state_dir, view, sink.options.lease_max_age_s)
        if sink.name == "search" and view.view.search:
            docs = stored_docs(self.state_dir, view)
            return StoredTexts({orjson.dumps(_key_json(reg.key, k)).decode(): t for k, t in docs})
        return None

    def _compare_at(self, conn: psycopg.Connection[Any], reg: TableReg, lsn: int, point: str) -> TableReport:
        view = self._views.get(reg.qualified)
        report = TableReport(table=reg.qualified, consistent_lsn=point)
        if view is not None:
            report.table, report.kind = view.view.name, "view"
        plan = self._plans.get(reg.qualified)
        report.fallback = self._fallback.get(reg.qualified, "")
        if plan is not None:
            report.mode, report.changes_read = "incremental", plan.records
        self._compare(conn, reg, lsn, report, plan)
        if plan is not None and report.mode == "incremental":
            report.checked = [
                {
                    "range": i,
                    "from": _key_json(reg.key, plan.record.bounds[i])
                    if 0 < i < len(plan.record.bounds)
                    else None,
                    "why": "changed" if i in plan.changed else "scrub",
                    "equal": i not in report.bad_ranges,
                }
                for i in sorted(plan.checked)
            ]
        return report

    def _source_rows(
        self,
        conn: psycopg.Connection[Any],
        reg: TableReg,
        columns: list[tuple[str, str]],
        target: Any,
        read: verify_ranges.Read = verify_ranges.WHOLE,
    ) -> Iterator[tuple[Key, list[Any]]]:
        """The source rows ``read`` selects (the whole table by default), normalised."""
        names = [c for c, _ in columns]
        key_idx = [names.index(k) for k in reg.key]
        from_, where, params = read
        view = self._views.get(reg.qualified)
        if from_ is None:
            from_ = source_from(view) if view is not None else sql.Identifier(reg.schema, reg.table)
        q = sql.SQL("SELECT {} FROM {}").format(
            sql.SQL(", ").join(_select_expr(n, t) for n, t in columns), from_
        )
        if where is not None:
            q = q + sql.SQL(" WHERE ") + where
        with conn.cursor(name=f"cdc_verify_{id(q)}") as cur:
            cur.itersize = FETCH_CHUNK
            cur.execute(q, params)
            while True:
                chunk = cur.fetchmany(FETCH_CHUNK)
                if not chunk:
                    break
                for norm in _normalise(columns, chunk, target):
                    yield tuple(norm[i] for i in key_idx), norm

    def _rows_side(self, reg: TableReg, columns: list[tuple[str, str]], back: StoredRows) -> _Side:
        """A rows sink's live rows (:meth:`sinks.Sink.read_back`) by key: values, hash, version."""
        side = _Side()
        table = back.table
        if table is None:
            return side
        names = [c for c, _ in columns]
        key_idx = [names.index(k) for k in reg.key]
        present = [n for n in names if n in table.column_names]
        data = {n: table.column(n).to_pylist() for n in present}
        versions = table.column(back.version_column).to_pylist()
        for i in range(table.num_rows):
            row = [data[n][i] if n in data else None for n in names]
            key = tuple(row[j] for j in key_idx)
            side.rows[key] = row
            side.hashes[key] = row_hash(row)
            side.versions[key] = int(versions[i])
        return side

    def _compare(
        self, conn: psycopg.Connection[Any], reg: TableReg, lsn: int, report: TableReport, plan: _Plan | None
    ) -> None:
        """Every sink's read-back against the source: the rows sinks by key ranges (the source read
        once per rows sink, normalised to that sink's types), the text sinks by document. With a
        ``plan``, only its ranges: each sink reads the rows and documents of those ranges
        (:class:`sinks.KeyRanges`; the text sinks those of the keys the source and the rows sinks
        hold there), and the whole table's counts are compared: when they differ, every row is."""
        only = None if plan is None else KeyRanges(tuple(verify_ranges.intervals(plan.record, plan.checked)))
        report.sinks = {sink.name: SinkDiff(sink.name, sink.unit) for sink in self.sinks}
        rows_backs = [(s, self._read_back(s, reg, only)) for s in self.sinks if s.unit != "docs"]
        reads = [verify_ranges.WHOLE] if only is None else verify_ranges.reads(reg, only.spans)
        src, src_search = self._compare_rows_sinks(conn, reg, lsn, report, plan, rows_backs, reads)
        texts_sinks = [s for s in self.sinks if s.unit == "docs"] if reg.search else []
        if only is not None and texts_sinks:
            wh_keys = [k for _, b in rows_backs if isinstance(b, StoredRows) for k in _keys_of(b, reg)]
            candidates = [*src.hashes, *wh_keys, *verify_ranges.spanned_keys(reg, only.spans)]
            only = KeyRanges(
                only.spans, frozenset(orjson.dumps(_key_json(reg.key, k)).decode() for k in candidates)
            )
        texts = [(s, self._read_back(s, reg, only)) for s in texts_sinks]
        for sink, back in texts:
            if isinstance(back, StoredTexts):
                self._compare_texts(reg, src, src_search, _only(back, reg, plan), report.sinks[sink.name])
        report.rows_checked = len(src.hashes)
        if plan is None:
            return
        totals = self._totals(conn, reg, [*rows_backs, *texts])
        if len(set(totals.values())) > 1:
            shown = ", ".join(f"{k} {v}" for k, v in totals.items())
            report.mode, report.fallback = "full", f"row counts differ ({shown}): every row checked"
            self._compare(conn, reg, lsn, report, None)
            return
        report.source_rows = totals["source"]  # the counts are the whole table's, as in a full run
        for name, d in report.sinks.items():
            d.stored = totals.get(name, d.stored)

    def _compare_rows_sinks(
        self,
        conn: psycopg.Connection[Any],
        reg: TableReg,
        lsn: int,
        report: TableReport,
        plan: _Plan | None,
        backs: Sequence[tuple[Any, Any]],
        reads: Sequence[verify_ranges.Read],
    ) -> tuple[_Side, dict[Key, dict[str, str]]]:
        """The source's rows of ``reads`` against each rows sink's; the source's hashes and search
        texts (read with the first rows sink's types)."""
        columns = self._columns(reg)
        names = [c for c, _ in columns]
        has_texts = any(s.unit == "docs" for s in self.sinks)
        search_idx = [(c, names.index(c)) for c in reg.search if c in names and has_texts]
        rows_backs = [(s.name, _only(b, reg, plan)) for s, b in backs if isinstance(b, StoredRows)] or [
            ("", StoredRows(None, ""))
        ]
        src_search: dict[Key, dict[str, str]] = {}
        src = _Side()
        for i, (name, back) in enumerate(rows_backs):
            target = back.table.schema if back.table is not None else None
            src = _Side()
            for read in reads:
                for key, row in self._source_rows(conn, reg, columns, target, read):
                    src.hashes[key] = row_hash(row)
                    if search_idx and i == 0:
                        src_search[key] = {
                            c: _indexed_text(row[j]) for c, j in search_idx if row[j] is not None
                        }
            report.source_rows = len(src.hashes)
            if name:
                shape = (columns, target, plan.record if plan is not None else None)
                self._compare_rows(conn, reg, lsn, shape, src, back, report, report.sinks[name])
        return src, src_search

    def _totals(
        self, conn: psycopg.Connection[Any], reg: TableReg, backs: Sequence[tuple[Any, Any]]
    ) -> dict[str, int]:
        """The whole table's row count at the source (same transaction) and in each sink (what its
        read-back of some ranges counted): an incremental run that finds them different checks every
        row (a lost insert or delete)."""
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(reg.schema, reg.table))
        ).fetchone()
        out = {"source": int(row[0]) if row is not None else 0}
        for sink, back in backs:
            if isinstance(back, StoredRows | StoredTexts):
                out[sink.name] = back.total if back.total is not None else _count(back)
        return out

    def _compare_rows(
        self,
        conn: psycopg.Connection[Any],
        reg: TableReg,
        lsn: int,
        shape: tuple[list[tuple[str, str]], Any, RangeRecord | None],
        src: _Side,
        back: StoredRows,
        report: TableReport,
        diff: SinkDiff,
    ) -> None:
        """Per-key-range hashes, then row by row in the ranges that differ (module docstring, 3)."""
        columns, target, record = shape
        names = [c for c, _ in columns]
        wh = self._rows_side(reg, columns, back)
        diff.stored = len(wh.hashes)
        src_sorted = sorted(src.hashes, key=_sort_key)
        if record is None:
            bound_keys: list[Key] | None = src_sorted[:: self.range_rows]
            bounds = verify_ranges.Bounds(bound_keys or [], _sort_key)
        else:
            bound_keys, bounds = None, record.placed
        src_ranges = _range_hashes(src_sorted, bounds, src)
        # a range differs where a key's row hash does (or the key is on one side only): what
        # comparing the two sides' range hashes finds, without hashing the warehouse's ranges
        unequal = [k for k, h in src.hashes.items() if wh.hashes.get(k) != h]
        unequal += [k for k in wh.hashes if k not in src.hashes]
        bad = sorted(set(bounds.of_many(unequal)))
        if diff is report.primary[1]:
            report.ranges = max(len(bounds), 1)
            report.ranges_differing = len(bad)
            report.bad_ranges, report.range_hashes, report.bounds = set(bad), src_ranges, bound_keys
        missing: list[Key] = []
        extra: list[Key] = []
        different: list[tuple[Key, dict[str, Any]]] = []
        if bad:
            bad_set = set(bad)

            src_keys = [
                k for k, i in zip(src_sorted, bounds.of_many(src_sorted), strict=True) if i in bad_set
            ]
            wh_all = list(wh.hashes)
            wh_keys = sorted(
                (k for k, i in zip(wh_all, bounds.of_many(wh_all), strict=True) if i in bad_set),
                key=_sort_key,
            )
            src_rows = self._refetch(conn, reg, columns, target, src_keys)
            for k in src_keys:
                if k not in wh.hashes:
                    missing.append(k)
                elif src.hashes[k] != wh.hashes[k]:
                    s_row = src_rows.get(k)
                    w_row = wh.rows[k]
                    cols = {
                        n: {"source": _show(sv), diff.name: _show(wv)}
                        for n, sv, wv in zip(names, s_row or [None] * len(names), w_row, strict=True)
                        if canonical(sv) != canonical(wv)
                    }
                    different.append((k, cols))
            extra = [k for k in wh_keys if k not in src.hashes]
        report.newer_than_point += sum(
            1 for k in [*extra, *(k for k, _ in different)] if wh.versions.get(k, 0) > lsn
        )
        diff.missing_count, diff.extra_count, diff.different_count = len(missing), len(extra), len(different)
        diff.missing = [_key_json(reg.key, k) for k in missing[: self.limit]]
        diff.extra = [_key_json(reg.key, k) for k in extra[: self.limit]]
        diff.different = [{"key": _key_json(reg.key, k), "columns": d} for k, d in different[: self.limit]]

    def _compare_texts(
        self,
        reg: TableReg,
        src: _Side,
        src_search: dict[Key, dict[str, str]],
        back: StoredTexts,
        diff: SinkDiff,
    ) -> None:
        """A text sink's documents: their keys equal the source's, their texts the source's values
        of the search columns (module docstring, 4)."""
        docs = back.docs
        diff.stored = len(docs)
        src_json = {orjson.dumps(_key_json(reg.key, k)).decode(): k for k in src.hashes}
        s_missing = [src_json[j] for j in src_json if j not in docs]
        s_extra = sorted(d for d in docs if d not in src_json)
        s_diff = sorted(
            (k for j, k in src_json.items() if j in docs and docs[j] != src_search.get(k, {})),
            key=_sort_key,
        )
        diff.missing_count, diff.extra_count, diff.different_count = len(s_missing), len(s_extra), len(s_diff)
        diff.missing = [_key_json(reg.key, k) for k in sorted(s_missing, key=_sort_key)[: self.limit]]
        diff.extra = [orjson.loads(d) for d in s_extra[: self.limit]]
        diff.different = [
            {
                "key": _key_json(reg.key, k),
                "source": src_search.get(k, {}),
                "search": docs[orjson.dumps(_key_json(reg.key, k)).decode()],
            }
            for k in s_diff[: self.limit]
        ]

    def _refetch(
        self,
        conn: psycopg.Connection[Any],
        reg: TableReg,
        columns: list[tuple[str, str]],
        target: Any,
        keys: list[Key],
    ) -> dict[Key, list[Any]]:
        """Full source rows of ``keys`` (same transaction), matched through ``unnest`` of typed arrays."""
        if not keys:
            return {}
        types = dict(columns)
        out: dict[Key, list[Any]] = {}
        for i in range(0, len(keys), 5000):
            chunk = keys[i : i + 5000]
            arrays = [[_to_param(k[j]) for k in chunk] for j in range(len(reg.key))]
            where = sql.SQL("({}) IN (SELECT * FROM unnest({}))").format(
                sql.SQL(", ").join(sql.Identifier(k) for k in reg.key),
                sql.SQL(", ").join(
                    sql.SQL("%s::text[]::{}[]").format(sql.SQL(_array_base(types[k]))) for k in reg.key
                ),
            )
            for key, row in self._source_rows(conn, reg, columns, target, (None, where, arrays)):
                out[key] = row
        return out


@dataclass
class _Plan:
    """An incremental run's ranges of one table: those with changes, the scrub's, records read."""

    record: RangeRecord
    changed: set[int]
    scrub: list[int]
    records: int

    @property
    def checked(self) -> set[int]:
        return self.changed | set(self.scrub)


def _only(back: Any, reg: TableReg, plan: _Plan | None) -> Any:
    """A sink's read-back restricted to the plan's ranges (all of it without a plan): a sink may
    return more than the ranges it was asked for (:class:`sinks.KeyRanges`)."""
    if plan is None or back is None:
        return back
    checked = plan.checked
    if isinstance(back, StoredTexts):
        docs = {}
        for k, texts in back.docs.items():
            key = orjson.loads(k)
            if plan.record.range_of(tuple(key.get(c) for c in reg.key)) in checked:
                docs[k] = texts
        return StoredTexts(docs, back.total)
    if back.table is None:
        return back
    return StoredRows(
        back.table.filter(_range_mask(back.table, reg, plan.record, checked)), back.version_column, back.total
    )


def _count(back: StoredRows | StoredTexts) -> int:
    """A whole read-back's rows or documents."""
    if isinstance(back, StoredTexts):
        return len(back.docs)
    return back.table.num_rows if back.table is not None else 0


def _keys_of(back: StoredRows, reg: TableReg) -> list[Key]:
    """The keys of a rows read-back (its key columns' values)."""
    if back.table is None or not all(k in back.table.column_names for k in reg.key):
        return []
    cols = [back.table.column(k).to_pylist() for k in reg.key]
    return list(zip(*cols, strict=True))


def _range_mask(table: Any, reg: TableReg, record: RangeRecord, checked: set[int]) -> Any:
    """Per row of ``table``: is its key in one of the ranges ``checked`` (vectorised for one-column
    keys: numpy's searchsorted over the bounds, as :meth:`RangeRecord.range_of` does)."""
    import numpy as np
    import pyarrow as pa

    if len(reg.key) == 1 and table.num_rows:
        values = table.column(reg.key[0]).to_numpy(zero_copy_only=False)
        ints = record.placed.ints
        if values.dtype.kind in "iu" and ints is not None:
            bounds = ints
        elif values.dtype.kind in "iu":
            bounds = np.array([b[0] for b in record.bounds], dtype=values.dtype)
        else:
            firsts = [b[0] for b in record.bounds]
            bounds = np.empty(len(firsts), dtype=object)
            bounds[:] = firsts
        idx = np.maximum(np.searchsorted(bounds, values, side="right") - 1, 0)
    else:
        cols = [table.column(k).to_pylist() for k in reg.key]
        idx = np.array([record.range_of(k) for k in zip(*cols, strict=True)], dtype=np.int64)
    return pa.array(np.isin(idx, np.fromiter(checked, dtype=np.int64, count=len(checked))))


class _Paced:
    """Calls ``check`` (if any) while verify waits: once, then only after ``progress()`` changed (the
    apply job committed a new position: only a batch it applied can make a table equal), at most every
    :data:`RECHECK_S` seconds and never for more than a third of the time (after a check that took t
    seconds, the next comes 2t later at the earliest). A check compares tables again, which for a
    large table takes long and on a small host competes with the pipeline it waits for."""

    def __init__(self, check: Callable[[], bool] | None, progress: Callable[[], Any]) -> None:
        self.check = check
        self.progress = progress
        self.seen: Any = None
        self.checked = False
        self.next = time.monotonic() + RECHECK_S

    def __call__(self) -> bool:
        if self.check is None or time.monotonic() < self.next:
            return False
        now = self.progress()
        if self.checked and now == self.seen:
            self.next = time.monotonic() + RECHECK_S
            return False
        self.seen, self.checked = now, True
        t0 = time.monotonic()
        done = self.check()
        took = time.monotonic() - t0
        self.next = time.monotonic() + max(RECHECK_S, 2 * took)
        return done


def _lag_of(lag: dict[str, Any], reg: TableReg) -> dict[str, Any]:
    """The part of :meth:`Verifier.wait_caught_up`'s answer (for several tables) that holds ``reg``
    back: the slot's (shared by every table), else its topic's apply lag."""
    if "slot" in lag:
        return {"slot": lag["slot"]}
    apply = lag.get("apply", {})
    return {"apply": {reg.topic: apply[reg.topic]}} if reg.topic in apply else {}


def _array_base(pg_type: str) -> str:
    """The element type to cast a text[] of key values to (format_type output from the registry)."""
    return pg_type.strip()


def _to_param(value: Any) -> str:
    if isinstance(value, bytes):
        return "\\x" + value.hex()
    iso = getattr(value, "isoformat", None)
    if iso is not None:
        return str(iso())
    return str(value)


def _indexed_text(value: Any) -> str:
    """A normalised value as the search sink indexes it (event encoding; non-strings as JSON)."""
    from sinks.types import to_event_value

    v = to_event_value(value)
    return v if isinstance(v, str) else orjson.dumps(v).decode()


def _show(value: Any) -> Any:
    from sinks.types import to_event_value

    v = to_event_value(value)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v
