"""``cdc wait``: read-your-writes. :func:`wait_for_lsn` returns once every named derived table has
applied every change up to a commit LSN, in every sink that keeps it (the warehouse, and the search
index where the table has search columns); ``cdc wait`` (:mod:`cdc.cli.wait`) and ``GET /wait`` in
``cdc serve`` (:mod:`cdc.cli.serve`) are its two faces. ``docs/wait.md`` shows the pattern.

What "applied up to L" means, and how it is known exactly
--------------------------------------------------------
A change's event carries its transaction's commit LSN (``source.commit_lsn``). A table has applied
everything up to ``L`` when every event of that table with a commit LSN <= ``L`` is applied in both
sinks. An application takes ``L`` with ``SELECT pg_current_wal_lsn()`` after its commit returned, so
``L`` is at or past the end of its commit record. Three facts, each the pipeline's own guarantee:

1. **Capture passed L.** The reader confirms a position to the slot (``confirmed_flush_lsn``) only
   when every event before it is durable in the log store (:mod:`cdc.reader.replication`), and only
   at a transaction boundary, a heartbeat or a keepalive's ``wal_end`` with nothing in flight. So
   once the slot's ``confirmed_flush_lsn`` >= ``L``, every event with a commit LSN < ``L`` is in its
   topic. When the reader is not running (slot inactive), the slot is peeked up to ``L`` for changes
   of these tables (nothing is consumed): none pending means the same (:func:`slot_passed`).
2. **Where those events are.** The topics' end offsets read *after* (1) was observed bound them:
   every such event sits below the end offset of its partition. Within ``[applied, end)`` the wait
   reads each record's commit LSN once (:func:`commit_lsn_of`, at most :data:`SCAN_MAX` records a
   partition, else the end offset is the target) and takes as the partition's target the offset
   after the last record with commit LSN <= ``L`` (:func:`partition_target`): under load the wait
   does not also wait for the changes committed after ``L``. A replay after a reader crash can put an
   old record after newer ones; scanning the whole range catches it. A tombstone (no value) counts
   with the delete before it.
3. **Applied.** The apply job commits its consumer positions (:data:`cdc.logstore.APPLY_CONSUMER`)
   after every sink of the micro-batch committed (Delta commits, the index's commit:
   :meth:`spark_jobs.applier.BatchApplier.apply` returns only then; ``spark_jobs.ledger
   .commit_positions``). A table is caught up when its committed position >= the target in every
   partition: its changes up to ``L`` are visible to a new reader of the warehouse table
   (``cdc sql``) and of the index (``cdc search``). A dead-lettered event counts as applied (it is
   in the dead-letter topic, not in the tables).

Idle sources do not make a wait hang: with no change after ``L``, the slot's position still passes
``L``. The reader confirms a keepalive's ``wal_end`` when nothing is in flight, and its heartbeat
message (``heartbeat_interval_s``, 10 s) moves it too. Measured with the heartbeat set to an hour,
after an idle stretch, WAL of another database, a change to an unregistered table or a checkpoint,
the slot passed ``L`` in 0.02-0.6 s on its own. As a fallback, a wait still short of ``L`` after
:data:`NUDGE_AFTER_S` emits a heartbeat message itself (``pg_logical_emit_message``, the reader's
prefix, at most every :data:`NUDGE_EVERY_S`; skipped when the source refuses it): the reader confirms
its position, which is past ``L``. A table with nothing written since (2) then has its target at or
below its applied position: caught up at once.

On timeout the result says for each table how far behind it is: its target and applied offsets per
partition, the offsets still to apply, the commit LSN of its oldest change still to apply and the
WAL bytes from it to ``L``; or, while capture has not passed ``L``, the slot's position and the
bytes it is behind.

Views from joins
----------------
A view (``cdc views add``, :mod:`cdc.views`) is a derived table too, and is named as it is
registered (``--table order_details``). It keeps no positions of its own: the apply recomputes it
after the base-table commits of each micro-batch (``ViewMaintainer``: its Delta table, then its
index) and commits the batch's consumer positions only after that, on the tables' topics (3.). So
a view is caught up to ``L`` when

* every table it reads (``ViewReg.tables``) is caught up to ``L`` as above, and then, read after
  those positions,
* the apply has not refused it (``extra["refused"]`` in the registry: a view that no longer parses
  against its tables, or whose rows no longer fit its table, is left at its last state while the
  positions move on; the refusal is recorded before the positions of its batch), and
* its Delta table exists, and its search index where it has search columns (a view added while the
  apply runs gets its index at the apply's next micro-batch).

A view whose tables caught up but that fails the other two is waited for until the timeout, and the
result says why (``error``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from cdc import paths, sink_locations
from cdc.config import Settings
from cdc.connect import connect
from cdc.errors import ConfigError, LogStoreError, RegistryError, UnknownTopicError
from cdc.events import int_to_lsn, lsn_to_int
from cdc.logstore import APPLY_CONSUMER, LogStore
from cdc.registry import Registry, TableReg, ViewReg

__all__ = [
    "EXIT_NOT_CAUGHT_UP",
    "Targets",
    "ViewWait",
    "WaitResult",
    "commit_lsn_of",
    "parse_lsn",
    "partition_target",
    "resolve",
    "slot_passed",
    "view_behind",
    "wait_for_lsn",
]

#: how often the slot and the apply's positions are read while waiting
POLL_S = 0.05
#: a wait still short of L this long after it started emits a heartbeat message (then every NUDGE_EVERY_S)
NUDGE_AFTER_S = 0.2
NUDGE_EVERY_S = 1.0
#: records of one partition whose commit LSN is read to find the target; past it, the end offset
SCAN_MAX = 100_000
#: the exit code of a wait that timed out (as ``cdc verify``'s "not caught up")
EXIT_NOT_CAUGHT_UP = 3
#: the longest wait accepted (``--timeout``, ``/wait?timeout=``)
MAX_TIMEOUT_S = 3600.0

_LSN = re.compile(r"[0-9A-Fa-f]{1,8}/[0-9A-Fa-f]{1,8}")
_COMMIT_LSN = b'"commit_lsn":'


def parse_lsn(text: str) -> int:
    """``0/16B3748`` (``pg_lsn`` text, as ``pg_current_wal_lsn()`` prints it) as an int; a
    ConfigError saying the expected form otherwise."""
    value = text.strip()
    if not _LSN.fullmatch(value):
        raise ConfigError(
            f"not an LSN: {text!r}",
            fix="pass the text of `SELECT pg_current_wal_lsn()` taken after the commit, e.g. 0/16B3748",
            lsn=text,
        )
    return lsn_to_int(value)


def parse_timeout(value: float) -> float:
    """A timeout in seconds, 0 < t <= :data:`MAX_TIMEOUT_S` (ConfigError otherwise)."""
    if not 0 < value <= MAX_TIMEOUT_S:
        raise ConfigError(
            f"timeout must be between 0 and {MAX_TIMEOUT_S:g} seconds, got {value:g}",
            fix="pass e.g. --timeout 30 (timeout=30)",
            timeout=value,
        )
    return value


def commit_lsn_of(value: bytes | None) -> int | None:
    """The ``source.commit_lsn`` of an event's value, None for a tombstone or a value without one.

    The reader writes ``source`` after ``before`` and ``after``, and only ``op``, ``ts_ms`` and
    ``unavailable`` (a list of column names: no ``":`` after a name) follow it; a string value's
    quotes are escaped. So the last ``"commit_lsn":`` of the bytes is ``source``'s, even when the
    table has a column of that name: found without parsing a value of many MB."""
    if not value:
        return None
    at = value.rfind(_COMMIT_LSN)
    if at < 0:
        return None
    start = at + len(_COMMIT_LSN)
    end = start
    while end < len(value) and 48 <= value[end] <= 57:
        end += 1
    return int(value[start:end]) if end > start else None


def partition_target(records: Iterable[tuple[int, int | None]], lsn: int, applied: int) -> int:
    """The offset the apply must have committed in a partition: one past the last record of
    ``records`` ((offset, commit LSN) from ``applied`` up to the end noted once capture passed
    ``lsn``) whose commit LSN is <= ``lsn``; ``applied`` when there is none. A record without a
    commit LSN (a tombstone) counts with the record before it; with none before, it counts."""
    target = applied
    previous: int | None = None
    for offset, commit_lsn in records:
        effective = commit_lsn if commit_lsn is not None else previous
        if effective is None or effective <= lsn:
            target = offset + 1
        if commit_lsn is not None:
            previous = commit_lsn
    return target


def slot_passed(
    conn: psycopg.Connection[Any],
    settings: Settings,
    lsn: int,
    tables: Sequence[TableReg],
    *,
    peek: bool = True,
) -> tuple[bool, dict[str, Any]]:
    """Is every change of ``tables`` committed before ``lsn`` durable in the log store?

    Yes when the slot's ``confirmed_flush_lsn`` >= ``lsn``, or when no slot exists (nothing to
    wait for). When the reader is not running (slot inactive, so it will not advance), the slot is
    peeked (``pg_logical_slot_peek_changes`` up to ``lsn``, filtered to these tables; nothing is
    consumed): no pending change of these tables also means caught up. The facts go in the dict:
    ``slot``, ``confirmed_flush_lsn`` (int), ``active``, and ``pending_changes`` when peeked.
    ``peek=False``: the slot's position only, never a peek (a read of ``pg_replication_slots``
    and nothing else: safe inside a caller's transaction, which a peek's error would abort)."""
    row = conn.execute(
        "SELECT active, confirmed_flush_lsn::text, plugin::text FROM pg_replication_slots WHERE slot_name = %s",
        (settings.slot_name,),
    ).fetchone()
    if row is None or row[1] is None:
        return True, {"slot": settings.slot_name, "exists": False}
    active, confirmed = bool(row[0]), lsn_to_int(str(row[1]))
    info: dict[str, Any] = {"slot": settings.slot_name, "confirmed_flush_lsn": confirmed, "active": active}
    if confirmed >= lsn:
        return True, info
    if not peek:
        return False, info
    # the plugins' facts (and msgspec, under the codec) only for a peek: a caught-up slot, the
    # common answer of `cdc verify` and `cdc wait`, needs neither
    from cdc.codec.plugins import PLUGINS

    plugin = PLUGINS.get(str(row[2]))
    if active or plugin is None:  # active: it moves on; None: not a plugin cdc reads, no peek
        return False, info
    try:
        pending = plugin.peek(conn, settings.slot_name, lsn, tables, settings.publication).changes
    except psycopg.errors.ObjectInUse:  # the reader just started: wait for it instead
        return False, info
    info["pending_changes"] = pending
    return pending == 0, info


@dataclass
class TableWait:
    """One table's part of a wait: per partition its target (None until capture passed L) and the
    apply's committed position."""

    reg: TableReg
    sinks: list[str]
    target: dict[int, int] | None = None
    applied: dict[int, int] = field(default_factory=dict)
    starts: dict[int, int] = field(default_factory=dict)
    error: str | None = None

    def position(self, part: int) -> int:
        """The apply's position in ``part`` (a partition it never committed: the start offset)."""
        return max(self.applied.get(part, 0), self.starts.get(part, 0))

    @property
    def caught_up(self) -> bool:
        return self.target is not None and all(self.position(p) >= t for p, t in self.target.items())

    @property
    def lag_offsets(self) -> int | None:
        if self.target is None:
            return None
        return sum(max(0, t - self.position(p)) for p, t in self.target.items())


