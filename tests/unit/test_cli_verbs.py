"""`cdc VERB` imports only that verb's module; `cdc --help` and unknown verbs see every verb."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cdc.cli import VERB_MODULES, _verb_of, build_parser


@pytest.mark.parametrize(
    ("argv", "verb"),
    [
        (["status", "--json"], "status"),
        (["--state", "/s", "--source", "postgresql://h/db", "tables", "list"], "tables"),
        (["--state=/s", "apply", "--once"], "apply"),
        (["--log", "kafka://h:9092", "sql", "select 1"], "sql"),
        (["--help"], None),
        (["--state", "/s"], None),
        ([], None),
    ],
)
def test_verb_of(argv: list[str], verb: str | None) -> None:
    assert _verb_of(argv) == verb


def test_every_verb_is_listed_with_its_module() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb")
    listed = {v for verbs in VERB_MODULES.values() for v in verbs}
    assert set(sub.choices) == listed  # type: ignore[arg-type]


def test_status_does_not_import_the_other_verbs() -> None:
    code = (
        "import sys\nfrom cdc.cli import build_parser, _verb_of\n"
        "build_parser(_verb_of(['status', '--json']))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('cdc.cli.', 'spark_jobs', 'snapshot'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "cdc.cli.status" in out
    for heavy in ("cdc.cli.apply", "cdc.cli.snapshot", "snapshot", "spark_jobs"):
        assert f"'{heavy}'" not in out, out
