"""``cdc serve [--host HOST] [--port PORT] [--token TOKEN]``: metrics, status and the dashboard.

Loopback (127.0.0.1:8787) unless ``[serve]`` or the flags say otherwise; a non-loopback bind needs a
token (``--token`` or ``CDC_SERVE_TOKEN``), and then every request must carry it. Runs until SIGTERM
or Ctrl-C (exit 0). See :mod:`cdc.cli.serve`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from types import FrameType

from pydantic import SecretStr

from cdc.cli import VERB_HELP
from cdc.config import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``cdc serve`` to the ``cdc`` parser."""
    p = sub.add_parser("serve", help=VERB_HELP["serve"])
    p.add_argument("--host", help="address to bind (default 127.0.0.1; others need --token)")
    p.add_argument("--port", type=int, help="port (default 8787; 0 picks a free one)")
    p.add_argument("--token", help="token every request must carry (default: $CDC_SERVE_TOKEN)")
    p.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace, settings: Settings) -> int:
    from cdc.cli.serve.server import ServeOptions, Server

    options = ServeOptions.from_settings(settings)
    changes = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    options = options.model_copy(update=changes)
    raw = args.token if args.token is not None else os.environ.get("CDC_SERVE_TOKEN")  # the entry point
    server = Server(settings, options, token=SecretStr(raw) if raw else None)
    host, port = server.address
    sys.stderr.write(f"cdc serve: http://{host}:{port}/ (metrics at /metrics, status at /status)\n")
    sys.stderr.flush()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0
