"""``cdc`` run in the test's own process (:data:`Run`, the ``cdc_main`` fixture): its exit code and
what it printed, from a clean directory and environment."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

#: ``run(*argv, source=None)``: (exit code, stdout, stderr)
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cdc_main(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Run:
    """``cdc --state TMP/state [--source SOURCE] ARGV...`` in this process, in ``tmp_path`` with no
    ``CDC_*`` variable (a test sets its own after this fixture). An argparse exit is its code."""
    from cdc.cli import main

    for var in [k for k in os.environ if k.startswith("CDC_")]:
        monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "200")  # rich folds long cells at the default 80

    def run(*argv: str, source: str | None = None) -> tuple[int, str, str]:
        capsys.readouterr()
        pre = ["--state", str(tmp_path / "state")] + (["--source", source] if source else [])
        try:
            code = main([*pre, *argv])
        except SystemExit as exc:  # argparse
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run
