"""Spark's Python processes in the test run import pyspark from the installed package, with its
bytecode, instead of compiling it again from Spark's zip.

Spark starts each Python process with ``$SPARK_HOME/python/lib/pyspark.zip`` first on ``PYTHONPATH``,
and Python compiles a module imported from a zip every time. The product's daemon
(:mod:`spark_jobs.pydaemon`) covers the workers that run tasks; the streaming source's runner, which
Spark starts afresh for every streaming query (and the test run starts hundreds: each apply of a
test is a query), and the planners' daemons it cannot reach. In a py-spy profile of
``tests/apply/test_job.py``, the runners took 47% of the Spark Python processes' samples, 22% of them
compiling pyspark's source. This plugin puts ``tests/plugins/startup`` first on ``PYTHONPATH``: its
``sitecustomize`` takes the zips (and Spark's jars) off ``sys.path`` in every process Spark starts
(the same files, from the installed package) and does nothing in the others."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

STARTUP = Path(__file__).with_name("startup")


def pytest_configure(config: pytest.Config) -> None:
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(STARTUP) not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(STARTUP), *entries])
