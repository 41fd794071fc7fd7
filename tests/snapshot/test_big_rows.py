"""Rows that real tables have: values of 1, 5 and 20 MB next to short ones, holding quotes, commas,
newlines, carriage returns, tabs and backslashes, in columns of many types. The initial snapshot and
a chunked one (through ``cdc run --once``) carry every value exactly."""

from __future__ import annotations

import random
from decimal import Decimal
from typing import Any

import orjson
import psycopg
import pytest
from psycopg.types.json import Jsonb

from cdc.logstore.factory import open_log_store
from cdc.reader import Reader
from cdc.registry import Registry
from snapshot import SnapshotError
from snapshot.encode import RowEncoder
from tests.plugins.capture import CaptureEnv, materialize

pytestmark = pytest.mark.cdc_config("[snapshot]\nchunk_size = 7\n")

MB = 1 << 20
UGLY = 'a"b,c\n\\d\r\te""\\\\,\n\r\n{}NULL é😀'

DDL = """
CREATE TYPE mood3 AS ENUM ('ok', 'a "quoted", label');
CREATE TABLE big (
  id integer PRIMARY KEY, e mood3, j jsonb, x xml, ta text[], b bytea, iv interval, ip inet,
  f double precision, n numeric, t text
)"""
COLUMNS = "id, e, j, x, ta, b, iv, ip, f, n, t"


def _text(rnd: random.Random, size: int) -> str:
    """``size`` characters, mostly the awkward ones, never the same twice (a cut or a swap shows)."""
    pieces = []
    n = 0
    while n < size:
        piece = UGLY[rnd.randrange(len(UGLY)) :] + str(rnd.random())
        pieces.append(piece)
        n += len(piece)
    return "".join(pieces)[:size]


