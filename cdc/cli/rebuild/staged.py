"""``cdc rebuild``: a derived table (or view) built again into a staged copy, verified, swapped in.

A **table** (``SCHEMA.TABLE``):

1. **Replay.** Its compacted topic is read from the first offset of every partition
   (:func:`cdc.logstore.records.read_records`) and applied by the apply's own Spark-free code
   (:class:`spark_jobs.applier.BatchApplier`) to the sinks of a *staging* state root,
   ``<state>/rebuild/<name>/stage`` (:func:`cdc.paths.rebuild_dir`): a new current table (and
   tombstones) and, for a table with search columns, a new search index with the live index's shard
   count. The live derived data is not touched and keeps serving readers. Records a sink rejects
   are counted (the apply dead-lettered them when it met them; they are not written again).
2. **Verify.** The copy is compared with the source by :class:`cdc.cli.verify.compare.Verifier`, its sinks
   pointed at the staging root: one consistent point, per-key-range hashes, the search documents.
   When the copy differs, the slot must have passed the point (every change up to it is in the
   topic: as ``cdc verify`` waits, at most ``wait_s``), then the copy replays what the topic gained
   since and is compared again; rows newer than the point retry at a fresh point.
3. **Swap.** Only a copy equal to the source replaces the live data: each staged location
   (:meth:`sinks.Sink.locations`, the history table excepted) takes the live one's place by one
   ``renameat2(RENAME_EXCHANGE)`` (a reader sees the old directory or the new, never none or half
   of one; where the filesystem cannot exchange, two renames), and the old one is kept under
   ``<state>/rebuild/<name>/replaced`` until the next rebuild of the same name. A copy that differs
   (or could not be compared: not caught up) is left in ``stage`` for inspection; the live data
   stays as it was.
4. **Views.** After the swap (under the apply lock) every view reading the table is computed whole
   from the live tables, its search index too (:func:`recompute_views`): the apply recomputes a view
   row only when a batch touches its keys, so rows derived from the replaced copy would stay.

**The history table** (SCD2) cannot come back from a compacted topic (compaction kept only each
key's newest record): it is never replaced, and the report says so.

A **view** (``cdc views``): computed whole from the live current tables of the tables it reads
(:func:`sinks.warehouse.views.view_copy`) into the staging root, compared as a multiset of rows
with the view's SQL run on the source (its SQL is Postgres SQL), then swapped the same way. The
base tables must hold the source's state for that comparison to be clean (run the apply until it
caught up, or rebuild them first). A view with search columns gets its index built again from the
copy and swapped with it: its documents are versioned by the view table's Delta version, which
starts again with the copy, so the old index would refuse the apply's later changes. A view with a
history (``--history``) keeps it, and right before the swap its open versions are brought to the
copy's rows (:func:`sinks.warehouse.view_history.write_history` against the history's own open
rows): a row that differs is closed (``u``) and opened again, one the copy lacks is closed (``d``),
so the history's open rows are the view's rows again; closed versions are never rewritten.

**The apply.** The swap happens under the ``apply`` lock (:mod:`cdc.locks`): never under a batch a
running apply is writing (its commit to a table just moved aside would be lost). A table's copy is
replayed and verified whether or not ``cdc apply`` runs (the live tables keep serving readers and
the apply keeps applying); the lock is then taken, the copy caught up and verified once more under
it, and swapped. When the apply still holds the lock, nothing is swapped (``apply_running``, exit 2)
and the verified copy is kept with its replay positions (``stage/replay.json``): the next rebuild,
once the apply is stopped, resumes it and replays only what the topic gained since. A view is
computed from the current tables the apply writes, so its rebuild takes the lock at the start and is
refused while the apply runs. After the swap the apply resumes from its checkpoint: the records it
applies again are at or below what the copy holds, and the version guards make them change nothing
(the copy's commits carry :data:`REBUILD_APP`, never the apply's application id).

**Reads and the apply's reclaim.** The live tables a view's copy is computed from are read under
reader leases (:mod:`sinks.warehouse.leases`; the apply lock is held then too), and the staged
verifier's sinks take theirs as every read-back does. The staged copies themselves need none: no
apply reclaims the staging root, and this process reads them only before the swap.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psycopg

from cdc import paths
from cdc.cli.verify.compare import Verifier
from cdc.config import Settings
from cdc.connect import connect
from cdc.errors import LockedError, UnknownTopicError
from cdc.locks import ProcessLock
from cdc.registry import Registry, TableReg, ViewReg

#: the application id of the replay's sink commits (never the apply job's own)
REBUILD_APP = "cdc-rebuild"
HISTORY_NOTE = (
    "the history table cannot be rebuilt from a compacted topic (compaction keeps only the newest "
    "record of each key): it was left untouched"
)

Progress = Callable[[str], None]
#: asked once the copy verified, before the swap (``--yes`` answers yes): False keeps the live data
Confirm = Callable[["RebuildReport"], bool]


@dataclass
class RebuildReport:
    """What ``cdc rebuild`` did (``to_dict`` is the ``--json`` shape). ``status``: ``rebuilt`` (the
    copy verified and was swapped in); ``different``, ``not_caught_up`` or ``declined`` (verified,
    but the swap was not confirmed): the live data stays."""

    name: str
    kind: str  # "table" or "view"
    status: str = "different"
    stage: str = ""
    replaced: str | None = None
    swapped: list[str] = field(default_factory=list)
    records: int = 0
    rejected: int = 0
    rows: int = 0
    seconds: float = 0.0
    verify: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: the views reading a rebuilt table, computed again from the swapped-in tables
    views: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def exit_code(self) -> int:
        return {"rebuilt": 0, "apply_running": 2, "not_caught_up": 3}.get(self.status, 1)


# --- the replay ------------------------------------------------------------------------------------
class Replay:
    """A table's topic applied to the sinks of the staging root ``stage``, from the first offset of
    each partition; :meth:`catch_up` applies what the topic holds beyond what it applied so far."""

    def __init__(
        self,
        settings: Settings,
        reg: TableReg,
        stage: Path,
        progress: Progress,
        resume: dict[str, Any] | None = None,
    ) -> None:
        from sinks.search.index import find_layout
        from spark_jobs.applier import BatchApplier, open_sinks

        self.settings = settings
        self.reg = reg
        layout = find_layout(settings.state_dir, reg) if reg.search else None
        self.staged = dataclasses.replace(
            settings, state_dir=stage, partitions=layout.count if layout else settings.partitions
        )
        self.sinks = open_sinks(self.staged)
        _keep_layout(settings, reg, self.sinks)
        self.applier = BatchApplier(self.sinks, {reg.topic: reg}.get, REBUILD_APP)
        self.progress = progress
        self.stage = stage
        resume = resume or {}
        #: per partition the next offset to replay, and the next batch id: the staged sinks skip a
        #: batch id at or below the last one they committed, so a resumed replay goes on from it
        self.positions: dict[int, int] = {int(p): int(o) for p, o in resume.get("positions", {}).items()}
        self.batch_id = int(resume.get("batch_id", 0))
        self.resumed = int(resume.get("records", 0))
        self.records = 0
        self.rejected = 0

    def save(self, *, verified: bool) -> None:
        """Record the replay's positions in the stage (``replay.json``): a later rebuild resumes a
        copy that verified (:func:`_stage`)."""
        body = {
            "topic": self.reg.topic,
            "positions": {str(p): o for p, o in self.positions.items()},
            "batch_id": self.batch_id,
            "records": self.resumed + self.records,
            "verified": verified,
        }
        tmp = self.stage / "replay.json.tmp"
        tmp.write_bytes(orjson.dumps(body))
        os.replace(tmp, self.stage / "replay.json")

    def catch_up(self) -> int:
        """Apply the records up to the topic's end offsets now; returns how many."""
        import pyarrow as pa

        from cdc.logstore.factory import open_log_store
        from cdc.logstore.records import read_records

        done = 0
        with open_log_store(self.settings) as store:
            try:
                starts, ends = store.start_offsets(self.reg.topic), store.end_offsets(self.reg.topic)
            except UnknownTopicError:
                return 0
            todo = {p: (self.positions.get(p, max(starts.get(p, 0), 0)), e) for p, e in ends.items()}
            total = sum(max(e - s, 0) for s, e in todo.values())
            shown = time.monotonic()
            for p, (start, end) in sorted(todo.items()):
                for chunk in read_records(store, self.reg.topic, p, start, end):
                    out = self.applier.run(pa.Table.from_batches([chunk]), self.batch_id)
                    self.batch_id += 1
                    self.rejected += len(out.dead)
                    done += chunk.num_rows
                    if time.monotonic() - shown >= 1.0 or done == total:
                        self.progress(f"{self.reg.qualified}: replayed {done}/{total} records")
                        shown = time.monotonic()
                self.positions[p] = end
        self.records += done
        return done

    def close(self) -> None:
        self.applier.close(close_sinks=True, timeout=120)


