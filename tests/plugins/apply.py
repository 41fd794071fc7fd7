"""The apply job and ``cdc`` in this process, for the tests: :class:`Env` (a state directory with its
settings, log store and registry), :func:`cdc_cli`, the job run once (:func:`run_job`,
:func:`apply_clean`, :func:`apply_once`) or continuously on a thread (:func:`continuous_job`,
:func:`start_job`), and the rows a table holds in the warehouse (:func:`warehouse_rows`, :func:`warehouse_ids`)."""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cdc.config import Settings
from cdc.errors import ApplyError
from cdc.logstore import LogStore
from cdc.registry import Registry, TableReg
from sinks import ChangeBatch, Sink

if TYPE_CHECKING:
    from spark_jobs.apply import ApplyJob
    from tests.plugins.capture import CaptureEnv


@dataclass
class Env:
    settings: Settings
    store: LogStore
    registry: Registry

    @property
    def state(self) -> Path:
        return Path(self.settings.state_dir)

    def register(self, reg: TableReg) -> TableReg:
        return self.registry.add(reg)


def cdc_cli(dsn: str, state: Path, *args: str) -> tuple[int, str]:
    """``cdc --source DSN --state STATE ARGS...`` in this process: (exit code, stdout)."""
    from cdc.cli import main as cdc_main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cdc_main(["--source", dsn, "--state", str(state), *args])
    return code, out.getvalue()


def reader_env(state: Path) -> Env:
    """The apply job's view of a state directory that ``cdc tables add`` / ``cdc run`` (the real
    reader) write: its settings only, no log store or registry held open here (the reader is the
    log store's writer)."""
    return Env(Settings(state_dir=state), None, None)  # type: ignore[arg-type]


def run_job(
    spark: Any, env: Env, *, make_sinks: Any = None, max_records: int = 0, on_batch: Any = None, **kw: Any
) -> Any:
    """Run the apply job once (availableNow) in this process; return its summary. ``on_batch``: called
    with each batch's :class:`spark_jobs.apply.BatchReport`; ``make_sinks``: the job's sinks from its
    settings (default: the product's), built in the driver and in every task."""
    from spark_jobs.applier import open_sinks
    from spark_jobs.apply import ApplyJob, ApplyOptions

    options = ApplyOptions(once=True, max_records_per_batch=max_records, **kw)
    job = ApplyJob(spark, env.settings, options, make_sinks=make_sinks or open_sinks, on_batch=on_batch)
    try:
        return job.run()
    finally:
        job.close()


def apply_clean(spark: Any, state: Path) -> Any:
    """The apply job once over what the real reader wrote to ``state``: no dead letter; its summary."""
    summary = run_job(spark, reader_env(state))
    assert summary.dead_letters == 0
    return summary


def apply_once(spark: Any, env: CaptureEnv) -> Any:
    """The apply job once with the capture environment's own settings (its ``cdc.toml``)."""
    from spark_jobs.apply import ApplyJob, ApplyOptions

    job = ApplyJob(spark, env.settings(), ApplyOptions(once=True))
    try:
        return job.run()
    finally:
        job.close()


def continuous_job(spark: Any, env: Env, **kw: Any) -> ApplyJob:
    """The apply job running continuously (0.2 s trigger, registry polled every second)."""
    from spark_jobs.apply import ApplyJob, ApplyOptions

    return ApplyJob(
        spark, env.settings, ApplyOptions(once=False, trigger_interval_s=0.2, registry_poll_s=1), **kw
    )


def start_job(job: ApplyJob) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``job.run()`` on a thread; what it raises is collected for the test's assertions."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            job.run()
        except BaseException as exc:  # surfaced by the assertions of the test
            errors.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return runner, errors


def warehouse_rows(env: Env | CaptureEnv, reg: Any) -> dict[Any, dict[str, Any]]:
    """Every current row of ``reg`` in the warehouse (no meta columns), by its ``id``."""
    from sinks.warehouse import WarehouseSink

    return {r["id"]: r for r in WarehouseSink(env.state).current_rows(reg, meta=False).to_pylist()}


