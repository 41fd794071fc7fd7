"""CPU of a short ``cdc`` verb's start (issue #33): what every ``cdc status --json`` poll, ``cdc
tables``, ``cdc wait``, ``cdc check``, ``cdc run --once`` and ``cdc --help`` pays before its work.

Each case is a fresh interpreter (this one, ``PYTHONPATH`` the tree measured, ``OPENBLAS_NUM_THREADS=1``
as ``cdc`` sets it) that imports what the verb imports on its common path: its parser
(:func:`cdc.cli.build_parser` of the verb, which imports the verb's module) and the modules its
handler imports before its work. Two cases run ``cdc`` itself: ``cdc --help``, and ``cdc status
--json`` on an empty state directory with a source that refuses the connection at once (port 1 of
this host: no network wait), the whole process. The figure is the median over the runs of the
child's user + system CPU (``resource.getrusage(RUSAGE_CHILDREN)`` before and after each run);
``python -c pass`` is the interpreter's own floor.

``python -m bench cli_start``: this tree, written to ``docs/benchmarks/cli_start.md``.
``python -m bench.cli_start [--runs N] [--against PATH] [--write]``: with ``--against``, the same cases
with the ``cdc`` of PATH (a checkout, e.g. of main: ``PYTHONPATH=PATH``) in the same run, alternated
run by run, and the ratio; ``--write`` writes that to ``docs/benchmarks/cli_start.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import loadavg, say

ROOT = Path(__file__).resolve().parent.parent


def _imports(verb: str, *modules: str) -> str:
    """The code of a process that imports what ``cdc VERB`` imports before its work."""
    extra = "".join(f"import {m}\n" for m in modules)
    return f"from cdc.cli import build_parser\nbuild_parser({verb!r})\n{extra}"


def _cdc(*argv: str) -> str:
    """The code of a ``cdc`` process (its exit code ignored)."""
    return (
        f"import sys\nsys.argv = ['cdc', *{list(argv)!r}]\nfrom cdc.cli import entry\n"
        "try:\n    entry()\nexcept SystemExit:\n    pass\n"
    )


def cases(state: str) -> dict[str, str]:
    """Case -> the code its process runs (``state``: an empty state directory)."""
    return {
        "python -c pass (the floor)": "pass",
        "cdc --help": _cdc("--help"),
        "cdc status --json: imports": _imports("status", "cdc.cli.status.gather", "cdc.cli.status.options"),
        "cdc status --json: whole process": _cdc(
            "--state", state, "--source", "postgresql://127.0.0.1:1/bench", "status", "--json"
        ),
        "cdc tables: imports": _imports("tables"),
        "cdc wait: imports": _imports("wait", "cdc.cli.wait.lsn"),
        "cdc check: imports": _imports("check"),
        "cdc run --once: imports before the reader starts": _imports(
            "run", "cdc.faults", "cdc.logstore.factory", "cdc.reader", "snapshot.progress"
        ),
    }


def cpu_ms(code: str, tree: Path, cwd: str) -> float:
    """User + system CPU (ms) of one new interpreter running ``code`` with ``tree``'s ``cdc``, in
    ``cwd`` (no ``cdc.toml``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_", "PYTHONPATH"))}
    env.update(PYTHONPATH=str(tree), OPENBLAS_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, timeout=120
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return 1000 * (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)


def measure(trees: list[Path], runs: int) -> dict[str, list[float]]:
    """Case -> the median CPU (ms) per tree; the trees alternate run by run (the same load)."""
    out: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as state:
        for name, code in cases(state).items():
            samples: list[list[float]] = [[] for _ in trees]
            for _ in range(runs):
                for i, tree in enumerate(trees):
                    samples[i].append(cpu_ms(code, tree, state))
            out[name] = [statistics.median(s) for s in samples]
            say(f"{name}: " + ", ".join(f"{m:.0f} ms" for m in out[name]))
    return out


def _commit(tree: Path) -> str:
    """The tree's checked-out commit (short), "?" outside git; its uncommitted changes count too."""
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "?"


def report(trees: list[Path], runs: int) -> str:
    """The Markdown section: the median CPU of each case per tree (and the ratio of two)."""
    started = loadavg()
    medians = measure(trees, runs)
    heads = [f"{'this tree' if t == ROOT else f'`{t}`'} at {_commit(t)}" for t in trees]
    lines = [
        "# Start-up CPU of the short `cdc` verbs",
        "",
        f"Median user + system CPU of a new process per case over {runs} runs "
        f"(`bench/cli_start.py`; load average {started} at the start, {loadavg()} at the end). "
        "Imports: what the verb imports before its work (its parser, its handler's modules).",
        "",
        "| case | "
        + " | ".join(f"{h} (ms)" for h in heads)
        + (" | ratio (first / second) |" if len(trees) == 2 else ""),
        "|---|" + "---:|" * len(trees) + ("---:|" if len(trees) == 2 else ""),
    ]
    for name, ms in medians.items():
        ratio = f" {ms[0] / ms[1]:.2f}x |" if len(trees) == 2 and ms[1] else ""
        lines.append(f"| {name} | " + " | ".join(f"{m:.0f}" for m in ms) + " |" + ratio)
    return "\n".join(lines) + "\n"


def run(quick: bool) -> str:
    """``python -m bench cli_start``: this tree only."""
    return report([ROOT], 3 if quick else 9)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cli_start")
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--against", type=Path, help="another checkout's cdc, measured in the same run")
    parser.add_argument("--write", action="store_true", help="write docs/benchmarks/cli_start.md")
    args = parser.parse_args()
    trees = [ROOT] + ([args.against.resolve()] if args.against else [])
    started = time.time()
    section = report(trees, args.runs)
    print(section)
    if args.write:
        command = " ".join(["python -m bench.cli_start", *sys.argv[1:]])
        header = (
            f"<!-- written by `{command}` on {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
            f"{os.cpu_count()} cores, {time.time() - started:.0f} s -->\n"
        )
        (ROOT / "docs" / "benchmarks" / "cli_start.md").write_text(header + section)


if __name__ == "__main__":
    main()