def _keep_layout(settings: Settings, reg: TableReg, sinks: Sequence[Any]) -> None:
    """The staged warehouse tables get the live current table's layout (its clustering, buckets and
    shards), whatever :meth:`~sinks.warehouse.layout.Layout.choose` would pick now: the live history
    table, which stays, has it, and the apply refuses tables that disagree on it."""
    from deltalake import DeltaTable

    from sinks.warehouse import WarehouseSink
    from sinks.warehouse.delta import layout_of

    current = WarehouseSink.locations(settings.state_dir, reg)["current"]
    if not DeltaTable.is_deltatable(str(current)):
        return
    layout = layout_of(DeltaTable(str(current)))
    for sink in sinks:
        if isinstance(sink, WarehouseSink):
            sink.layouts[reg.qualified] = layout


class StagedVerifier(Verifier):
    """:class:`~cdc.cli.verify.compare.Verifier` of the staged copy: its sinks read the staging root, and its
    wait for the pipeline is a wait for the slot followed by a :meth:`Replay.catch_up`."""

    def __init__(self, settings: Settings, replay: Replay, *, wait_s: float, limit: int) -> None:
        from spark_jobs.applier import open_sinks

        super().__init__(settings, wait_s=wait_s, limit=limit)
        self.sinks = open_sinks(replay.staged)
        self.replay = replay

    def wait_caught_up(
        self,
        conn: psycopg.Connection[Any],
        lsn: int,
        tables: Sequence[TableReg],
        settled: Callable[[], bool] | None = None,
    ) -> dict[str, Any]:
        ok, info = self._wait_for_slot(conn, lsn, tables, time.monotonic() + self.wait_s)
        if not ok:
            return {"slot": info}
        self.replay.catch_up()
        return {}


