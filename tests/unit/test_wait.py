"""`cdc wait`'s decision logic without a source or a JVM (cdc/cli/wait/lsn.py): the LSN and timeout input,
reading a record's commit LSN, the target offset of a partition, and targets, applied positions and
the report against a real embedded log store holding the reader's own envelopes; the names a wait
takes (tables and views) and when a view is caught up, against a real registry."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc import paths
from cdc.cli.wait.lsn import (
    TableWait,
    ViewWait,
    _apply_phase,
    _describe,
    _targets,
    commit_lsn_of,
    parse_lsn,
    parse_timeout,
    partition_target,
    resolve,
    slot_passed,
)
from cdc.config import Settings
from cdc.errors import ConfigError, RegistryError
from cdc.events import int_to_lsn
from cdc.logstore import APPLY_CONSUMER, TopicConfig
from cdc.logstore.embedded import EmbeddedLogStore
from cdc.registry import Registry, ViewReg
from tests.plugins.changes import ChangeWriter, make_reg

COLUMNS = [("id", "bigint"), ("commit_lsn", "text"), ("body", "text")]


def test_parse_lsn_takes_pg_lsn_text_and_refuses_the_rest() -> None:
    assert parse_lsn("0/16B3748") == 0x16B3748
    assert parse_lsn(" 1A/0000000F\n") == (0x1A << 32) | 0xF
    for bad in ("", "16B3748", "0/", "0/G", "1/2/3", "123456789/0", "0x0/1"):
        with pytest.raises(ConfigError, match="not an LSN") as err:
            parse_lsn(bad)
        assert "pg_current_wal_lsn" in (err.value.fix or "")


def test_parse_timeout_bounds() -> None:
    assert parse_timeout(0.5) == 0.5
    for bad in (0, -1, 3601):
        with pytest.raises(ConfigError, match="timeout"):
            parse_timeout(bad)


def _writer(tmp_path: Path, partitions: int = 2) -> tuple[EmbeddedLogStore, ChangeWriter]:
    store = EmbeddedLogStore(tmp_path / "log", writer=True)
    reg = make_reg("public", "t", COLUMNS)
    return store, ChangeWriter(store, reg, partitions=partitions, start_lsn=0x1_0000_0000)


def test_commit_lsn_of_the_readers_records_with_ugly_values(tmp_path: Path) -> None:
    """A column named commit_lsn, values that spell '"commit_lsn":', multi-MB values, quotes,
    newlines and backslashes: the source's commit LSN is found; a tombstone has none."""
    store, w = _writer(tmp_path)
    ugly = '"commit_lsn":7, \\"commit_lsn\\":8 \n\t\\ ' + "x" * 3_000_000
    with w.txn(commit_lsn=0x2_0000_0010) as lsn:
        w.insert({"id": 1, "commit_lsn": '"commit_lsn":1', "body": ugly})
        w.update({"id": 2, "commit_lsn": "9", "body": "b"}, unavailable=["body"])
        w.delete({"id": 3})
    records = [r for p in range(2) for r in store.iter_partition(w.reg.topic, p)]
    values = [r.value for r in records]
    assert len(values) == 4 and values.count(None) == 1  # insert, update, delete + tombstone
    assert {commit_lsn_of(v) for v in values if v is not None} == {lsn}
    assert commit_lsn_of(None) is None and commit_lsn_of(b"") is None
    assert commit_lsn_of(b'{"after": {"x": 1}}') is None
    assert commit_lsn_of(b'{"source": {"commit_lsn":}}') is None
    store.close()


@pytest.mark.parametrize(
    ("records", "lsn", "applied", "target"),
    [
        ([], 100, 5, 5),  # nothing written since the apply's position: caught up there
        ([(5, 90), (6, 100), (7, 110)], 100, 5, 7),  # up to and including the target LSN
        ([(5, 110), (6, 120)], 100, 5, 5),  # only later changes pending: nothing to wait for
        ([(5, 90), (6, 110), (7, 80)], 100, 5, 8),  # a replayed older record after newer ones
        ([(5, 90), (6, None), (7, 110), (8, None)], 100, 5, 7),  # tombstones count with their delete
        ([(5, None), (6, 110)], 100, 5, 6),  # a first record without a commit LSN counts
        ([(5, 90), (9, 95)], 100, 5, 10),  # compaction gaps
    ],
)
def test_partition_target(records: list[tuple[int, int | None]], lsn: int, applied: int, target: int) -> None:
    assert partition_target(records, lsn, applied) == target


