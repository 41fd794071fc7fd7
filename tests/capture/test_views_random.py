"""Views from joins under random changes and crashes, end to end: the real reader (``cdc run``) and the
real apply (``cdc apply``, Spark, its work in tasks) run continuously while a seeded workload makes
random inserts, updates, deletes and primary-key changes on the three joined tables (orders ->
customers -> regions, many-to-one, an inner and a left join, filters, renames), with quotes,
newlines, backslashes and a few ~1 MB values. The apply is killed twice while batches flow: once by
its fault point ``apply.after_sink`` (a sink wrote the batch, the driver dies before its commit: the
batch is replayed), once by ``kill -9`` of its process group at a seeded moment. Once the apply is
caught up (``cdc wait``), every view (``cdc sql``) equals its SQL run on the source, row for row.

No crash is hidden: an apply job that stops on its own fails the test, as does a Traceback in a log
(the reader's, an apply job's) that no fault explains; the one exception is a job that stopped on
Spark's "Python worker failed to connect back" (a loaded machine's, not cdc's), which is started
again, counted and reported.

``CDC_TEST_VIEWS_SEED=N`` replays a run (its seed is in the test's failure message)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
import uuid
from collections import Counter
from typing import Any

import orjson
import psycopg

from tests.plugins.apply import processes_with_env
from tests.plugins.capture import CaptureEnv, SourceLoad, wait_streaming
from tests.plugins.postgres import wait_for

VIEWS = {
    "order_view": (
        "SELECT o.id, o.total, o.note, c.name AS customer, c.id AS cid, r.label AS region "
        "FROM orders o JOIN customers c ON o.customer_id = c.id LEFT JOIN regions r ON c.region = r.code "
        "WHERE o.total > 10 AND c.name <> 'hidden'"
    ),
    "customer_view": (
        "SELECT c.id AS customer_id, c.name, c.note, r.code, r.label AS where_ FROM customers c "
        "LEFT JOIN regions r ON c.region = r.code WHERE c.id > 3"
    ),
}
UGLY = ("it's", 'say "hi"', "back\\slash", "new\nline", "tab\there", "", "ünï", "hidden", "'; --")
#: the one error after which an apply job that stopped on its own is started again, matched by its
#: exact message: Spark's, when a Python worker it started did not connect back in time (a loaded
#: machine's, not cdc's); the job then exits 1, as on any failed micro-batch
INFRA_ERROR = "Python worker failed to connect back."
RESTARTS = 3  # restarts after INFRA_ERROR, at most
#: what the apply writes as its fault point ``apply.after_sink`` fires (then kill -9 of its processes)
FAULT_LINE = "cdc-fault: apply.after_sink"
BIG_VALUES = 4  # ~1 MB text values written over the run


def _text(rng: random.Random) -> str:
    return f"{rng.choice(UGLY)} {rng.randrange(1000)} {rng.choice(UGLY)}"


class _Workload(SourceLoad):
    """Random transactions on the three tables (1-4 changes each), on its own seeded generator; keys
    of new rows and of key changes come from a counter, so no change collides."""

    def __init__(self, env: CaptureEnv, seed: int) -> None:
        super().__init__(env)
        self.rng = random.Random(seed)
        self.keys: dict[str, list[Any]] = {
            "regions": [f"r{i}" for i in range(4)],
            "customers": list(range(1, 31)),
            "orders": list(range(1, 201)),
        }
        self.next_id = 1000
        self.big = 0
        self.tx = 0

    def _new_key(self, table: str) -> Any:
        self.next_id += 1
        return f"r{self.next_id}" if table == "regions" else self.next_id

    def _ref(self, table: str) -> Any:
        """A key of ``table`` that exists, mostly; sometimes one that does not (a dangling reference),
        or NULL."""
        if self.rng.random() < 0.03:
            return None
        if self.rng.random() < 0.1 or not self.keys[table]:
            return self._new_key(table) if table != "regions" else f"r{self.rng.randrange(10)}"
        return self.rng.choice(self.keys[table])

    def _value(self) -> str | None:
        if self.big < BIG_VALUES and self.tx >= 10 + 40 * self.big:  # every 40 transactions
            self.big += 1
            return (_text(self.rng) + "\n") * (1_000_000 // 20)
        return None if self.rng.random() < 0.1 else _text(self.rng)

    def _row(self, table: str, key: Any) -> tuple[str, tuple[Any, ...]]:
        rng = self.rng
        if table == "regions":
            return "INSERT INTO regions VALUES (%s, %s)", (key, self._value())
        if table == "customers":
            name = rng.choice(["ann", "bob", "hidden", None, _text(rng)])
            return "INSERT INTO customers VALUES (%s, %s, %s, %s)", (
                key,
                name,
                self._ref("regions"),
                self._value(),
            )
        return "INSERT INTO orders VALUES (%s, %s, %s, %s)", (
            key,
            self._ref("customers"),
            rng.choice([None, *range(0, 40, 3)]),
            self._value(),
        )

    def _update(self, table: str, key: Any) -> tuple[str, tuple[Any, ...]]:
        column, value = {
            "regions": lambda: ("label", self._value()),
            "customers": lambda: self.rng.choice(
                [
                    ("name", self.rng.choice(["ann", "hidden", None, _text(self.rng)])),
                    ("region", self._ref("regions")),
                    ("note", self._value()),
                ]
            ),
            "orders": lambda: self.rng.choice(
                [
                    ("customer_id", self._ref("customers")),
                    ("total", self.rng.randrange(40)),
                    ("note", self._value()),
                ]
            ),
        }[table]()
        pk = "code" if table == "regions" else "id"
        return f"UPDATE {table} SET {column} = %s WHERE {pk} = %s", (value, key)

    def change(self, conn: psycopg.Connection[Any]) -> None:
        """One random change (its effect on :attr:`keys` applied once the transaction commits)."""
        table = self.rng.choice(["regions", "customers", "customers", "orders", "orders", "orders"])
        pk = "code" if table == "regions" else "id"
        keys = self.keys[table]
        op = self.rng.choices(["insert", "update", "delete", "key"], [3, 5, 2, 1])[0]
        if op == "insert" or not keys:
            key = self._new_key(table)
            conn.execute(*self._row(table, key))
            keys.append(key)
        elif op == "update":
            conn.execute(*self._update(table, self.rng.choice(keys)))
        elif op == "delete":
            key = keys.pop(self.rng.randrange(len(keys)))
            conn.execute(f"DELETE FROM {table} WHERE {pk} = %s", (key,))
        else:
            i = self.rng.randrange(len(keys))
            new = self._new_key(table)
            conn.execute(f"UPDATE {table} SET {pk} = %s WHERE {pk} = %s", (new, keys[i]))
            keys[i] = new

    def loop(self, conn: psycopg.Connection[Any]) -> None:
        while not self.stop.is_set():
            with conn.transaction():
                for _ in range(self.rng.randint(1, 4)):
                    self.change(conn)
            self.tx += 1
            time.sleep(0.2)  # the workload's pace: it writes on, slowly, while the apply restarts


def _setup(env: CaptureEnv) -> None:
    env.sql(
        "CREATE TABLE regions (code text PRIMARY KEY, label text);"
        "CREATE TABLE customers (id int PRIMARY KEY, name text, region text, note text);"
        "CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total int, note text);"
        "INSERT INTO regions SELECT 'r' || g, 'region ''' || g || E'\\n' FROM generate_series(0, 3) g;"
        "INSERT INTO customers SELECT g, (ARRAY['ann', 'bob', 'hidden', NULL])[g % 4 + 1],"
        " 'r' || (g % 6), 'note \"' || g FROM generate_series(1, 30) g;"
        "INSERT INTO orders SELECT g, g % 33, g % 40, E'it''s\\\\ \\n' || g FROM generate_series(1, 200) g"
    )
    for table in ("regions", "customers", "orders"):
        env.add_table(f"public.{table}")
    for name, sql in VIEWS.items():
        res = env.cdc("views", "add", name, "--sql", sql)
        assert res.returncode == 0, res.stderr


class _Apply:
    """`cdc apply` running continuously, in a process group of its own; the fault point
    ``apply.after_sink`` armed by a file. Every process it starts carries :attr:`marker`.

    Strict: a job that stops on its own fails the test (:meth:`batches`), unless it stopped on
    :data:`INFRA_ERROR` (then it is started again, and reported: :attr:`restarts`); a job's log holds
    no Traceback up to the moment a fault ended it (the fault point's kill, the test's kill -9), nor,
    for the job running at the end, at all."""

    def __init__(self, env: CaptureEnv) -> None:
        self.env = env
        self.arm = env.state.parent / "arm-after-sink"
        self.marker = f"CDC_TEST_RUN={uuid.uuid4().hex}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = -1
        self.jobs = 0
        self.armed = False  # the fault point is armed for the running job: its kill -9 is the fault's
        #: the end of the log of each job that stopped on INFRA_ERROR and was started again
        self.restarts: list[str] = []

    def start(self) -> None:
        name, _, value = self.marker.partition("=")
        self.proc = self.env.spawn(
            "apply",
            "--trigger-interval",
            "0.3",
            "--max-records-per-batch",
            "1000",
            extra_env={"CDC_FAULTS": f"apply.after_sink:@{self.arm}", name: value},
            group=True,
        )
        self.log = len(self.env.procs) - 1
        self.jobs += 1
        self.armed = self.arm.exists()  # the file arms whichever job runs while it exists

    def arm_fault(self) -> None:
        """Arm ``apply.after_sink`` for the running job: it fires at the job's next batch."""
        self.armed = True
        self.arm.touch()

    def summary(self) -> str:
        return f"{self.jobs} apply jobs, {len(self.restarts)} started again after {INFRA_ERROR!r}"

    def no_traceback(self, text: str, when: str) -> None:
        """``text``, the log of the running job up to ``when``, holds no Traceback: no fault explains one."""
        at = text.find("Traceback")
        assert at < 0, (
            f"a Traceback no fault explains in the log of apply job #{self.jobs} ({when}); "
            f"{self.summary()}:\n{text[max(at - 500, 0) : at + 2500]}"
        )

    def batches(self) -> int:
        """Micro-batches the running job applied. A job that stopped on its own fails the test, unless
        it exited 1 with :data:`INFRA_ERROR` in its log: it is then started again, as its supervisor
        would, at most :data:`RESTARTS` times, and reported (printed, and in :meth:`summary`). The
        exit of a job the armed fault point killed is the fault's."""
        assert self.proc is not None
        text = self.env.proc_log(self.log)
        code = self.proc.poll()
        if code is None or (self.armed and code == -signal.SIGKILL and FAULT_LINE in text):
            return text.count("\nbatch ") + text.startswith("batch ")
        tail = text[-3000:]
        assert code == 1 and INFRA_ERROR in text, (
            f"apply job #{self.jobs} stopped on its own (exit {code}): no fault explains it, and not on "
            f"{INFRA_ERROR!r}; {self.summary()}; the end of its log:\n{tail}"
        )
        self.restarts.append(tail)
        print(f"apply job #{self.jobs} stopped on {INFRA_ERROR!r} (exit 1): started again; {self.summary()}")
        assert len(self.restarts) <= RESTARTS, f"{self.summary()}: more than {RESTARTS}: {self.restarts}"
        self.gone()
        self.start()
        return 0

    def fault_fired(self) -> None:
        """The armed fault point ended the job (kill -9, after its line), with no Traceback before it;
        then until the job is gone."""
        self.gone()
        text = self.env.proc_log(self.log)
        assert self.proc is not None and self.proc.returncode == -signal.SIGKILL and FAULT_LINE in text, (
            f"apply job #{self.jobs}: exit {self.proc and self.proc.returncode}, not the fault's:\n{text[-3000:]}"
        )
        self.no_traceback(text.split(FAULT_LINE, 1)[0], "before the fault point fired")

    def gone(self) -> None:
        """Until the job and every process it started (the JVM, its Python workers) are gone: one
        JVM at a time."""
        assert self.proc is not None
        self.proc.wait(timeout=120)
        wait_for(lambda: not processes_with_env(self.marker), timeout=120, what="the apply's JVM to exit")

    def kill(self) -> None:
        """kill -9 of the running job's process group, the test's fault: a job that stopped on its
        own before it is told apart first (:meth:`batches`); its log up to the kill holds no Traceback."""
        self.batches()
        self.no_traceback(self.env.proc_log(self.log), "before the test's kill -9")
        self.stop()

    def stop(self) -> None:
        """kill -9 of the job's process group if it runs, then until it is gone (no check: teardown)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.gone()


def _rows(pairs: list[tuple[Any, ...]]) -> Counter[tuple[Any, ...]]:
    return Counter(pairs)


def _compare(env: CaptureEnv, seed: int, jobs: str) -> None:
    for name, sql in VIEWS.items():
        with psycopg.connect(env.dsn) as conn:
            cur = conn.execute(sql)
            columns = [d.name for d in cur.description or ()]
            source = _rows(cur.fetchall())
        res = env.cdc("sql", f"SELECT * FROM {name}", "--json", timeout=300)
        assert res.returncode == 0, res.stderr
        view = _rows([tuple(r[c] for c in columns) for r in orjson.loads(res.stdout)])
        missing, extra = source - view, view - source
        assert not missing and not extra, (
            f"seed {seed} ({jobs}): view {name} differs from its SQL on the source: "
            f"missing {[str(r)[:300] for r in missing][:5]}, extra {[str(r)[:300] for r in extra][:5]}"
        )
        assert sum(source.values()) > 10, (name, source)


def test_views_equal_the_source_after_random_changes_and_kills(env: CaptureEnv, jvm: None) -> None:
    seed = int(os.environ.get("CDC_TEST_VIEWS_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    print(f"CDC_TEST_VIEWS_SEED={seed}")  # shown with a failure: the run's seed
    _setup(env)
    reader = env.spawn("run")
    wait_streaming(env, reader)
    apply = _Apply(env)
    try:
        with _Workload(env, seed) as load:
            apply.start()
            # 1. the replay: the fault fires at the batch after it is armed (tasks applied it, the
            # search shards committed it, the driver dies before its Delta commit)
            first = rng.randint(1, 2)
            wait_for(lambda: apply.batches() >= first, timeout=600, what=f"batch {first} of the apply")
            apply.arm_fault()
            wait_for(
                lambda: apply.batches() >= 0 and not apply.arm.exists(),
                timeout=600,
                what="apply.after_sink to fire",
            )
            apply.fault_fired()
            apply.start()
            # 2. kill -9 of the apply's process group at a seeded moment while batches flow
            second = rng.randint(1, 2)
            wait_for(lambda: apply.batches() >= second, timeout=600, what=f"batch {second} of the restart")
            time.sleep(rng.uniform(0, 3))  # the moment of the fault within the batches, seeded
            apply.kill()
            apply.start()
            wait_for(lambda: apply.batches() >= 1, timeout=600, what="a batch after the kill -9")
            assert load.tx > 50 and load.big > 0, (load.tx, load.big)
        assert reader.poll() is None, env.proc_log(0)
        assert "Traceback" not in env.proc_log(0), env.proc_log(0)[-5000:]  # no fault touched the reader
        lsn = env.fetch("SELECT pg_current_wal_lsn()::text")[0][0]
        wait_for(  # every view is maintained before the batch's positions commit: caught up
            lambda: (
                apply.batches() >= 0 and env.cdc("wait", "--lsn", str(lsn), "--timeout", "30").returncode == 0
            ),
            timeout=900,
            interval=1,
            what=f"the apply to catch up (seed {seed}; `cdc wait` exits 0)",
        )
        _compare(env, seed, apply.summary())
        apply.batches()  # the last job still runs ...
        apply.no_traceback(env.proc_log(apply.log), "at the end of the test")  # ... and crashed nowhere
        print(apply.summary())  # the restarts after INFRA_ERROR, reported
    finally:
        apply.stop()