# --- the swap --------------------------------------------------------------------------------------
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths atomically (Linux ``renameat2``); False where it is not supported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def swap_in(staged: Path, live: Path, aside: Path) -> None:
    """``staged`` takes ``live``'s place; the old ``live`` (if any) moves to ``aside``."""
    paths.ensure_private_dir(aside.parent)
    paths.ensure_private_dir(live.parent)
    if live.exists():
        if _exchange(staged, live):
            os.rename(staged, aside)  # the staged path now holds the old one
            return
        os.rename(live, aside)
    os.rename(staged, live)


def _swap_locations(pairs: Sequence[tuple[Path, Path]], work: Path) -> list[str]:
    """Every ``(staged, live)`` of ``pairs`` that exists staged swapped in; the old ones kept under
    ``work/replaced`` (emptied first). Returns the live paths replaced. Each swap is atomic, the set
    is not: the stage's ``replay.json`` goes first, so that after a crash in the middle the next
    rebuild starts over instead of resuming a stage that lost some of its tables."""
    (work / "stage" / "replay.json").unlink(missing_ok=True)
    replaced = work / "replaced"
    shutil.rmtree(replaced, ignore_errors=True)
    done = []
    for i, (staged, live) in enumerate(pairs):
        if staged.exists():
            swap_in(staged, live, replaced / f"{i}-{live.name}")
            done.append(str(live))
    return done


