"""``cdc demo``: the pipeline end to end on a private Postgres and the embedded log store."""

from __future__ import annotations

import argparse
from pathlib import Path

from cdc.cli import VERB_HELP
from cdc.cli.demo.pipeline import run_demo
from cdc.config import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to the ``cdc`` parser."""
    p = sub.add_parser("demo", help=VERB_HELP["demo"])
    p.add_argument("--dir", type=Path, help="work directory (default: a new temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the state (Delta tables, index) afterwards")
    p.add_argument(
        "--verbose", action="store_true", help="run and apply with --verbose (Spark's start-up output too)"
    )
    p.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace, settings: Settings) -> int:
    return run_demo(args.run_cli, args.dir, keep=args.keep, verbose=args.verbose)