def warehouse_ids(env: Env, reg: Any) -> set[int]:
    """The ``id`` of every current row of ``reg`` in the warehouse (none before its table exists)."""
    try:
        return set(warehouse_rows(env, reg))
    except ApplyError:  # not created yet
        return set()


class GateSink(Sink):
    """A sink that holds every batch inside ``apply`` until the test releases it, told through files
    in ``root`` (it runs in the apply's Spark tasks, processes of their own): ``entered`` is created
    when a batch arrives, the test creates ``release`` to let it go, and ``applied`` gets a line
    ``<batch_id> <events>`` per batch applied. ``limit_s``: how long it waits before failing."""

    name = "gate"

    def __init__(self, root: Path, limit_s: float = 120.0) -> None:
        self.root = root
        self.limit_s = limit_s

    def entered(self) -> bool:
        return (self.root / "entered").exists()

    def release(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "release").touch()

    def applied(self) -> list[tuple[int, int]]:
        path = self.root / "applied"
        lines = path.read_text().splitlines() if path.exists() else []
        return [(int(a), int(b)) for a, b in (ln.split() for ln in lines)]

    def apply(self, batch: ChangeBatch, batch_id: int, app_id: str) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "entered").touch()
        deadline = time.monotonic() + self.limit_s
        while not (self.root / "release").exists():  # polled: the test is in another process
            if time.monotonic() > deadline:
                raise TimeoutError("the test never released the gate")
            time.sleep(0.05)
        with (self.root / "applied").open("a") as f:
            f.write(f"{batch_id} {len(batch)}\n")


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first): `cdc apply`'s Spark JVM, in a process group
    of its own, and the Python workers the JVM starts."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                out.extend(kids)
                todo.extend(kids)
    return out


