"""The reader keeps a key's image only for a row that may hold a value out of line: one whose stored
length can pass Postgres' ``TOAST_TUPLE_THRESHOLD`` (``TableCodec.holds_out_of_line``, and the same
bound in the snapshot's Arrow path). The bound must never be under the real size, or an update
that leaves such a value out could not be filled in. Checked against Postgres' own sizes, with the
types whose stored form outgrows their text (jsonb of one-digit numbers, int8 and numeric arrays,
multi-byte text, tsvector), through the real reader on both decoders."""

from __future__ import annotations

import random

import orjson
import pytest

from cdc.codec.envelope import TableCodec
from cdc.codec.values import TOAST_TUPLE_THRESHOLD
from cdc.logstore.images import Images, images_path
from tests.plugins.capture import CaptureEnv

pytestmark = [pytest.mark.postgres, pytest.mark.decoders("wal2json", "pgoutput")]

COLUMNS = "id int PRIMARY KEY, j jsonb, a bigint[], n numeric[], t text, b bytea, v tsvector"


def test_the_row_bound_is_never_under_the_stored_size(env: CaptureEnv) -> None:
    rng = random.Random(31)
    env.sql(f"CREATE TABLE t ({COLUMNS})")
    for col in ("j", "a", "n", "t", "b", "v"):  # stored as they are: no compression hides the size
        env.sql(f"ALTER TABLE t ALTER COLUMN {col} SET STORAGE EXTERNAL")

    def row(i: int) -> tuple[object, ...]:
        k = rng.randrange(1, 160)
        return (
            i,
            orjson.dumps([1] * rng.randrange(0, k + 1)).decode() if i % 5 else None,
            [rng.randrange(0, 9) for _ in range(rng.randrange(0, k + 1))],
            [str(rng.randrange(0, 9)) for _ in range(rng.randrange(0, k // 2 + 1))],
            "é€" * rng.randrange(0, k * 2),
            bytes(rng.randrange(256) for _ in range(rng.randrange(0, k * 4))),
            " ".join(f"w{rng.randrange(50)}" for _ in range(rng.randrange(0, k))),
        )

    insert = "INSERT INTO t VALUES (%s, %s, %s, %s::numeric[], %s, %s, to_tsvector('simple', %s))"
    for i in range(150):
        env.sql(insert, row(i))
    env.add_table("public.t")
    env.run_once()  # the snapshot's Arrow path
    for i in range(150, 300):
        env.sql(insert, row(i))  # the stream's path
    env.run_once()

    sizes = dict(env.fetch("SELECT id, pg_column_size(t.*) FROM t"))
    reg = env.reg("public", "t")
    codec = TableCodec(reg, prefix="p", db="d", partitions=1)
    over = 0
    for value in env.values(reg.topic):
        after = value["after"]
        size = sizes[after["id"]]
        if size > TOAST_TUPLE_THRESHOLD:
            over += 1
            assert codec.holds_out_of_line(after), (after["id"], size)
    assert over > 20  # the test reached both sides of the threshold
    assert over < 290
    images = Images(images_path(env.state))
    try:
        for i, size in sizes.items():
            kept = images.get(reg.topic, orjson.dumps({"id": i}))
            if size > TOAST_TUPLE_THRESHOLD:  # both paths kept it: the snapshot's and the stream's
                assert kept is not None and set(kept) == {b'"j"', b'"a"', b'"n"', b'"t"', b'"b"', b'"v"'}, i
    finally:
        images.close()