# --- a table ---------------------------------------------------------------------------------------
def _stage(state_dir: Path, name: str, topic: str | None = None) -> tuple[Path, Path, dict[str, Any] | None]:
    """``(work dir, stage, what to resume)``: a stage left by a rebuild of ``topic`` whose copy
    verified but could not be swapped (the apply was running) is resumed; any other is removed."""
    work = paths.rebuild_dir(state_dir, name)
    stage = work / "stage"
    try:
        kept = orjson.loads((stage / "replay.json").read_bytes()) if topic else None
    except (OSError, orjson.JSONDecodeError):
        kept = None
    if isinstance(kept, dict) and kept.get("verified") is True and kept.get("topic") == topic:
        return work, stage, kept
    shutil.rmtree(stage, ignore_errors=True)
    paths.ensure_private_dir(stage)
    return work, stage, None


class ApplyLock:
    """The ``apply`` lock (:mod:`cdc.locks`) as the rebuild takes it: :meth:`take` answers whether it
    is held now (``refused``: the error that says who holds it)."""

    def __init__(self, state_dir: Path, name: str) -> None:
        self.lock = ProcessLock(state_dir, "apply", command="cdc rebuild")
        self.name = name
        self.held = False
        self.refused: LockedError | None = None

    def take(self) -> bool:
        if not self.held:
            try:
                self.lock.acquire()
                self.held = True
            except LockedError as exc:
                exc.fix = (
                    f"stop `cdc apply` (it resumes from its checkpoint), then run `cdc rebuild "
                    f"{self.name}` again; the live tables keep serving readers during a rebuild"
                )
                self.refused = exc
        return self.held

    def release(self) -> None:
        if self.held:
            self.lock.release()
            self.held = False


def rebuild_table(
    settings: Settings,
    reg: TableReg,
    *,
    wait_s: float,
    limit: int,
    progress: Progress,
    confirm: Confirm,
    lock: ApplyLock,
) -> RebuildReport:
    """See the module docstring (a table). Without ``lock`` held the copy is built and verified, and
    swapped only if the lock can be taken then (after a last catch-up and verify under it)."""
    started = time.monotonic()
    work, stage, resume = _stage(settings.state_dir, reg.qualified, reg.topic)
    report = RebuildReport(reg.qualified, "table", stage=str(stage), notes=[HISTORY_NOTE])
    replay = Replay(settings, reg, stage, progress, resume)
    if resume:
        report.notes.append(f"resumed the verified copy of an earlier rebuild ({replay.resumed} records)")
    if not lock.held:
        progress(
            f"{reg.qualified}: `cdc apply` is running: the copy is built and verified, the swap waits for it"
        )
    verifier = StagedVerifier(settings, replay, wait_s=wait_s, limit=limit)
    try:
        replay.catch_up()
        progress(f"{reg.qualified}: verifying the copy against the source")
        (verified,) = verifier.verify([reg])
        if verified.equal and verified.caught_up and not lock.held and lock.take():
            progress(f"{reg.qualified}: the apply stopped: verifying the copy again under its lock")
            (verified,) = verifier.verify([reg])
        ok = verified.equal and verified.caught_up
        replay.save(verified=ok)
    finally:
        replay.close()
    report.records, report.rejected = replay.records, replay.rejected
    report.verify = verified.to_dict()
    report.rows = int(verified.primary[1].stored or 0)
    report.status = ("rebuilt" if lock.held else "apply_running") if ok else verified.status
    if report.rejected:
        report.notes.append(
            f"{report.rejected} records were rejected by a sink (as the apply dead-lettered them)"
        )
    if report.status == "apply_running" and lock.refused is not None:
        report.notes.append(f"{lock.refused.message}; the verified copy is kept: {lock.refused.fix}")
    if report.status == "rebuilt" and not confirm(report):
        report.status = "declined"
    if report.status == "rebuilt":
        _swap_table(settings, reg, stage, work, report)
        report.views = recompute_views(settings, reg, progress)
    report.seconds = round(time.monotonic() - started, 3)
    return report


