"""``cdc apply``: run the Spark apply job (log store -> warehouse + search index).

``cdc apply --once`` applies everything available when it starts, then exits (Spark's
``availableNow`` trigger); ``cdc apply`` runs until interrupted, one micro-batch every
``--trigger-interval`` seconds. Progress goes to stdout (stderr with ``--json``, whose summary --
batches, records, events applied, dead letters -- is the only thing on stdout).

Exit codes: 0 done; 1 a micro-batch failed (the job stopped; the batch is retried from the
checkpoint on the next run, nothing is skipped).

``CDC_TEST_CRASH_AFTER_SINK=N`` (test hook): kill -9 the job after the first sink applied batch N.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from cdc.cli.output import print_json
from cdc.config import Settings
from cdc.errors import ConfigError

#: a micro-batch is collected on the driver: bound it (about 0.5-1 KB of driver memory per record)
DEFAULT_MAX_RECORDS = 250_000


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's verbs to the `cdc` parser."""
    p = sub.add_parser("apply", help="apply captured changes to the warehouse and the search index (Spark)")
    p.add_argument("--once", action="store_true", help="apply what is available now, then exit")
    p.add_argument(
        "--trigger-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between micro-batches when running continuously (default 1)",
    )
    p.add_argument(
        "--max-records-per-batch",
        type=int,
        default=DEFAULT_MAX_RECORDS,
        metavar="N",
        help=f"at most N log records per micro-batch, bounding the driver's memory "
        f"(default {DEFAULT_MAX_RECORDS:,}; 0: no limit)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    p.set_defaults(handler=handle)


def _hook(name: str) -> int | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not a batch id", fix=f"unset {name}") from exc


def handle(args: argparse.Namespace, settings: Settings) -> int:
    from spark_jobs.apply import ApplyOptions, BatchReport, run_apply

    if args.trigger_interval <= 0:
        raise ConfigError(
            f"--trigger-interval must be positive, got {args.trigger_interval}",
            fix="use e.g. --trigger-interval 1",
        )
    options = ApplyOptions(
        once=bool(args.once),
        trigger_interval_s=float(args.trigger_interval),
        max_records_per_batch=max(int(args.max_records_per_batch), 0),
        crash_after_sink_batch=_hook("CDC_TEST_CRASH_AFTER_SINK"),
    )
    out = sys.stderr if args.json else sys.stdout

    def progress(r: BatchReport) -> None:
        out.write(
            f"batch {r.batch_id}: {r.records:,} records, {r.events:,} events, {r.dead_letters:,} dead letters, "
            f"{r.tables} tables, {r.seconds:.2f} s ({r.rate:,.0f} records/s; read+parse {r.read_parse_seconds:.2f} s, "
            + ", ".join(f"{k} {v:.2f} s" for k, v in r.sink_seconds.items())
            + ")\n"
        )
        out.flush()

    out.write(f"apply: state {settings.state_dir}, log {settings.log_url or 'embedded'}, starting Spark...\n")
    out.flush()
    summary = run_apply(settings, options, on_batch=progress)
    body: dict[str, Any] = summary.to_dict()
    if args.json:
        print_json(body)
    else:
        rate = summary.records / summary.seconds if summary.seconds > 0 else 0.0
        out.write(
            f"applied {summary.events:,} events from {summary.records:,} records in {summary.batches} batches "
            f"({summary.seconds:.1f} s, {rate:,.0f} records/s); dead letters: {summary.dead_letters} this run, "
            f"{summary.dead_letters_total} in total\n"
        )
    return 0
