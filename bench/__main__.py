"""``make bench``: every benchmark with its peer in the same run, ratios printed.

``python -m bench [NAME ...] [--quick] [--no-write]``. Each module listed in BENCHMARKS has
``run(quick: bool) -> str``: it prints progress and figures as it goes and returns a Markdown
section, which is written to ``docs/benchmarks/NAME.md`` (full runs only, and not with ``--no-write``:
a full-size run that only prints, e.g. to compare a branch) so the figures are committed;
a module with ``SECTION_OF = "OTHER"`` has its section put in ``docs/benchmarks/OTHER.md`` instead,
between ``<!-- begin NAME -->`` and ``<!-- end NAME -->`` (replaced, or appended the first time).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import re
import time
from pathlib import Path

BENCHMARKS = [
    "logstore_embedded",
    "logstore_kafka",
    "capture",
    "toast_fill",
    "nonfinite",
    "snapshot",
    "chunked",
    "apply",
    "apply_cluster",
    "jvm",
    "freshness",
    "freshness_cluster",
    "freshness_sustained",
    "decoders",
    "reader_steady",
    "search_shards",
    "wait",
    "views",
    "rebuild",
    "write_amp",
    "write_amp_catchup",
    "write_amp_wide",
    "compact_aging",
    "verify_incremental",
    "cli_start",
]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("names", nargs="*", choices=[[], *BENCHMARKS], default=[])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the benchmarks run")
    parser.add_argument(
        "--no-write", action="store_true", help="full size, printed only: docs/benchmarks untouched"
    )
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
        if args.quick or args.no_write:
            continue
        into = getattr(module, "SECTION_OF", None)
        if into is None:
            (out / f"{name}.md").write_text(header + section + _kept_sections(out / f"{name}.md"))
            continue
        _put_section(out / f"{into}.md", name, header + section)


def _kept_sections(path: Path) -> str:
    """The other benchmarks' sections in ``path`` (``SECTION_OF``), kept when it is rewritten."""
    old = path.read_text() if path.exists() else ""
    found = re.finditer(r"<!-- begin (\S+) -->\n.*?<!-- end \1 -->\n", old, flags=re.S)
    return "".join("\n" + m.group(0) for m in found)


def _put_section(path: Path, name: str, text: str) -> None:
    """``text`` between ``name``'s markers in ``path``: replacing the block there, or appended."""
    begin, end = f"<!-- begin {name} -->\n", f"<!-- end {name} -->\n"
    old = path.read_text() if path.exists() else ""
    block = begin + text.rstrip("\n") + "\n" + end
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        path.write_text(head + block + rest.split(end, 1)[1])
    else:
        path.write_text(old.rstrip("\n") + "\n\n" + block)


if __name__ == "__main__":
    main()
