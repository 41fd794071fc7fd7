"""A primary failover under load through the real reader (``cdc run``, decoder pgoutput) on two
PostgreSQL 18 clusters (tests/plugins/failover.py): with a failover slot the reader reconnects
through the two-host DSN to the promoted standby and goes on from the synced slot, losing nothing
(the load's own ledger, the source's rows, ``cdc verify`` after the apply); without one
(``slot_lost = "resnapshot"``) it finds its slot gone, creates a new one and snapshots every table
again, and rows deleted while no slot existed leave the warehouse and the index.

The primary commits synchronously to the standby (``synchronous_standby_names``), so a commit the
load saw acknowledged is on the standby when the primary stops: what the ledger holds is what the
promoted standby holds. A change whose commit the stop cut off is settled from the new primary.
"""

from __future__ import annotations

import random
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from cdc.events import TRUNCATE_KEY_FIELD
from cdc.registry import State
from tests.plugins.apply import apply_once, warehouse_rows
from tests.plugins.capture import CaptureEnv, materialize, rows_of, wait_caught_up, wait_streaming
from tests.plugins.failover import FailoverPair, pair_env
from tests.plugins.postgres import wait_for

pytestmark = pytest.mark.slow  # postgres, pg18 and spark come from the fixtures

#: the changes' ugly text: quotes, a newline, a tab, backslashes
UGLY = "'q' \"dq\" back\\slash\\\\ new\nline\ttab"
#: a column stored out of line (SET STORAGE EXTERNAL) and incompressible
BIG_HEX = 3000


class LedgerLoad:
    """Single-row changes (insert, update, delete) to ``docs`` (an out-of-line TOASTed column) and
    ``parts`` (partitioned) through the two-host DSN on a thread, until stopped. Every change whose
    commit the server acknowledged goes into :attr:`ledger` (``(table, id)`` to the row's columns,
    None once deleted); one whose commit a lost connection cut off is settled, after reconnecting,
    from the new primary's row. It reconnects after a lost primary and counts the changes committed
    after :attr:`promoted` is set."""

    def __init__(self, dsn: str, first_id: int = 1000) -> None:
        self.dsn = dsn
        self.rng = random.Random(18)
        self.ledger: dict[tuple[str, int], dict[str, Any] | None] = {}
        self.live: dict[str, list[int]] = {"docs": [], "parts": []}
        self.next_id = first_id
        self.committed = 0
        self.after_promotion = 0
        self.reconnects = 0
        self.promoted = threading.Event()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._pending: tuple[str, int] | None = None
        self.thread = threading.Thread(target=self._run, name="ledger-load", daemon=True)

    def seed(self, table: str, ids: list[int], rows: dict[int, dict[str, Any]]) -> None:
        self.live[table].extend(ids)
        self.ledger.update({(table, i): rows[i] for i in ids})

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self.stop.is_set():
                try:
                    if conn is None:
                        conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=3)
                        self._settle(conn)
                    self._one(conn)
                except psycopg.OperationalError:
                    if conn is not None:
                        conn.close()
                    conn, self.reconnects = None, self.reconnects + 1
                    self.stop.wait(0.1)
                else:
                    self.stop.wait(0.003)
        except BaseException as exc:
            self.errors.append(exc)
        finally:
            if conn is not None:
                conn.close()

    def _settle(self, conn: psycopg.Connection[Any]) -> None:
        """The change whose commit was cut off: what the new primary has decides."""
        if self._pending is None:
            return
        table, key = self._pending
        cols = "body, big" if table == "docs" else "v"
        row = conn.execute(f"SELECT {cols} FROM {table} WHERE id = %s", [key]).fetchone()
        self.ledger[(table, key)] = dict(zip(cols.split(", "), row, strict=True)) if row else None
        ids = self.live[table]
        if row is None and key in ids:
            ids.remove(key)
        elif row is not None and key not in ids:
            ids.append(key)
        self._pending = None

    def _one(self, conn: psycopg.Connection[Any]) -> None:
        table = self.rng.choice(("docs", "parts"))
        ids, r = self.live[table], self.rng.random()
        n = self.next_id
        if len(ids) < 20 or r < 0.4:
            key = n if table == "docs" or n % 2 else 100_000 + n  # parts: both partitions
            self.next_id += 1
            row: dict[str, Any] | None = (
                {"body": f"{table} {n} {UGLY}", "big": secrets.token_hex(BIG_HEX)}
                if table == "docs"
                else {"v": f"{table} {n} {UGLY}"}
            )
            assert row is not None
            query = (
                "INSERT INTO docs (id, body, big) VALUES (%s, %s, %s)"
                if table == "docs"
                else "INSERT INTO parts (id, v) VALUES (%s, %s)"
            )
            params: list[Any] = [key, *row.values()]
        elif r < 0.8:
            key = self.rng.choice(ids)
            col = "body" if table == "docs" else "v"
            row = {**(self.ledger[(table, key)] or {}), col: f"{table} {key} updated {n} {UGLY}"}
            self.next_id += 1
            query = f"UPDATE {table} SET {col} = %s WHERE id = %s"  # docs: big unchanged (TOAST)
            params = [row[col], key]
        else:
            key, row = self.rng.choice(ids), None
            query, params = f"DELETE FROM {table} WHERE id = %s", [key]
        self._pending = (table, key)
        conn.execute(query, params)  # autocommit: returns once the commit is acknowledged
        self._pending = None
        self.ledger[(table, key)] = row
        if row is None:
            ids.remove(key)
        elif key not in ids:
            ids.append(key)
        self.committed += 1
        self.after_promotion += self.promoted.is_set()

    def __enter__(self) -> LedgerLoad:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive() and not self.errors, self.errors


