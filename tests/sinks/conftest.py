"""Sink tests run twice: with batches in the per-event form and in the columnar form."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cdc.registry import TableReg
from sinks.parse import Form
from sinks.warehouse import WarehouseOptions, WarehouseSink
from tests.sinks.feed import Feed

FeedMaker = Callable[[TableReg], Feed]


@pytest.fixture(params=["events", "columns"])
def columnar(request: pytest.FixtureRequest) -> Form:
    """The batch form a test's feeds build (``events`` or ``columns``)."""
    form: Form = request.param
    return form


@pytest.fixture(params=[1, 4], ids=["1-shard", "4-shards"])
def sink(tmp_path: Path, request: pytest.FixtureRequest) -> WarehouseSink:
    """A warehouse in ``tmp_path``: 4 buckets, no maintenance; its tables in one shard, and in 4
    shards (what the apply's Spark tasks write)."""
    shards: int = request.param
    return WarehouseSink(tmp_path, WarehouseOptions(buckets=4, maintain_every=0, shards=shards))


@pytest.fixture
def feed(columnar: Form) -> FeedMaker:
    """``feed(reg)``: a :class:`Feed` building batches in the form of the ``columnar`` parameter."""
    return lambda reg: Feed(reg, columnar)
