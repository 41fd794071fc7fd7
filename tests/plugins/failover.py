"""Two PostgreSQL 18 clusters, a primary and its physical standby, set up for failover slots: the
harness of the failover tests (``pg18_pair`` fixture: a factory of :class:`FailoverPair`).

The standby is a ``pg_basebackup -R`` of the primary through a physical slot (:data:`STANDBY_SLOT`),
with ``sync_replication_slots``, ``hot_standby_feedback``, ``primary_slot_name`` and a ``dbname`` in
``primary_conninfo``; the primary lists that slot in ``synchronized_standby_slots``, so no logical
consumer gets ahead of the standby. Each of those can be left out (``standby_settings`` overrides,
``synchronized=False``) for the tests of what ``cdc check`` says about a pair set up wrong. The pair
can lose its primary (:meth:`FailoverPair.stop_primary`) and promote the standby
(:meth:`FailoverPair.promote`); :meth:`FailoverPair.dsn` names both hosts as an application that
follows the primary does (``target_session_attrs=primary``).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from psycopg import sql

from cdc.devcluster import (
    PgCluster,
    as_postgres_user,
    cluster_conf,
    embedded_pg_bin,
    free_port,
    own_dirs,
    start_cluster,
)
from tests.plugins.capture import CaptureEnv, make_env
from tests.plugins.postgres import wait_for

__all__ = ["STANDBY_SLOT", "FailoverPair", "pair_env", "pg18_pair", "start_pair"]

#: the primary's physical slot that the standby streams from
STANDBY_SLOT = "cdc_standby"
#: what a standby needs for failover slots (PostgreSQL 17+); primary_slot_name comes from -R -S
STANDBY_SETTINGS = {"sync_replication_slots": "on", "hot_standby_feedback": "on"}


@dataclass
class FailoverPair:
    primary: PgCluster
    standby: PgCluster
    base: Path

    def dsn(self, dbname: str = "postgres", attrs: str = "primary") -> str:
        """Both hosts, the primary first, and ``target_session_attrs``: what a client that follows
        a failover is given."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} dbname={dbname} "
            f"user=postgres target_session_attrs={attrs}"
        )

    def wait_replayed(self, timeout: float = 30.0) -> None:
        """Until the standby has replayed all WAL the primary has written now."""
        target = str(self.primary.fetch("SELECT pg_current_wal_lsn()::text")[0][0])
        query = sql.SQL("SELECT pg_last_wal_replay_lsn() >= {}::pg_lsn").format(sql.Literal(target))
        wait_for(lambda: self.standby.fetch(query)[0][0], timeout=timeout, what=f"standby replay to {target}")

    def standby_slot(self, slot: str) -> tuple[bool, bool] | None:
        """``(synced, temporary)`` of the standby's copy of ``slot``; None when it has none."""
        rows = self.standby.fetch(
            sql.SQL("SELECT synced, temporary FROM pg_replication_slots WHERE slot_name = {}").format(
                sql.Literal(slot)
            )
        )
        return (bool(rows[0][0]), bool(rows[0][1])) if rows else None

    def wait_synced(
        self, slot: str, *, advance: bool = True, by_hand: bool = False, timeout: float = 60.0
    ) -> float:
        """Until the standby's copy of ``slot`` is ``synced AND NOT temporary`` (failover-ready);
        returns the seconds it took.

        The standby keeps its copy temporary until the primary's slot has moved past the WAL and
        catalog xmin the copy could reserve ("could not synchronize replication slot ... could
        lead to data loss" in its log). The slot's catalog xmin moves only at a running-xacts
        record, which the primary writes every 15 s by itself, and the slot-sync worker naps up to
        30 s when nothing changes: with a consumer confirming every 0.5 s and no help, the copy
        was ready after 26 s. So each round writes a running-xacts record, wakes the worker (a
        reload sets its latch) and, with ``advance`` (no consumer of its own on the slot), moves
        the primary's slot to the current WAL position, as a consumer confirming it would.
        ``by_hand``: the standby's ``sync_replication_slots`` is off (no worker): each round syncs
        its slots once with ``pg_sync_replication_slots()`` instead."""

        def ready() -> bool:
            if self.standby_slot(slot) == (True, False):
                return True
            self.primary.execute("SELECT pg_log_standby_snapshot()")
            if advance:
                self.primary.execute(
                    sql.SQL("SELECT pg_replication_slot_advance({}, pg_current_wal_lsn())").format(
                        sql.Literal(slot)
                    )
                )
            self.wait_replayed()
            self.standby.execute(
                "SELECT pg_sync_replication_slots()" if by_hand else "SELECT pg_reload_conf()"
            )
            return False

        start = time.monotonic()
        wait_for(
            ready, timeout=timeout, interval=0.1, what=f"the standby's copy of {slot} synced, not temporary"
        )
        return time.monotonic() - start

    def stop_primary(self, mode: str = "immediate") -> None:
        """The primary goes away (``immediate``: as in a crash, no shutdown checkpoint)."""
        self.primary.stop(mode)

    def promote(self) -> None:
        """Promote the standby and wait until it accepts writes."""
        self.standby.promote()

    def stop(self) -> None:
        for cluster in (self.standby, self.primary):
            with contextlib.suppress(subprocess.CalledProcessError):  # already stopped (a failover)
                cluster.stop("immediate")