@dataclass
class ViewWait:
    """One view's part of a wait: the waits of the tables it reads, and, once they are caught up,
    what :func:`view_behind` found (``error``; ``current``: nothing, so the view is caught up)."""

    view: ViewReg
    tables: list[TableWait]
    sinks: list[str]
    error: str | None = None
    current: bool = False

    @property
    def caught_up(self) -> bool:
        return self.current and all(tw.caught_up for tw in self.tables)

    @property
    def lag_offsets(self) -> int | None:
        lags = [tw.lag_offsets for tw in self.tables]
        return None if any(x is None for x in lags) else sum(x for x in lags if x is not None)

    def check(self, state_dir: Path) -> None:
        """Once every table it reads is caught up: is the view maintained through them?"""
        self.error = view_behind(state_dir, self.view.name)
        self.current = self.error is None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "table": self.view.name,
            "kind": "view",
            "reads": [tw.reg.qualified for tw in self.tables],
            "sinks": self.sinks,
            "caught_up": self.caught_up,
            "lag_offsets": self.lag_offsets,
        }
        if self.error:
            out["error"] = self.error
        return out


def view_behind(state_dir: Path, name: str) -> str | None:
    """Why the view ``name`` does not show what the apply applied of its tables (None: it does): it
    is no longer registered, the apply refused it, or its Delta table or search index is not built
    yet (module docstring, Views from joins)."""
    try:
        with Registry(state_dir) as registry:
            view = registry.get_view(name)
    except RegistryError:
        return f"view {name} is no longer registered"
    refused = view.extra.get("refused")
    if refused:
        return (
            f"the apply refused view {name}, which stays at its last state: {refused.get('reason')} "
            f"(fix: {refused.get('fix')})"
        )
    if not (paths.view_table(state_dir, name) / "_delta_log").is_dir():
        return f"view {name} is not built yet: the apply builds it at its next micro-batch"
    from sinks.view_search import view_search_reg  # deferred: the sinks import deltalake and tantivy

    if view.search and not paths.search_index(state_dir, view_search_reg(view).topic).exists():
        return (
            f"the search index of view {name} is not built yet: the apply builds it at its next micro-batch"
        )
    return None


