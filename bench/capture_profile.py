"""Where the reader's CPU per change goes (issue #34): one workload, then ``cdc run --once`` with
each decoder (and ``pg_recvlogical`` beside it, the same run), optionally under cProfile.

Not a figure of record (``bench capture`` is): a quicker loop for the per-change path's work.
``python -m bench.capture_profile [--changes N] [--profile DIR] [--decoders pgoutput,wal2json]``:
N changes (default 300,000: 2/3 inserts in 10 transactions, 1/3 single-row updates 1,000 per
transaction, :func:`bench.capture._workload`); ``--baseline DIR``: each decoder's ``cdc run`` with the
code of the checkout DIR too (before/after pairs in one session); ``--rounds R``: every consumer R
times, on slots of its own, the order reversed every other round; with ``--profile``, each cdc run also writes its
cProfile stats to DIR (the profiler's own cost inflates the CPU figures: read them without it).
Prints, per consumer: wall seconds, the process's CPU µs per change net of the same process run
with nothing to stream, the walsender's, the changes per wait of the process (its voluntary context
switches, every thread's: a reader faster than its walsender waits for the stream every few
messages), and the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import psycopg

from bench._common import CDC, discard_cluster, loadavg, say
from bench.capture import (
    PGOUTPUT_OPTS,
    WAL2JSON_OPTS,
    _cdc_once,
    _cdc_state,
    _consume,
    _create_slots,
    _drop_slots,
    _pg_recvlogical,
    _Run,
    _setup_source,
    _wal_lsn,
    _workload,
)
from cdc.devcluster import start_cluster


def _profiled(env: dict[str, str], dsn: str, out: Path) -> _Run:
    """``cdc run --once --json`` under cProfile (stats to ``out``)."""
    code = (
        "import cProfile, sys; sys.argv = ['cdc', 'run', '--once', '--json']; "
        "from cdc.cli import entry; "
        f"cProfile.run('entry()', {str(out)!r})"
    )
    return _consume([CDC[0], "-c", code], dsn, env["CDC_SLOT"], env, Path(env["CDC_STATE"]))


def _sampled(env: dict[str, str], dsn: str, out: Path) -> _Run:
    """``cdc run --once --json`` under py-spy (collapsed stacks of every thread, C frames of the
    compiled path included, to ``out``); the CPU figures are py-spy's own, not the reader's."""
    cmd = [
        str(Path(sys.executable).with_name("py-spy")),
        "record",
        "-r",
        "1000",
        "-f",
        "raw",
        "--threads",
        "--native",
        "-o",
        str(out),
        "--",
    ]
    return _consume(
        [*cmd, *CDC, "run", "--once", "--json"], dsn, env["CDC_SLOT"], env, Path(env["CDC_STATE"])
    )


def _baseline(env: dict[str, str], dsn: str, checkout: Path) -> _Run:
    """``cdc run --once --json`` with the code of ``checkout`` (not this one's, which the
    consumers' working directory would put first on the path)."""
    env = {**env, "PYTHONPATH": str(checkout)}
    code = "import sys; del sys.path[0]; from cdc.cli import entry; entry()"
    cmd = [CDC[0], "-c", code, "run", "--once", "--json"]
    return _consume(cmd, dsn, env["CDC_SLOT"], env, Path(env["CDC_STATE"]))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench.capture_profile")
    ap.add_argument("--changes", type=int, default=300_000)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--py-spy", type=Path, default=None, help="sample each cdc run with py-spy into DIR")
    ap.add_argument("--decoders", default="pgoutput,wal2json")
    ap.add_argument("--python-path", action="store_true", help="pgoutput's Python path too (CDC_NATIVE=0)")
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="also run cdc from this checkout (its code, its build: before/after pairs)",
    )
    ap.add_argument(
        "--rounds", type=int, default=1, help="every consumer this many times (order reversed every other)"
    )
    args = ap.parse_args(argv)
    updates = args.changes // 3
    inserts = args.changes - updates
    decoders = args.decoders.split(",")
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-capprof-"))
    pg = start_cluster(Path(tempfile.mkdtemp(prefix="cdc-bench-pg-")))
    try:
        dsn, idle = _setup_source(pg, base)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE bench")
        one = [(f"recv_{d}", d, False) for d in decoders] + [(f"cdc_{d}", d, True) for d in decoders]
        if args.baseline is not None:
            one += [(f"cdc_{d}_base", d, True) for d in decoders]
        if args.python_path and "pgoutput" in decoders:
            one.append(("cdc_pgoutput_python", "pgoutput", True))
        labels = []
        for r in range(args.rounds):
            labels += [(f"{label}_r{r}", d, c) for label, d, c in (one if r % 2 == 0 else one[::-1])]
        _create_slots(dsn, [(label, d) for label, d, _ in labels])
        _workload(dsn, inserts, updates)
        endpos = _wal_lsn(dsn)
        n = inserts + updates
        say(f"{n:,} changes written; load {loadavg()}")
        for label, decoder, is_cdc in labels:
            if is_cdc:
                env = _cdc_state(base, dsn, label, decoder=decoder)
                env.pop("CDC_NATIVE", None)
                if "_python_" in label:
                    env["CDC_NATIVE"] = "0"
                if "_base_" in label:
                    run = _baseline(env, dsn, args.baseline)
                elif args.py_spy is not None:
                    args.py_spy.mkdir(parents=True, exist_ok=True)
                    run = _sampled(env, dsn, args.py_spy / f"{label}.txt")
                elif args.profile is not None:
                    args.profile.mkdir(parents=True, exist_ok=True)
                    run = _profiled(env, dsn, args.profile / f"{label}.prof")
                else:
                    run = _cdc_once(env, dsn)
                if run.summary.get("changes") != n:
                    raise RuntimeError(f"{label} streamed {run.summary.get('changes')} changes, expected {n}")
                net = (run.cpu - idle[decoder].cpu) / n * 1e6
            else:
                opts = WAL2JSON_OPTS if decoder == "wal2json" else PGOUTPUT_OPTS
                run = _pg_recvlogical(dsn, label, endpos, opts, base)
                net = run.cpu / n * 1e6
            ws = run.walsender_cpu / n * 1e6
            say(
                f"{label}: {run.seconds:.2f} s, {n / run.seconds:,.0f} changes/s; CPU µs/change: "
                f"process {run.cpu / n * 1e6:.2f} (net {net:.2f}), walsender {ws:.2f}, "
                f"process/walsender {f'{net / ws:.2f}' if ws else 'n/a (walsender not sampled)'}; "
                f"{n / max(1, run.waits):.1f} changes a wait (voluntary context switch); load {loadavg()}"
            )
        _drop_slots(dsn, [label for label, _, _ in labels])
    finally:
        discard_cluster(pg, base)


if __name__ == "__main__":
    main(sys.argv[1:])