def test_targets_applied_positions_and_report(tmp_path: Path) -> None:
    """Targets from the topic once capture passed L; caught up only when every partition's
    committed position reaches its target; the report says how far behind."""
    store, w = _writer(tmp_path, partitions=2)
    with w.txn(commit_lsn=0x1_0000_0100):
        for i in range(1, 7):
            w.insert({"id": i, "commit_lsn": "a", "body": "b"})
    with w.txn(commit_lsn=0x1_0000_0200) as target_lsn:
        w.update({"id": 1, "commit_lsn": "a", "body": "changed"})
    with w.txn(commit_lsn=0x1_0000_0300):  # after the target: not waited for
        for i in range(1, 7):
            w.update({"id": i, "commit_lsn": "a", "body": "later"})
    ends = store.end_offsets(w.reg.topic)
    store.hold(APPLY_CONSUMER, w.reg.topic)

    tw = TableWait(w.reg, ["warehouse"])
    _targets(store, tw, target_lsn)
    assert tw.target is not None and not tw.caught_up
    assert sum(tw.target.values()) == 7 and sum(ends.values()) == 13
    report = _describe(store, tw, target_lsn)
    assert report["caught_up"] is False and report["lag_offsets"] == 7
    assert report["pending_lsn"] == int_to_lsn(0x1_0000_0100)
    assert report["behind_bytes"] == 0x100
    assert {p: v["applied"] for p, v in report["partitions"].items()} == {"0": 0, "1": 0}

    # the apply commits part of it: still behind; then the rest (and not the later changes)
    part_of_1 = next(p for p, t in tw.target.items() if t)
    store.commit(APPLY_CONSUMER, w.reg.topic, {part_of_1: tw.target[part_of_1]})
    _apply_phase(store, [tw], deadline=0.0, poll_s=0.0)  # one read of the positions
    other = 1 - part_of_1
    assert tw.target[other] > 0 and not tw.caught_up and tw.lag_offsets == tw.target[other]
    store.commit(APPLY_CONSUMER, w.reg.topic, dict(tw.target))
    _apply_phase(store, [tw], deadline=0.0, poll_s=0.0)
    assert tw.caught_up and tw.lag_offsets == 0
    assert _describe(store, tw, target_lsn)["caught_up"] is True

    # a wait for an LSN before every change: caught up at the apply's first position
    early = TableWait(w.reg, ["warehouse"])
    store.commit(APPLY_CONSUMER, w.reg.topic, {p: 0 for p in ends})
    _targets(store, early, 0x1_0000_0000)
    assert early.caught_up
    store.close()


def test_a_missing_topic_is_not_caught_up(tmp_path: Path) -> None:
    store = EmbeddedLogStore(tmp_path / "log", writer=True)
    tw = TableWait(make_reg("public", "never", COLUMNS), ["warehouse"])
    _targets(store, tw, 100)
    assert not tw.caught_up and "does not exist" in (tw.error or "")
    assert _describe(store, tw, 100)["error"] == tw.error
    store.close()


def test_render_says_how_far_behind() -> None:
    from cdc.cli.wait import render

    table = {"table": "public.t", "sinks": ["warehouse", "search"], "caught_up": False, "lag_offsets": 3}
    behind = {
        **table,
        "partitions": {"0": {"applied": 4, "target": 7}, "1": {"applied": 2, "target": 2}},
        "pending_lsn": "0/100",
        "behind_bytes": 4096,
    }
    capture = {"passed": True, "slot": "s", "active": True, "confirmed_lsn": "0/200", "behind_bytes": 0}
    text = render(
        {"lsn": "0/180", "caught_up": False, "elapsed_s": 2.0, "capture": capture, "tables": [behind]}
    )
    assert "NOT caught up to 0/180" in text and "public.t (warehouse + search): 3 change(s)" in text
    assert "oldest at 0/100 (4,096 bytes" in text and "p0 4/7" in text and "p1" not in text
    assert "cdc apply" in text
    no_pending = {k: v for k, v in behind.items() if k not in ("pending_lsn", "behind_bytes")}
    assert "oldest" not in render(
        {"lsn": "0/180", "caught_up": False, "elapsed_s": 2.0, "capture": capture, "tables": [no_pending]}
    )
    stopped = {**capture, "passed": False, "active": False, "confirmed_lsn": "0/80", "behind_bytes": 256}
    waiting = {**table, "lag_offsets": None, "partitions": {}}
    text = render(
        {"lsn": "0/180", "caught_up": False, "elapsed_s": 2.0, "capture": stopped, "tables": [waiting]}
    )
    assert "confirmed 0/80, 256 bytes behind (reader not running" in text and "waiting for capture" in text
    done = {**table, "caught_up": True}
    assert render(
        {"lsn": "0/180", "caught_up": True, "elapsed_s": 0.1, "capture": capture, "tables": [done]}
    ) == ("caught up to 0/180 in 0.100 s: public.t\n")


