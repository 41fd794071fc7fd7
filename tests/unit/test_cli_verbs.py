"""`cdc VERB` imports only that verb's module; `cdc --help` and unknown verbs see every verb."""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from cdc.cli import (
    GC_THRESHOLDS,
    VERB_HELP,
    VERB_MODULES,
    _only_listing,
    _verb_of,
    build_parser,
    collect_less_often,
    one_blas_thread,
)
from cdc.registry import Registry, TableReg
from cdc.sink_locations import LOCATIONS, keeping


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


def _verb_lines(parser: argparse.ArgumentParser) -> list[tuple[str, str | None]]:
    sub = next(a for a in parser._actions if a.dest == "verb")
    return [(a.dest, a.help) for a in sub._choices_actions]


def test_every_verb_is_listed_with_its_module() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb")
    listed = {v for verbs in VERB_MODULES.values() for v in verbs}
    assert set(sub.choices) == listed  # type: ignore[arg-type]


def test_the_list_of_verbs_is_what_their_modules_register() -> None:
    """`cdc --help` lists the verbs from VERB_HELP without importing their modules, and each module
    registers its verbs with their VERB_HELP line: every verb a module registers has a line, and the
    listing is the full parser's, the same names, order and lines."""
    for module, verbs in VERB_MODULES.items():
        assert [name for name, _ in _verb_lines(build_parser(verbs[0]))] == list(verbs), module
    full = _verb_lines(build_parser())
    assert [name for name, _ in full] == list(VERB_HELP)
    assert _verb_lines(build_parser(listing=True)) == full


@pytest.mark.parametrize(
    ("argv", "listing"),
    [
        (["--help"], True),
        (["--state", "/s", "-h"], True),
        (["--state=/s"], True),
        ([], True),
        (["verify", "--help"], False),
        (["--bogus", "verify"], False),
        (["bogus"], False),
    ],
)
def test_only_a_request_for_the_verbs_gets_the_list(argv: list[str], listing: bool) -> None:
    assert _only_listing(argv) is listing


def test_cdc_help_lists_every_verb_and_imports_none() -> None:
    code = (
        "import sys\nsys.argv = ['cdc', '--help']\n"
        "from cdc.cli import entry\ntry:\n    entry()\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith(('cdc.cli.', 'cdc.config', 'pydantic', 'psycopg', 'numpy', 'snapshot'))))"
    )
    out = _python(code)
    for verb, line in VERB_HELP.items():
        assert f"    {verb} " in out and line.split()[0] in out, verb
    assert out.splitlines()[-1] == "['cdc.cli.output']", out.splitlines()[-1]