def processes_with_env(marker: str) -> dict[int, str]:
    """The live processes whose environment holds ``marker`` (``NAME=VALUE``), pid -> command line:
    a process started with it and all it started that inherited it (the Spark JVM, its Python
    workers), even once they were orphaned. Zombies have no environment: they are not listed."""
    want = marker.encode()
    out: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                out[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
    return out


def apply_without_spark(
    state: Path, app_id: str = "cdc-apply-test", *, settings: Settings | None = None
) -> int:
    """Every registered table's topic, from its first offset, applied to the sinks of ``state`` by
    the apply's Spark-free micro-batch (:class:`spark_jobs.applier.BatchApplier`), the views
    maintained after each batch as the apply job does; one batch per partition chunk; the apply
    consumer's positions committed at the end (``cdc verify`` waits for them). Returns the records
    applied. Version guards make a second call (new batch ids, same records) change nothing.
    ``settings``: the sinks' (default: ``state``'s with no cdc.toml).

    A test-only loop, not the apply job (:func:`run_job`, ``cdc apply``). It does not cover: the
    job's Spark source and checkpoint (the records are read here straight from the log store, every
    call from offset 0); its work in Spark tasks (:mod:`spark_jobs.tasks`, the job's default: the
    warehouse's commits made in the driver, views by the keys the tasks touched); its batch ids
    (here from 0 at every call, where the job continues its checkpoint's); its offset commits
    (here each topic's end offsets as read before the topic, committed by this loop, not the job's
    :func:`spark_jobs.ledger.commit_positions` from Spark's offset log, and no position held before
    the first batch); its dead letters (here dropped: neither written to the dead-letter topic nor
    asserted absent), ledger, metrics, sink recovery, watchdog and apply lock."""
    import pyarrow as pa

    from cdc.logstore import APPLY_CONSUMER
    from cdc.logstore.factory import open_log_store
    from cdc.logstore.records import read_records
    from sinks.search import SearchSink
    from sinks.warehouse.views import ViewMaintainer
    from spark_jobs.applier import BatchApplier, open_sinks

    settings = settings or Settings(state_dir=state)
    with Registry(state) as registry:
        tables = registry.list_tables()
        by_topic = {t.topic: t for t in tables}
        views = ViewMaintainer(
            state,
            lambda: (registry.list_views(), registry.list_tables()),
            app_id,
            search=SearchSink.from_settings(settings),
        )
        applier = BatchApplier(open_sinks(settings), by_topic.get, app_id, after=views.maintain)
        batch_id, done = 0, 0
        try:
            with open_log_store(settings) as store:
                for topic in sorted(by_topic):
                    ends = store.end_offsets(topic)
                    for p, end in sorted(ends.items()):
                        for chunk in read_records(store, topic, p, 0, end):
                            applier.run(pa.Table.from_batches([chunk]), batch_id)
                            batch_id, done = batch_id + 1, done + chunk.num_rows
                    store.commit(APPLY_CONSUMER, topic, ends)
        finally:
            applier.close(close_sinks=True, timeout=60)
            views.close()
    return done


SPARKLESS_APP = "cdc-apply-sparkless-test"


def _registered(state: Path) -> Any:
    """The registered views and tables of ``state``, read afresh at each call (as the job does)."""

    def read() -> tuple[list[Any], list[TableReg]]:
        with Registry(state) as registry:
            return registry.list_views(), registry.list_tables()

    return read


def apply_pending_without_spark(state: Path, *, settings: Settings | None = None) -> int:
    """Apply every record the real reader wrote to ``state`` past the apply consumer's committed
    positions through :class:`spark_jobs.applier.BatchApplier` (the Spark-free micro-batch, no JVM),
    the views maintained after it as the apply job does, then commit the end positions; asserts no
    dead letter. Returns the records applied. ``settings``: the sinks' (default: ``state``'s with
    no cdc.toml).

    A test-only loop, not the apply job (:func:`run_job`, ``cdc apply``). It does not cover: the
    job's Spark source and checkpoint (the records are read here straight from the log store,
    from the committed positions to the end offsets seen at the start); its work in Spark tasks
    (:mod:`spark_jobs.tasks`: here one batch on this process, every partition at once); its batch ids (here the committed positions summed); its offset
    commits (here the end offsets this loop read, committed by it, not the job's
    :func:`spark_jobs.ledger.commit_positions` from Spark's offset log, and no position held before
    the batch); its dead-letter topic, ledger, metrics, sink recovery, watchdog and apply lock."""
    import pyarrow as pa

    from cdc.logstore import APPLY_CONSUMER
    from cdc.logstore.factory import open_log_store
    from cdc.logstore.records import RECORDS, read_records
    from sinks.search import SearchSink
    from sinks.warehouse.views import ViewMaintainer
    from spark_jobs.applier import BatchApplier, open_sinks

    settings = settings or Settings(state_dir=state)
    with Registry(state) as registry:
        regs = registry.list_tables()
    views = ViewMaintainer(
        state, _registered(state), SPARKLESS_APP, search=SearchSink.from_settings(settings)
    )
    sinks = open_sinks(settings)
    try:
        with open_log_store(settings) as store:
            batches: list[pa.RecordBatch] = []
            ends = {reg.topic: store.end_offsets(reg.topic) for reg in regs}
            batch_id = 0  # the committed positions summed: they grow with every call that applies records
            for reg in regs:
                done, starts = store.committed(APPLY_CONSUMER, reg.topic), store.start_offsets(reg.topic)
                batch_id += sum(done.values())
                for p, end in ends[reg.topic].items():
                    since = max(done.get(p, 0), starts.get(p, 0))
                    batches.extend(read_records(store, reg.topic, p, since, end))
            if batches:
                applier = BatchApplier(
                    sinks, {reg.topic: reg for reg in regs}.get, SPARKLESS_APP, after=views.maintain
                )
                out = applier.run(pa.Table.from_batches(batches, schema=RECORDS), batch_id)
                assert not out.dead, out.dead
            for topic, end in ends.items():
                store.commit(APPLY_CONSUMER, topic, end)
    finally:
        for s in sinks:
            s.close()
        views.close()
    return sum(b.num_rows for b in batches)
