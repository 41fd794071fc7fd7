"""Sink tests run twice: with batches in the per-event form and in the columnar form."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.sinks import feed


@pytest.fixture(params=[False, True], ids=["events", "columns"])
def columnar(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Feed.batch builds the columnar form (when the columnar parse takes the batch) if True."""
    feed.COLUMNAR = bool(request.param)
    try:
        yield feed.COLUMNAR
    finally:
        feed.COLUMNAR = False
