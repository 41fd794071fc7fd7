"""``cdc run [--once] [--json]`` and ``cdc snapshot SCHEMA.TABLE ... | --all [--json]``.

* ``run`` snapshots what needs it (the initial snapshot when the slot does not exist yet, tables
  registered or re-snapshot-requested later), then streams changes into the log store until SIGTERM
  (the current batch is made durable and confirmed, exit 0) or, with ``--once``, until the WAL
  position at the start of the run is confirmed. Snapshot progress goes to stderr (a bar per table
  on a terminal; JSON lines with ``--json``). ``--json`` prints a summary object on stdout at the
  end: ``{"reason", "confirmed_lsn", "changes", "events", "snapshot_rows"}``.
  Exit codes: 0 done, 1 error, 2 configuration, 3 slot lost (``cdc snapshot --all`` needed).
* ``snapshot`` requests a re-snapshot: the table's state becomes ``pending`` and the registry
  generation is bumped; a running reader picks it up within a second, otherwise the next
  ``cdc run`` does it.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from cdc.cli.output import print_json
from cdc.config import Settings
from cdc.errors import ConfigError
from cdc.registry import Registry


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc run`` and ``cdc snapshot`` to the ``cdc`` parser."""
    run = sub.add_parser("run", help="snapshot, then stream changes into the log store")
    run.add_argument("--once", action="store_true", help="catch up to the WAL position at start, then exit")
    run.add_argument("--json", action="store_true", help="JSON progress on stderr and a JSON summary")
    run.set_defaults(handler=run_capture)

    snap = sub.add_parser("snapshot", help="request a re-snapshot of tables (done by `cdc run`)")
    snap.add_argument("tables", nargs="*", metavar="SCHEMA.TABLE")
    snap.add_argument("--all", action="store_true", help="every registered table")
    snap.add_argument("--json", action="store_true")
    snap.set_defaults(handler=request_snapshot)


def run_capture(args: argparse.Namespace, settings: Settings) -> int:
    from cdc.logstore import open_log_store
    from cdc.reader import Reader
    from snapshot.progress import make_progress

    as_json = bool(args.json)
    settings.require_source()
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)

    def log(message: str) -> None:
        if not as_json:
            sys.stderr.write(f"cdc run: {message}\n")
            sys.stderr.flush()

    try:
        with Registry(settings.state_dir) as registry, open_log_store(settings, writer=True) as store:
            reader = Reader(settings, store, registry, progress=lambda: make_progress(as_json), log=log)
            result = reader.run(once=bool(args.once), stop=stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if as_json:
        print_json(result.to_dict())
    else:
        print(
            f"{result.reason}: {result.changes} changes, {result.events} events written, "
            f"confirmed up to {result.to_dict()['confirmed_lsn']}"
        )
    return 0


def request_snapshot(args: argparse.Namespace, settings: Settings) -> int:
    if bool(args.all) == bool(args.tables):
        raise ConfigError(
            "name the tables to re-snapshot, or pass --all (not both)",
            fix="e.g. `cdc snapshot public.orders` or `cdc snapshot --all`",
        )
    with Registry(settings.state_dir) as registry:
        regs = registry.list_tables() if args.all else [registry.find(name) for name in args.tables]
        for reg in regs:
            registry.set_snapshot_state(reg.schema, reg.table, "pending")
    names = [r.qualified for r in regs]
    if args.json:
        print_json({"requested": names})
    else:
        for name in names:
            print(f"re-snapshot requested: {name} (a running `cdc run` picks it up, else the next one)")
    return 0
