"""Bytecode for the test run and the processes it starts: with ``PYTHONDONTWRITEBYTECODE`` set (as in
this machine's environment), every ``cdc`` subprocess, Spark job and Python worker compiled each module
of ``cdc``, ``snapshot``, ``sinks`` and ``spark_jobs`` from source again (about 0.25 s of CPU per
``cdc`` invocation, of which a full run makes well over a thousand), and pytest rewrote and compiled
every test module again in each xdist worker (13 s of CPU per worker to collect ``make check``, 5.4 s
from bytecode). The run instead writes and reads bytecode under a ``PYTHONPYCACHEPREFIX``: in the
virtualenv (``<venv>/pycache``, kept from run to run) when pytest runs from one, else a private
temporary directory removed at the end. The source tree still gets no ``__pycache__``. Without the
variable nothing changes."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_TEMPORARY: str | None = None
_SET = False


def pytest_configure(config: pytest.Config) -> None:
    global _TEMPORARY, _SET
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    if sys.prefix != sys.base_prefix:  # a virtualenv: its own directory, not the source tree's
        prefix = Path(sys.prefix) / "pycache"
        prefix.mkdir(exist_ok=True)
    else:
        prefix = Path(_TEMPORARY := tempfile.mkdtemp(prefix="cdc-test-pycache-"))
    _SET = True
    os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)  # the processes the run starts (xdist workers too)
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    sys.pycache_prefix = str(prefix)  # this process: the test modules pytest rewrites from here on
    sys.dont_write_bytecode = False


def pytest_unconfigure(config: pytest.Config) -> None:
    global _TEMPORARY, _SET
    if not _SET:
        return
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    os.environ.pop("PYTHONPYCACHEPREFIX", None)
    sys.pycache_prefix, sys.dont_write_bytecode = None, True
    if _TEMPORARY is not None:
        shutil.rmtree(_TEMPORARY, ignore_errors=True)
    _TEMPORARY, _SET = None, False
