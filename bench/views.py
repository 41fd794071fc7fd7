"""A view from joins maintained beside its base tables: what the view costs per micro-batch against
the single-table apply of the same batch (``docs/benchmarks/views.md``, ``docs/views.md``).

``python -m bench views [--quick]``

The tables: ``orders`` (the driving table, ORDERS rows), ``customers`` (CUSTOMERS rows), ``regions``
(50 rows); the view ``SELECT o.id, o.total, c.name, r.label FROM orders o JOIN customers c ON
o.customer_id = c.id LEFT JOIN regions r ON c.region = r.code``, registered once the tables hold
their rows (its first batch builds it whole). Then BATCHES micro-batches of PER_BATCH changes:
80 % updates of random orders (a new customer now and then), 18 % updates of random customers, 2 %
of regions, applied by :class:`spark_jobs.applier.BatchApplier` to the real Delta tables (no JVM).
Per batch: the warehouse sink's seconds (the peer: the single-table apply of the batch's three
tables) and the view's, both as wall time and CPU seconds of this process; medians printed.
"""

from __future__ import annotations

import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import loadavg, say
from cdc.registry import TableReg, ViewReg
from sinks import RawRecord
from sinks.parse import records_table
from sinks.warehouse import WarehouseSink
from sinks.warehouse.views import ViewMaintainer, ViewOutcome
from spark_jobs.applier import BatchApplier
from tests.sinks.feed import Feed, join_tables

ORDERS, CUSTOMERS, REGIONS = join_tables()
TABLES = [ORDERS, CUSTOMERS, REGIONS]
SQL = (
    "SELECT o.id, o.total, c.name, r.label FROM orders o JOIN customers c ON o.customer_id = c.id "
    "LEFT JOIN regions r ON c.region = r.code"
)
APP = "cdc-bench-views"


class Load:
    def __init__(self, orders: int, customers: int) -> None:
        self.rng = random.Random(1)
        self.orders, self.customers = orders, customers
        self.feeds = {t.table: Feed(t, form="columns") for t in TABLES}
        self.lsn = 1000

    def _next(self) -> int:
        self.lsn += 10
        return self.lsn

    def order(self, i: int) -> dict[str, Any]:
        return {
            "id": i,
            "customer_id": self.rng.randrange(1, self.customers + 1),
            "total": self.rng.randrange(100),
            "note": f"order {i}",
        }

    def customer(self, i: int) -> dict[str, Any]:
        return {
            "id": i,
            "name": f"customer {i} {self.rng.random():.3f}",
            "region": f"r{self.rng.randrange(50)}",
        }

    def initial(self) -> list[list[RawRecord]]:
        regions = [
            self.feeds["regions"].change("r", {"code": f"r{i}", "label": f"region {i}"}, self._next())
            for i in range(50)
        ]
        customers = [
            self.feeds["customers"].change("r", self.customer(i), self._next())
            for i in range(1, self.customers + 1)
        ]
        orders = [
            self.feeds["orders"].change("r", self.order(i), self._next()) for i in range(1, self.orders + 1)
        ]
        step = 50_000
        return [regions + customers] + [orders[i : i + step] for i in range(0, len(orders), step)]

    def batch(self, n: int) -> list[RawRecord]:
        out = []
        for _ in range(n):
            x = self.rng.random()
            if x < 0.80:
                out.append(
                    self.feeds["orders"].change(
                        "u", self.order(self.rng.randrange(1, self.orders + 1)), self._next()
                    )
                )
            elif x < 0.98:
                out.append(
                    self.feeds["customers"].change(
                        "u", self.customer(self.rng.randrange(1, self.customers + 1)), self._next()
                    )
                )
            else:
                i = self.rng.randrange(50)
                out.append(
                    self.feeds["regions"].change(
                        "u", {"code": f"r{i}", "label": f"region {i} {x:.4f}"}, self._next()
                    )
                )
        return out


def run(quick: bool) -> str:
    orders, customers, batches, per_batch = (20_000, 2_000, 5, 200) if quick else (200_000, 20_000, 15, 1_000)
    state = Path(tempfile.mkdtemp(prefix="cdc-bench-views-"))
    views: list[ViewReg] = []
    view_cpu: list[float] = []
    maintainer = ViewMaintainer(state, lambda: (list(views), TABLES), APP)

    def timed(batches_: Any, batch_id: int) -> dict[str, ViewOutcome]:
        t0 = time.process_time()
        out = maintainer.maintain(batches_, batch_id)
        view_cpu.append(time.process_time() - t0)
        return out

    by_topic: dict[str, TableReg] = {t.topic: t for t in TABLES}
    app = BatchApplier([WarehouseSink(state)], by_topic.get, APP, after=timed)
    load = Load(orders, customers)
    rows: list[tuple[float, float, float, float, int]] = []
    try:
        batch_id = 0
        for records in load.initial():
            app.run(records_table(records), batch_id)
            batch_id += 1
        views.append(ViewReg("order_view", SQL, tuple(t.qualified for t in TABLES)))
        t0, c0 = time.monotonic(), time.process_time()
        out = app.run(records_table(load.batch(per_batch)), batch_id)
        build = (out.views["order_view"][2], view_cpu[-1], out.views["order_view"][1])
        say(f"built the view whole: {build[0]:.2f} s, {build[1]:.2f} CPU s, {build[2]} rows")
        for _ in range(batches):
            batch_id += 1
            t0, c0 = time.monotonic(), time.process_time()
            out = app.run(records_table(load.batch(per_batch)), batch_id)
            wall, cpu = time.monotonic() - t0, time.process_time() - c0
            keys, _, view_s = out.views["order_view"]
            rows.append((wall - view_s, cpu - view_cpu[-1], view_s, view_cpu[-1], keys))
            say(f"batch {batch_id}: base {wall - view_s:.2f} s, view {view_s:.2f} s ({keys} keys)")
    finally:
        app.close(close_sinks=True, timeout=120)
        shutil.rmtree(state, ignore_errors=True)
    med = [statistics.median(r[i] for r in rows) for i in range(5)]
    return "\n".join(
        [
            "# Views from joins: maintenance against the single-table apply",
            "",
            f"`python -m bench views`: orders {orders:,} rows (driving), customers {customers:,}, regions 50; "
            f"{batches} batches of {per_batch:,} changes (80 % orders, 18 % customers, 2 % regions), "
            "BatchApplier with the Delta warehouse sink, no JVM. Medians per batch; the base is the "
            f"warehouse sink applying the batch to the three tables (the peer). Load average {loadavg()} "
            "(other work on the machine: wall times are noisy, CPU seconds less so).",
            "",
            "| | wall s | CPU s |",
            "| --- | --- | --- |",
            f"| base tables (single-table apply) | {med[0]:.2f} | {med[1]:.2f} |",
            f"| the view (affected keys: median {med[4]:,.0f}) | {med[2]:.2f} | {med[3]:.2f} |",
            f"| view / base | {med[2] / med[0]:.2f} | {med[3] / med[1]:.2f} |",
            "",
            f"The first build, whole from {build[2]:,} rows: {build[0]:.2f} s, {build[1]:.2f} CPU s.",
            "",
            "Each batch reads the used columns of the view's tables whole (docs/views.md, \"Costs and "
            "limits\"): the view's cost grows with the tables, not with the batch.",
        ]
    )
