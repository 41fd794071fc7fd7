"""One process per role per state directory (issue 9 item 1): real processes, both backends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from cdc.errors import LockedError
from cdc.locks import ProcessLock
from tests.plugins.capture import CDC, CaptureEnv, wait_streaming
from tests.plugins.postgres import wait_for

# the lock tests without a database start `cdc apply` / `cdc deadletters` processes: kept out of
# make check as before
pytestmark = pytest.mark.postgres

HOLD = (
    "import sys; from pathlib import Path; from cdc.locks import ProcessLock\n"
    "with ProcessLock(Path(sys.argv[1]), sys.argv[2]):\n"
    "    print('held', flush=True); sys.stdin.read()\n"
)


def _hold(state: Path, role: str) -> subprocess.Popen[str]:
    """Another process holding ``role``'s lock on ``state`` until its stdin closes."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(state), role],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def _snapshot_of_state(env: CaptureEnv) -> tuple[object, ...]:
    with env.registry() as reg:
        regs = reg.list_tables()
        state = (reg.generation(), [(r.qualified, r.snapshot_state) for r in regs])
    with env.store() as store:
        ends = {t.name: t.end_offsets for t in sorted(store.list_topics(), key=lambda t: t.name)}
    slots = env.pg.fetch(
        f"SELECT slot_name, active_pid FROM pg_replication_slots WHERE slot_name LIKE '{env.slot}%'"
    )
    return state, ends, slots


@pytest.mark.parametrize("env", ["embedded", "kafka"], indirect=True)
def test_second_run_is_refused_with_the_first_ones_pid_and_host(env: CaptureEnv) -> None:
    env.sql("CREATE TABLE t (id int PRIMARY KEY, v text)")
    env.sql("INSERT INTO t SELECT g, 'x' FROM generate_series(1, 50) g")
    env.add_table("public.t")
    first = env.spawn("run")
    wait_streaming(env, first)
    env.sql("INSERT INTO t VALUES (51, 'y')")
    wait_for(lambda: sum(len(v) for v in [env.records(env.reg("public", "t").topic)]) >= 51, what="event 51")
    before = _snapshot_of_state(env)
    second = env.cdc("run", "--once", timeout=120)
    assert second.returncode == 2, second.stderr
    assert f"pid {first.pid}" in second.stderr and socket.gethostname() in second.stderr
    assert "nothing was changed" in second.stderr
    assert first.poll() is None  # the first goes on
    assert _snapshot_of_state(env) == before


def test_second_apply_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    holder = _hold(state, "apply")
    try:
        res = subprocess.run(
            [*CDC, "--state", str(state), "apply", "--once"],
            capture_output=True,
            text=True,
            timeout=120,
            env={k: v for k, v in os.environ.items() if not k.startswith("CDC_")},
        )
        assert res.returncode == 2, res.stderr
        assert f"pid {holder.pid}" in res.stderr and socket.gethostname() in res.stderr
        assert "starting Spark" not in res.stdout  # refused before anything ran
        assert sorted(p.name for p in state.iterdir()) == ["locks"]
    finally:
        holder.communicate("", timeout=30)


def test_lock_is_released_when_the_holder_dies(tmp_path: Path) -> None:
    holder = _hold(tmp_path, "run")
    with pytest.raises(LockedError) as err:
        ProcessLock(tmp_path, "run").acquire()
    assert err.value.pid == holder.pid  # type: ignore[attr-defined]
    holder.kill()
    holder.wait(timeout=30)
    with ProcessLock(tmp_path, "run") as lock:
        assert lock.holder()["pid"] == os.getpid()
    assert oct((tmp_path / "locks" / "run.lock").stat().st_mode & 0o777) == oct(0o600)


