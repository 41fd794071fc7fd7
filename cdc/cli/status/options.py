"""On-call status: every stage's lag in bytes/offsets and seconds, slot health, verdicts.

Interface: :func:`collect` (one report, a JSON-able dict whose schema ``docs/status.md`` documents),
tuned by :class:`StatusOptions` (``[status]`` in ``cdc.toml``). Modules beside it:
:mod:`~cdc.cli.status.judge` (the Burrow-style verdicts, pure), :mod:`~cdc.cli.status.history` (the samples
that let a one-shot call judge "rising" and "not moving"), :mod:`~cdc.cli.status.slot` (slot safety and
the ``keep``/``drop`` policy), :mod:`~cdc.cli.status.gather` (reading the source and the state dir).

Guarantees: :func:`collect` needs no running process: it reads only the source (one short
connection; none when it is unreachable, which becomes the capture stage's verdict) and the state
directory (registry, log-store end offsets, the Spark checkpoint's offsets, the processes' metrics
files); never the Spark job. It writes only its own sample (``<state>/status/``) and, when the
policy is ``drop`` and the slot crosses ``slot_drop_at_bytes`` or was invalidated, it drops the
slot and marks the tables for re-snapshot (see :mod:`cdc.cli.status.slot`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from cdc.errors import ConfigError

if TYPE_CHECKING:
    from cdc.config import Settings

__all__ = ["SCHEMA_VERSION", "StatusOptions"]

SCHEMA_VERSION = 1
GiB = 1024**3


@dataclass(frozen=True)
class StatusOptions:
    """``[status]`` in ``cdc.toml`` (keys as the field names)."""

    window_s: float = 300.0
    lag_warn_s: float = 60.0
    lag_critical_s: float = 600.0
    retained_wal_warn_bytes: int = 1 * GiB
    retained_wal_critical_bytes: int = 8 * GiB
    slot_policy: str = "keep"  # "keep" | "drop"
    slot_drop_at_bytes: int | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> StatusOptions:
        return cls.from_mapping(settings.extra.get("status", {}) or {})

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> StatusOptions:
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown key(s) in [status]: {', '.join(unknown)}",
                fix=f"use only {', '.join(known)}",
            )
        kwargs: dict[str, Any] = {}
        for name, raw in values.items():
            if name == "slot_policy":
                if raw not in ("keep", "drop"):
                    raise ConfigError(
                        f'[status] slot_policy must be "keep" or "drop", got {raw!r}',
                        fix='set slot_policy = "keep" (the default) or "drop"',
                    )
                kwargs[name] = raw
                continue
            is_int = name.endswith("_bytes")
            if (
                isinstance(raw, bool)
                or not isinstance(raw, int | float)
                or (is_int and not isinstance(raw, int))
            ):
                raise ConfigError(
                    f"[status] {name} must be {'an integer' if is_int else 'a number'}, got {raw!r}",
                    fix=f"set {name} in [status] of cdc.toml to a positive {'integer' if is_int else 'number'}",
                )
            if raw <= 0:
                raise ConfigError(f"[status] {name} must be positive, got {raw!r}", fix=f"set {name} > 0")
            kwargs[name] = raw
        opts = cls(**kwargs)
        if opts.slot_policy == "drop" and opts.slot_drop_at_bytes is None:
            raise ConfigError(
                '[status] slot_policy = "drop" needs slot_drop_at_bytes',
                fix="set slot_drop_at_bytes (retained WAL bytes at which the slot is dropped), "
                'or slot_policy = "keep"',
            )
        if opts.retained_wal_warn_bytes > opts.retained_wal_critical_bytes:
            raise ConfigError(
                "[status] retained_wal_warn_bytes is above retained_wal_critical_bytes",
                fix="make the warning threshold the lower one",
            )
        if opts.lag_warn_s > opts.lag_critical_s:
            raise ConfigError(
                "[status] lag_warn_s is above lag_critical_s", fix="make the warning threshold the lower one"
            )
        return opts
