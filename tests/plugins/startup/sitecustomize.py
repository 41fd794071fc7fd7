"""Every Python process the tests start runs this at its start (``tests/plugins/spark_workers.py`` puts
this directory on ``PYTHONPATH``). In one that Spark started (a zip of the installed pyspark on
``sys.path``), pyspark is imported from the installed package instead of the zip
(:func:`spark_jobs.pydaemon.use_installed_pyspark`); anywhere else it does nothing. Then the next
``sitecustomize`` on the path, if any, runs as it would have."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _run() -> None:
    if any(os.path.basename(p) == "pyspark.zip" for p in sys.path):  # Spark started this process
        from spark_jobs import pydaemon

        pydaemon.use_installed_pyspark()
        # Spark's daemon runs it as ``-m spark_jobs.pydaemon``: runpy warns of a copy already imported
        del sys.modules["spark_jobs.pydaemon"]
    here = os.path.dirname(os.path.realpath(__file__))
    rest = [p for p in sys.path if os.path.realpath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[__name__] = module
        spec.loader.exec_module(module)


_run()
