"""``cdc run [--once] [--json]`` (``cdc snapshot`` is in :mod:`cdc.cli.snapshot`).

* ``run`` snapshots what needs it (the initial snapshot when the slot does not exist yet, tables
  registered or re-snapshot-requested later), then streams changes into the log store until SIGTERM
  (the current batch is made durable and confirmed, exit 0) or, with ``--once``, until the WAL
  position at the start of the run is confirmed. Snapshot progress goes to stderr (a bar per table
  on a terminal; JSON lines with ``--json``). ``--json`` prints a summary object on stdout at the
  end: ``{"reason", "confirmed_lsn", "changes", "events", "snapshot_rows"}``. The reader's log lines
  go to stderr, each once (:class:`Log`; ``--verbose``: a repeated line too).
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

from cdc.cli import VERB_HELP
from cdc.cli.output import json_dumps, print_json
from cdc.config import Settings
from cdc.locks import ProcessLock
from cdc.registry import Registry


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc run`` to the ``cdc`` parser."""
    run = sub.add_parser("run", help=VERB_HELP["run"])
    run.add_argument("--once", action="store_true", help="catch up to the WAL position at start, then exit")
    run.add_argument("--json", action="store_true", help="JSON progress on stderr and a JSON summary")
    run.add_argument(
        "--verbose", action="store_true", help="also repeat a log line identical to the one before it"
    )
    run.set_defaults(handler=run_capture)


class Log:
    """The reader's log lines on stderr (``cdc run: MESSAGE``, or JSON lines with ``as_json``), each
    once: a line identical to the one before it is left out unless ``verbose``. The reader says
    what it does per session, and on wal2json < 2.6 every ``cdc run`` starts a second session at
    once, at the same position (its first asks for ``numeric-data-types-as-string``, which the
    plugin refuses: :meth:`cdc.reader.Reader._stream_session`), so "streaming N table(s) from L"
    came twice."""

    def __init__(self, *, as_json: bool, verbose: bool) -> None:
        self.as_json = as_json
        self.verbose = verbose
        self.last: str | None = None

    def __call__(self, message: str) -> None:
        if message == self.last and not self.verbose:
            return
        self.last = message
        # with --json, as JSON lines beside the snapshot progress (retries and warnings stay visible)
        line = json_dumps({"event": "log", "message": message}) if self.as_json else f"cdc run: {message}"
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


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

    log = Log(as_json=as_json, verbose=bool(args.verbose))
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
