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


@pytest.fixture(params=["merge", "files"])
def write(request: pytest.FixtureRequest) -> str:
    """The warehouse's write method (``WarehouseOptions.write``): delta-rs' MERGE or the Arrow
    copy-on-write of whole buckets (``sinks.warehouse.files``); every warehouse test runs with both."""
    method: str = request.param
    return method


@pytest.fixture(params=[("merge", 1), ("files", 4)], ids=["merge", "files-4-shards"])
def sink(tmp_path: Path, request: pytest.FixtureRequest) -> WarehouseSink:
    """A warehouse in ``tmp_path``: 4 buckets, no maintenance; written with delta-rs' MERGE (one
    shard: the driver's default), and with the Arrow file writes in 4 shards (what the apply's Spark
    tasks write; one shard with file writes is covered by the tests that take ``write``)."""
    write, shards = request.param
    return WarehouseSink(tmp_path, WarehouseOptions(buckets=4, maintain_every=0, write=write, shards=shards))


@pytest.fixture
def feed(columnar: Form) -> FeedMaker:
    """``feed(reg)``: a :class:`Feed` building batches in the form of the ``columnar`` parameter."""
    return lambda reg: Feed(reg, columnar)