def pair_env(
    pair: FailoverPair, tmp_path: Path, request: pytest.FixtureRequest, options: str = ""
) -> Iterator[CaptureEnv]:
    """A :class:`~tests.plugins.capture.CaptureEnv` on a new database of the pair, whose source DSN
    names both hosts with ``target_session_attrs=primary`` (what a reader that follows a failover
    is given); the database is on the standby too before it is yielded."""
    db = pair.primary.create_database()
    pair.wait_replayed()
    for env in make_env(pair.primary, db, tmp_path, "embedded", request, options):
        env.source = pair.dsn(db)
        yield env


def start_pair(
    base: Path,
    bin_dir: Path,
    *,
    standby_settings: dict[str, str] | None = None,
    synchronized: bool = True,
    conninfo_dbname: bool = True,
) -> FailoverPair:
    """A primary under ``base/primary`` and its streaming standby under ``base/standby``, set up
    for failover slots; ``standby_settings`` add to or override :data:`STANDBY_SETTINGS`;
    ``synchronized=False`` leaves ``synchronized_standby_slots`` unset on the primary;
    ``conninfo_dbname=False`` leaves the dbname out of the standby's ``primary_conninfo``."""
    own_dirs(base)
    primary = start_cluster(base / "primary", bin_dir=bin_dir)
    try:
        return _add_standby(primary, base, bin_dir, standby_settings, synchronized, conninfo_dbname)
    except BaseException:
        primary.stop("immediate")
        raise


def _add_standby(
    primary: PgCluster,
    base: Path,
    bin_dir: Path,
    standby_settings: dict[str, str] | None,
    synchronized: bool,
    conninfo_dbname: bool,
) -> FailoverPair:
    primary.execute(
        sql.SQL("SELECT pg_create_physical_replication_slot({})").format(sql.Literal(STANDBY_SLOT))
    )
    sbase = base / "standby"
    datadir, sockdir = sbase / "data", sbase / "sock"
    sockdir.mkdir(parents=True)
    own_dirs(sbase, sockdir)
    source = f"host=127.0.0.1 port={primary.port} user=postgres" + (
        " dbname=postgres" if conninfo_dbname else ""
    )
    subprocess.run(
        [
            *as_postgres_user(),
            str(bin_dir / "pg_basebackup"),
            *("-D", str(datadir), "-R", "-S", STANDBY_SLOT, "-X", "stream", "-c", "fast", "--no-sync"),
            *("-d", source),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    port = free_port()
    settings = {**STANDBY_SETTINGS, **(standby_settings or {})}
    with open(datadir / "postgresql.conf", "a") as fh:
        fh.write(cluster_conf(port, sockdir, settings))
    standby = PgCluster(datadir=datadir, sockdir=sockdir, port=port, bin_dir=bin_dir)
    standby.start()
    if synchronized:
        primary.execute(
            sql.SQL("ALTER SYSTEM SET synchronized_standby_slots = {}").format(sql.Literal(STANDBY_SLOT))
        )
        primary.execute("SELECT pg_reload_conf()")
    pair = FailoverPair(primary=primary, standby=standby, base=base)
    wait_for(
        lambda: primary.fetch("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")[0][0],
        what="the standby streaming",
    )
    return pair


@pytest.fixture
def pg18_pair() -> Iterator[Callable[..., FailoverPair]]:
    """A factory of PostgreSQL 18 primary/standby pairs (:func:`start_pair`'s options); every pair
    is stopped and removed after the test."""
    bin_dir = embedded_pg_bin()
    made: list[FailoverPair] = []
    bases: list[Path] = []

    def make(**options: object) -> FailoverPair:
        base = Path(tempfile.mkdtemp(prefix="cdc-pg18-pair-"))
        bases.append(base)
        pair = start_pair(base, bin_dir, **options)  # type: ignore[arg-type]
        made.append(pair)
        return pair

    try:
        yield make
    finally:
        for pair in made:
            pair.stop()
        for base in bases:
            shutil.rmtree(base, ignore_errors=True)
