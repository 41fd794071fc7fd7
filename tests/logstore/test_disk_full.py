"""The embedded store on a full disk: a clear StoreFullError, nothing acknowledged lost, nothing of
the failed append visible, and the writer goes on once space is freed -- the same instance, and a
writer restarted in a new process (as ``cdc run`` is after it crashes on the error).

Two ways to fill the disk: a real size-limited file system (a small tmpfs, where ``mount`` is
allowed: root in a container; skipped elsewhere, with the reason) and, everywhere, SQLite's own page
limit (``PRAGMA max_page_count``) on the writer's connection, which makes SQLite fail exactly as
its VFS does on ENOSPC (SQLITE_FULL).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdc.logstore import Record, StoreFullError, TopicConfig
from cdc.logstore.embedded import EmbeddedLogStore


def batch(n: int, size: int = 1000, tag: str = "") -> list[Record]:
    return [Record(f"{tag}{n}-{i}".encode(), os.urandom(size)) for i in range(20)]


def values_by_partition(path: Path, topic: str) -> dict[int, list[bytes | None]]:
    with EmbeddedLogStore(path) as reader:
        return {p: [r.value for r in reader.iter_partition(topic, p)] for p in reader.end_offsets(topic)}


def test_injected_disk_full(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with EmbeddedLogStore(path, writer=True, compaction_interval_s=None) as store:
        store.create_topic("t", TopicConfig(partitions=2))
        for n in range(5):
            store.append("t", batch(n))
        before = values_by_partition(path, "t")
        ends = store.end_offsets("t")
        conn = store._topics["t"].conn  # the writer's own connection: cap the file at its size now
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count={pages}")
        failed = [Record(f"big-{i}".encode(), os.urandom(50_000)) for i in range(40)]
        with pytest.raises(StoreFullError) as err:
            store.append("t", failed)
        assert "full" in str(err.value) and str(path / "t.db") in str(err.value)
        assert err.value.fix and "free space" in err.value.fix
        assert err.value.exit_code == 2
        # nothing acknowledged lost, nothing of the failed append visible
        assert store.end_offsets("t") == ends
        assert values_by_partition(path, "t") == before
        with pytest.raises(StoreFullError):  # still full: still a clear error
            store.append("t", failed)
        conn.execute("PRAGMA max_page_count=1073741823")  # space freed
        last = store.append("t", failed)
        assert sum(last.values()) + len(last) == sum(ends.values()) + len(failed)
    after = values_by_partition(path, "t")
    for p, values in before.items():
        assert after[p][: len(values)] == values
    assert sorted(v for p in after for v in after[p][len(before[p]) :]) == sorted(r.value for r in failed)


WRITER = r"""
import json, os, sys
from cdc.logstore import Record, StoreFullError, TopicConfig
from cdc.logstore.embedded import EmbeddedLogStore
store = EmbeddedLogStore(sys.argv[1], writer=True, compaction_interval_s=None)
store.create_topic("t", TopicConfig(partitions=2))
acked = {0: [], 1: []}
n = 0
while True:
    recs = [Record(b"%d-%d" % (n, i), b"%d-%d|" % (n, i) + os.urandom(2000)) for i in range(10)]
    try:
        last = store.append("t", recs)
    except StoreFullError as exc:
        print(json.dumps({"error": str(exc), "fix": exc.fix, "ends": store.end_offsets("t")}), flush=True)
        break
    n += 1
assert sys.stdin.readline().strip() == "freed"
last = store.append("t", [Record(b"after-free", b"ok")])
print(json.dumps({"appended": last}), flush=True)
os._exit(3)  # a crash: no close(), no clean shutdown
"""


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (needs mount: root); skipped where it cannot be made."""
    mnt = tmp_path / f"small-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.strip()}); the injected test covers this")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_filesystem_then_space_freed_and_restart(small_fs: Path) -> None:
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (1024 * 1024))  # what gets deleted to free space
    path = small_fs / "log"
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()  # pytest-timeout fails the test if it never comes
        assert line, child.stderr.read() if child.stderr else ""
        full = json.loads(line)
        assert "disk holding the log store is full" in full["error"] and "free space" in full["fix"]
        ends = {int(p): o for p, o in full["ends"].items()}
        assert sum(ends.values()) > 0
        # everything acknowledged is there, in order, and nothing of the failed append
        before = values_by_partition(path, "t")
        assert {p: len(v) for p, v in before.items()} == ends
        for values in before.values():
            seq = [tuple(map(int, v.split(b"|", 1)[0].split(b"-"))) for v in values if v]
            assert seq == sorted(seq)
        filler.unlink()
        child.stdin.write("freed\n")
        child.stdin.flush()
        appended = json.loads(child.stdout.readline())["appended"]
        assert child.wait(timeout=120) == 3
    finally:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
    [(p, offset)] = appended.items()
    assert int(offset) == ends[int(p)]  # the next offset after the acknowledged ones
    # a writer restarted after the crash finds the store consistent and goes on
    with EmbeddedLogStore(path, writer=True, compaction_interval_s=None) as store:
        assert store.end_offsets("t") == {q: ends[q] + (1 if q == int(p) else 0) for q in ends}
        after = values_by_partition(path, "t")
        for q, values in before.items():
            assert after[q][: len(values)] == values
        assert after[int(p)][-1] == b"ok"
        store.append("t", [Record(b"restarted", b"fine")])
        store.compact("t")
    assert sum(len(v) for v in values_by_partition(path, "t").values()) == sum(ends.values()) + 2