@dataclass
class WaitResult:
    """What a wait found: ``caught_up`` (every table), the capture's facts and each table's."""

    lsn: int
    caught_up: bool
    elapsed_s: float
    capture: dict[str, Any]
    tables: list[dict[str, Any]]

    @property
    def exit_code(self) -> int:
        return 0 if self.caught_up else EXIT_NOT_CAUGHT_UP

    def to_dict(self) -> dict[str, Any]:
        return {
            "lsn": int_to_lsn(self.lsn),
            "caught_up": self.caught_up,
            "elapsed_s": round(self.elapsed_s, 4),
            "capture": self.capture,
            "tables": self.tables,
        }


def _targets(store: LogStore, tw: TableWait, lsn: int) -> None:
    """Set ``tw.target`` from the topic as it is now (capture has passed ``lsn``; step 2)."""
    topic = tw.reg.topic
    try:
        ends = store.end_offsets(topic)
        starts = store.start_offsets(topic)
        done = store.committed(APPLY_CONSUMER, topic)
    except UnknownTopicError:
        tw.error = f"topic {topic} does not exist: the reader has not written this table yet"
        return
    tw.applied, tw.starts = done, starts
    target: dict[int, int] = {}
    for part, end in ends.items():
        pos = tw.position(part)
        if end - pos > SCAN_MAX:
            target[part] = end
            continue
        records = ((r.offset, commit_lsn_of(r.value)) for r in store.iter_partition(topic, part, pos, end))
        target[part] = partition_target(records, lsn, pos)
    tw.target = target


