"""Processes of their own for tests that run code at the same time in several of them (a Spark task
per shard, a second writer of the registry or the index)."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

#: what the processes' code imports: in the server once, not in every process
PRELOAD = ["spark_jobs.tasks", "spark_jobs.applier", "sinks.all", "cdc.registry", "cdc.logstore.factory"]


def workers(module: str) -> BaseContext:
    """A context whose processes fork from a server that imported the product's task code and
    ``module`` (the test's: its target functions), as PySpark's daemon forks its Python workers.
    Each process is fresh (no state of the test's process), without an interpreter start and
    imports of its own: ``spawn`` cost about 3 s of CPU per process on a 2-core machine. The
    server starts with the first test of the session (of the xdist worker) that asks and serves
    the later ones; a later test's module is imported by its processes as they unpickle their
    target."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, module])
    return ctx
