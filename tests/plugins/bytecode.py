"""Bytecode for the processes the tests start: with ``PYTHONDONTWRITEBYTECODE`` set (as in this
machine's environment), every ``cdc`` subprocess, Spark job and Python worker compiled each module of
``cdc``, ``snapshot``, ``sinks`` and ``spark_jobs`` from source again: about 0.25 s of CPU per ``cdc``
invocation, of which a full run makes well over a thousand. For the session, the processes it starts
write and read their bytecode under a private temporary ``PYTHONPYCACHEPREFIX`` instead (removed at
the end), so the source tree still gets no ``__pycache__``. Without the variable nothing changes."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

_PREFIX: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _PREFIX
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return
    _PREFIX = tempfile.mkdtemp(prefix="cdc-test-pycache-")
    os.environ["PYTHONPYCACHEPREFIX"] = _PREFIX
    del os.environ["PYTHONDONTWRITEBYTECODE"]


def pytest_unconfigure(config: pytest.Config) -> None:
    global _PREFIX
    if _PREFIX is not None:
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
        os.environ.pop("PYTHONPYCACHEPREFIX", None)
        shutil.rmtree(_PREFIX, ignore_errors=True)
        _PREFIX = None
