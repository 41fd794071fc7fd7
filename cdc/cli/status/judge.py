"""Burrow-style verdicts: pure functions of a stage's lag, its position history and its process.

A verdict is judged over the evaluation window (``window_s``), not from one bare threshold:

* ``ERROR``: the stage's process recorded an error (its metrics file's ``last_error``).
* ``STOPPED``: work is pending (lag > 0), the process is not running (or its heartbeat is older than
  the window), and the position has not moved for longer than the window.
* ``STALLED``: work is pending, the process runs, but its position has not moved for longer than
  the window.
* ``WARN``: the lag is rising across the window's samples, or the process is not running while
  work is pending (not yet for a whole window), or the lag in seconds is over ``lag_warn_s``.
* ``OK``: otherwise; in particular a stage with nothing pending is OK even when its process is not
  running (a ``--once`` deployment).

A verdict has a severity (``ok``/``warn``/``critical``): OK is ok, WARN is warn, STALLED/STOPPED/ERROR
are critical; a WARN whose lag is over ``lag_critical_s`` (moving, but far behind) is critical too.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

OK, WARN, STALLED, STOPPED, ERROR = "OK", "WARN", "STALLED", "STOPPED", "ERROR"
VERDICTS = (OK, WARN, STALLED, STOPPED, ERROR)
SEVERITIES = ("ok", "warn", "critical")
EXIT_CODES = {"ok": 0, "warn": 1, "critical": 2}


def worst(severities: Sequence[str]) -> str:
    return max(severities, key=SEVERITIES.index, default="ok")


@dataclass(frozen=True)
class Point:
    """One sample of a stage: wall time (ms), its position (any monotonic number) and its lag."""

    t_ms: int
    position: float | None
    lag: float | None


@dataclass(frozen=True)
class Judgement:
    verdict: str
    severity: str
    reason: str


def not_moving_s(points: Sequence[Point], now: Point, last_move_ms: int | None) -> float | None:
    """How long the position is known not to have moved, in seconds (None: unknown).

    ``last_move_ms``: when the process itself last recorded a move (its metrics), an exact answer.
    Otherwise the history gives a lower bound: the position is the same from the oldest sample of
    the trailing run of samples equal to ``now`` up to now.
    """
    if last_move_ms is not None:
        return max(0.0, (now.t_ms - last_move_ms) / 1000)
    start = None
    for p in reversed(points):
        if p.position is None or p.position != now.position:
            break
        start = p.t_ms
    return None if start is None else max(0.0, (now.t_ms - start) / 1000)


def rising(points: Sequence[Point], now: Point, window_s: float) -> bool:
    """The lag never fell across the window's samples and is higher now than at their start."""
    inside = [p for p in points if p.lag is not None and now.t_ms - p.t_ms <= window_s * 1000]
    if not inside or now.lag is None:
        return False
    series = [p.lag for p in inside if p.lag is not None] + [now.lag]
    return series[-1] > series[0] and all(b >= a for a, b in itertools.pairwise(series))


def judge(
    *,
    points: Sequence[Point],
    now: Point,
    window_s: float,
    running: bool | None,
    last_error: str | None,
    last_move_ms: int | None,
    lag_seconds: float | None,
    lag_warn_s: float,
    lag_critical_s: float,
    unit: str = "",
) -> Judgement:
    """The verdict of one stage; see the module docstring. ``running`` None means unknown (the
    process ran on another host): then its heartbeat decides, which the caller folds in."""
    if last_error:
        return Judgement(ERROR, "critical", f"the process recorded an error: {last_error}")
    pending = now.lag is not None and now.lag > 0
    if not pending:
        note = "" if running else " (process not running)"
        return Judgement(OK, "ok", "nothing pending" + note)
    still = not_moving_s(points, now, last_move_ms)
    lag_txt = f"{now.lag:g}{unit} pending"
    if running is False:
        if still is None or still > window_s:
            since = "" if still is None else f" for {still:.0f} s"
            return Judgement(STOPPED, "critical", f"{lag_txt}, process not running, no progress{since}")
        return Judgement(WARN, "warn", f"{lag_txt}, process not running (no progress for {still:.0f} s)")
    if still is not None and still > window_s:
        return Judgement(STALLED, "critical", f"{lag_txt}, position not moving for {still:.0f} s")
    if lag_seconds is not None and lag_seconds >= lag_critical_s:
        return Judgement(
            WARN, "critical", f"{lag_txt}, {lag_seconds:.0f} s behind (lag_critical_s {lag_critical_s:g})"
        )
    if rising(points, now, window_s):
        return Judgement(WARN, "warn", f"{lag_txt}, lag rising over the last {window_s:g} s")
    if lag_seconds is not None and lag_seconds >= lag_warn_s:
        return Judgement(WARN, "warn", f"{lag_txt}, {lag_seconds:.0f} s behind (lag_warn_s {lag_warn_s:g})")
    return Judgement(OK, "ok", f"{lag_txt}, moving")