def _lsn_at(store: LogStore, topic: str, part: int, offset: int) -> int | None:
    """The commit LSN of the record at ``offset`` (or the next one kept), None if none."""
    try:
        recs = store.read(topic, part, offset, 4)
    except LogStoreError:
        return None
    return next((x for r in recs if (x := commit_lsn_of(r.value)) is not None), None)


def _describe(store: LogStore, tw: TableWait, lsn: int) -> dict[str, Any]:
    """The table's part of the result: caught up or how far behind."""
    out: dict[str, Any] = {
        "table": tw.reg.qualified,
        "kind": "table",
        "topic": tw.reg.topic,
        "sinks": tw.sinks,
        "snapshot_state": tw.reg.snapshot_state,
        "caught_up": tw.caught_up,
        "lag_offsets": tw.lag_offsets,
        "partitions": {
            str(p): {"applied": tw.position(p), "target": t} for p, t in sorted((tw.target or {}).items())
        },
    }
    if tw.error:
        out["error"] = tw.error
    if tw.target is not None and not tw.caught_up:
        oldest = [
            x
            for p, t in tw.target.items()
            if tw.position(p) < t and (x := _lsn_at(store, tw.reg.topic, p, tw.position(p)))
        ]
        if oldest:
            out["pending_lsn"] = int_to_lsn(min(oldest))
            out["behind_bytes"] = max(0, lsn - min(oldest))
    return out


