"""The ``cdc`` command: one error boundary that sets the exit code.

Each verb group lives in its own module with a ``register(subparsers)`` function that adds its
parsers and sets ``handler`` on them; this module lists those modules explicitly (no registration
by import side effect). A handler has the signature ``handler(args, settings) -> int``.
Text goes to people, ``--json`` to scripts; errors go to stderr (as JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path
from types import ModuleType

from cdc.cli.output import print_error
from cdc.errors import CdcError
from cdc.paths import PRIVATE_UMASK, tighten

#: the verb modules, in the order of `cdc --help`, each with the verbs it adds. Only the module of
#: the verb being run is imported (a verb's module imports what it needs: pyarrow, the snapshot
#: reader, Spark glue); a verb not listed here imports all of them, `cdc --help` none (:data:`VERB_HELP`).
VERB_MODULES: dict[str, tuple[str, ...]] = {
    "check": ("check",),
    "tables": ("tables",),
    "views": ("views",),
    "capture": ("run",),
    "snapshot": ("snapshot",),
    "topic": ("topic",),
    "apply": ("apply",),
    "deadletters": ("deadletters",),
    "query": ("sql", "search"),
    "verify": ("verify",),
    "rebuild": ("rebuild",),
    "wait": ("wait",),
    "demo": ("demo",),
    "status": ("status",),
    "serve": ("serve",),
}

#: each verb's line in ``cdc --help``, written only here: its module registers the verb with it
#: (``help=VERB_HELP[verb]``). ``cdc --help`` (or no verb) lists the verbs from here
#: (:func:`build_parser` with ``listing``) without importing their modules: 0.2-0.4 s of CPU for
#: those of check, tables, topic, snapshot and the demo, which import psycopg, numpy, msgspec and
#: the snapshot reader
VERB_HELP: dict[str, str] = {
    "check": "check that the source is ready for capture",
    "tables": "register, list and remove captured tables",
    "views": "register, list and remove views from joins of tables",
    "run": "snapshot, then stream changes into the log store",
    "snapshot": "request a re-snapshot of tables (done by `cdc run`, in chunks)",
    "topic": "list, dump and follow the log store's topics",
    "apply": "apply captured changes to the warehouse and the search index (Spark)",
    "deadletters": "list dead letters, and replay them once the cause is fixed",
    "sql": "query the warehouse tables with SQL (DuckDB)",
    "search": "full-text search a table's search columns",
    "verify": "compare source tables with the warehouse and the search index",
    "rebuild": "replay a table's topic (or recompute a view) into a verified copy, then swap it in",
    "wait": "until the derived tables applied every change up to a commit LSN (exit 0; 3 on timeout)",
    "demo": "run the whole pipeline on a private Postgres, then clean up",
    "status": "lag per stage, slot health and verdicts (exit 0 OK, 1 WARN, 2 critical)",
    "serve": "Prometheus /metrics, /status JSON and a live dashboard",
}

#: the options before the verb, each with a value: (flag, help)
_GLOBAL_OPTIONS = (
    ("--source", "source DSN or URI (default: $CDC_SOURCE, cdc.toml)"),
    ("--state", "state directory (default: $CDC_STATE or .cdc)"),
    ("--log", "log store: kafka://HOST:PORT (default: $CDC_LOG, else embedded)"),
)
_GLOBAL_OPTIONS_WITH_VALUE = tuple(flag for flag, _ in _GLOBAL_OPTIONS)


def _first_other(argv: Sequence[str]) -> str | None:
    """The first word of ``argv`` that is neither a global option nor its value (None: none)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _GLOBAL_OPTIONS_WITH_VALUE:
            skip = True
        elif not arg.startswith(_GLOBAL_OPTIONS_WITH_VALUE):  # a verb, -h, --help, an unknown option
            return arg
    return None


def _verb_of(argv: Sequence[str]) -> str | None:
    """The verb of ``argv`` (the first word that is neither a global option nor its value)."""
    first = _first_other(argv)
    return first if first is not None and not first.startswith("-") else None