def _python(code: str, check: bool = True) -> str:
    """``code`` run by a fresh interpreter (what a new ``cdc`` process imports): its stdout."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=check).stdout


def test_status_does_not_import_the_other_verbs() -> None:
    code = (
        "import sys\nfrom cdc.cli import build_parser, _verb_of\n"
        "build_parser(_verb_of(['status', '--json']))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('cdc.cli.', 'spark_jobs', 'snapshot'))))"
    )
    out = _python(code)
    assert "cdc.cli.status" in out
    for heavy in ("cdc.cli.apply", "cdc.cli.snapshot", "snapshot", "spark_jobs"):
        assert f"'{heavy}'" not in out, out


def _loaded(argv: list[str], imports: str) -> list[str]:
    """The modules a new process holds after building ``cdc``'s parser for ``argv`` (as the verb's
    process does) and importing ``imports``."""
    code = (
        "import sys\nfrom cdc.cli import build_parser, _verb_of\n"
        f"build_parser(_verb_of({argv!r}))\n"
        f"import {imports}\n"
        "print('\\n'.join(sorted(sys.modules)))"
    )
    return _python(code).split()


#: what a ``cdc status`` process never imports (issue #33: on-call and the tests poll it): numpy (only
#: the writers of batches hash arrays), the warehouse's libraries, pandas, and the codec that decodes
#: changes
STATUS_NEVER = ("numpy", "pyarrow", "deltalake", "pandas", "cdc.codec.envelope", "cdc.codec.fastpath")


def test_status_imports_neither_numpy_nor_the_warehouse_libraries() -> None:
    """``cdc status``'s parser, its handler's modules and the log store it opens to read (and the
    Spark checkpoint reader) import none of :data:`STATUS_NEVER`, directly or through any module."""
    loaded = _loaded(
        ["status", "--json"],
        "cdc.cli.status.gather, cdc.cli.status.options, cdc.logstore.factory, spark_jobs.checkpoint",
    )
    assert "cdc.cli.status.gather" in loaded and "cdc.logstore.embedded.store" in loaded
    _none_of_status_never(loaded)


def _none_of_status_never(loaded: list[str]) -> None:
    for name in loaded:
        assert name not in STATUS_NEVER and not name.startswith(tuple(f"{m}." for m in STATUS_NEVER)), name


#: a source nothing listens on: the verb gets as far as connecting, and fails there at once
UNREACHABLE = "postgresql://cdc@127.0.0.1:1/cdc?connect_timeout=2"


def _ran(state: Path, argv: list[str]) -> tuple[str, str, list[str]]:
    """``cdc --state STATE --source UNREACHABLE ARGV`` run whole by a fresh interpreter: its stdout,
    its stderr and the modules it held at the end."""
    code = (
        "import sys\nfrom cdc.cli import entry\n"
        f"sys.argv = ['cdc', '--state', {str(state)!r}, '--source', {UNREACHABLE!r}, *{argv!r}]\n"
        "try:\n    entry()\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write('\\n'.join(['--modules--', *sorted(sys.modules)]))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDC_")}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=state.parent
    )
    err, _, modules = res.stderr.partition("--modules--")
    return res.stdout, err, modules.split()


def test_status_and_wait_on_a_registered_table_import_none_of_the_sinks(tmp_path: Path) -> None:
    """``cdc status`` and ``cdc wait`` on a registered table with search columns (issue #33: the
    tests poll both) ask which sinks keep it without importing them: none of :data:`STATUS_NEVER`,
    nor ``sinks``, nor tantivy. The source is unreachable: status reports the table's stages all
    the same, and wait has its sinks before it connects."""
    state = tmp_path / "state"
    with Registry(state) as registry:
        registry.add(TableReg("public", "items", "cdc.public.items", ("id",), search=("name",)))
    out, _, loaded = _ran(state, ["status", "--json"])
    assert [t["sinks"] for t in orjson.loads(out)["tables"]] == [["warehouse", "search"]], out
    _, err, waited = _ran(state, ["wait", "--lsn", "0/1", "--table", "public.items", "--timeout", "1"])
    assert "cannot be reached" in err, err
    for verb, modules in (("status", loaded), ("wait", waited)):
        assert f"cdc.cli.{verb}" in modules and "cdc.sink_locations" in modules, modules
        _none_of_status_never(modules)
        assert not [m for m in modules if m.split(".")[0] in ("sinks", "tantivy")], modules


def test_run_loads_no_arrow_until_a_snapshot_starts(tmp_path: Path) -> None:
    """``cdc run`` loads its reader (the snapshot modules with it) without pyarrow or numpy: only a
    snapshot's reads of rows need them, and the tests start ``cdc run`` hundreds of times (issue
    #33). The source is unreachable, and the run gives up on it after half a second."""
    state = tmp_path / "state"
    (tmp_path / "cdc.toml").write_text("retry_max_s = 0.5\n")
    with Registry(state) as registry:
        registry.add(TableReg("public", "items", "cdc.public.items", ("id",)))
    _, err, modules = _ran(state, ["run", "--once"])
    assert "cannot be reached" in err, err
    assert "cdc.reader" in modules and "snapshot.chunked" in modules, modules
    assert not [m for m in modules if m.split(".")[0] in ("pyarrow", "numpy")], modules


def test_the_sinks_keep_a_table_where_cdc_sink_locations_says() -> None:
    """:data:`cdc.sink_locations.LOCATIONS` names every sink of :data:`sinks.all.SINKS`, in its
    order, and each keeps a table where its entry says (with and without search columns)."""
    from sinks.all import SINKS

    for reg in (
        TableReg("public", "items", "cdc.public.items", ("id",), search=("name",)),
        TableReg("odd schema", "t/1", "cdc.odd.t1", ("id",)),
    ):
        light = [(name, where(Path("/s"), reg)) for name, where in LOCATIONS.items()]
        assert light == [(sink.name, sink.locations(Path("/s"), reg)) for sink in SINKS]
        assert keeping(Path("/s"), reg) == [name for name, where in light if where]
    assert keeping(Path("/s"), TableReg("public", "t", "cdc.public.t", ("id",))) == ["warehouse"]