def _registered(state: Path, *views: ViewReg) -> Registry:
    registry = Registry(state)
    registry.add(make_reg("public", "t", COLUMNS))
    registry.add(make_reg("public", "u", COLUMNS))
    for view in views:
        registry.add_view(view)
    return registry


VIEW = ViewReg("tu", "SELECT t.id, u.body FROM t JOIN u ON t.id = u.id", ("public.t", "public.u"), ("body",))


def test_resolve_takes_views_and_tables(tmp_path: Path) -> None:
    """A view's name resolves to the view and the tables it reads (views first, as verify does); no
    name: every table and view; a name that is neither is refused, naming the views."""
    with _registered(tmp_path, VIEW) as registry:
        registry.add(make_reg("public", "tu", COLUMNS))  # a table named like the view: the view wins
        got = resolve(tmp_path, ["tu", "public.t"])
        assert [r.qualified for r in got.tables] == ["public.t"]
        ((view, regs),) = got.views
        assert view.name == "tu" and [r.qualified for r in regs] == ["public.t", "public.u"]
        assert [r.qualified for r in got.waited] == ["public.t", "public.u"]  # each once
        every = resolve(tmp_path, [])
        assert len(every.tables) == 3 and [v.name for v, _ in every.views] == ["tu"]
        assert [r.qualified for r in resolve(tmp_path, ["public.tu"]).tables] == ["public.tu"]
        with pytest.raises(RegistryError) as refused:
            resolve(tmp_path, ["nope"])
        assert "registered views: tu" in (refused.value.fix or "")


def test_a_view_is_caught_up_once_its_tables_are_and_it_shows_them(tmp_path: Path) -> None:
    """Caught up when every table it reads is (the apply commits their positions after the view),
    then only if it is built (its Delta table, its index with search columns) and not refused."""
    state = tmp_path / "state"
    state.mkdir()
    store, w = _writer(tmp_path)
    with w.txn(commit_lsn=0x1_0000_0100) as lsn:
        w.insert({"id": 1, "commit_lsn": "a", "body": "b"})
    store.hold(APPLY_CONSUMER, w.reg.topic)
    registry = _registered(state, VIEW)
    t, u = (TableWait(registry.find(n), ["warehouse"]) for n in ("public.t", "public.u"))
    store.create_topic(u.reg.topic, TopicConfig(partitions=2))  # the reader wrote nothing of u
    store.hold(APPLY_CONSUMER, u.reg.topic)
    for tw in (t, u):
        _targets(store, tw, lsn)
    vw = ViewWait(VIEW, [t, u], ["warehouse", "search"])
    _apply_phase(store, [t, u], 0.0, 0.0, [vw], state)
    assert u.caught_up and not t.caught_up and not vw.caught_up
    assert vw.error is None and vw.lag_offsets == 1  # not looked at while its tables are behind

    store.commit(APPLY_CONSUMER, w.reg.topic, dict(t.target or {}))
    _apply_phase(store, [t, u], 0.0, 0.0, [vw], state)
    assert t.caught_up and not vw.caught_up and "tu is not built yet" in (vw.error or "")
    (paths.view_table(state, "tu") / "_delta_log").mkdir(parents=True)
    _apply_phase(store, [t, u], 0.0, 0.0, [vw], state)
    assert not vw.caught_up and "search index of view tu is not built" in (vw.error or "")
    paths.search_index(state, "_views.tu").mkdir(parents=True)
    _apply_phase(store, [t, u], 0.0, 0.0, [vw], state)
    assert vw.caught_up and vw.error is None and vw.lag_offsets == 0
    assert vw.describe() == {
        "table": "tu",
        "kind": "view",
        "reads": ["public.t", "public.u"],
        "sinks": ["warehouse", "search"],
        "caught_up": True,
        "lag_offsets": 0,
    }

    registry.set_view_refused("tu", {"reason": "column body is gone", "fix": "add it back"})
    refused = ViewWait(VIEW, [t, u], ["warehouse"])
    _apply_phase(store, [t, u], 0.0, 0.0, [refused], state)
    assert not refused.caught_up
    assert refused.error is not None and "refused" in refused.error and "column body is gone" in refused.error
    registry.set_view_refused("tu", None)  # computed whole by a later batch: shows the tables again
    _apply_phase(store, [t, u], 0.0, 0.0, [refused], state)
    assert refused.caught_up
    registry.remove_view("tu")
    gone = ViewWait(VIEW, [t, u], ["warehouse"])
    _apply_phase(store, [t, u], 0.0, 0.0, [gone], state)
    assert not gone.caught_up and "no longer registered" in (gone.error or "")
    registry.close()
    store.close()


