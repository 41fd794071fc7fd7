"""The ``cdc`` command: one error boundary that sets the exit code.

Each verb group lives in its own module with a ``register(subparsers)`` function that adds its
parsers and sets ``handler`` on them; this module lists those modules explicitly (no registration
by import side effect). A handler has the signature ``handler(args, settings) -> int``.
Text goes to people, ``--json`` to scripts; errors go to stderr (as JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cdc.cli import (
    apply,
    capture,
    check,
    deadletters,
    demo,
    query,
    serve,
    snapshot,
    status,
    tables,
    topic,
    verify,
)
from cdc.cli.output import print_error
from cdc.config import load_settings
from cdc.errors import CdcError
from cdc.paths import PRIVATE_UMASK, tighten

VERB_MODULES = (
    check,
    tables,
    capture,
    snapshot,
    topic,
    apply,
    deadletters,
    query,
    verify,
    demo,
    status,
    serve,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cdc", description="Change-data-capture for PostgreSQL.")
    parser.add_argument("--source", help="source DSN or URI (default: $CDC_SOURCE, cdc.toml)")
    parser.add_argument("--state", help="state directory (default: $CDC_STATE or .cdc)")
    parser.add_argument("--log", help="log store: kafka://HOST:PORT (default: $CDC_LOG, else embedded)")
    parser.set_defaults(run_cli=main)  # for `cdc demo`, which runs verbs without importing the CLI
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    for module in VERB_MODULES:
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    as_json = bool(getattr(args, "json", False))
    # least privilege on disk: whatever this process (and Spark, tantivy, delta-rs under it) creates
    # is private to this user; restored on return for in-process callers (the demo, tests)
    old_umask = os.umask(PRIVATE_UMASK)
    try:
        settings = load_settings(
            {"source": args.source, "state": args.state, "log": args.log}, dict(os.environ), Path.cwd()
        )
        tighten(settings.state_dir)
        code = int(args.handler(args, settings))
    except CdcError as err:
        print_error(err, as_json=as_json)
        code = err.exit_code
    except KeyboardInterrupt:
        code = 130
    finally:
        os.umask(old_umask)
    sys.stdout.flush()
    return code


def entry() -> None:  # pragma: no cover - console script shim
    sys.exit(main())
