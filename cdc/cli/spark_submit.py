"""``spark-submit cdc/cli/spark_submit.py [cdc apply flags]``: the apply job under spark-submit.

The same as ``cdc apply`` (same flags, ``--state``/``--log`` accepted anywhere); spark-submit's own
``--master``/``--conf`` configure the session (:mod:`spark_jobs.session`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cdc.cli import main as cdc_main


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``cdc apply`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--state")
    parser.add_argument("--log")
    known, rest = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    pre = []
    if known.state:
        pre += ["--state", known.state]
    if known.log:
        pre += ["--log", known.log]
    if rest[:1] == ["apply"]:
        rest = rest[1:]
    return cdc_main([*pre, "apply", *rest])


if __name__ == "__main__":
    sys.exit(main())
