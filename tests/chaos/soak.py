"""`make soak DURATION=10m`: a steady 2,000 changes/s through the whole pipeline (`cdc run` and
`cdc apply` as processes, the embedded log store), for a duration.

It prints the resident memory (RSS) of every process -- the reader, the Spark driver (the `cdc apply`
Python process and its JVM) and Spark's Python workers -- every minute, with the growth over the
second half of the run (after the warm-up: JIT, caches, Spark's first batches) as the flatness test, the
end-to-end lag over time (now minus the source commit time of the newest change applied, sampled
every second; the source is never idle, so this is the freshness of the derived tables), and ends
with `cdc verify`. Memory must be flat. The figures go to `docs/benchmarks/soak.md`.

    python -m tests.chaos.soak [--duration 10m] [--rate 2000]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import psycopg

from cdc.devcluster import start_cluster
from tests.chaos.harness import DDL, TABLES, Proc
from tests.plugins.apply import descendants
from tests.plugins.capture import CDC

PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smh]?)", text.strip())
    if not m:
        raise SystemExit(f"--duration {text!r}: use e.g. 90s, 10m or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE / 1e6
    except OSError:
        return 0.0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def memory(reader: Proc, apply: Proc) -> dict[str, float]:
    """RSS in MB: the reader; the Spark driver (Python + JVM); the Python workers (summed)."""
    out = {
        "reader": 0.0,
        "spark driver (python)": 0.0,
        "spark driver (jvm)": 0.0,
        "spark python workers": 0.0,
    }
    if reader.popen:
        out["reader"] = _rss_mb(reader.popen.pid)
    if apply.popen:
        root = apply.popen.pid
        out["spark driver (python)"] = _rss_mb(root)
        for pid in descendants(root):
            cmd = _comm(pid)
            if "java" in cmd.split(" ")[0]:
                out["spark driver (jvm)"] += _rss_mb(pid)
            elif "python" in cmd:
                out["spark python workers"] += _rss_mb(pid)
    return {k: round(v, 1) for k, v in out.items()}


@dataclass
class Writer:
    """Changes at a steady rate: every 100 ms a transaction of rate/10 changes (60% updates, 30%
    inserts, 10% deletes of the accounts table, plus events rows)."""

    dsn: str
    rate: int
    changes: int = 0
    behind_s: float = 0.0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        per_tick = max(1, self.rate // 10)
        next_id = 1
        live: list[int] = []
        with psycopg.connect(self.dsn) as conn:
            tick = time.monotonic()
            while not self.stop.is_set():
                with conn.transaction(), conn.cursor() as cur:
                    rows = []
                    for _ in range(per_tick):
                        r = (next_id * 7919) % 100
                        if r < 30 or len(live) < 100:
                            rows.append(("i", next_id))
                            live.append(next_id)
                            next_id += 1
                        elif r < 90:
                            rows.append(("u", live[(next_id * 31 + r) % len(live)]))
                        else:
                            rows.append(("d", live.pop((next_id * 17) % len(live))))
                    ins = [(i, f"account {i}", i % 1000, i * 0.5) for op, i in rows if op == "i"]
                    if ins:
                        cur.executemany(
                            "INSERT INTO chaos_accounts (id, name, balance, ratio) VALUES (%s, %s, %s, %s)",
                            ins,
                        )
                    upd = [(f"renamed {i} {self.changes}", i) for op, i in rows if op == "u"]
                    if upd:
                        cur.executemany(
                            "UPDATE chaos_accounts SET name = %s, updated_at = now() WHERE id = %s", upd
                        )
                    dels = [(i,) for op, i in rows if op == "d"]
                    if dels:
                        cur.executemany("DELETE FROM chaos_accounts WHERE id = %s", dels)
                self.changes += per_tick
                tick += 0.1
                delay = tick - time.monotonic()
                if delay > 0:
                    self.stop.wait(delay)
                else:
                    self.behind_s = -delay


def newest_applied_ms(state: Path) -> int | None:
    """The source commit time of the newest change the apply job applied (its metrics file or ledger)."""
    for path in (state / "metrics" / "apply.json", state / "spark" / "apply-ledger.json"):
        try:
            data = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            continue
        for key in ("newest_applied_commit_ms", "newest_event_ts_ms"):
            if isinstance(data.get(key), int):
                return int(data[key])
    return None


@dataclass
class Sampled:
    """What the soak measured while it ran: (seconds since the start, end-to-end lag) samples, the
    processes' memory at the start, middle and end, and per minute."""

    samples: list[tuple[float, float]] = field(default_factory=list)
    memory_at: dict[str, dict[str, float]] = field(default_factory=dict)
    memory_by_minute: dict[int, dict[str, float]] = field(default_factory=dict)


