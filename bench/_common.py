"""Helpers the benchmarks share: progress output, process CPU, the ``cdc`` command line, paced
writers, a COPY read and discarded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg

#: ``cdc`` as a new process of this interpreter (append the verb and its arguments)
CDC = [sys.executable, "-c", "from cdc.cli import entry; entry()"]


def say(msg: str) -> None:
    """Print a progress line now (benchmarks run for minutes)."""
    print(msg, flush=True)


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages, for the report (the machine is shared)."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (a Postgres backend, the broker) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def discard_cluster(pg: Any, base: Path) -> None:
    """Stop a bench's private Postgres at once and remove its directory and the bench's ``base``."""
    try:
        pg.stop("immediate")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(pg.datadir.parent, ignore_errors=True)


def cdc_env(
    dsn: str, state: Path, slot: str, *, prefix: str | None = None, config: Path | None = None
) -> dict[str, str]:
    """This process's environment for a ``cdc`` process on ``state`` with the embedded log store:
    ``CDC_LOG`` unset, and ``CDC_CONFIG`` unset unless ``config`` is given."""
    env = {**os.environ, "CDC_SOURCE": dsn, "CDC_STATE": str(state), "CDC_SLOT": slot}
    if prefix is not None:
        env["CDC_TOPIC_PREFIX"] = prefix
    env.pop("CDC_LOG", None)
    env.pop("CDC_CONFIG", None)
    for name in [k for k in env if k.startswith("CDC_BENCH_")]:
        env.pop(name)  # the benchmarks' own knobs (CDC_BENCH_ROUNDS): cdc refuses unknown CDC_* names
    if config is not None:
        env["CDC_CONFIG"] = str(config)
    return env


def cdc_caller(
    dsn: str, state: Path, slot: str, prefix: str, config: Path, timeout: float
) -> Callable[..., str]:
    """``cdc ARGS`` as a subprocess on ``state`` (the embedded log store): returns its stdout, and
    fails the benchmark on a non-zero exit."""
    env = cdc_env(dsn, state, slot, prefix=prefix, config=config)

    def call(*args: str) -> str:
        res = subprocess.run([*CDC, *args], env=env, capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, res.stderr
        return res.stdout

    return call


def late_table(
    dsn: str, state: Path, slot: str, config_text: str, table: str, timeout: float
) -> Callable[..., str]:
    """A pipeline on the new directory ``state`` (cdc.toml ``config_text``) that snapshotted and
    streams the one-row ``public.tiny``, with ``table`` registered after it: the next ``cdc run
    --once`` reads ``table`` as a chunked snapshot. Returns the pipeline's :func:`cdc_caller`."""
    state.mkdir(parents=True)
    config = state / "cdc.toml"
    config.write_text(config_text)
    call = cdc_caller(dsn, state, slot, "bench", config, timeout=timeout)  # its own log store: any prefix
    call("tables", "add", "public.tiny")
    call("run", "--once")
    call("tables", "add", table)
    return call


def paced(per_s: float, stop: threading.Event) -> Iterator[int]:
    """0, 1, 2, ... at ``per_s`` a second until ``stop`` is set: a writer's loop at a target rate
    (it sleeps until each step is due, and catches up without sleeping when it falls behind)."""
    nxt = time.monotonic()
    k = 0
    while not stop.is_set():
        yield k
        k += 1
        nxt += 1 / per_s
        time.sleep(max(0.0, nxt - time.monotonic()))


def copy_peer(dsn: str, query: Any) -> tuple[float, float, int]:
    """(seconds, backend CPU seconds, bytes) of a ``COPY ... TO STDOUT`` read and discarded."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pid = conn.info.backend_pid
        cpu0 = cpu_s(pid)
        t0 = time.perf_counter()
        nbytes = 0
        with conn.cursor().copy(query) as copy:
            for chunk in copy:
                nbytes += len(chunk)
        elapsed = time.perf_counter() - t0
        return elapsed, cpu_s(pid) - cpu0, nbytes