@pytest.mark.parametrize("env", ["embedded", "kafka"], indirect=True)
def test_reader_refuses_to_drop_an_active_slot(env: CaptureEnv) -> None:
    """A slot whose initial snapshot never completed is recreated -- unless a process streams from it."""
    if env.log_url:
        pytest.skip("backend-independent")
    env.sql("CREATE TABLE t (id int PRIMARY KEY)")
    env.add_table("public.t")
    env.pg.execute(
        f"SELECT pg_create_logical_replication_slot('{env.slot}', '{env.settings().decoder}')", env.db
    )
    with env.registry() as reg:
        reg.set_state("initial_snapshot", "running")
    # another process streams from the slot (pg_recvlogical stands in for a second reader)
    other = subprocess.Popen(
        [
            "/usr/lib/postgresql/15/bin/pg_recvlogical",
            "-d",
            env.dsn,
            "-S",
            env.slot,
            "--start",
            "-f",
            "/dev/null",
        ]
    )
    try:
        wait_for(
            lambda: env.pg.fetch(f"SELECT active FROM pg_replication_slots WHERE slot_name = '{env.slot}'")[
                0
            ][0],
            what="the other process to hold the slot",
        )
        res = env.cdc("run", "--once", timeout=120)
        assert res.returncode == 2
        assert "in use by another process" in res.stderr, res.stderr
        rows = env.pg.fetch(f"SELECT active_pid FROM pg_replication_slots WHERE slot_name = '{env.slot}'")
        assert rows and rows[0][0] is not None  # still there, still the other one's
    finally:
        other.kill()
        other.wait(timeout=30)


def _files(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` but the locks, with its size and mtime."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.parent.name != "locks"
    }


def test_deadletters_replay_is_refused_next_to_apply(tmp_path: Path) -> None:
    """`cdc deadletters replay` writes the sinks `cdc apply` writes: next to a running apply it exits
    2 naming the holder's pid and host, and changes nothing; with the lock free it replays."""
    from cdc.events import dead_letter_topic
    from cdc.logstore.embedded import EmbeddedLogStore
    from cdc.registry import Registry
    from sinks import DeadLetter
    from sinks.dead_letters import TOPIC_CONFIG, encode
    from tests.plugins.changes import ChangeWriter, make_reg

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    reg = make_reg("public", "items", [("id", "bigint"), ("name", "text")], search=("name",))
    with Registry(state) as registry:
        registry.add(reg)
    store = EmbeddedLogStore(state / "log", writer=True, compaction_interval_s=None)
    try:
        w = ChangeWriter(store, reg, partitions=1)
        with w.txn():
            w.insert({"id": 1, "name": "replayed widget"})
        (rec,) = w.written
        store.create_topic(dead_letter_topic("cdc"), TOPIC_CONFIG)
        letter = DeadLetter(reg.topic, 0, 0, rec.key, rec.value, "a sink could not hold it", reg.qualified)
        store.append(dead_letter_topic("cdc"), [encode(letter, 0, "cdc-apply-test")])
    finally:
        store.close()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("CDC_")}
    replay = [*CDC, "--state", str(state), "deadletters", "replay"]
    before = _files(state)
    holder = _hold(state, "apply")
    try:
        res = subprocess.run(replay, capture_output=True, text=True, timeout=120, env=environ)
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"another `cdc apply` (pid {holder.pid} on host {socket.gethostname()})" in res.stderr
        assert "nothing was changed" in res.stderr and "fix:" in res.stderr and res.stdout == ""
        assert _files(state) == before  # no sink table, no index, no replayed.json
    finally:
        holder.communicate("", timeout=30)
    res = subprocess.run([*replay, "--json"], capture_output=True, text=True, timeout=120, env=environ)
    assert res.returncode == 0, res.stderr
    assert orjson.loads(res.stdout)["replayed"] == 1
    assert _files(state) != before  # what the refused replay would have written


def test_refusal_names_the_command_that_holds_the_lock(tmp_path: Path) -> None:
    """A `cdc apply` refused because a replay holds the apply lock says so, not "another apply"."""
    with ProcessLock(tmp_path, "apply", command="cdc deadletters replay"), pytest.raises(LockedError) as err:
        ProcessLock(tmp_path, "apply").acquire()
    assert f"another `cdc deadletters replay` (pid {os.getpid()}" in str(err.value)