#: the source refusing a heartbeat message: no EXECUTE on it, a read-only or recovering server ("cannot
#: make new WAL entries during recovery" is an internal error)
_NO_NUDGE = (
    psycopg.errors.InsufficientPrivilege,
    psycopg.errors.ReadOnlySqlTransaction,
    psycopg.errors.ObjectNotInPrerequisiteState,
    psycopg.errors.InternalError_,
)


class _Nudger:
    """Emits a heartbeat message when a wait is still short of L after NUDGE_AFTER_S, then at most
    every NUDGE_EVERY_S; stops for good when the source refuses it (no privilege, a standby)."""

    def __init__(self, conn: psycopg.Connection[Any], enabled: bool) -> None:
        self.conn = conn
        self.enabled = enabled
        self.next = time.monotonic() + NUDGE_AFTER_S
        self.count = 0

    def __call__(self) -> None:
        if not self.enabled or time.monotonic() < self.next:
            return
        from cdc.codec import HEARTBEAT_PREFIX

        try:
            self.conn.execute("SELECT pg_logical_emit_message(false, %s, '')", [HEARTBEAT_PREFIX])
        except _NO_NUDGE:
            self.enabled = False
            return
        self.count += 1
        self.next = time.monotonic() + NUDGE_EVERY_S


@dataclass
class Targets:
    """What a wait is for: tables, and views each with the registered tables it reads."""

    tables: list[TableReg] = field(default_factory=list)
    views: list[tuple[ViewReg, list[TableReg]]] = field(default_factory=list)

    @property
    def waited(self) -> list[TableReg]:
        """Every table whose changes are waited for: those named, then those the views read, each once."""
        out = {reg.qualified: reg for reg in self.tables}
        for _view, regs in self.views:
            for reg in regs:
                out.setdefault(reg.qualified, reg)
        return list(out.values())


def resolve(state_dir: Path, names: Sequence[str]) -> Targets:
    """The derived tables named, each a view's name (tried first, as ``cdc verify`` does) or a
    registered table's; with none named, every registered table and view. RegistryError for a name
    that is neither; ConfigError when nothing is registered."""
    with Registry(state_dir) as registry:
        tables = {reg.qualified: reg for reg in registry.list_tables()}
        views = {v.name: v for v in registry.list_views()}
        out = Targets()
        for name in names or [*tables, *views]:
            view = views.get(name)
            if view is None:
                try:
                    out.tables.append(registry.find(name))
                except RegistryError as exc:
                    if views:
                        exc.fix = f"{exc.fix}; registered views: {', '.join(views)}"
                    raise
                continue
            unknown = [t for t in view.tables if t not in tables]
            if unknown:  # `cdc tables remove` refuses a table a view reads
                raise RegistryError(
                    f"view {view.name} reads {', '.join(unknown)}, which is not registered",
                    fix=f"`cdc views remove {view.name}`, then add it again over registered tables",
                    view=view.name,
                )
            out.views.append((view, [tables[t] for t in view.tables]))
    if not out.tables and not out.views:
        raise ConfigError(
            "no table is registered: there is nothing to wait for", fix="`cdc tables add TABLE`"
        )
    return out