def _swap_table(settings: Settings, reg: TableReg, stage: Path, work: Path, report: RebuildReport) -> None:
    """Every staged location of every sink but the history swapped in (see :func:`_swap_locations`)."""
    from sinks.all import SINKS

    pairs = [
        (cls.locations(stage, reg)[k], where)
        for cls in SINKS
        for k, where in cls.locations(settings.state_dir, reg).items()
        if k != "history"
    ]
    report.swapped = _swap_locations(pairs, work)
    report.replaced = str(work / "replaced")
    shutil.rmtree(stage, ignore_errors=True)
    report.stage = ""


def recompute_views(settings: Settings, reg: TableReg, progress: Progress) -> list[str]:
    """Every view reading ``reg`` computed whole from the live tables, its search index too: their
    rows were derived from the table's copy just replaced (a view row changes only when a batch
    touches its keys, so without this a row derived from a corrupted table would stay wrong). Runs
    under the apply lock, right after the swap; commits under :data:`REBUILD_APP` with a batch id
    from the clock (each rebuild's above the last). Returns the views recomputed."""
    from sinks.search import SearchSink
    from sinks.warehouse.views import ViewMaintainer

    with Registry(settings.state_dir) as registry:
        tables = registry.list_tables()
        views = [v for v in registry.list_views() if reg.qualified in v.tables]
    if not views:
        return []
    progress(f"{reg.qualified}: computing the views that read it again: {', '.join(v.name for v in views)}")
    maintainer = ViewMaintainer(
        settings.state_dir, lambda: (views, tables), REBUILD_APP, search=SearchSink.from_settings(settings)
    )
    try:
        done = maintainer.rebuild(time.time_ns() // 1_000_000)
    finally:
        maintainer.close()
    return sorted(name for name, outcome in done.items() if not outcome.refused)


# --- a view ----------------------------------------------------------------------------------------
def _source_view_rows(
    settings: Settings, view: ViewReg, target: Any
) -> tuple[list[tuple[str, str]], list[list[Any]]]:
    """The view's SQL run on the source (one read-only snapshot): its columns (name, type) and rows
    normalised as ``cdc verify`` normalises a table's (:func:`cdc.cli.verify.compare._normalise`)."""
    from psycopg import sql

    from cdc.cli.verify.compare import _normalise, _select_expr

    with connect(settings.require_source(), application_name="cdc rebuild") as conn:
        for stmt in ("SET TimeZone = 'UTC'", "SET DateStyle = 'ISO, YMD'", "SET extra_float_digits = 1"):
            conn.execute(stmt)
        with conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            inner = sql.SQL(view.sql.strip().rstrip(";"))  # the registered, parsed and checked view SQL
            cur = conn.execute(sql.SQL("SELECT * FROM ({}) AS __v LIMIT 0").format(inner))
            desc = cur.description or []
            columns = []
            for d in desc:
                row = conn.execute("SELECT format_type(%s, NULL)", (d.type_code,)).fetchone()
                columns.append((d.name, str(row[0]) if row else "text"))
            q = sql.SQL("SELECT {} FROM ({}) AS __v").format(
                sql.SQL(", ").join(_select_expr(n, t) for n, t in columns), inner
            )
            rows = conn.execute(q).fetchall()
    return columns, _normalise(columns, rows, target)


def _compare_view(settings: Settings, view: ViewReg, copy: Path, limit: int) -> dict[str, Any]:
    """The staged view ``copy`` against the view's SQL on the source, as multisets of rows."""
    from collections import Counter

    from deltalake import DeltaTable

    from cdc.cli.verify.compare import canonical, row_hash

    table = DeltaTable(str(copy)).to_pyarrow_table()
    columns, src = _source_view_rows(settings, view, table.schema)
    names = [n for n, _ in columns]
    data = {n: table.column(n).to_pylist() for n in names if n in table.column_names}
    mine = [[data[n][i] if n in data else None for n in names] for i in range(table.num_rows)]
    want, have = Counter(row_hash(r) for r in src), Counter(row_hash(r) for r in mine)
    show = {row_hash(r): {n: canonical(v) for n, v in zip(names, r, strict=True)} for r in [*src, *mine]}
    missing, extra = list((want - have).elements()), list((have - want).elements())
    return {
        "status": "ok" if not missing and not extra else "different",
        "source_rows": len(src),
        "warehouse_rows": len(mine),
        "missing_count": len(missing),
        "extra_count": len(extra),
        "missing": [show[h] for h in missing[:limit]],
        "extra": [show[h] for h in extra[:limit]],
    }


def _view_index(
    settings: Settings, view: ViewReg, stage: Path, report: RebuildReport, limit: int
) -> list[tuple[Path, Path]]:
    """The view's search index built from the staged copy (:func:`sinks.view_search.index_view`) and
    checked against it (a document for every row of the copy, no other); its ``(staged, live)`` locations. It must be swapped
    with the copy: its documents are versioned by the view table's Delta version, which starts again
    at the copy's, so the live index's newer versions would refuse every later change. A mismatch
    makes the report ``different``."""
    from sinks.search import SearchSink
    from sinks.search.query import live_texts
    from sinks.view_search import index_view, view_search_reg
    from sinks.warehouse.views import view_rows

    reg = view_search_reg(view)
    staged = dataclasses.replace(settings, state_dir=stage)
    sink = SearchSink.from_settings(staged)
    try:
        index_view(sink, stage, view, None, 0, REBUILD_APP)
    finally:
        sink.close()
    rows = view_rows(stage, view.name)
    want = set(rows.column("_cdc_key").to_pylist()) if rows is not None else set()
    have = {orjson.loads(k)["_cdc_key"] for k in live_texts(stage, reg)}
    report.verify["search_docs"] = len(have)
    if have != want:
        report.status = "different"
        report.verify["search"] = {
            "missing": sorted(want - have)[:limit],
            "extra": sorted(have - want)[:limit],
        }
    return [
        (SearchSink.locations(stage, reg)[k], p)
        for k, p in SearchSink.locations(settings.state_dir, reg).items()
    ]


def rebuild_view(
    settings: Settings, view: ViewReg, *, limit: int, progress: Progress, confirm: Confirm
) -> RebuildReport:
    """See the module docstring (a view)."""
    from cdc.views import spec_of
    from sinks.warehouse import WarehouseOptions
    from sinks.warehouse.views import view_copy

    started = time.monotonic()
    work, stage, _ = _stage(settings.state_dir, f"_views.{view.name}")
    report = RebuildReport(view.name, "view", stage=str(stage))
    with Registry(settings.state_dir) as registry:
        spec = spec_of(view, registry.list_tables())
    copy = paths.view_table(stage, view.name)
    progress(f"view {view.name}: computing it whole from the current tables")
    lease_s = WarehouseOptions.from_settings(settings).lease_max_age_s
    report.rows = view_copy(settings.state_dir, spec, copy, lease_s)
    progress(f"view {view.name}: comparing the copy with the view's SQL on the source")
    report.verify = _compare_view(settings, view, copy, limit)
    report.status = "rebuilt" if report.verify["status"] == "ok" else "different"
    pairs = [(copy, paths.view_table(settings.state_dir, view.name))]
    if view.search and report.status == "rebuilt":
        pairs += _view_index(settings, view, stage, report, limit)
    if report.status == "rebuilt" and not confirm(report):
        report.status = "declined"
    if report.status == "different":
        report.notes.append(
            "the view is computed from the warehouse's current tables: if they have not caught up "
            "with the source, run the apply until they have (or rebuild them), then rebuild the view"
        )
    if report.status == "rebuilt":
        if view.extra.get("history"):
            _reconcile_history(settings, view, copy, report)
        report.swapped = _swap_locations(pairs, work)
        report.replaced = str(work / "replaced")
        shutil.rmtree(stage, ignore_errors=True)
        report.stage = ""
    report.seconds = round(time.monotonic() - started, 3)
    return report


def _reconcile_history(settings: Settings, view: ViewReg, copy: Path, report: RebuildReport) -> None:
    """The view's history brought to the verified copy before it is swapped in (see the module
    docstring), committed under :data:`REBUILD_APP` with a batch id from the clock."""
    from deltalake import CommitProperties, DeltaTable, Transaction

    from sinks.warehouse.view_history import write_history

    if not DeltaTable.is_deltatable(str(paths.view_history(settings.state_dir, view.name))):
        return
    batch = time.time_ns() // 1_000_000
    props = CommitProperties(app_transactions=[Transaction(REBUILD_APP, version=batch)])
    rows = DeltaTable(str(copy)).to_pyarrow_table()
    opened = write_history(settings.state_dir, view.name, None, rows, None, props, (REBUILD_APP, batch))
    report.notes.append(
        f"the view's history was kept; {opened} of its rows differed from the copy and got a new version"
    )


# --- the verb --------------------------------------------------------------------------------------
def rebuild(
    settings: Settings, name: str, *, wait_s: float, limit: int, progress: Progress, confirm: Confirm
) -> RebuildReport:
    """Rebuild the registered view or table ``name`` (a view's name is tried first) under the
    ``apply`` lock: a view's from start to end (refused while the apply runs), a table's for its
    swap (see the module docstring). One rebuild of a name at a time (the lock ``rebuild.<name>``:
    a second one would remove the first one's stage)."""
    settings.require_source()
    with Registry(settings.state_dir) as registry:
        view = next((v for v in registry.list_views() if v.name == name), None)
        reg = None if view is not None else registry.find(name)
    target = view.name if view is not None else reg.qualified if reg is not None else name
    with ProcessLock(settings.state_dir, f"rebuild.{target}", command=f"cdc rebuild {target}"):
        return _locked(settings, view, reg, wait_s=wait_s, limit=limit, progress=progress, confirm=confirm)


def _locked(
    settings: Settings,
    view: ViewReg | None,
    reg: TableReg | None,
    *,
    wait_s: float,
    limit: int,
    progress: Progress,
    confirm: Confirm,
) -> RebuildReport:
    """:func:`rebuild` under its own lock: the apply lock taken (see there)."""
    name = view.name if view is not None else reg.qualified if reg is not None else ""
    lock = ApplyLock(settings.state_dir, name)
    lock.take()
    try:
        if view is not None:
            if lock.refused is not None:
                raise lock.refused
            return rebuild_view(settings, view, limit=limit, progress=progress, confirm=confirm)
        assert reg is not None  # registry.find raised otherwise
        return rebuild_table(
            settings, reg, wait_s=wait_s, limit=limit, progress=progress, confirm=confirm, lock=lock
        )
    finally:
        lock.release()


__all__ = [
    "REBUILD_APP",
    "ApplyLock",
    "RebuildReport",
    "Replay",
    "StagedVerifier",
    "rebuild",
    "recompute_views",
    "swap_in",
]
