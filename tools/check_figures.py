"""List the figures in README.md and docs/*.md that no bench output stands behind.

The developers' guide: every figure in the README and ``docs/`` comes from a committed bench's
output, with its date and command. This lists each line holding a measurement-looking figure (a
number with a unit of time, size, rate, ratio or percentage) whose paragraph cites no bench: no
``docs/benchmarks/`` file, no ``python -m bench``, ``make bench``, ``make chaos``, ``make soak`` or
``python -m tests.chaos`` command. In a Markdown table each row is its own paragraph, and a bare
``NAME.md`` cites ``docs/benchmarks/NAME.md`` when the paragraph before the table names
``docs/benchmarks/`` (the README's benchmark table).

Not figures: numbers inside `code` spans and fenced blocks (settings, commands, sample output), and a
number right after a word that makes it a setting or a limit ("every 2 s", "default 60 s", "at most
10 MB", "timeout of 5 s"). ``docs/benchmarks/`` itself is written by the benches and not checked.

``python tools/check_figures.py`` prints ``path:line: figure(s) | the line`` and a count; it exits 1
when there is any. ``--count`` prints only the count.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CITATION = re.compile(
    r"docs/benchmarks/|python -m bench\b|make bench\b|make chaos\b|make soak\b|python -m tests\.chaos\b"
    r"|pytest (?:-s )?tests/chaos\b"
)
UNIT = (
    r"(?:%|[x×](?![\w-])|µs|us\b|ns\b|ms\b|s\b|min\b|minutes?\b|seconds?\b|hours?\b|h\b"
    r"|[kKMGT]i?B\b|bytes\b|[a-zA-Z]+/s\b|/s\b)"
)
FIGURE = re.compile(r"(?<![\w.,/-])(\d[\d,]*(?:\.\d+)?)(?:-\d[\d,]*(?:\.\d+)?)?[ \u00a0]?" + UNIT)
# a word right before the number that makes it a setting, a limit or a protocol constant
SETTING = re.compile(
    r"(?:\b(?:every|default|defaults to|default of|timeout|timeout of|at most|at least|up to|max|maximum|"
    r"minimum|limit|limit of|after|within|under|over|below|above|than|past|bar|cap|capped at|"
    r"interval|each|per|set to|rotating|budget|window|starts at|the lower of)|[=≤≥<>])\s*\(?\s*$"
    # a setting's value right after its name: `name` (5 s), `name`: 5 s, `name` = 5 s
    r"|\x00\s*[(:=,]?\s*$",
    re.IGNORECASE,
)
# a setting's value named after it: "10 s by default", "5 s default"
SETTING_AFTER = re.compile(r"\)?\s*(?:by default|default\b|timeout\b|limit\b|of\s*\x00)", re.IGNORECASE)
# a size that describes an input, not a measurement: "9 KB rows", "rows of ~9 KB", "values of 20 MB"
INPUT = re.compile(r"^\s*(?:rows?|records?|values?|of TOAST)\b", re.IGNORECASE)
INPUT_BEFORE = re.compile(
    r"(?:rows?|records?|values?|blocks?|buffers?) of (?:~|about )?(?:\d+(?:,| and) )*$", re.IGNORECASE
)
CODE_SPAN = re.compile(r"`[^`]*`")
# a table row whose first cell is a setting's name (`[status]`, `lag_warn_s`): a table of settings
SETTINGS_ROW = re.compile(r"^\s*\|\s*`")
HEADER = "\x00header"
EXEMPT = "<!-- figures: "
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def paragraphs(text: str) -> Iterator[tuple[int, list[str], str]]:
    """``(first line number, lines, context)`` of each paragraph or table row outside fenced
    blocks; ``context`` is the paragraph before a table, for its rows (for its header row, that
    paragraph with the header's own mark, so a header is cited by the paragraph alone)."""
    block: list[str] = []
    start = 0
    fenced = False
    in_table = False
    previous = ""
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.lstrip().startswith("|"):
            if block:
                previous = "\n".join(block)
                yield start, block, ""
                block = []
            header = not in_table
            in_table = True
            yield number, [line], previous + (HEADER if header else "")
            continue
        in_table = False
        if not line.strip() or line.startswith("#"):
            if block:
                previous = "\n".join(block)
                yield start, block, ""
            block = []
            continue
        if not block:
            start = number
        block.append(line)


def figures(paragraph: str) -> list[tuple[int, str]]:
    """``(line offset, figure)`` of each measurement-looking figure of a paragraph: code spans and
    settings left out."""
    if SETTINGS_ROW.match(paragraph):
        return []
    # a code span becomes one NUL (a setting's name, for SETTING) padded to keep the line breaks
    plain = CODE_SPAN.sub(lambda m: "\x00" + "\n" * m.group(0).count("\n"), paragraph)
    found = []
    for match in FIGURE.finditer(plain):
        before, after = plain[: match.start()], plain[match.end() :]
        if SETTING.search(before[-24:]) or SETTING_AFTER.match(after[:16]):
            continue
        if match.group(0)[-1] == "B" and (INPUT.match(after[:16]) or INPUT_BEFORE.search(before[-32:])):
            continue
        if float(match.group(1).replace(",", "")) == 0:
            continue  # nothing, not a measurement
        found.append((before.count("\n"), match.group(0)))
    return found


def cited(paragraph: str, context: str, benches: set[str]) -> bool:
    """Whether a paragraph (or a table row, with the paragraph before its table) names a bench, or
    says that its figures are not measurements (``<!-- figures: arithmetic, not a measurement -->``)."""
    if CITATION.search(paragraph) or EXEMPT in paragraph:
        return True
    if context and CITATION.search(context):
        named = any(f"`{name}`" in paragraph or f"{name}," in paragraph for name in benches)
        return named or bool(DATE.search(paragraph)) or context.endswith(HEADER)
    return False


def uncited(root: Path = ROOT) -> list[tuple[str, int, list[str], str]]:
    """``(path, line number, figures, line)`` of every uncited figure line in README.md and docs/*.md."""
    benches = {path.name for path in (root / "docs" / "benchmarks").glob("*.md")}
    found = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for start, lines, context in paragraphs(text):
            paragraph = "\n".join(lines)
            if cited(paragraph, context, benches):
                continue
            by_line: dict[int, list[str]] = {}
            for offset, figure in figures(paragraph):
                by_line.setdefault(offset, []).append(figure)
            for offset, hits in sorted(by_line.items()):
                found.append((str(path.relative_to(root)), start + offset, hits, lines[offset].strip()))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(prog="python tools/check_figures.py", description=__doc__.split("\n")[0])
    parser.add_argument("--count", action="store_true", help="print only how many lines are listed")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to check (default: this one)")
    args = parser.parse_args()
    found = uncited(args.root)
    if not args.count:
        for path, number, hits, line in found:
            print(f"{path}:{number}: {', '.join(hits)} | {line[:140]}")
    print(f"{len(found)} line(s) with a figure and no bench cited in their paragraph")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
