"""``cdc run [--once] [--json]`` (``cdc snapshot`` is in :mod:`cdc.cli.snapshot`).

* ``run`` snapshots what needs it (the initial snapshot when the slot does not exist yet, tables
  registered or re-snapshot-requested later), then streams changes into the log store until SIGTERM
  (the current batch is made durable and confirmed, exit 0) or, with ``--once``, until the WAL
  position at the start of the run is confirmed. Snapshot progress goes to stderr (a bar per table
  on a terminal; JSON lines with ``--json``). ``--json`` prints a summary object on stdout at the
  end: ``{"reason", "confirmed_lsn", "changes", "events", "snapshot_rows"}``.
  Exit codes: 0 done, 1 error, 2 configuration, a permanent source error, or another ``cdc run``
  holding the state directory's ``run`` lock (:mod:`cdc.locks`), 3 slot lost (``cdc snapshot
  --all`` needed).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from types import FrameType

from cdc.cli.output import json_dumps, print_json
from cdc.config import Settings
from cdc.locks import ProcessLock
from cdc.registry import Registry


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc run`` to the ``cdc`` parser."""
    run = sub.add_parser("run", help="snapshot, then stream changes into the log store")
    run.add_argument("--once", action="store_true", help="catch up to the WAL position at start, then exit")
    run.add_argument("--json", action="store_true", help="JSON progress on stderr and a JSON summary")
    run.set_defaults(handler=run_capture)


def run_capture(args: argparse.Namespace, settings: Settings) -> int:
    from cdc import faults
    from cdc.logstore.factory import open_log_store
    from cdc.reader import Reader
    from snapshot.progress import make_progress

    as_json = bool(args.json)
    settings.require_source()
    faults.install_from_env(os.environ)  # tests only (cdc.faults): e.g. reader.after_append
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)

    def log(message: str) -> None:
        # with --json, as JSON lines beside the snapshot progress (retries and warnings stay visible)
        line = json_dumps({"event": "log", "message": message}) if as_json else f"cdc run: {message}"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    try:
        with (
            ProcessLock(settings.state_dir, "run"),
            Registry(settings.state_dir) as registry,
            open_log_store(settings, writer=True) as store,
        ):
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