def test_render_a_view() -> None:
    from cdc.cli.wait import render

    capture = {"passed": True, "slot": "s", "active": True, "confirmed_lsn": "0/200", "behind_bytes": 0}
    view = {"table": "tu", "kind": "view", "reads": ["public.t", "public.u"], "sinks": ["warehouse"]}
    waiting = {**view, "caught_up": False, "lag_offsets": 2}
    text = render(
        {"lsn": "0/180", "caught_up": False, "elapsed_s": 2.0, "capture": capture, "tables": [waiting]}
    )
    assert "tu (view of public.t, public.u): waiting for its tables" in text
    refused = {**waiting, "lag_offsets": 0, "error": "the apply refused view tu"}
    text = render(
        {"lsn": "0/180", "caught_up": False, "elapsed_s": 2.0, "capture": capture, "tables": [refused]}
    )
    assert "  tu: the apply refused view tu" in text
    done = {**view, "caught_up": True, "lag_offsets": 0}
    assert render(
        {"lsn": "0/180", "caught_up": True, "elapsed_s": 0.1, "capture": capture, "tables": [done]}
    ) == ("caught up to 0/180 in 0.100 s: tu\n")


class _SlotRow:
    """A connection that answers every query with one row (the slot's, or None: no slot), and
    counts the queries."""

    def __init__(self, row: tuple[bool, str, str] | None) -> None:
        self.row = row
        self.queries: list[str] = []

    def execute(self, query: str, params: object = None) -> _SlotRow:
        self.queries.append(query)
        return self

    def fetchone(self) -> tuple[bool, str, str] | None:
        return self.row


def test_the_slot_is_read_without_a_peek_when_asked_and_a_caught_up_slot_needs_no_second_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``slot_passed(peek=False)`` reads ``pg_replication_slots`` only (safe in a caller's
    transaction): an inactive slot behind the point answers no, where a peek would have been made.
    ``cdc verify``'s capture check reads it on its own connection first, and opens a second one
    (to wait, or peek) only for a slot that is behind."""
    from cdc.cli.verify import compare

    settings = Settings(state_dir=tmp_path, slot_name="s")
    behind = _SlotRow((False, "0/100", "wal2json"))
    assert slot_passed(behind, settings, 0x200, [], peek=False) == (
        False,
        {"slot": "s", "confirmed_flush_lsn": 0x100, "active": False},
    )
    assert len(behind.queries) == 1
    assert slot_passed(_SlotRow((False, "0/300", "wal2json")), settings, 0x200, [], peek=False)[0]
    assert slot_passed(_SlotRow(None), settings, 0x200, [], peek=False)[0]

    opened: list[str] = []

    def connect(dsn: str, **kw: object) -> None:
        opened.append(dsn)
        raise RuntimeError("a second connection")

    monkeypatch.setattr(compare, "connect", connect)
    verifier = compare.Verifier(settings, wait_s=0.0, limit=1)
    caught_up = _SlotRow((False, "0/300", "wal2json"))
    assert verifier._capture_passed(caught_up, "dbname=x", 0x200, []) and not opened  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="a second connection"):
        verifier._capture_passed(behind, "dbname=x", 0x200, [])  # type: ignore[arg-type]
    assert opened == ["dbname=x"]
