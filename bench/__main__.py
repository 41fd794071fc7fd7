"""``make bench``: every benchmark with its peer in the same run, ratios printed.

``python -m bench [NAME ...] [--quick]``. Each module listed in BENCHMARKS has
``run(quick: bool) -> str``: it prints progress and figures as it goes and returns a Markdown
section, which is written to ``docs/benchmarks/NAME.md`` (full runs only) so the figures are committed.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import time
from pathlib import Path

BENCHMARKS = [
    "logstore_embedded",
    "logstore_kafka",
    "capture",
    "nonfinite",
    "snapshot",
    "chunked",
    "apply",
    "freshness",
    "decoders",
    "search_shards",
]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], default=[])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the benchmarks run")
    args = parser.parse_args()
    names = args.names or BENCHMARKS
    out = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        module = importlib.import_module(f"bench.{name}")
        print(f"\n=== {name} ===", flush=True)
        started = time.time()
        section = module.run(quick=args.quick)
        header = (
            f"<!-- written by `python -m bench {name}` on {time.strftime('%Y-%m-%d')}, "
            f"{platform.machine()}, {__import__('os').cpu_count()} cores, {time.time() - started:.0f} s -->\n"
        )
        if not args.quick:
            (out / f"{name}.md").write_text(header + section)


if __name__ == "__main__":
    main()