def _only_listing(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks only for the list of verbs: ``-h``/``--help`` before any verb, or only
    global options (argparse then says a verb is required)."""
    return _first_other(argv) in (None, "-h", "--help")


def _modules_for(verb: str | None) -> list[ModuleType]:
    names = [m for m, verbs in VERB_MODULES.items() if verb in verbs] or list(VERB_MODULES)
    return [importlib.import_module(f"cdc.cli.{name}") for name in names]


def build_parser(verb: str | None = None, *, listing: bool = False) -> argparse.ArgumentParser:
    """The `cdc` parser; with ``verb``, only that verb's module is registered (see VERB_MODULES).
    With ``listing`` (``argv`` asks only for the list of verbs: :func:`_only_listing`) and no known
    ``verb``: every verb as a name and its :data:`VERB_HELP` line only, no module imported (what
    ``cdc --help`` prints, or argparse's error for a missing verb, needs no more); such a parser
    cannot run a verb."""
    parser = argparse.ArgumentParser(prog="cdc", description="Change-data-capture for PostgreSQL.")
    for flag, text in _GLOBAL_OPTIONS:
        parser.add_argument(flag, help=text)
    parser.set_defaults(run_cli=main)  # for `cdc demo`, which runs verbs without importing the CLI
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True
    if listing and verb not in VERB_HELP:
        for name, text in VERB_HELP.items():
            sub.add_parser(name, help=text, add_help=False)
        return parser
    for module in _modules_for(verb):
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = _verb_of(argv)
    parser = build_parser(verb, listing=_only_listing(argv))
    args = parser.parse_args(argv)
    as_json = bool(getattr(args, "json", False))
    # least privilege on disk: whatever this process (and Spark, tantivy, delta-rs under it) creates
    # is private to this user; restored on return for in-process callers (the demo, tests)
    old_umask = os.umask(PRIVATE_UMASK)
    try:
        # here, not at the top: the settings' pydantic models (0.15-0.2 s of CPU) are not needed
        # for `cdc --help`, which lists the verbs and exits in parse_args
        from cdc.config import load_settings

        settings = load_settings(
            {"source": args.source, "state": args.state, "log": args.log}, dict(os.environ), Path.cwd()
        )
        tighten(settings.state_dir)
        code = int(args.handler(args, settings))
    except CdcError as err:
        print_error(err, as_json=as_json)
        code = err.exit_code
    except KeyboardInterrupt:
        code = 130
    finally:
        os.umask(old_umask)
    sys.stdout.flush()
    return code


#: the verbs that run Spark, whose Arrow conversions use pandas (``cdc demo`` runs ``cdc apply``)
SPARK_VERBS = frozenset({"apply", "demo"})


class _NoPandas:
    """Finds pandas missing (an ImportError, which pyarrow takes as "not installed")."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname == "pandas":
            raise ModuleNotFoundError("pandas is not used outside the Spark verbs", name=fullname)


def keep_pandas_out(verb: str | None) -> None:
    """Outside :data:`SPARK_VERBS`, pandas cannot be imported by this process. No other verb uses
    pandas, but pyarrow imports it (0.3-0.5 s of CPU, more than the rest of a ``cdc run --once``'s
    imports) on its first array of Python values, only to ask whether they are pandas objects."""
    if verb not in SPARK_VERBS and "pandas" not in sys.modules:
        sys.meta_path.insert(0, _NoPandas())


def one_blas_thread(environ: MutableMapping[str, str]) -> None:
    """OpenBLAS, which numpy loads, starts a thread per core when it is loaded unless told otherwise:
    ~0.05-0.1 s of CPU in every ``cdc`` process (a sixth of an incremental ``cdc verify``'s imports),
    for matrix products that cdc never computes. One thread, unless the user set a number; the
    processes a verb starts (Spark's Python workers) inherit it."""
    environ.setdefault("OPENBLAS_NUM_THREADS", "1")


#: Python's collector thresholds for a ``cdc`` process (see :func:`collect_less_often`)
GC_THRESHOLDS = (50_000, 10, 10)


def collect_less_often() -> None:
    """Python's cyclic garbage collector looks at the young objects every 700 net allocations, and
    at every live object after 100 of those: a verb that holds millions of objects (``cdc verify
    --full`` of 1M rows keeps both sides' rows and hashes) spent 5.0 of its 30 s of CPU in it. cdc
    makes few reference cycles (reference counting frees the rest): every 50,000 allocations, that
    run spent 0.5 s."""
    gc.set_threshold(*GC_THRESHOLDS)


def leave_the_rest_to_the_os() -> None:
    """Called as a ``cdc`` process ends, after its verb: Python's shutdown runs full collections of
    the cyclic garbage collector, each walking every object the process still holds (the imported
    modules' and the verb's), to free memory the OS is about to take back: 0.06-0.13 s, a tenth of
    an incremental ``cdc verify``. Frozen, those objects are left out of them (``gc.freeze``). The
    rest of the shutdown is unchanged: the atexit functions run, the streams are flushed, the
    threads are joined, the objects freed; only a reference cycle left behind goes uncollected,
    and cdc closes what it writes with ``with``, not by the collector."""
    gc.freeze()


def entry() -> None:  # pragma: no cover - console script shim
    one_blas_thread(os.environ)  # before anything imports numpy
    collect_less_often()
    keep_pandas_out(_verb_of(sys.argv[1:]))  # the process's own: never for in-process callers of main()
    try:
        code = main()
    finally:
        leave_the_rest_to_the_os()
    sys.exit(code)
