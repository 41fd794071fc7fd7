"""Fault-injection points for tests: one place that lists every point the product code offers.

Product code calls ``faults.point(name, arg, action)`` at a named place -- on the :class:`Faults` it
was handed (e.g. ``ApplyOptions.faults``), or the module's :func:`point` for the process-wide installed
set; nothing happens unless a test enabled that point. Points are enabled from ``CDC_FAULTS``, read
only at a process's entry point (``cdc apply`` parses it with :meth:`Faults.parse` and passes the
result on), never deep in the code. The value is a
comma-separated list of ``NAME[:ARG]``; ``ARG`` is the point's parameter (for the batch points: the
micro-batch id at which the fault fires), e.g. ``CDC_FAULTS=apply.after_sink:3``; or ``@PATH``: the
point fires at the first call after the file ``PATH`` appears, once (it removes the file first), so a
test can arm a running process, e.g. ``CDC_FAULTS=apply.after_sink:@/tmp/arm``.

Points (:data:`POINTS`):

* ``apply.after_sink:N`` -- in the apply job, after every task applied micro-batch N (the search
  shards committed it) and before the driver's commits and Spark's checkpoint: kill -9 of the JVM
  and the driver (a crash between a sink write and the checkpoint). The job writes
  ``cdc-fault: apply.after_sink`` to stderr first.

* ``reader.after_append`` -- in ``cdc run``, after the log store acknowledged a batch whose events
  changed images and before those images are committed (:mod:`cdc.logstore.images`): kill -9 of the
  reader. It writes ``cdc-fault: reader.after_append`` to stderr first. Without an argument it fires
  at the first such batch; ``@PATH`` arms it.

A point fires by calling the action given to :func:`point` (the caller knows how to crash its own
process); :func:`point` returns whether the point is enabled for that argument.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from cdc.errors import ConfigError

__all__ = ["ENV", "POINTS", "Faults", "enabled", "install", "install_from_env", "point"]

ENV = "CDC_FAULTS"

#: every fault-injection point: name -> what it does (see the module docstring)
POINTS: dict[str, str] = {
    "apply.after_sink": "kill -9 of the apply job after the first sink applied micro-batch ARG",
    "reader.after_append": "kill -9 of the reader between a batch's append and its images' commit",
}


@dataclass(frozen=True)
class Faults:
    """The enabled points: name -> argument (None for a point without one; a str is the path of the
    file that arms it)."""

    points: Mapping[str, int | str | None] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: str) -> Faults:
        """``NAME[:ARG],...`` -> Faults; a ConfigError names an unknown point or a bad argument."""
        out: dict[str, int | str | None] = {}
        for item in (p.strip() for p in raw.split(",")):
            if not item:
                continue
            name, sep, arg = item.partition(":")
            if name not in POINTS:
                raise ConfigError(
                    f"{ENV}: unknown fault-injection point {name!r}",
                    fix=f"use one of {sorted(POINTS)} (or unset {ENV})",
                )
            if sep and arg.startswith("@") and len(arg) > 1:
                out[name] = arg[1:]
                continue
            try:
                out[name] = int(arg) if sep else None
            except ValueError as exc:
                raise ConfigError(
                    f"{ENV}: the argument of {name} must be an integer, got {arg!r}",
                    fix=f"e.g. {ENV}={name}:3",
                ) from exc
        return cls(out)

    def arg(self, name: str) -> int | str | None:
        return self.points.get(name)

    def on(self, name: str, arg: int | None = None) -> bool:
        """Whether ``name`` is enabled (and, when the point has an argument, for ``arg``; when it is
        armed by a file, whether the file exists)."""
        if name not in self.points:
            return False
        want = self.points[name]
        if isinstance(want, str):
            return os.path.exists(want)
        return want is None or want == arg

    def point(self, name: str, arg: int | None = None, action: Callable[[], None] | None = None) -> bool:
        """A fault-injection point: when ``name`` is enabled (for ``arg``), run ``action``. Returns
        whether it fired. ``name`` must be listed in :data:`POINTS`."""
        assert name in POINTS, name
        if not self.on(name, arg):
            return False
        armed = self.points[name]
        if isinstance(armed, str):  # fires once per arming
            with contextlib.suppress(FileNotFoundError):
                os.unlink(armed)
        if action is not None:
            action()
        return True


_installed = Faults()


def install(faults: Faults) -> None:
    """Enable ``faults`` for this process (the entry point calls it once)."""
    global _installed
    _installed = faults


def install_from_env(environ: Mapping[str, str]) -> Faults:
    """Parse ``CDC_FAULTS`` from ``environ`` (entry points only) and install it."""
    faults = Faults.parse(environ.get(ENV, ""))
    install(faults)
    return faults


def enabled() -> Faults:
    """The installed faults (to pass on explicitly, e.g. into a job's options)."""
    return _installed


def point(name: str, arg: int | None = None, action: Callable[[], None] | None = None) -> bool:
    """:meth:`Faults.point` of the installed faults (code that is handed no :class:`Faults`)."""
    return _installed.point(name, arg, action)
