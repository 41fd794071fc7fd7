"""The reader's CPU per change under a steady, rate-limited load (issue 32): what a continuous
``cdc run`` costs per captured change when transactions arrive a few at a time, against its peer
``pg_recvlogical`` on its own slot, in the same run.

A private PostgreSQL 15, ``pgbench -i -s 2`` (200k accounts); per round, for each decoder (wal2json
and pgoutput, side by side): a new state directory with ``pgbench_accounts``, ``pgbench_branches``
and ``pgbench_tellers`` registered and snapshotted (``cdc run --once``), then a continuous
``cdc run`` at its defaults (a subprocess) and ``pg_recvlogical`` to /dev/null on its own slot with
the options the reader sends (wal2json: the same ``add-tables``; pgoutput: a publication of the same
tables). Then pgbench's TPC-B, rate-limited (``-R 300 -T 60``: about 900 captured changes/s, an
update of each of the three tables a transaction; ``pgbench_history`` is not captured). CPU
(``/proc`` utime + stime) of each consumer and of the walsender serving it, from just before the
load until every slot has been sent the load's last change and each ``cdc run`` has appended it
(its topics' end offsets), divided by the captured changes (3 x pgbench's transactions, checked
against what ``cdc run`` appended). Medians over ``$BENCH_READER_STEADY_ROUNDS`` (3) rounds.

``python -m bench reader_steady`` (writes ``docs/benchmarks/reader_steady.md``) or
``python -m bench.reader_steady [--seconds 60] [--rounds 3] [--profile DIR]``: ``--profile`` also
records ``py-spy record --gil`` (raw, collapsed stacks) of each ``cdc run`` through round 1's load into
DIR, and prints each profile's frames by their share of the samples (inclusive): where the reader's
time goes, by thread (the stream loop, the log writer, the store's background compaction).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from bench._common import CDC, cdc_env, cpu_s, discard_cluster, loadavg, say
from cdc.devcluster import PG_BIN, start_cluster

RATE = 300  # pgbench transactions/s: 3 captured changes each
SECONDS = int(os.environ.get("BENCH_READER_STEADY_S", "60"))
ROUNDS = int(os.environ.get("BENCH_READER_STEADY_ROUNDS", "3"))
TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers")
DECODERS = ("wal2json", "pgoutput")
RECV_PUB = "recv_pub"


def _recv_options(decoder: str) -> list[str]:
    """The options ``cdc run`` sends, for ``pg_recvlogical`` (the same tables)."""
    from cdc.codec.wal2json import BASE_OPTIONS

    if decoder == "wal2json":
        opts = dict(BASE_OPTIONS, **{"add-tables": ",".join(f"public.{t}" for t in TABLES)})
    else:
        opts = {"proto_version": "2", "publication_names": RECV_PUB, "messages": "true", "streaming": "on"}
    return [f"{k}={v}" for k, v in opts.items()]


@dataclass
class _Consumer:
    label: str
    slot: str
    proc: subprocess.Popen[bytes]
    state: Path | None = None  # cdc run's
    walsender: int = 0
    cpu0: float = 0.0
    ws0: float = 0.0
    cpu: float = 0.0
    ws: float = 0.0
    appended: int = 0


@dataclass
class _Round:
    changes: int
    seconds: float
    load: str
    per_change_us: dict[str, float] = field(default_factory=dict)  # "label process"/"label walsender"


def _appended(state: Path) -> int:
    """The records ``cdc run`` appended to the three tables' topics (end offsets; compaction keeps them)."""
    from cdc.logstore.embedded import EmbeddedLogStore

    store = EmbeddedLogStore(state / "log", compaction_interval_s=None)
    try:
        return sum(
            sum(t.end_offsets.values()) for t in store.list_topics() if t.name.split(".")[-1] in TABLES
        )
    finally:
        store.close()


def _lsn(conn: psycopg.Connection) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def _start_cdc(dsn: str, base: Path, decoder: str, k: int) -> tuple[_Consumer, int]:
    """A snapshotted state directory for ``decoder`` and its continuous ``cdc run``; (consumer, the
    records its snapshot appended)."""
    slot = f"cdc_{decoder}_{k}"
    state = base / f"state-{slot}"
    env = {**cdc_env(dsn, state, slot), "CDC_DECODER": decoder}
    for t in TABLES:
        subprocess.run([*CDC, "tables", "add", f"public.{t}"], env=env, check=True, capture_output=True)
    subprocess.run([*CDC, "run", "--once"], env=env, check=True, capture_output=True)
    log = open(base / f"{slot}.log", "wb")  # noqa: SIM115 - the process's for its life
    proc = subprocess.Popen([*CDC, "run"], env=env, stdout=log, stderr=subprocess.STDOUT)
    return _Consumer(f"cdc run ({decoder})", slot, proc, state), _appended(state)


