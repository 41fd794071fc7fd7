"""The daemon Spark forks its Python workers from (``spark.python.daemon.module``, set by
:func:`spark_jobs.session.get_session`): pyspark's own daemon, started once Spark's zipped copy of
pyspark is off ``sys.path`` where the installed pyspark is that copy's package.

Spark starts its Python daemons with ``$SPARK_HOME/python/lib/pyspark.zip`` and py4j's zip first on
``PYTHONPATH``. Python keeps no compiled code for modules it imports from a zip, so each daemon, and
each worker it forks (a worker imports its worker module after the fork), compiled pyspark's source
again: in a profile of ``tests/apply/test_job.py`` with py-spy, 29% of the Python workers' samples
were ``zipimport``'s ``_compile_source`` and 10% more re-read the zip's directory (pyspark's
``setup_spark_files`` invalidates the import caches when it changes the path). With pip's pyspark, ``SPARK_HOME``
is the installed package and its zip holds the same files, so this module takes the zips off the
path (and their importers out of ``sys.path_importer_cache``): pyspark is imported from the package,
with its cached bytecode. Spark's core jar (``<pyspark>/jars/spark-core_*.jar``) is on the path too,
and holds no Python in a pip-installed Spark; but Python opens it as a zip (reading its directory of
some 6,000 entries) at the first import that reaches it, and again at every ``invalidate_caches``
(pyspark's, when a worker's first task puts the job's files on the path): 0.11 s of CPU for one
``invalidate_caches`` in a worker of the apply's session (2026-11-30, in a task). The jars go
as well. Elsewhere (a cluster's own Spark, whose zip is not the installed package's, or no pyspark
installed) the path is left as it is.

Then the daemon imports, once, what every worker it forks imports for its first task
(:data:`PRELOAD`): pyspark's worker, pandas and pyarrow, the apply's tasks with both sinks, and the
source's reader. pyspark's own daemon imports the worker module after each fork, so each worker
imported them again, about 0.7 s of CPU (for each worker of each session or executor). A fork
inherits them: the workers' own imports find them in ``sys.modules``. Those imports start threads
(jemalloc's background threads in pyarrow and deltalake, OpenBLAS's pool under numpy) which the
fork does not copy; each of those libraries takes its locks across a fork and starts its threads
again in the child (``pthread_atfork``), as any ``multiprocessing`` fork after ``import numpy``
relies on.

Nothing here may import pyspark before the path is set: this module runs before pyspark is imported.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

#: what a worker imports for its first task: pyspark's worker (and the pandas and pyarrow of its Arrow
#: serializers), the apply's tasks and both sinks (deltalake, tantivy), the source's reader
PRELOAD = (
    "pyspark.worker",
    "pandas",
    "pyarrow.dataset",
    "spark_jobs.tasks",
    "sinks.all",
    "spark_jobs.source",
)


def _package_dir(path: Sequence[str], name: str) -> str | None:
    """The directory of package ``name`` in the first entry of ``path`` that is not a zip."""
    for entry in path:
        if entry.endswith(".zip"):
            continue
        candidate = os.path.join(entry or ".", name)
        if os.path.isfile(os.path.join(candidate, "__init__.py")):
            return os.path.realpath(candidate)
    return None


def without_spark_archives(path: Sequence[str]) -> list[str]:
    """``path`` without the zips of the installed pyspark package (``<pyspark>/python/lib/*.zip``)
    and its jars (``<pyspark>/jars/*.jar``, which hold no Python), when pyspark and py4j are both
    installed outside them; else ``path`` unchanged."""
    pyspark = _package_dir(path, "pyspark")
    if pyspark is None or _package_dir(path, "py4j") is None:
        return list(path)
    archives = {(os.path.join(pyspark, "python", "lib"), ".zip"), (os.path.join(pyspark, "jars"), ".jar")}
    return [e for e in path if (os.path.dirname(os.path.realpath(e)), os.path.splitext(e)[1]) not in archives]


def use_installed_pyspark() -> None:
    """Take the installed pyspark's zips and jars off ``sys.path`` (:func:`without_spark_archives`), and
    their importers out of ``sys.path_importer_cache``; before pyspark is imported."""
    kept = without_spark_archives(sys.path)
    for entry in set(sys.path) - set(kept):
        sys.path_importer_cache.pop(entry, None)
    sys.path[:] = kept


def main() -> None:
    use_installed_pyspark()
    for name in PRELOAD:
        importlib.import_module(name)
    from pyspark.daemon import manager  # the zips are off the path: the installed package's

    manager()


if __name__ == "__main__":
    main()
