"""Pure logic of the verdicts, the slot judgement and the [status] options."""

from __future__ import annotations

import pytest

from cdc.catalog import SlotInfo
from cdc.cli.status.judge import Point, judge
from cdc.cli.status.options import StatusOptions
from cdc.cli.status.slot import critical_at, judge_slot, should_drop
from cdc.errors import ConfigError

MiB = 1024 * 1024


def _j(points: list[Point], now: Point, running: bool | None = True, **kw: object) -> str:
    args: dict[str, object] = {
        "window_s": 10,
        "running": running,
        "last_error": None,
        "last_move_ms": None,
        "lag_seconds": None,
        "lag_warn_s": 60,
        "lag_critical_s": 600,
    }
    args.update(kw)
    j = judge(points=points, now=now, **args)  # type: ignore[arg-type]
    return f"{j.verdict}/{j.severity}"


def test_verdicts() -> None:
    assert _j([], Point(0, 5, 0), running=False) == "OK/ok"  # nothing pending: OK even when not running
    assert _j([], Point(0, 5, 3), last_error="boom") == "ERROR/critical"
    rising = [Point(1000, 1, 1), Point(2000, 2, 2), Point(3000, 3, 3)]
    assert _j(rising, Point(4000, 4, 5)) == "WARN/warn"
    falling = [Point(1000, 1, 9), Point(2000, 5, 4)]
    assert _j(falling, Point(4000, 9, 2)) == "OK/ok"
    still = [Point(0, 7, 3), Point(5000, 7, 3)]
    assert _j(still, Point(11_000, 7, 3)) == "STALLED/critical"
    assert _j(still, Point(11_000, 7, 3), running=False) == "STOPPED/critical"
    assert _j([], Point(11_000, 7, 3), running=False, last_move_ms=5000) == "WARN/warn"  # not yet a window
    assert _j([], Point(11_000, 7, 3), running=False) == "STOPPED/critical"  # never seen moving
    assert _j([], Point(0, 7, 3), lag_seconds=700) == "WARN/critical"
    assert _j([], Point(0, 7, 3), lag_seconds=70) == "WARN/warn"


def test_slot_critical_before_max_slot_wal_keep_size() -> None:
    opts = StatusOptions(retained_wal_warn_bytes=MiB, retained_wal_critical_bytes=100 * MiB)
    assert critical_at(opts, 10 * MiB) == 8 * MiB  # 80 % of the server's limit, below ours
    info = SlotInfo(name="s", exists=True, active=False, wal_status="reserved", retained_bytes=9 * MiB)
    j, fix = judge_slot(info, opts, max_keep=10 * MiB, expected=True, dropped=None, awaiting_resnapshot=False)
    assert j.severity == "critical" and fix and "max_slot_wal_keep_size" in fix
    lost = SlotInfo(name="s", exists=True, wal_status="lost", retained_bytes=0)
    j, fix = judge_slot(lost, opts, max_keep=-1, expected=True, dropped=None, awaiting_resnapshot=False)
    assert j.verdict == "ERROR" and fix and "cdc snapshot --all" in fix
    drop = StatusOptions(slot_policy="drop", slot_drop_at_bytes=8 * MiB)
    assert should_drop(lost, drop) is not None
    assert should_drop(lost, opts) is None  # keep: never dropped
    assert should_drop(SlotInfo(name="s", exists=True, active=True, retained_bytes=9 * MiB), drop) is None
    assert should_drop(info, drop) is not None


def test_options_validation() -> None:
    assert StatusOptions.from_mapping({"window_s": 5}).window_s == 5
    with pytest.raises(ConfigError, match="slot_drop_at_bytes"):
        StatusOptions.from_mapping({"slot_policy": "drop"})
    with pytest.raises(ConfigError, match="unknown"):
        StatusOptions.from_mapping({"windows": 5})
    with pytest.raises(ConfigError, match="integer"):
        StatusOptions.from_mapping({"retained_wal_warn_bytes": "1G"})
    with pytest.raises(ConfigError, match="keep"):
        StatusOptions.from_mapping({"slot_policy": "delete"})


def test_slot_recovered_from_a_loss_says_what_it_cost() -> None:
    opts = StatusOptions()
    info = SlotInfo(name="s", exists=True, active=True, wal_status="reserved", retained_bytes=0)
    record = {"slot": "s", "at": "2026-11-26T01:00:00Z", "reason": "gone", "tables": ["public.a", "public.b"]}
    j, _ = judge_slot(info, opts, max_keep=-1, expected=True, dropped=record, awaiting_resnapshot=True)
    assert j.verdict == "ERROR" and "2 table(s) wait for their re-snapshot" in j.reason
    j, _ = judge_slot(info, opts, max_keep=-1, expected=True, dropped=record, awaiting_resnapshot=False)
    assert j.verdict == "OK" and "re-read" not in j.reason  # a record from before the cost was kept
    done = {**record, "reread": {"public.a": 5, "public.b": 7}, "reread_rows": 12}
    j, fix = judge_slot(info, opts, max_keep=-1, expected=True, dropped=done, awaiting_resnapshot=False)
    assert (j.verdict, fix) == ("OK", None)
    assert (
        "recovered from the loss of slot 's' at 2026-11-26T01:00:00Z: 12 rows re-read from 2 table(s)"
        in j.reason
    )