def _sample(reader: Proc, apply: Proc, writer: Writer, duration: float, work: Path) -> Sampled:
    """Sample the lag every second and the memory at the marks and every minute, for ``duration``
    seconds, reporting a line a minute; a process that dies ends the soak."""
    out = Sampled()
    t0 = time.monotonic()
    marks = {"start": min(60.0, duration / 4), "middle": duration / 2, "end": duration - 5}
    next_memory = t0 + 60
    next_report = t0 + 60
    while (now := time.monotonic()) - t0 < duration:
        if not reader.alive() or not apply.alive():
            raise SystemExit(f"a process died during the soak: see {work}/run.log and apply.log")
        newest = newest_applied_ms(work / "state")
        if newest is not None:
            out.samples.append((now - t0, time.time() - newest / 1000))
        for name, at in list(marks.items()):
            if now - t0 >= at:
                out.memory_at[name] = memory(reader, apply)
                del marks[name]
                print(f"  memory at the {name}: {out.memory_at[name]}", file=sys.stderr, flush=True)
        if now >= next_memory:
            out.memory_by_minute[round((now - t0) / 60)] = memory(reader, apply)
            next_memory += 60
        if now >= next_report:
            recent = [lag for t, lag in out.samples if t > now - t0 - 60]
            if recent:
                print(
                    f"  {now - t0:5.0f} s: {writer.changes:,} changes, lag p50 {statistics.median(recent):.2f} s,"
                    f" max {max(recent):.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
            next_report += 60
        time.sleep(1.0)  # the sampling period
    return out


def _memory_lines(sampled: Sampled, duration: float) -> list[str]:
    """The RSS tables: at the start, middle and end; per minute, with the second half's growth."""
    memory_at, memory_by_minute = sampled.memory_at, sampled.memory_by_minute
    lines = ["| process | RSS at the start (MB) | middle | end |", "| --- | ---: | ---: | ---: |"]
    for proc in memory_at.get("start", {}):
        lines.append(
            f"| {proc} | {memory_at.get('start', {}).get(proc, 0):,.0f} | "
            f"{memory_at.get('middle', {}).get(proc, 0):,.0f} | {memory_at.get('end', {}).get(proc, 0):,.0f} |"
        )
    minutes = sorted(memory_by_minute)
    if minutes:
        half = [m for m in minutes if m >= duration / 120]
        lines += ["", "RSS (MB) per minute:", ""]
        lines += ["| process | " + " | ".join(str(m) for m in minutes) + " | second half |"]
        lines += ["| --- | " + " | ".join("---:" for _ in minutes) + " | ---: |"]
        for proc in memory_by_minute[minutes[0]]:
            series = [memory_by_minute[m].get(proc, 0.0) for m in minutes]
            lo, hi = memory_by_minute[half[0]].get(proc, 0.0), memory_by_minute[half[-1]].get(proc, 0.0)
            growth = f"{hi - lo:+,.0f} MB ({(hi - lo) / lo * 100 if lo else 0:+.1f} %)"
            lines.append(f"| {proc} | " + " | ".join(f"{v:,.0f}" for v in series) + f" | {growth} |")
    return lines


def _lag_lines(samples: list[tuple[float, float]], duration: float) -> list[str]:
    """The end-to-end lag: p99 per minute, and p50/p99/max over the run (after its first 30 s)."""
    lags = sorted(lag for t, lag in samples if t > 30)
    per_minute: list[tuple[int, float]] = []
    for minute in range(int(duration // 60) + 1):
        window = sorted(lag for t, lag in samples if minute * 60 <= t < (minute + 1) * 60)
        if window:
            per_minute.append((minute, window[int(0.99 * (len(window) - 1))]))
    lines = [
        "",
        "End-to-end lag (now - source commit time of the newest change applied), p99 per minute:",
        "",
    ]
    lines += ["| minute | " + " | ".join(str(m + 1) for m, _ in per_minute) + " |"]
    lines += ["| --- | " + " | ".join("---:" for _ in per_minute) + " |"]
    lines += ["| p99 (s) | " + " | ".join(f"{p:.2f}" for _, p in per_minute) + " |"]
    if lags:
        lines += [
            "",
            f"Over the whole run: p50 {statistics.median(lags):.2f} s, "
            f"p99 {lags[int(0.99 * (len(lags) - 1))]:.2f} s, max {lags[-1]:.2f} s.",
        ]
    return lines


def _report(
    args: argparse.Namespace,
    duration: float,
    writer: Writer,
    sampled: Sampled,
    verify: subprocess.CompletedProcess[str],
) -> tuple[list[str], bool]:
    """The soak's figures as markdown lines, and whether `cdc verify` was clean at the end."""
    reports = orjson.loads(verify.stdout) if verify.stdout.strip() else []
    achieved = writer.changes / duration
    lines = [
        "## Soak: a steady load through the whole pipeline",
        "",
        f"{duration / 60:.0f} minutes at {args.rate:,} changes/s asked, {achieved:,.0f}/s achieved "
        f"({writer.changes:,} changes; the writer ended {writer.behind_s:.2f} s behind its schedule), "
        "embedded log store, `cdc run` and `cdc apply` (local[2]) as processes.",
        "",
    ]
    lines += _memory_lines(sampled, duration)
    lines += _lag_lines(sampled.samples, duration)
    clean = verify.returncode == 0 and all(r.get("status") == "ok" for r in reports)
    lines += [
        "",
        f"`cdc verify` at the end: {'clean' if clean else 'NOT CLEAN: ' + verify.stdout[:500]}",
        "",
    ]
    return lines, clean


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__)
    parser.add_argument("--duration", default="10m")
    parser.add_argument("--rate", type=int, default=2000, help="changes per second (default 2000)")
    parser.add_argument("--out", default="docs/benchmarks/soak.md", help="where the figures go ('' for none)")
    args = parser.parse_args()
    duration = parse_duration(args.duration)
    pg_base = Path(tempfile.mkdtemp(prefix="cdc-soak-pg-"))
    work = Path(tempfile.mkdtemp(prefix="cdc-soak-"))
    cluster = start_cluster(pg_base)
    db = cluster.create_database("soak")
    dsn = cluster.dsn(db)
    (work / "cdc.toml").write_text("heartbeat_interval_s = 1\n")
    env = {
        **os.environ,
        "CDC_SOURCE": dsn,
        "CDC_STATE": str(work / "state"),
        "CDC_CONFIG": str(work / "cdc.toml"),
    }
    env.pop("CDC_LOG", None)
    cluster.execute(DDL, db)
    for table in TABLES:
        subprocess.run([*CDC, "tables", "add", table], env=env, check=True, capture_output=True)
    reader = Proc("cdc run", [*CDC, "run"], env, work / "run.log")
    apply = Proc("cdc apply", [*CDC, "apply", "--stall-timeout", "60"], env, work / "apply.log")
    writer = Writer(dsn, args.rate)
    try:
        reader.start()
        apply.start()
        thread = threading.Thread(target=writer.run, daemon=True)
        thread.start()
        sampled = _sample(reader, apply, writer, duration, work)
        writer.stop.set()
        thread.join(30)
        verify = subprocess.run(
            [*CDC, "verify", "--json", "--wait", "300"], env=env, capture_output=True, text=True
        )
        lines, clean = _report(args, duration, writer, sampled, verify)
        print("\n".join(lines))
        if args.out:
            Path(args.out).write_text(
                f"<!-- written by `make soak DURATION={args.duration}` on {time.strftime('%Y-%m-%d')} -->\n"
                + "\n".join(lines)
            )
        return 0 if clean else 1
    finally:
        writer.stop.set()
        reader.stop()
        apply.stop()
        cluster.stop("immediate")
        shutil.rmtree(pg_base, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
