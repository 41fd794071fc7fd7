"""``cdc apply``: run the Spark apply job (log store -> warehouse + search index).

``cdc apply --once`` applies everything available when it starts, then exits (Spark's
``availableNow`` trigger); ``cdc apply`` runs until interrupted, one micro-batch every
``--trigger-interval`` seconds. Progress goes to stdout (stderr with ``--json``, whose summary --
batches, records, events applied, dead letters -- is the only thing on stdout).

Stopping: SIGTERM or SIGINT (Ctrl-C), to this process or to its whole process group (as supervisors
send it), lets the micro-batch in progress complete -- its sinks and its checkpoint -- then the job
stops and exits 0; a second SIGINT aborts (exit 130; the batch is replayed from the checkpoint). The
Spark driver JVM runs in a process group of its own (:func:`spark_jobs.session.start_driver_jvm`),
so a signal to this group does not reach it.

Output: cdc's own lines only; Spark's start-up output (the JVM's incubator-module warning, log4j's
notes and WARN lines, pyspark's warnings) only with ``--verbose`` (:func:`spark_jobs.session.get_session`,
``quiet``). Errors always show.

Exit codes: 0 done; 1 a micro-batch failed or made no progress for ``--stall-timeout`` seconds (the
job stopped; the batch is retried from the checkpoint on the next run, nothing is skipped).

A failure ends the process hard (``os._exit`` after the error is written and the streams flushed): a
thread stuck in Spark, py4j's callback server or a sink would otherwise keep the interpreter alive at
exit (``concurrent.futures`` joins its worker threads, pyspark's exit hook stops the SparkContext
through the JVM), and a process that hangs instead of exiting is never restarted by its supervisor.

``CDC_FAULTS`` (tests only, :mod:`cdc.faults`) is read here, at the entry point, and passed to the job,
e.g. ``CDC_FAULTS=apply.after_sink:3``.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any, NoReturn

from cdc.cli import VERB_HELP
from cdc.cli.output import print_error, print_json
from cdc.config import TRIGGER_INTERVAL_S, Settings
from cdc.errors import CdcError, ConfigError
from cdc.faults import ENV as FAULTS_ENV
from cdc.faults import Faults
from cdc.locks import ProcessLock
from cdc.signals import StopSignals

#: what a stop signal does (told on stderr when it arrives)
STOPPING = "finishing the micro-batch in progress, then stopping"

#: a micro-batch's slices are read and parsed in the tasks: bound them (about 0.5-1 KB of memory per record)
DEFAULT_MAX_RECORDS = 250_000
#: ... and what it may grow to when the apply is behind (a 1M-record batch peaks near 3 GB of RSS)
DEFAULT_MAX_RECORDS_BEHIND = 500_000
#: ... and at most this many bytes of records (key + value, estimated from a sample of each
#: partition's next records): 500,000 records of 9 KB rows would be 4.5 GB in flight
DEFAULT_MAX_BYTES = 256 << 20


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add this module's verbs to the `cdc` parser."""
    p = sub.add_parser("apply", help=VERB_HELP["apply"])
    p.add_argument("--once", action="store_true", help="apply what is available now, then exit")
    p.add_argument(
        "--trigger-interval",
        type=float,
        default=TRIGGER_INTERVAL_S,
        metavar="SECONDS",
        help=f"seconds between micro-batches when running continuously (default {TRIGGER_INTERVAL_S:g})",
    )
    p.add_argument(
        "--max-records-per-batch",
        type=int,
        default=DEFAULT_MAX_RECORDS,
        metavar="N",
        help=f"at most N log records per micro-batch, bounding the memory of its tasks "
        f"(default {DEFAULT_MAX_RECORDS:,}; 0: no limit)",
    )
    p.add_argument(
        "--max-records-per-batch-behind",
        type=int,
        default=None,
        metavar="N",
        help="when the apply is behind, a micro-batch takes half the backlog, up to N records, so "
        "each rewrite of a table's files carries more changes; back to --max-records-per-batch when "
        f"caught up (default {DEFAULT_MAX_RECORDS_BEHIND:,} with the default --max-records-per-batch, "
        "else 0; 0: never more than --max-records-per-batch)",
    )
    p.add_argument(
        "--max-bytes-per-batch",
        type=int,
        default=DEFAULT_MAX_BYTES,
        metavar="BYTES",
        help="at most this many bytes of log records (key + value, estimated from each partition's next "
        "records) per micro-batch, whatever the record bounds allow: wide rows make smaller batches "
        f"(default {DEFAULT_MAX_BYTES:,} = 256 MiB; 0: no byte bound; applies with --max-records-per-batch)",
    )
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a micro-batch without any progress (no Spark task finishing) for this long is a stall: dump "
        "every thread and exit 1; the same batch's retry gets twice as long per earlier stall, up to 8x "
        "(default 300; 0: no watchdog)",
    )
    p.add_argument(
        "--master",
        metavar="URL",
        help="the Spark master: spark://HOST:PORT (standalone), yarn, k8s://https://HOST:PORT or local[N] "
        "(default $CDC_SPARK_MASTER, else local[2]; see docs/apply.md, Running on a cluster)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show Spark's start-up output (its log4j notes and WARN lines, the JVM's warnings)",
    )
    p.set_defaults(handler=handle)


