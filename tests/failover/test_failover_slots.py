"""Failover slots on two PostgreSQL 18 clusters (tests/plugins/failover.py): a logical slot created
with failover on the primary is synced to the standby (``synced AND NOT temporary``), and after the
primary is gone and the standby promoted, the slot on the new primary still has every change written
on the old one after the sync: nothing lost."""

from __future__ import annotations

import time
from collections.abc import Callable

from cdc.catalog import create_logical_slot
from cdc.connect import connect, connect_replication
from tests.plugins.failover import FailoverPair
from tests.plugins.postgres import wait_for


def _peek(pair_cluster_dsn: str, slot: str) -> list[bytes]:
    with connect(pair_cluster_dsn) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'p')",
            [slot],
        ).fetchall()
    return [bytes(r[0]) for r in rows]


def _stream(dsn: str, slot: str, count: int) -> tuple[int, list[bytes]]:
    """The port the replication connection reached and the first ``count`` messages of ``slot``."""
    repl = connect_replication(dsn)
    try:
        cur = repl.cursor()
        cur.start_replication(
            slot_name=slot, decode=False, options={"proto_version": "1", "publication_names": "p"}
        )
        got: list[bytes] = []

        def read() -> bool:
            msg = cur.read_message()
            if msg is not None:
                got.append(bytes(msg.payload))
            return len(got) >= count

        wait_for(read, interval=0.01, what=f"{count} messages from {slot}")
        return int(repl.info.port), got
    finally:
        repl.close()


def test_failover_slot_survives_promotion_with_every_change(pg18_pair: Callable[..., FailoverPair]) -> None:
    pair = pg18_pair()
    pair.primary.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pair.primary.execute("CREATE PUBLICATION p FOR TABLE t")
    with connect(pair.primary.dsn()) as conn:
        create_logical_slot(conn, "cdc_fo", "pgoutput")
    assert pair.primary.fetch("SELECT failover FROM pg_replication_slots WHERE slot_name = 'cdc_fo'") == [
        (True,)
    ]
    synced_s = pair.wait_synced("cdc_fo")

    # written after the sync, replicated, then the primary crashes: the promoted standby has them
    values = [f"after sync {i}: quote ' backslash \\ newline \n end" for i in range(50)]
    with connect(pair.primary.dsn()) as conn:
        conn.execute("INSERT INTO t SELECT i, (%s::text[])[i] FROM generate_series(1, 50) i", [values])
        conn.execute("UPDATE t SET v = v || ' updated' WHERE id <= 10")
        conn.execute("DELETE FROM t WHERE id > 45")
    pair.wait_replayed()
    pair.stop_primary("immediate")
    start = time.monotonic()
    pair.promote()
    changes = _peek(pair.standby.dsn(), "cdc_fo")
    usable_s = time.monotonic() - start
    kinds = [c[:1] for c in changes]
    assert kinds.count(b"I") == 50 and kinds.count(b"U") == 10 and kinds.count(b"D") == 5, kinds
    inserted = b"".join(c for c in changes if c[:1] == b"I")
    assert all(v.encode() in inserted for v in values)
    # what the reader does: the DSN of both hosts with target_session_attrs=primary reaches the
    # promoted standby, and the replication protocol streams the same changes from the slot
    assert _stream(pair.dsn(), "cdc_fo", len(changes)) == (pair.standby.port, changes)
    # the slot goes on on the new primary: consume and write more
    with connect(pair.standby.dsn()) as conn:
        conn.execute(
            "SELECT count(*) FROM pg_logical_slot_get_binary_changes('cdc_fo', NULL, NULL, "
            "'proto_version', '1', 'publication_names', 'p')"
        )
        conn.execute("INSERT INTO t VALUES (1000, 'on the new primary')")
    assert [c[:1] for c in _peek(pair.standby.dsn(), "cdc_fo")] == [b"B", b"R", b"I", b"C"]
    print(f"\nfailover slot: synced in {synced_s:.2f}s; promoted and slot usable in {usable_s:.2f}s")


def test_without_failover_the_promoted_standby_has_no_slot(pg18_pair: Callable[..., FailoverPair]) -> None:
    """The control: a slot created without failover is not kept by the standby, so a failover loses
    it (the reader's lost-slot path: every table snapshotted again)."""
    pair = pg18_pair()
    with connect(pair.primary.dsn()) as conn:
        create_logical_slot(conn, "cdc_plain", "pgoutput", failover=False)
        create_logical_slot(conn, "cdc_fo2", "pgoutput")
    pair.wait_synced("cdc_fo2")  # the worker has synced what it syncs
    assert pair.standby_slot("cdc_plain") is None
    pair.stop_primary("immediate")
    pair.promote()
    names = {r[0] for r in pair.standby.fetch("SELECT slot_name FROM pg_replication_slots")}
    assert "cdc_fo2" in names and "cdc_plain" not in names
