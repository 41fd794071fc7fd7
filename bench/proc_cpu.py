"""CPU of every process on the machine over a span, summed per kind of process (a bench's
companion: what each stage of the pipeline costs while a workload runs).

``python -m bench.proc_cpu SECONDS [EVERY]``: samples ``/proc/*/stat`` (utime + stime) every
``EVERY`` seconds (default 30) for ``SECONDS``, and prints per kind -- the Spark Python workers, the
JVMs, ``cdc apply``'s and ``cdc run``'s processes, pgbench, the walsender and Postgres' other
backends, a bench's own driver -- the CPU seconds and the share of one core. A process that starts
within the span counts from its start; one that ends between two samples loses its last interval.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

from bench._common import cpu_s


def snapshot() -> dict[int, tuple[float, str, str]]:
    """pid -> (CPU seconds so far, command line, command name)."""
    out: dict[int, tuple[float, str, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cpu, comm = cpu_s(int(entry.name)), (entry / "comm").read_text().strip()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[int(entry.name)] = (cpu, cmd[:300], comm)
    return out


def kind(cmd: str, comm: str) -> str:
    """The kind of process a command line is."""
    if "pyspark.daemon" in cmd or "pyspark.worker" in cmd:
        return "Spark Python workers"
    if "java" in comm or cmd.startswith("/usr/lib/jvm") or " org.apache.spark" in cmd:
        return "JVMs"
    if "cdc" in cmd and " apply" in cmd:
        return "cdc apply (driver)"
    if "cdc" in cmd and " run" in cmd:
        return "cdc run"
    if comm == "pgbench":
        return "pgbench"
    if "postgres" in comm or "postgres:" in cmd:
        return "Postgres walsender" if "START_REPLICATION" in cmd or "walsender" in cmd else "Postgres, other"
    if "-m bench" in cmd:
        return "the bench's own driver"
    return f"other: {comm}"


def main() -> None:
    seconds = float(sys.argv[1])
    every = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
    prev, started = snapshot(), time.time()
    spent: collections.Counter[str] = collections.Counter()
    while time.time() - started < seconds:
        time.sleep(every)
        cur = snapshot()
        for pid, (cpu, cmd, comm) in cur.items():
            spent[kind(cmd, comm)] += max(cpu - (prev[pid][0] if pid in prev else 0.0), 0.0)
        prev = cur
    elapsed = time.time() - started
    for name, cpu in spent.most_common(12):
        print(f"{name:40s} {cpu:8.1f} s  {100 * cpu / elapsed:5.1f}% of a core")
    print(f"over {elapsed:.0f} s", flush=True)


if __name__ == "__main__":
    main()
