"""A streaming query of the ``cdclog`` source stopped while Spark's streaming source runner (the Python
process the source's reader lives in) is answering a call.

``query.stop()`` interrupts the query's thread; one waiting on the runner's socket closes it (Java NIO).
The runner then reads EOF, fails to write that error back to the closed socket and, left to pyspark,
prints both as a traceback, which reaches the user of ``cdc apply`` through the driver JVM's stderr
(CI saw it once in ``test_stop_signals``). The source's ``streamReader`` makes that end say nothing
(:func:`spark_jobs.source.quiet_hang_up`). On the real JVM and the real runner: the reader below is the
source's own (``CdcLogDataSource.streamReader``, which installs the hook) with a ``latestOffset`` that
sleeps through the stop, so the runner lives on to find its socket closed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from tests.plugins.postgres import wait_for


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_a_query_stopped_while_the_runner_answers_a_call_leaves_no_traceback(
    spark_clean: Any, tmp_path: Path
) -> None:
    from pyspark.sql.datasource import DataSourceStreamReader

    from spark_jobs.source import CdcLogDataSource

    marks = tmp_path / "marks"
    marks.mkdir()

    # defined here, so cloudpickle sends them to the runner by value (``tests`` is not importable there)
    class SlowReader(DataSourceStreamReader):
        def __init__(self, where: str) -> None:
            import signal
            import sys

            from spark_jobs.source import RUNNER_MODULE

            self.where, self.calls = Path(where), 0
            if getattr(sys.modules["__main__"].__spec__, "name", None) != RUNNER_MODULE:
                return  # Spark also makes a reader in its planning worker: this one is not the runner's
            # the JVM's stop also ends the runner (SIGTERM): the runner CI saw outlived it long enough
            # to find its socket closed; here it does so always
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            fd = os.open(self.where / "runner.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)  # what the runner prints, kept whatever the JVM does with its stderr
            (self.where / "pid").write_text(str(os.getpid()))

        def initialOffset(self) -> dict[str, int]:
            return {"o": 0}

        def latestOffset(self, *args: Any) -> dict[str, int]:
            self.calls += 1
            if self.calls == 3:  # the query is running: the fault
                (self.where / "in_call").write_text(repr(time.time()))
                time.sleep(3)
                (self.where / "answered").write_text(repr(time.time()))
            return {"o": self.calls}

        def partitions(self, start: Any, end: Any) -> list[Any]:
            return []

        def read(self, partition: Any) -> Any:
            return iter(())

        def commit(self, end: Any) -> None:
            pass

        def stop(self) -> None:
            pass

    class SlowSource(CdcLogDataSource):
        @classmethod
        def name(cls) -> str:
            return "cdclog_slow"

        def streamReader(self, schema: Any) -> Any:
            super().streamReader(schema)  # the source's own: installs the hook in the runner
            return SlowReader(self.options["marks"])

    spark_clean.dataSource.register(SlowSource)
    query = (
        spark_clean.readStream.format("cdclog_slow")
        .option("state", str(tmp_path / "state"))
        .option("marks", str(marks))
        .load()
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(processingTime="0.2 seconds")
        .start()
    )
    try:
        wait_for(
            lambda: (marks / "in_call").exists() or not query.isActive,
            timeout=120,
            what="the third latestOffset call",
        )
        assert query.isActive, query.exception()
    finally:
        query.stop()
    stopped = time.time()
    pid = int((marks / "pid").read_text())
    wait_for(lambda: not _running(pid), timeout=60, what="the runner to end")
    # the fault hit: the stop came while the runner was in the call, and it answered after
    assert float((marks / "answered").read_text()) > stopped
    assert (marks / "runner.stderr").read_text() == ""
