"""The differential harness of the compiled per-change paths (tests/unit/test_native.py for pgoutput,
tests/unit/test_native_wal2json.py for wal2json): a :class:`World` is one path (the Python one, or
the compiled one driven by :func:`cdc.codec.fastpath.native_changes`) over one table with an image
store; :func:`differential` feeds the same messages through both and asserts each outcome alike.
Each test file says how its decoder reads one message (its ``World.feed``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cdc.codec.envelope import EventBuilder, TableCodec
from cdc.codec.fastpath import native_changes
from cdc.logstore import Record
from cdc.logstore.images import Images
from cdc.reader.schema import SchemaFollower
from cdc.registry import Column, TableReg
from tests.codec_fakes import StaticCatalog

#: the builder's clock in the pump tests, so both paths stamp the same time
NOW = b"1764000000000"


def every_table(
    cols: list[tuple[str, str]], domains: dict[str, str], key: tuple[str, ...], exclude: tuple[str, ...]
) -> TableReg:
    """``public.every`` with ``cols`` ((name, type); a type in ``domains`` is a domain over its value)."""
    columns = tuple(Column(n, domains.get(t, t), domain=t if t in domains else None) for n, t in cols)
    return TableReg("public", "every", "cdc.public.every", key, columns=columns, exclude=exclude)


class World:
    """One path: its builder (with an image store at ``images``) and, with ``native`` (the compiled
    module), its driver of ``decoder``'s changes."""

    def __init__(self, images: Path, codec: TableCodec, decoder: Any, native: Any | None) -> None:
        self.images = Images(images)
        self.images.follow("cdc.public.every", 0.0)
        self.codec = codec
        self.changed: list[Any] = []
        self.builder = EventBuilder(
            {("public", "every"): self.codec}, images=self.images, staging=self.images.staging()
        )
        self.schema = SchemaFollower(
            self.builder, StaticCatalog(), lambda r, cols, told: self.changed.append(cols)
        )
        self.fast = native_changes(decoder, self.builder, native=native) if native is not None else None

    def feed(self, msg: bytes) -> Any:
        """What one message gives (:meth:`outcome`), or the error."""
        raise NotImplementedError

    def outcome(self, out: Any) -> tuple[Any, ...]:
        """A message's records (``out``: the builder's, None when it made none) and the image changes
        staged."""
        b = self.builder
        staged = dict(b.staging.changes) if b.staging is not None else {}
        version = b.staging.version if b.staging is not None else None
        records = None if out is None else (out[0], [(r.key, r.value, r.partition) for r in out[1]])
        return records, staged, version

    def records(self, msgs: list[bytes]) -> list[Any]:
        """Each record ``msgs`` give, fed in order, as ``(topic, key, value, partition)``."""
        got: list[Any] = []
        for m in msgs:
            out = self.feed(m)
            if out[0] is not None:
                got += [(out[0][0], *r) for r in out[0][1]]
        return got

    def ready(self, head: list[bytes]) -> None:
        """Feed ``head`` (a relation, a begin), then fix the builder's clock for a ``pump`` (the
        compiled world only)."""
        for m in head:
            self.feed(m)
        assert self.fast is not None
        self.builder.now = NOW

    def close(self) -> None:
        self.images.close()


def differential(py: World, nat: World, msgs: list[bytes], shown: int) -> tuple[list[Any], Any]:
    """Feed ``msgs`` through both paths; assert each message's outcome is identical (a difference
    shows the message's first ``shown`` bytes). The outcomes and the compiled driver."""
    try:
        outs = []
        for m in msgs:
            a, b = py.feed(m), nat.feed(m)
            assert b == a, (m[:shown], a, b)
            outs.append(b)
        assert nat.changed == py.changed
        assert nat.fast is not None
        return outs, nat.fast
    finally:
        py.close()
        nat.close()


class Batch:
    """What ``Changes.pump`` touches of a ``cdc.logstore.batch.Batch`` (pure logic: no writer)."""

    def __init__(self) -> None:
        self.records: dict[str, list[Any]] = {}
        self.count = 0
        self.started = 0.0


def packed_alike(batch: Any, want: list[Any], end: list[int]) -> None:
    """``batch`` holds one topic's records in the compiled ``Records`` form, they are ``want``
    (``(topic, key, value, partition)``), and the embedded store's compiled append packs them to the
    bytes it packs a list of the same records to."""
    records_native = pytest.importorskip("cdc.logstore._records")
    pack = pytest.importorskip("cdc.logstore.embedded._pack")
    (topic, recs), *others = batch.records.items()
    assert not others and type(recs) is records_native.Records
    assert [(topic, r.key, r.value, r.partition) for r in recs] == want
    listed = [Record(r.key, r.value) for r in recs]
    assert pack.group_pack(topic, 3, end, recs, 5) == pack.group_pack(topic, 3, end, listed, 5)