@pytest.fixture
def pair(pg18_pair: Callable[..., FailoverPair], request: pytest.FixtureRequest) -> FailoverPair:
    """The pair of the test (an indirect parameter: :func:`start_pair`'s options); the primary
    commits synchronously to its standby."""
    made = pg18_pair(**getattr(request, "param", {}))
    made.primary.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
    made.primary.execute("SELECT pg_reload_conf()")
    return made


@pytest.fixture
def fenv(pair: FailoverPair, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[CaptureEnv]:
    marker = request.node.get_closest_marker("cdc_config")
    yield from pair_env(
        pair, tmp_path, request, 'decoder = "pgoutput"\n' + (marker.args[0] if marker else "")
    )


def create_tables(env: CaptureEnv, seed: int = 30) -> dict[str, dict[int, dict[str, Any]]]:
    """``docs`` (``big`` out of line) and ``parts`` (partitioned on id), ``seed`` rows each; the
    seeded rows by table and id."""
    env.sql("CREATE TABLE docs (id int PRIMARY KEY, body text, big text)")
    env.sql("ALTER TABLE docs ALTER COLUMN big SET STORAGE EXTERNAL")
    env.sql("CREATE TABLE parts (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
    env.sql("CREATE TABLE parts_lo PARTITION OF parts FOR VALUES FROM (MINVALUE) TO (100000)")
    env.sql("CREATE TABLE parts_hi PARTITION OF parts FOR VALUES FROM (100000) TO (MAXVALUE)")
    rows: dict[str, dict[int, dict[str, Any]]] = {"docs": {}, "parts": {}}
    for i in range(1, seed + 1):
        rows["docs"][i] = {"body": f"seed {i} {UGLY}", "big": secrets.token_hex(BIG_HEX)}
        rows["parts"][i * 7919] = {"v": f"seed {i} {UGLY}"}
    with psycopg.connect(env.dsn, autocommit=True) as conn, conn.transaction():
        for i, row in rows["docs"].items():
            conn.execute("INSERT INTO docs VALUES (%s, %s, %s)", [i, row["body"], row["big"]])
        for i, row in rows["parts"].items():
            conn.execute("INSERT INTO parts VALUES (%s, %s)", [i, row["v"]])
    return rows


def topic_rows(env: CaptureEnv, table: str) -> dict[str, Any]:
    return materialize(env.records(env.reg("public", table).topic))


def has_key(env: CaptureEnv, table: str, key: int) -> bool:
    want = orjson.dumps({"id": key})
    try:
        return any(r.key == want for r in env.records(env.reg("public", table).topic))
    except Exception:  # the topic is being created
        return False


def stop_reader(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


@pytest.mark.timeout(600)
def test_failover_slot_capture_goes_on_and_loses_nothing(
    pair: FailoverPair, fenv: CaptureEnv, spark: Any
) -> None:
    env = fenv
    seeded = create_tables(env)
    env.add_table("public.docs")
    env.add_table("public.parts")
    proc = env.spawn("run")
    wait_streaming(env, proc)
    with LedgerLoad(env.dsn) as load:
        for table, rows in seeded.items():
            load.seed(table, list(rows), rows)
        wait_for(lambda: load.committed >= 100, timeout=60, what="the load's first changes")
        pair.wait_synced(env.slot, advance=False)
        before = load.committed
        wait_for(lambda: load.committed >= before + 100, timeout=60, what="changes after the sync")

        stopped = time.monotonic()
        pair.stop_primary("immediate")
        # the failover's window: the reader finds only the standby, not yet what the DSN's
        # target_session_attrs=primary asks for, and retries (a race once made it exit 2 here)
        wait_for(lambda: "a failover in progress" in env.proc_log(), what="a retry before the promotion")
        pair.promote()
        load.promoted.set()
        env.sql("INSERT INTO docs VALUES (-1, %s, 'marker')", [f"after the promotion {UGLY}"])
        wait_for(lambda: has_key(env, "docs", -1), timeout=60, interval=0.05, what="the marker in the topic")
        resumed_s = time.monotonic() - stopped
        wait_for(lambda: load.after_promotion >= 200, timeout=60, what="the load on the new primary")
    print(
        f"\nfailover: {load.committed} changes ({load.after_promotion} after the promotion, "
        f"{load.reconnects} reconnects); capture resumed {resumed_s:.2f} s after the primary stopped"
    )

    # one process all along, now streaming from the promoted standby
    assert proc.poll() is None, env.proc_log()
    assert len(env.procs) == 1
    wait_caught_up(env, pg=pair.standby)
    assert pair.standby.fetch(
        f"SELECT active, failover FROM pg_replication_slots WHERE slot_name = '{env.slot}'"
    ) == [(True, True)]
    assert "retry" in env.proc_log(), env.proc_log()[-3000:]
    with env.registry() as registry:
        assert registry.get_state(State.SLOT_DROPPED) is None

    for table in ("docs", "parts"):
        got, src = topic_rows(env, table), rows_of(env, table)
        assert got == src, f"{table}: the topic differs from the source"
        lost = {
            key: want
            for (t, key), want in load.ledger.items()
            if t == table
            and got.get(orjson.dumps({"id": key}).decode(), {}) != ({"id": key, **want} if want else {})
        }
        assert not lost, f"{table}: {len(lost)} ledger changes lost: {sorted(lost)[:10]}"
    assert has_key(env, "docs", -1)

    stop_reader(proc)
    summary = apply_once(spark, env)
    assert summary.dead_letters == 0
    for table in ("docs", "parts"):
        wh = warehouse_rows(env, env.reg("public", table))
        assert {orjson.dumps({"id": k}).decode(): row for k, row in wh.items()} == rows_of(env, table)
    code, report = env.verify()
    assert code == 0, report
    assert {t["table"]: t["status"] for t in report} == {"public.docs": "ok", "public.parts": "ok"}, report


def slot_dropped(env: CaptureEnv) -> dict[str, Any]:
    """The registry's record of the lost slot's recovery (``{}`` before one)."""
    with env.registry() as registry:
        raw = registry.get_state(State.SLOT_DROPPED)
    return dict(orjson.loads(raw)) if raw else {}


def table_states(env: CaptureEnv) -> dict[str, str | None]:
    with env.registry() as registry:
        return {r.qualified: r.snapshot_state for r in registry.list_tables()}


def create_items(env: CaptureEnv, count: int = 40) -> None:
    """``items``, searched on ``name``: each name a word of its own (``itemN``) and ugly text."""
    env.sql("CREATE TABLE items (id int PRIMARY KEY, name text, note text)")
    env.sql(
        "INSERT INTO items SELECT i, 'item' || i || ' ' || %s, 'note ' || i FROM generate_series(1, %s) i",
        [UGLY, count],
    )


@pytest.mark.parametrize(
    "pair", [{"standby_settings": {"sync_replication_slots": "off"}}], indirect=True, ids=["no-slot-sync"]
)
@pytest.mark.cdc_config('slot_lost = "resnapshot"\n[snapshot]\nchunk_size = 7\n')
@pytest.mark.timeout(600)
def test_without_failover_slot_the_reader_resnapshots_and_deletes_go(
    pair: FailoverPair, fenv: CaptureEnv, spark: Any
) -> None:
    """A standby not set up for failover (no ``sync_replication_slots``) has no copy of the slot:
    after the failover the reader finds it gone, creates a new slot and snapshots every table again
    in chunks, each ending with a TRUNCATE marker, so rows deleted while no slot existed (on the old
    primary after the reader stopped reading, and on the new one before its new slot) leave the
    warehouse and the index; ``cdc status`` says what happened and what it cost."""
    env = fenv
    create_items(env)
    create_tables(env, seed=20)
    env.add_table("public.items", "--search", "name")
    env.add_table("public.parts")
    proc = env.spawn("run")
    wait_streaming(env, proc)
    env.sql("UPDATE items SET name = name || ' streamed' WHERE id <= 5")
    env.sql("DELETE FROM items WHERE id BETWEEN 6 AND 8")
    wait_for(
        lambda: has_key(env, "items", 8) and len(topic_rows(env, "items")) == 37, what="the streamed changes"
    )
    pair.wait_replayed()
    assert pair.standby_slot(env.slot) is None  # nothing to fail over to

    # the reader stands still while the primary changes, goes away and the standby takes over
    proc.send_signal(signal.SIGSTOP)
    try:
        env.sql("DELETE FROM items WHERE id BETWEEN 10 AND 14")
        env.sql("DELETE FROM parts WHERE id IN (7919, 15838)")
        env.sql("UPDATE items SET name = 'item15 changed before the stop' WHERE id = 15")
        pair.stop_primary("immediate")
        pair.promote()
        env.sql("DELETE FROM items WHERE id BETWEEN 20 AND 24")
        env.sql("DELETE FROM parts WHERE id = 23757")
        env.sql("INSERT INTO items VALUES (100, %s, 'new primary')", [f"item100 {UGLY}"])
    finally:
        proc.send_signal(signal.SIGCONT)
    gone = {*range(6, 9), *range(10, 15), *range(20, 25)}

    # the slot-drop record's reread_done_at first: the tables' states read alone may still be the
    # old "done" of the lost slot while the new one is being created (and already active)
    wait_for(
        lambda: (
            "reread_done_at" in slot_dropped(env)
            and set(table_states(env).values()) == {"done"}
            and pair.standby.fetch(f"SELECT active FROM pg_replication_slots WHERE slot_name = '{env.slot}'")
            == [(True,)]
        ),
        timeout=90,
        what="the new slot and every table snapshotted again",
    )
    env.sql("DELETE FROM items WHERE id = 30")  # streamed from the new slot
    wait_caught_up(env, pg=pair.standby)
    assert proc.poll() is None, env.proc_log()
    for table in ("items", "parts"):
        records = env.records(env.reg("public", table).topic)
        assert any(TRUNCATE_KEY_FIELD in orjson.loads(r.key) for r in records), f"{table}: no TRUNCATE marker"
        assert materialize(records) == rows_of(env, table), f"{table}: the topic differs from the source"

    res = env.cdc("status", "--json")
    report = orjson.loads(res.stdout)
    (slot_stage,) = [s for s in report["stages"] if s["stage"] == "slot"]
    dropped = slot_stage["dropped"]
    assert dropped == report["slot_drop"]
    assert "does not exist" in dropped["reason"] and "resnapshot" in dropped["reason"], dropped
    assert sorted(dropped["tables"]) == ["public.items", "public.parts"]
    items_n, parts_n = (env.fetch(f"SELECT count(*) FROM {t}")[0][0] for t in ("items", "parts"))
    # the re-read counts the rows each table's chunks emitted: id 30, deleted only once every table
    # was read again (reread_done_at), was among them (27 was seen when the wait passed early)
    reread = dropped["reread"]
    assert reread["public.items"] == items_n + 1 and reread["public.parts"] == parts_n, dropped
    assert dropped["reread_rows"] == sum(reread.values()) and dropped["reread_done_at"], dropped
    assert slot_stage["verdict"] == "OK" and "re-read" in slot_stage["reason"], slot_stage

    stop_reader(proc)
    summary = apply_once(spark, env)
    assert summary.dead_letters == 0
    wh = warehouse_rows(env, env.reg("public", "items"))
    assert set(wh) == {r[0] for r in env.fetch("SELECT id FROM items")} and not gone & set(wh)
    for word in ("item12", "item22", "item30"):
        hits = env.cdc("search", "public.items", word, "--json")
        assert hits.returncode == 0 and word not in hits.stdout, hits.stdout
    assert "item100" in env.cdc("search", "public.items", "item100", "--json").stdout
    code, verified = env.verify()
    assert code == 0, verified
    assert {t["table"]: t["status"] for t in verified} == {"public.items": "ok", "public.parts": "ok"}, (
        verified
    )
