"""The one way the project opens DuckDB."""

from __future__ import annotations

import duckdb


def connect() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection that never prints a progress bar.

    DuckDB's Python client draws a progress bar on the process's stdout once a query runs longer than
    2 s, even when stdout is a pipe. Its C stdio buffer is flushed at exit, after the JSON that
    ``cdc sql --json`` printed, so a slow query's output stopped being one JSON document. Printing is
    turned off, not just the bar: ``SET progress_bar_time`` turns the bar back on."""
    con = duckdb.connect(":memory:")
    con.execute("SET enable_progress_bar = false")
    con.execute("SET enable_progress_bar_print = false")
    return con