def _rows() -> list[tuple[Any, ...]]:
    rnd = random.Random(16)
    out: list[tuple[Any, ...]] = []
    big = {5: 1 * MB, 12: 20 * MB, 20: 5 * MB, 21: 1 * MB, 33: 5 * MB}
    for i in range(1, 41):
        size = big.get(i, rnd.choice([0, 1, 10, 200]))
        t = _text(rnd, size)
        small = _text(rnd, 12)
        out.append(
            (
                i,
                "ok" if i % 2 else 'a "quoted", label',
                Jsonb({"k": small, "n": [1, 2.5, None], "big": _text(rnd, MB) if i == 21 else ""}),
                "<a>" + small.replace("<", "").replace("&", "") + "</a>",
                [small, None, "", "NULL", '"', "a,b", "{x}"] + ([t[: MB // 2]] if i == 33 else []),
                rnd.randbytes(5 * MB if i == 20 else 20),
                f"{i} days {i % 24}:00:01.5",
                f"10.0.{i}.1/24",
                rnd.uniform(-1e300, 1e300) if i % 3 else 0.1,
                Decimal(f"{rnd.randrange(10**30)}.{i:09d}"),
                t if size or i % 4 else None,
            )
        )
    return out


def _source(env: CaptureEnv) -> dict[str, dict[str, Any]]:
    """Every row as the events encode it, read back from the source."""
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT id, e::text, j::text, x::text, ta, b, iv::text, ip::text, f, n::text, t FROM big"
        ).fetchall()
    out = {}
    for id_, e, j, x, ta, b, iv, ip, f, n, t in rows:
        out[orjson.dumps({"id": id_}).decode()] = {
            "id": id_,
            "e": e,
            "j": j,
            "x": x,
            "ta": ta,
            "b": b.hex(),
            "iv": iv,
            "ip": ip,
            "f": f,
            "n": n,
            "t": t,
        }
    return out


def _check(env: CaptureEnv, want: dict[str, dict[str, Any]]) -> int:
    """The topic's rows equal the source's, value for value; returns the number of ``op=r`` events."""
    records = env.records(env.reg("public", "big").topic)
    got = materialize(records)
    assert sorted(got) == sorted(want)
    for key, row in want.items():
        for col, value in row.items():
            assert got[key][col] == value, (key, col, str(got[key][col])[:80], str(value)[:80])
    return sum(1 for r in records if r.value and orjson.loads(r.value)["op"] == "r")


def test_rows_of_1_5_and_20_mb_snapshot_exactly_initial_and_chunked(env: CaptureEnv) -> None:
    env.sql(DDL)
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        for row in _rows():  # one by one, in id order: the COPY returns them in this order
            conn.execute(f"INSERT INTO big ({COLUMNS}) VALUES ({', '.join(['%s'] * 11)})", row)
    want = _source(env)
    assert max(len(r["t"] or "") for r in want.values()) == 20 * MB
    env.add_table("public.big")
    out = env.run_once()  # the initial snapshot
    assert out["snapshot_rows"].get("public.big") == len(want), out
    assert _check(env, want) == len(want)
    res = env.cdc("snapshot", "public.big")
    assert res.returncode == 0, res.stderr
    env.run_once()  # a chunked snapshot (7 rows a chunk) while streaming
    assert _check(env, want) == 2 * len(want)


def test_a_table_whose_snapshot_fails_is_named_and_the_others_are_kept(
    env: CaptureEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unforeseen failure (injected: nothing real is known to fail any more) while encoding one
    value of table 2 of 3: the error names the table and the column, with a fix; tables 1 and 3 are
    recorded as snapshotted; the next run snapshots table 2 in chunks, and nothing is read twice."""

    for name in ("t1", "t2", "t3"):
        env.sql(f"CREATE TABLE {name} (id integer PRIMARY KEY, v text, w text)")
        env.sql(f"INSERT INTO {name} SELECT g, 'v' || g, repeat('w', g) FROM generate_series(1, 50) g")
        env.add_table(f"public.{name}")
    err = _run_failing_on_t2_w(env, monkeypatch)
    assert (
        "public.t2" in err.message and "column w" in err.message and "something nobody foresaw" in err.message
    )
    assert err.fix and "--exclude w" in err.fix
    assert [r.reg.qualified for r in err.done] == ["public.t1", "public.t3"]
    with env.registry() as r:
        assert r.get_state("initial_snapshot") == "done"
        states = {t: r.get("public", t).snapshot_state for t in ("t1", "t2", "t3")}
    assert states == {"t1": "done", "t2": "pending", "t3": "done"}
    monkeypatch.undo()  # encoding works again
    env.sql("UPDATE t1 SET v = 'changed' WHERE id = 1")  # streamed from the same slot
    env.run_once()  # t2 in chunks while t1 and t3 stream
    with env.registry() as r:
        assert all(r.get("public", t).snapshot_state == "done" for t in ("t1", "t2", "t3"))
    for name in ("t1", "t2", "t3"):
        records = env.records(env.reg("public", name).topic)
        got = materialize(records)
        want = {orjson.dumps({"id": i}).decode(): {"id": i, "v": f"v{i}", "w": "w" * i} for i in range(1, 51)}
        if name == "t1":
            want['{"id":1}']["v"] = "changed"
        assert got == want, name
        reads = [r for r in records if r.value and orjson.loads(r.value)["op"] == "r"]
        if name != "t2":
            assert len(reads) == 50, name  # snapshotted once: kept, not read again


def test_a_chunked_snapshot_that_fails_names_the_table_and_column(
    env: CaptureEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same unforeseen failure in a chunked snapshot (a table registered on a running pipeline):
    the error names the table and column; the table already streaming keeps its state."""

    for name in ("t1", "t2"):
        env.sql(f"CREATE TABLE {name} (id integer PRIMARY KEY, v text, w text)")
        env.sql(f"INSERT INTO {name} SELECT g, 'v' || g, repeat('w', g) FROM generate_series(1, 20) g")
    env.add_table("public.t1")
    env.run_once()
    env.add_table("public.t2")
    err = _run_failing_on_t2_w(env, monkeypatch)
    assert err.fix and "--exclude w" in err.fix
    with env.registry() as r:
        assert r.get("public", "t1").snapshot_state == "done"
    monkeypatch.undo()  # encoding works again
    env.run_once()
    got = materialize(env.records(env.reg("public", "t2").topic))
    assert len(got) == 20 and got['{"id":3}'] == {"id": 3, "v": "v3", "w": "www"}


def _run_failing_on_t2_w(env: CaptureEnv, monkeypatch: pytest.MonkeyPatch) -> SnapshotError:
    """Run the reader in-process (``--once``) with encoding ``public.t2``'s column ``w`` failing for
    a reason nobody foresaw; return the :class:`SnapshotError` it raises, which names both."""
    fragment = RowEncoder.fragment

    def failing(self: RowEncoder, name: str, arr: Any) -> Any:
        if self.table == "public.t2" and name == "w":
            raise ValueError("something nobody foresaw")
        return fragment(self, name, arr)

    monkeypatch.setattr(RowEncoder, "fragment", failing)
    monkeypatch.setenv("CDC_NATIVE", "0")  # the injection is in the Arrow path's encoder
    settings = env.settings()
    with (
        Registry(settings.state_dir) as registry,
        open_log_store(settings, writer=True) as store,
        pytest.raises(SnapshotError) as info,
    ):
        Reader(settings, store, registry).run(once=True)
    err = info.value
    assert (err.table, err.column) == ("public.t2", "w")  # type: ignore[attr-defined]
    return err
