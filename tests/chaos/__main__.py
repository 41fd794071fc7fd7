"""`make chaos`: the fault suite at full size on both log-store backends (see harness.py).

python -m tests.chaos [--size full|ci] [--backend embedded|kafka|both] [--decoder wal2json|pgoutput]
                     [--seed N] [--json] [--cycles N] [--kinds K,...] [--budget-min M]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path

import orjson

from cdc.devcluster import start_cluster
from tests.chaos.harness import Chaos, Report, Size, tansu


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--size", default="full", choices=["full", "ci"])
    parser.add_argument("--backend", default="both", choices=["embedded", "kafka", "both"])
    parser.add_argument("--decoder", default="wal2json", choices=["wal2json", "pgoutput"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print the reports as JSON on stdout")
    parser.add_argument("--cycles", type=int, help="how many faults (default: by --size)")
    parser.add_argument("--kinds", help="only these kinds of fault, comma-separated (default: all)")
    parser.add_argument(
        "--budget-min",
        type=float,
        help="inject no fault after this many minutes, then end as usual (final verify, count, disk)",
    )
    args = parser.parse_args()
    size = Size.named(args.size)
    if args.cycles:
        size = dataclasses.replace(size, cycles=args.cycles)
    if args.budget_min:
        size = dataclasses.replace(size, budget_s=args.budget_min * 60)
    kinds = tuple(args.kinds.split(",")) if args.kinds else None
    backends = ["embedded", "kafka"] if args.backend == "both" else [args.backend]
    base = Path(tempfile.mkdtemp(prefix="cdc-chaos-"))
    pg_base = Path(tempfile.mkdtemp(prefix="cdc-chaos-pg-"))  # chowned to postgres by start_cluster
    cluster = start_cluster(pg_base)
    reports: list[Report] = []
    completed = False  # an exception keeps the logs too
    try:
        for backend in backends:
            print(f"chaos: {backend} log store, {size.cycles} faults", file=sys.stderr)
            db = cluster.create_database("chaos")
            say = lambda line: print(line, file=sys.stderr)  # noqa: E731
            common = {"say": say, "kinds": kinds, "decoder": args.decoder}
            if backend == "kafka":
                with tansu() as (bootstrap, pid):
                    run = Chaos(
                        cluster,
                        db,
                        base / backend,
                        backend,
                        size,
                        args.seed,
                        bootstrap,
                        kafka_pid=pid,
                        **common,
                    )
                    reports.append(run.run())
            else:
                reports.append(Chaos(cluster, db, base / backend, backend, size, args.seed, **common).run())
        completed = True
    finally:
        cluster.stop("immediate")
        shutil.rmtree(pg_base, ignore_errors=True)
        if completed and all(r.ok for r in reports):
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"the processes' logs are kept in {base}/*/logs", file=sys.stderr)
    if args.json:
        sys.stdout.write(orjson.dumps([r.to_dict() for r in reports]).decode() + "\n")
    else:
        for r in reports:
            print("\n".join(r.lines()))
    return 0 if all(r.ok for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
