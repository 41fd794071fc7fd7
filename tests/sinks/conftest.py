"""Sink tests run twice: with batches in the per-event form and in the columnar form."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cdc.registry import TableReg
from sinks.parse import Form
from tests.sinks.feed import Feed

FeedMaker = Callable[[TableReg], Feed]


@pytest.fixture(params=["events", "columns"])
def columnar(request: pytest.FixtureRequest) -> Form:
    """The batch form a test's feeds build (``events`` or ``columns``)."""
    form: Form = request.param
    return form


@pytest.fixture
def feed(columnar: Form) -> FeedMaker:
    """``feed(reg)``: a :class:`Feed` building batches in the form of the ``columnar`` parameter."""
    return lambda reg: Feed(reg, columnar)