def _exit_hard(exc: BaseException, *, as_json: bool) -> NoReturn:
    """Report ``exc`` (as the CLI's error boundary would) and end the process now (module docstring)."""
    if isinstance(exc, CdcError):
        print_error(exc, as_json=as_json)
        code = exc.exit_code
    elif isinstance(exc, KeyboardInterrupt):
        sys.stderr.write("interrupted\n")
        code = 130
    else:  # an unknown error: crash loudly, the supervisor restarts from the checkpoint
        traceback.print_exception(exc, file=sys.stderr)
        code = 1
    session = sys.modules.get("spark_jobs.session")  # the JVM's stderr passes through this process
    if session is not None:
        session.drain_jvm_stderr()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _behind(args: argparse.Namespace) -> int:
    """``--max-records-per-batch-behind``; unset: the default cap, unless ``--max-records-per-batch``
    was changed (a chosen bound is kept as given: no growth)."""
    if args.max_records_per_batch_behind is not None:
        return max(int(args.max_records_per_batch_behind), 0)
    return DEFAULT_MAX_RECORDS_BEHIND if args.max_records_per_batch == DEFAULT_MAX_RECORDS else 0


def handle(args: argparse.Namespace, settings: Settings) -> int:
    from spark_jobs.apply import ApplyOptions, BatchReport, run_apply
    from spark_jobs.session import get_session

    if args.trigger_interval <= 0:
        raise ConfigError(
            f"--trigger-interval must be positive, got {args.trigger_interval}",
            fix="use e.g. --trigger-interval 1",
        )
    options = ApplyOptions(
        once=bool(args.once),
        trigger_interval_s=float(args.trigger_interval),
        max_records_per_batch=max(int(args.max_records_per_batch), 0),
        max_records_per_batch_behind=_behind(args),
        max_bytes_per_batch=max(int(args.max_bytes_per_batch), 0),
        faults=Faults.parse(os.environ.get(FAULTS_ENV, "")),
        stall_timeout_s=max(float(args.stall_timeout), 0.0),
        hard_exit_on_stall=True,
        sole_writer=True,  # under the apply lock, below
    )
    out = sys.stderr if args.json else sys.stdout

    def progress(r: BatchReport) -> None:
        out.write(
            f"batch {r.batch_id}: {r.records:,} records, {r.events:,} events, {r.dead_letters:,} dead letters, "
            f"{r.tables} tables, {r.seconds:.2f} s ({r.rate:,.0f} records/s; read+parse {r.read_parse_seconds:.2f} s, "
            + ", ".join(f"{k} {v:.2f} s" for k, v in r.sink_seconds.items())
            + ")"
            + (f" [{', '.join(f'{k} {v * 1000:.0f} ms' for k, v in r.phases.items())}]" if r.phases else "")
            + "\n"
        )
        out.flush()

    with ProcessLock(settings.state_dir, "apply"):  # one `cdc apply` per state directory
        out.write(
            f"apply: state {settings.state_dir}, log {settings.log_url or 'embedded'}, starting Spark...\n"
        )
        out.flush()
        try:
            with StopSignals("cdc apply", STOPPING) as stop:  # before Spark starts: no signal is lost
                spark = get_session(master=args.master, quiet=not args.verbose)
                stop.install()  # the SparkContext installed its own SIGINT handler
                summary = run_apply(settings, options, spark=spark, on_batch=progress, stop_signals=stop)
        except BaseException as exc:  # reported, then the process ends (see the module docstring)
            _exit_hard(exc, as_json=bool(args.json))
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
