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
from typing import Any

from cdc.config import Settings, StatusConfig, section_options

__all__ = ["SCHEMA_VERSION", "StatusOptions"]

SCHEMA_VERSION = 1


class StatusOptions(StatusConfig):
    """``[status]`` in ``cdc.toml``, whose model (:class:`cdc.config.StatusConfig`) holds each key's
    default and bounds."""

    @classmethod
    def from_settings(cls, settings: Settings) -> StatusOptions:
        return section_options(cls, settings, "status")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> StatusOptions:
        return section_options(cls, Settings(extra={"status": values}), "status")
