"""Every path under the state directory, and the rules that keep it private.

Layout (``<state>`` is ``--state`` / ``CDC_STATE``, default ``.cdc``)::

    <state>/registry.db                      the registry (cdc.registry)
    <state>/log/                             the embedded log store
    <state>/warehouse/<schema>/<table>       Delta current state; ``<table>__history``, ``<table>__tombstones``
    <state>/warehouse/_views/<view>          Delta current table of a view (cdc.views)
    <state>/search/<topic>                   search index: ``shard-<i>/`` (tantivy) and ``shard-<i>.versions.sqlite``
                                             per shard; ``<topic>.versions.sqlite`` the index's metadata
    <state>/spark/checkpoint/apply           Spark checkpoint of the apply job; ``apply.id`` its app id
    <state>/spark/apply-ledger.json          the apply job's ledger (``apply-metrics.json`` before 2026-11)
    <state>/spark/scratch/                   Spark's local dir (private to the state's owner)
    <state>/metrics/<role>.json              counters a process publishes (cdc.metrics)
    <state>/locks/<role>.lock                one process per role (cdc.locks)
    <state>/rebuild/<name>/stage             ``cdc rebuild``'s staged copy (a state root of its own);
                                             ``replaced/`` the derived data it swapped out (cdc.cli.rebuild.staged)
    <state>/verify/<schema>/<table>.json     key ranges and hashes of the last clean verify (cdc.cli.verify.ranges)

Names taken from the source (schema, table, topic) become one path component each: characters
outside ``[A-Za-z0-9._-]`` are replaced by ``_`` (as in topic names), and a component made only of
dots (``.``, ``..``) is written ``_2e`` per dot, so no name can leave its directory
(:func:`component`). Least privilege: the CLI runs with umask 0o077, so everything it creates is
0700 (directories) or 0600 (files); :func:`ensure_private_dir` creates a directory 0700 and
:func:`tighten` takes group/other permissions off what already exists.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from pathlib import Path

#: the state directory when neither ``--state``, ``CDC_STATE`` nor ``cdc.toml`` names one
DEFAULT_STATE = ".cdc"
#: the scheme of a log URL (``CDC_LOG``) naming a Kafka store; no URL: the embedded store in ``<state>/log``
KAFKA_SCHEME = "kafka://"

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
PRIVATE_UMASK = 0o077


def component(name: str) -> str:
    """``name`` as one path component that stays inside its directory."""
    safe = _UNSAFE.sub("_", name)
    if safe == "" or set(safe) == {"."}:
        safe = "_2e" * len(safe) or "_"
    return safe


def registry_path(state_dir: Path) -> Path:
    return Path(state_dir) / "registry.db"


def log_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "log"


def warehouse_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "warehouse"


def warehouse_tables(state_dir: Path, schema: str, table: str) -> tuple[Path, Path, Path]:
    """``(current, history, tombstones)`` of a source table."""
    base = warehouse_dir(state_dir) / component(schema)
    name = component(table)
    return base / name, base / f"{name}__history", base / f"{name}__tombstones"


def view_table(state_dir: Path, name: str) -> Path:
    """The Delta current table of the view ``name`` (:mod:`cdc.views`), beside the tables'."""
    return warehouse_dir(state_dir) / "_views" / component(name)


def view_history(state_dir: Path, name: str) -> Path:
    """The Delta history (SCD2) table of the view ``name`` (``cdc views add --history``), beside
    its current table as a table's is (``<name>__history``)."""
    return warehouse_dir(state_dir) / "_views" / f"{component(name)}__history"


def search_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "search"


def search_index(state_dir: Path, topic: str) -> Path:
    return search_dir(state_dir) / component(topic)


def search_versions(state_dir: Path, topic: str) -> Path:
    return search_dir(state_dir) / f"{component(topic)}.versions.sqlite"


def search_shard(state_dir: Path, topic: str, shard: int) -> tuple[Path, Path]:
    """``(tantivy index, side table)`` of shard ``shard`` of a topic's search index."""
    base = search_index(state_dir, topic)
    return base / f"shard-{shard}", base / f"shard-{shard}.versions.sqlite"


def spark_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "spark"


def spark_checkpoint(state_dir: Path, job: str = "apply") -> Path:
    return spark_dir(state_dir) / "checkpoint" / component(job)


def apply_ledger(state_dir: Path) -> Path:
    """The apply job's correctness ledger: the last batch whose dead letters were written (a
    replayed batch must not write them again) and the checkpoint's counters (spark_jobs.ledger)."""
    return spark_dir(state_dir) / "apply-ledger.json"


def legacy_apply_ledger(state_dir: Path) -> Path:
    """The ledger's name before 2026-11 (``apply-metrics.json``): read once when the new file is
    absent, so an existing state directory keeps its dead-letter record (spark_jobs.ledger)."""
    return spark_dir(state_dir) / "apply-metrics.json"


def metrics_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "metrics"


def metrics_file(state_dir: Path, role: str) -> Path:
    return metrics_dir(state_dir) / f"{component(role)}.json"


def rebuild_dir(state_dir: Path, name: str) -> Path:
    """``cdc rebuild``'s work directory for the table or view ``name`` (:mod:`cdc.cli.rebuild.staged`)."""
    return Path(state_dir) / "rebuild" / component(name)


def lock_path(state_dir: Path, role: str) -> Path:
    return Path(state_dir) / "locks" / f"{component(role)}.lock"


def verify_ranges(state_dir: Path, schema: str, table: str) -> Path:
    """The key ranges (bounds, hashes, topic offsets) of the table's last clean ``cdc verify``."""
    return Path(state_dir) / "verify" / component(schema) / f"{component(table)}.json"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) mode 0700; an existing directory keeps its mode."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def tighten(state_dir: Path) -> None:
    """Take group and other permissions off the state directory and everything in it (files we
    own; symlinks are not followed). Called by the CLI on the state directory it uses."""
    root = Path(state_dir)
    try:
        st = root.lstat()
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or not st.st_mode & 0o077:
        return  # not ours, or already private (then nothing inside can be reached by others)
    _chmod_private(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            _chmod_private(Path(dirpath) / name)


def _chmod_private(path: Path) -> None:
    try:
        st = path.lstat()
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or not st.st_mode & 0o077:
        return
    with contextlib.suppress(OSError):  # a file that vanished or is not ours to change
        path.chmod(stat.S_IMODE(st.st_mode) & 0o700)
