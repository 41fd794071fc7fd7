""":func:`cdc.locks.process_start`: a process named by its pid and its start time, however odd its
command's name (``/proc/<pid>/stat`` puts it in parentheses)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cdc.locks import process_runs, process_start


def test_a_process_start_is_read_past_a_name_with_spaces_and_parentheses(tmp_path: Path) -> None:
    odd = tmp_path / "a) b (c) 1 2"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        mine, theirs = process_start(os.getpid()), process_start(child.pid)
        assert mine is not None and theirs is not None and theirs >= mine
        assert process_runs(child.pid, theirs) and not process_runs(child.pid, theirs + 1)
        assert process_runs(child.pid)  # no start time known: by the pid alone
    finally:
        child.communicate(b"")
    assert process_start(child.pid) is None and not process_runs(child.pid, theirs)