def wait_for_lsn(
    settings: Settings,
    lsn: int,
    tables: Sequence[TableReg],
    timeout_s: float,
    *,
    views: Sequence[tuple[ViewReg, Sequence[TableReg]]] = (),
    store: LogStore | None = None,
    nudge: bool = True,
    poll_s: float = POLL_S,
) -> WaitResult:
    """Wait (at most ``timeout_s``) until every table of ``tables`` has applied every change up to
    commit LSN ``lsn``, and every view of ``views`` (each with the registered tables it reads, as
    :func:`resolve` gives them) shows them (see the module docstring); ``store``: an open log store
    to read (else one is opened read-only); ``nudge``: emit heartbeat messages on an idle source."""
    from cdc.logstore.factory import open_log_store

    started = time.monotonic()
    deadline = started + timeout_s
    state = Path(settings.state_dir)
    waited = Targets(list(tables), [(v, list(regs)) for v, regs in views]).waited
    waits = [TableWait(reg, sink_locations.keeping(state, reg)) for reg in waited]
    by_name = {tw.reg.qualified: tw for tw in waits}
    view_waits = [
        ViewWait(
            view, [by_name[r.qualified] for r in regs], ["warehouse", *(["search"] if view.search else [])]
        )
        for view, regs in views
    ]
    own = store is None
    log = open_log_store(settings, writer=False) if store is None else store
    try:
        with connect(settings.require_source(), application_name="cdc wait") as conn:
            passed, capture = _capture_phase(conn, settings, lsn, waited, deadline, nudge, poll_s)
        if passed:
            for tw in waits:
                _targets(log, tw, lsn)
            _apply_phase(log, waits, deadline, poll_s, view_waits, state)
        for vw in view_waits:  # say why a view that is not caught up may not be (refused, not built)
            if not vw.caught_up and vw.error is None:
                vw.error = view_behind(state, vw.view.name)
        return WaitResult(
            lsn=lsn,
            caught_up=passed and all(tw.caught_up for tw in waits) and all(vw.caught_up for vw in view_waits),
            elapsed_s=time.monotonic() - started,
            capture=capture,
            tables=[_describe(log, tw, lsn) for tw in waits] + [vw.describe() for vw in view_waits],
        )
    finally:
        if own:
            log.close()


def _capture_phase(
    conn: psycopg.Connection[Any],
    settings: Settings,
    lsn: int,
    tables: Sequence[TableReg],
    deadline: float,
    nudge: bool,
    poll_s: float,
) -> tuple[bool, dict[str, Any]]:
    """Step 1: until the slot passed ``lsn`` or the deadline; (passed, the capture's facts)."""
    nudger = _Nudger(conn, nudge)
    while True:
        passed, info = slot_passed(conn, settings, lsn, tables)
        if passed or time.monotonic() >= deadline:
            break
        nudger()
        time.sleep(poll_s)
    confirmed = info.get("confirmed_flush_lsn")
    capture: dict[str, Any] = {
        "passed": passed,
        "slot": info.get("slot"),
        "active": info.get("active"),
        "confirmed_lsn": None if confirmed is None else int_to_lsn(confirmed),
        "behind_bytes": 0 if passed or confirmed is None else max(0, lsn - confirmed),
        "heartbeats_emitted": nudger.count,
    }
    if "pending_changes" in info:
        capture["pending_changes"] = info["pending_changes"]
    return passed, capture


def _apply_phase(
    store: LogStore,
    waits: Sequence[TableWait],
    deadline: float,
    poll_s: float,
    views: Sequence[ViewWait] = (),
    state_dir: Path | None = None,
) -> None:
    """Step 3: read the apply's committed positions until every table reached its target and every
    view of ``views`` is caught up (checked in ``state_dir`` once its tables are, after reading
    their positions), or the deadline passed (at least once)."""
    while True:
        for tw in waits:
            if tw.target is None or tw.caught_up:
                continue
            try:
                tw.applied = store.committed(APPLY_CONSUMER, tw.reg.topic)
            except UnknownTopicError:
                continue
        for vw in views:
            if state_dir is not None and not vw.current and all(tw.caught_up for tw in vw.tables):
                vw.check(state_dir)
        if (
            all(tw.caught_up for tw in waits) and all(vw.caught_up for vw in views)
        ) or time.monotonic() >= deadline:
            return
        time.sleep(poll_s)
