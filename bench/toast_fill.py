"""What filling in unchanged TOAST values costs the reader (issue 31), the same run without it beside.

Workload on a private cluster: ``bench (id bigint PK, n int, body text)``, ``body`` 4 kB stored out
of line (``STORAGE EXTERNAL``), N rows (full: 1M, ``BENCH_ROWS``; ``--quick``: 20k). Four pipelines
read the same WAL, each with its own slot and state directory: each decoder (wal2json, pgoutput)
with the fill (``fill_unchanged_toast = true``, the default) and without it (``false``: the events list
``body`` in ``unavailable``, no image store). Each first streams the N inserts (which give the
images their values; not measured). Then, in rounds (``CDC_BENCH_ROUNDS``, 3; medians), N/2
single-row updates of ``n``, 1,000 per transaction, every one leaving ``body`` out, and each
pipeline's ``cdc run --once`` through them (order reversed every other round): its CPU (``wait4``)
net of an idle run's, the walsender's CPU, the peak RSS (``VmHWM``). Also the image store's size
against the table's out-of-line bytes.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import psycopg

from bench._common import cdc_env, loadavg, say
from bench.capture import CDC_PUB, _cdc_once, _create_slots, _mb, _Run
from cdc.devcluster import PgCluster, start_cluster

DECODERS = ("wal2json", "pgoutput")
PIPELINES = [(decoder, fill) for decoder in DECODERS for fill in (1, 0)]


def _label(decoder: str, fill: int) -> str:
    return f"{decoder}_{'fill' if fill else 'nofill'}"


def _state(base: Path, dsn: str, decoder: str, fill: int) -> dict[str, str]:
    """A state directory for ``cdc run`` on its own slot (``public.bench`` registered, nothing to
    snapshot); its environment."""
    from cdc.registry import Registry, State, TableReg

    label = _label(decoder, fill)
    state = base / f"state-{label}"
    with Registry(state) as reg:
        reg.add(TableReg("public", "bench", "cdc.public.bench", ("id",), snapshot_state="done"))
        reg.set_state(State.INITIAL_SNAPSHOT, "done")
    config = state / "cdc.toml"
    config.write_text(f"fill_unchanged_toast = {'true' if fill else 'false'}\n")
    return {
        **cdc_env(str(dsn), state, label, config=config),
        "CDC_DECODER": decoder,
        "CDC_PUBLICATION": CDC_PUB,
    }


def _updates(dsn: str, rows: int, updates: int, k: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"""
            DO $$
            DECLARE b int; r int;
            BEGIN
              FOR b IN 0 .. {updates // 1000} - 1 LOOP
                FOR r IN 1 .. 1000 LOOP
                  UPDATE bench SET n = n + 1
                  WHERE id = mod((b * 1000 + r + {k * updates})::bigint * 7919, {rows}) + 1;
                END LOOP;
                COMMIT;
              END LOOP;
            END $$
            """)


def _run_checked(env: dict[str, str], dsn: str, changes: int) -> _Run:
    run = _cdc_once(env, dsn)
    if run.summary["changes"] != changes:
        raise RuntimeError(f"{env['CDC_SLOT']} streamed {run.summary['changes']} changes, expected {changes}")
    return run


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*") if p.is_file())


def run(quick: bool = False) -> str:
    rows = int(os.environ.get("BENCH_ROWS", 20_000 if quick else 1_000_000))
    updates = rows // 2
    rounds = int(os.environ.get("CDC_BENCH_ROUNDS", 1 if quick else 3))
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-toast-"))
    pg: PgCluster = start_cluster(Path(tempfile.mkdtemp(prefix="cdc-bench-pg-")))
    try:
        pg.execute("CREATE DATABASE bench")
        dsn = pg.dsn("bench")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE bench (id bigint PRIMARY KEY, n int, body text)")
            conn.execute("ALTER TABLE bench ALTER COLUMN body SET STORAGE EXTERNAL")
        envs = {(d, f): _state(base, dsn, d, f) for d, f in PIPELINES}
        _create_slots(dsn, [(_label(d, f), d) for d, f in PIPELINES])
        idle = {p: _run_checked(env, dsn, 0) for p, env in envs.items()}  # start-up; cdc's publication
        t0 = time.perf_counter()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for k in range(10):
                conn.execute(
                    "INSERT INTO bench SELECT g, 0, repeat(md5(g::text), 128) "
                    "FROM generate_series(%s::bigint, %s::bigint) g",
                    [k * rows // 10 + 1, (k + 1) * rows // 10],
                )
            toast = conn.execute(
                "SELECT pg_total_relation_size(reltoastrelid), (SELECT sum(octet_length(body)) FROM bench) "
                "FROM pg_class WHERE relname = 'bench'"
            ).fetchone()
        assert toast is not None
        say(f"{rows:,} rows of 4 kB written in {time.perf_counter() - t0:.1f} s; load {loadavg()}")
        for p, env in envs.items():
            t0 = time.perf_counter()
            _run_checked(env, dsn, rows)
            say(f"  {_label(*p)}: the inserts streamed in {time.perf_counter() - t0:.1f} s")
        runs: dict[tuple[str, int], list[_Run]] = {p: [] for p in PIPELINES}
        loads = []
        for k in range(rounds):
            t0 = time.perf_counter()
            _updates(dsn, rows, updates, k)
            say(f"round {k + 1}: {updates:,} updates in {time.perf_counter() - t0:.1f} s; load {loadavg()}")
            for p in PIPELINES if k % 2 == 0 else list(reversed(PIPELINES)):
                run = _run_checked(envs[p], dsn, updates)
                runs[p].append(run)
                net = (run.cpu - idle[p].cpu) / updates * 1e6
                say(
                    f"  {_label(*p)}: {run.seconds:.2f} s, CPU {net:.2f} µs/change net of start-up, "
                    f"walsender {run.walsender_cpu / updates * 1e6:.2f} µs/change, "
                    f"peak RSS {_mb(run.peaks, 'maxrss')} MB"
                )
            loads.append(loadavg())
        images = _bytes(Path(envs[("pgoutput", 1)]["CDC_STATE"]) / "images.sqlite")
        images_w = _bytes(Path(envs[("wal2json", 1)]["CDC_STATE"]) / "images.sqlite")
        return _report(
            rows, updates, rounds, runs, idle, loads, (int(toast[0]), int(toast[1])), images, images_w
        )
    finally:
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)


def _report(
    rows: int,
    updates: int,
    rounds: int,
    runs: dict[tuple[str, int], list[_Run]],
    idle: dict[tuple[str, int], _Run],
    loads: list[str],
    toast: tuple[int, int],
    images: int,
    images_w: int,
) -> str:
    def net(p: tuple[str, int]) -> float:
        return statistics.median((r.cpu - idle[p].cpu) / updates * 1e6 for r in runs[p])

    def wal(p: tuple[str, int]) -> float:
        return statistics.median(r.walsender_cpu / updates * 1e6 for r in runs[p])

    def wall(p: tuple[str, int]) -> float:
        return statistics.median(r.seconds for r in runs[p])

    lines = [
        "# Filling in unchanged TOAST values: what it costs the reader",
        "",
        f"`python -m bench toast_fill`: {rows:,} rows with a 4 kB `body` stored out of line, then "
        f"{rounds} round(s) of {updates:,} single-row updates of another column (1,000 a transaction), "
        "each leaving `body` out. Each decoder's `cdc run --once` with the fill (the default) and "
        "without it (`fill_unchanged_toast = false`), on their own slots through the same WAL, into the "
        "durable embedded log store; medians. CPU: the process's (`wait4`) net of an idle run's "
        f"start-up. Load per round: {'; '.join(loads)}.",
        "",
        "| decoder | with the fill: µs CPU/change | without | ratio | walsender µs/change | wall with / without | peak RSS with the fill |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for decoder in DECODERS:
        on, off = (decoder, 1), (decoder, 0)
        rss = max(int(r.peaks.get("maxrss", 0)) for r in runs[on]) / 2**20
        lines.append(
            f"| {decoder} | {net(on):.2f} | {net(off):.2f} | **{net(on) / net(off):.2f}×** | "
            f"{wal(on):.2f} | {wall(on):.2f} s / {wall(off):.2f} s | {rss:.0f} MB |"
        )
    lines += [
        "",
        f"The image store after the run: {images / 2**20:,.0f} MB (pgoutput's), {images_w / 2**20:,.0f} MB "
        f"(wal2json's), against the table's out-of-line bytes: {toast[1] / 2**20:,.0f} MB of `body` "
        f"values, {toast[0] / 2**20:,.0f} MB of TOAST relation: "
        f"{images / max(1, toast[1]):.2f}× the values.",
        "",
        "Each event with the fill carries the whole 4 kB value, where without it `body` is listed in "
        "`unavailable`: the ratio holds the image lookup, the larger event (built with the stored JSON "
        "spliced in as it is, `orjson.Fragment`) and its larger append.",
    ]
    return "\n".join(lines) + "\n"