def _start_recv(dsn: str, base: Path, decoder: str, k: int) -> _Consumer:
    slot = f"recv_{decoder}_{k}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, %s)", [slot, decoder])
    cmd = [str(PG_BIN / "pg_recvlogical"), "-d", dsn, "-S", slot, "--start", "-f", "/dev/null", "--no-loop"]
    for opt in _recv_options(decoder):
        cmd += ["-o", opt]
    err = open(base / f"{slot}.err", "wb")  # noqa: SIM115 - the process's for its life
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    return _Consumer(f"pg_recvlogical ({decoder})", slot, proc)


def _await(what: str, check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _walsenders(conn: psycopg.Connection, consumers: list[_Consumer]) -> bool:
    for c in consumers:
        if c.proc.poll() is not None:
            raise RuntimeError(f"{c.label} ended early (exit {c.proc.returncode})")
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", [c.slot]
        ).fetchone()
        c.walsender = int(row[0]) if row and row[0] else 0
    return all(c.walsender for c in consumers)


def _sent(conn: psycopg.Connection, consumers: list[_Consumer], lsn: int) -> bool:
    """Every walsender sent up to ``lsn``."""
    rows = dict(conn.execute("SELECT pid, sent_lsn - '0/0'::pg_lsn FROM pg_stat_replication").fetchall())
    return all(int(rows.get(c.walsender) or 0) >= lsn for c in consumers)


def _await_appends(c: _Consumer, records: int) -> None:
    """Wait until ``c`` (a ``cdc run``) has appended ``records`` records to the three topics."""
    state = c.state
    assert state is not None
    _await(f"{c.label}'s appends", lambda: _appended(state) >= records, 300)


