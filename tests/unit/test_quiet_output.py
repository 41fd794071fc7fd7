"""Keeping what a user sees to cdc's own lines (issue #35), without a JVM: the filter the Spark
driver JVM's stderr passes through, pyspark's Python warnings, and `cdc run`'s log lines, each once
unless ``--verbose``."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from cdc.cli.capture import Log
from spark_jobs.session import StderrFilter, drain_jvm_stderr, quiet_python_warnings


def test_the_jvm_stderr_filter_drops_the_start_up_noise_and_keeps_every_other_line(
    capfd: pytest.CaptureFixture[str],
) -> None:
    f = StderrFilter()
    os.write(f.write_fd, b"WARNING: Using incubator modules: jdk.incubator.vector\n")
    os.write(
        f.write_fd, b"Using Spark's default log4j profile: org/apache/spark/log4j2-defaults.properties\n"
    )
    os.write(f.write_fd, b'Setting default log level to "WARN".\nTo adjust logging level use sc.setLogLevel(')
    os.write(f.write_fd, b"newLevel). For SparkR, use setLogLevel(newLevel).\n")  # a line in two writes
    os.write(
        f.write_fd, b"26/11/28 16:46:23 ERROR Executor: a real error\nTraceback (most recent call last):\n"
    )
    os.write(f.write_fd, b"  mentions WARNING: Using incubator modules: later in a line\n")
    drain_jvm_stderr(5.0)
    assert capfd.readouterr().err == (
        "26/11/28 16:46:23 ERROR Executor: a real error\nTraceback (most recent call last):\n"
        "  mentions WARNING: Using incubator modules: later in a line\n"
    )
    os.write(f.write_fd, b"the last words, with no newline")
    f.child_started()  # the JVM ends: the pipe's end
    f._thread.join(5)
    assert not f._thread.is_alive() and capfd.readouterr().err == "the last words, with no newline"
    assert len(f.dropped) == 4


def test_pyspark_python_warnings_are_ignored_when_quiet() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_python_warnings()
        warnings.warn_explicit(
            "pandas >= 3.0.0", FutureWarning, "utils.py", 127, module="pyspark.testing.utils"
        )
        warnings.warn_explicit("ours", FutureWarning, "x.py", 1, module="cdc.x")
        warnings.warn_explicit("not pyspark", FutureWarning, "y.py", 1, module="pysparkling")
    assert [str(w.message) for w in seen] == ["ours", "not pyspark"]


def test_run_log_lines_once_unless_verbose(capsys: pytest.CaptureFixture[str]) -> None:
    for verbose, expected in ((False, ["a", "b", "a"]), (True, ["a", "a", "b", "a"])):
        log = Log(as_json=False, verbose=verbose)
        for message in ("a", "a", "b", "a"):
            log(message)
        assert capsys.readouterr().err.splitlines() == [f"cdc run: {m}" for m in expected]
    log = Log(as_json=True, verbose=False)
    log("streaming 3 table(s) from 0/1")
    log("streaming 3 table(s) from 0/1")
    assert capsys.readouterr().err == '{"event":"log","message":"streaming 3 table(s) from 0/1"}\n'


#: a process that takes itself for Spark's streaming source runner (``python -m``), installs the
#: hook as the source's ``streamReader`` does, and ends on SCENARIO's uncaught exception
_RUNNER = """
import importlib.machinery, sys
from spark_jobs.source import RUNNER_MODULE, quiet_hang_up
if sys.argv[2] == "runner":
    sys.modules["__main__"].__spec__ = importlib.machinery.ModuleSpec(RUNNER_MODULE, None)
quiet_hang_up()
quiet_hang_up()  # a second reader of the same runner: one hook
def answer():
    raise BrokenPipeError(32, "Broken pipe")  # writing to the JVM's closed socket
try:
    if sys.argv[1] == "eof":
        raise EOFError  # reading Spark's next call: the JVM closed the socket
    raise ValueError("a reader's own error")
except BaseException:
    answer()
"""


@pytest.mark.parametrize(
    ("scenario", "process", "quiet"),
    [("eof", "runner", True), ("error", "runner", False), ("eof", "driver", False)],
    ids=["hung-up-runner", "runner-with-its-own-error", "not-the-runner"],
)
def test_a_source_runner_whose_socket_the_jvm_closed_ends_without_a_traceback(
    scenario: str, process: str, quiet: bool
) -> None:
    """``query.stop()`` mid-call closes the runner's socket (spark_jobs/source.py): the runner's
    end must not print a traceback through the JVM's stderr; every other end still does."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, scenario, process], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1, proc.stderr
    if quiet:
        assert proc.stderr == ""
    else:
        assert proc.stderr.count("Traceback (most recent call last):") == 2, proc.stderr
        assert proc.stderr.rstrip().endswith("BrokenPipeError: [Errno 32] Broken pipe"), proc.stderr