@pytest.mark.parametrize(
    ("verb", "pandas"), [("run", False), ("verify", False), (None, False), ("apply", True)]
)
def test_a_verb_without_spark_never_imports_pandas_through_pyarrow(verb: str | None, pandas: bool) -> None:
    """pyarrow imports pandas on its first array of Python values (0.3-0.5 s of CPU) unless the
    process marked it absent, as `cdc` does for every verb but those that run Spark; pyarrow works
    the same without it."""
    code = (
        "import sys\nfrom cdc.cli import keep_pandas_out\n"
        f"keep_pandas_out({verb!r})\n"
        "import pyarrow as pa\n"
        "assert pa.array(['a', None]).to_pylist() == ['a', None]\n"
        "assert pa.scalar(b'x', pa.binary()).as_py() == b'x'\n"
        "print(sys.modules.get('pandas') is not None)"
    )
    out = _python(code)
    assert out.strip() == str(pandas)


def test_the_cdc_process_marks_pandas_absent_for_its_verb() -> None:
    code = (
        "import sys\nsys.argv = ['cdc', '--state', '/nonexistent', 'topic', 'list', '--help']\n"
        "from cdc.cli import entry\ntry:\n    entry()\nexcept SystemExit:\n    pass\n"
        "try:\n    import pandas\nexcept ImportError as exc:\n    print(exc)"
    )
    out = _python(code)
    assert out.splitlines()[-1] == "pandas is not used outside the Spark verbs"


def test_numpy_gets_one_blas_thread_unless_the_user_set_a_number() -> None:
    env: dict[str, str] = {}
    one_blas_thread(env)
    assert env == {"OPENBLAS_NUM_THREADS": "1"}
    mine = {"OPENBLAS_NUM_THREADS": "4"}
    one_blas_thread(mine)
    assert mine == {"OPENBLAS_NUM_THREADS": "4"}


def test_a_cdc_process_ends_with_its_objects_frozen_and_its_atexit_work_done() -> None:
    code = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('atexit ran, frozen', gc.get_freeze_count() > 0, flush=True))\n"
        "sys.argv = ['cdc', '--state', '/nonexistent', 'status', '--json']\n"
        "from cdc.cli import entry\nentry()\n"
    )
    assert _python(code, check=False).splitlines()[-1] == "atexit ran, frozen True"


def test_a_cdc_process_collects_garbage_less_often() -> None:
    before = gc.get_threshold()
    try:
        collect_less_often()
        assert gc.get_threshold() == GC_THRESHOLDS and GC_THRESHOLDS[0] > before[0]
    finally:
        gc.set_threshold(*before)


#: what ``cdc verify`` never needs: Spark and its glue, pandas, the other verbs' libraries (duckdb for
#: ``cdc sql``, the Kafka client for a ``kafka://`` log, rich for text tables) and the capture side
#: (the codec's output plugins are loaded only to peek a slot that is behind: ``slot_passed``), the
#: warehouse's columnar apply (and its fill of unchanged TOAST values)
VERIFY_NEVER = (
    "pyspark",
    "py4j",
    "pandas",
    "spark_jobs",
    "snapshot",
    "duckdb",
    "kafka",
    "rich",
    "cdc.reader",
    "cdc.codec",
    "sinks.warehouse.columnar",
    "sinks.warehouse.fill",
)
#: the verb modules ``cdc verify`` uses besides its own: the output helpers and the slot check
VERIFY_CLI = ("cdc.cli.output", "cdc.cli.verify", "cdc.cli.wait", "cdc.cli.wait.lsn")


def test_verify_imports_only_what_its_work_needs() -> None:
    """A ``cdc verify`` process's start is a fixed cost of every incremental run (issue 35: about
    half of one): its parser, its modules and the sinks it reads import no other verb's module and
    none of :data:`VERIFY_NEVER`, directly or through any module."""
    loaded = _loaded(
        ["--state", "/s", "verify", "--json"],
        "cdc.cli.verify.compare, cdc.cli.verify.views, cdc.logstore.factory, sinks.all",
    )
    assert "cdc.cli.verify.compare" in loaded and "sinks.warehouse" in loaded
    for name in loaded:
        assert not name.startswith(tuple(f"{m}." for m in VERIFY_NEVER)) and name not in VERIFY_NEVER, name
        if name.startswith("cdc.cli."):
            assert name in VERIFY_CLI or name.startswith("cdc.cli.verify."), name