def _profile(consumers: list[_Consumer], seconds: int, out: Path) -> list[subprocess.Popen[bytes]]:
    out.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    return [
        subprocess.Popen(
            [
                spy,
                "record",
                "--gil",
                "-r",
                "200",
                "-d",
                str(seconds),
                "-f",
                "raw",
                "-o",
                str(out / f"{c.slot}.txt"),
                "-p",
                str(c.proc.pid),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for c in consumers
        if c.state is not None
    ]


#: the frames every sample of a thread has (start-up, the session, a thread's bootstrap): left out
_ENTRY_FRAMES = ("<module>", "main ", "entry ", "run_capture ", "Reader.", "stream ", "Thread.")


def profile_shares(path: Path, top: int = 25) -> str:
    """The frames of a raw py-spy profile (collapsed stacks) by their share of the samples, inclusive."""
    total = 0
    incl: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        total += int(n)
        for frame in set(stack.split(";")):
            incl[frame] += int(n)
    rows = [
        f"{100 * v / total:5.1f}%  {frame}"
        for frame, v in incl.most_common()
        if not frame.startswith(_ENTRY_FRAMES)
    ][:top]
    return f"{path.name}: {total} samples\n" + "\n".join(rows)


def _round(dsn: str, base: Path, k: int, seconds: int, profile: Path | None) -> _Round:
    consumers: list[_Consumer] = []
    try:
        snap: dict[str, int] = {}
        for decoder in DECODERS:
            cdc, snap[cdc.slot] = _start_cdc(dsn, base, decoder, k)
            consumers += [cdc, _start_recv(dsn, base, decoder, k)]
        with psycopg.connect(dsn, autocommit=True) as conn:
            _await("the walsenders", lambda: _walsenders(conn, consumers), 120)
            time.sleep(2)  # start-up done: the consumers idle in their loops
            load = loadavg()
            for c in consumers:
                c.cpu0, c.ws0 = cpu_s(c.proc.pid), cpu_s(c.walsender)
            t0 = time.monotonic()
            spies = _profile(consumers, seconds, profile) if profile else []
            res = subprocess.run(
                ["pgbench", "-n", "-c", "4", "-j", "2", "-R", str(RATE), "-T", str(seconds), dsn],
                check=True,
                capture_output=True,
                text=True,
            )
            end = _lsn(conn)
            txns = int(re.findall(r"number of transactions actually processed: (\d+)", res.stdout)[0])
            changes = 3 * txns
            _await("the walsenders to send the load", lambda: _sent(conn, consumers, end), 300)
            for c in consumers:
                if c.state is not None:
                    _await_appends(c, snap[c.slot] + changes)
            elapsed = time.monotonic() - t0
            for c in consumers:
                c.cpu, c.ws = cpu_s(c.proc.pid) - c.cpu0, cpu_s(c.walsender) - c.ws0
                if c.state is not None:
                    c.appended = _appended(c.state) - snap[c.slot]
                    if c.appended != changes:
                        raise RuntimeError(f"{c.label} appended {c.appended} records, expected {changes}")
            for spy in spies:
                spy.wait(seconds + 60)
            for c in consumers:
                if profile and c.state is not None and (profile / f"{c.slot}.txt").exists():
                    say(profile_shares(profile / f"{c.slot}.txt"))
        r = _Round(changes, elapsed, load)
        for c in consumers:
            r.per_change_us[f"{c.label} process"] = c.cpu / changes * 1e6
            r.per_change_us[f"{c.label} walsender"] = c.ws / changes * 1e6
        return r
    finally:
        for c in consumers:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGINT if c.state is None else signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.proc.wait(60)
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for c in consumers:
                with contextlib.suppress(psycopg.Error):
                    conn.execute("SELECT pg_drop_replication_slot(%s)", [c.slot])


def measure(seconds: int = SECONDS, rounds: int = ROUNDS, profile: Path | None = None) -> str:
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-reader-steady-"))
    pg = start_cluster(Path(tempfile.mkdtemp(prefix="cdc-bench-reader-steady-pg-")))
    try:
        dsn = pg.dsn("postgres")
        subprocess.run(["pgbench", "-i", "-s", "2", "-q", dsn], check=True, capture_output=True)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE PUBLICATION {RECV_PUB} FOR TABLE {', '.join(TABLES)}")
        results = []
        for k in range(rounds):
            r = _round(dsn, base, k, seconds, profile if k == 0 else None)
            say(
                f"round {k + 1}: {r.changes:,} changes in {r.seconds:.1f} s (load {r.load}); CPU µs/change: "
                + ", ".join(f"{name} {v:.1f}" for name, v in r.per_change_us.items())
            )
            results.append(r)
        return _report(results, seconds)
    finally:
        discard_cluster(pg, base)


def _report(results: list[_Round], seconds: int) -> str:
    med = {
        name: statistics.median(r.per_change_us[name] for r in results) for name in results[0].per_change_us
    }
    lines = [
        "## The reader under a steady load (`python -m bench reader_steady`)\n",
        f"pgbench TPC-B scale 2 at `-R {RATE} -T {seconds}` (about {RATE * 3} captured changes/s: "
        "accounts, tellers, branches), a continuous `cdc run` at its defaults and `pg_recvlogical` "
        "(to /dev/null, its own slot, the same tables) per decoder, all four in the same run. CPU "
        "(`/proc` utime + stime) per captured change, from the load's start until every consumer has "
        f"it; medians of {len(results)} rounds. The machine was shared and loaded (load averages "
        "per round below).\n",
        "| decoder | `cdc run` µs/change | its walsender | `pg_recvlogical` µs/change | its walsender "
        "| `cdc run` / `pg_recvlogical` | `cdc run` / its walsender |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for d in DECODERS:
        cdc, cws = med[f"cdc run ({d}) process"], med[f"cdc run ({d}) walsender"]
        recv, rws = med[f"pg_recvlogical ({d}) process"], med[f"pg_recvlogical ({d}) walsender"]
        lines.append(
            f"| {d} | {cdc:.1f} | {cws:.1f} | {recv:.1f} | {rws:.1f} | {cdc / recv:.1f}× | {cdc / cws:.2f}× |"
        )
    lines.append("\nRounds:\n")
    for k, r in enumerate(results):
        lines.append(
            f"- round {k + 1}: {r.changes:,} changes in {r.seconds:.1f} s, load {r.load}: "
            + ", ".join(f"{name} {v:.1f}" for name, v in r.per_change_us.items())
        )
    return "\n".join(lines) + "\n"


def run(quick: bool = False) -> str:
    return measure(seconds=10 if quick else SECONDS, rounds=1 if quick else ROUNDS)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.reader_steady")
    parser.add_argument("--seconds", type=int, default=SECONDS)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--profile", type=Path, default=None, help="py-spy --gil profiles of round 1 here")
    args = parser.parse_args()
    print(measure(args.seconds, args.rounds, args.profile), flush=True)


if __name__ == "__main__":
    main()
