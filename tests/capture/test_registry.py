import sqlite3
from pathlib import Path

import pytest

from cdc.cli.tables import table_json
from cdc.errors import RegistryError
from cdc.registry import Alignment, Column, Registry, State, TableReg, TableState
from tests.plugins.forks import workers

COLS = (Column("id", "integer", False), Column("body", "text"))


def reg(schema: str = "public", table: str = "orders", **kw: object) -> TableReg:
    return TableReg(
        schema=schema, table=table, topic=f"cdc.{schema}.{table}", key=("id",), columns=COLS, **kw
    )  # type: ignore[arg-type]


def test_add_get_list_remove_round_trip(tmp_path: Path) -> None:
    with Registry(tmp_path / "state") as r:
        assert r.list_tables() == []
        g0 = r.generation()
        r.add(reg(table="zeta", search=("body",), extra={"note": 1}))
        r.add(reg(schema="Mixed Case", table="tab le"))
        r.add(reg(table="alpha"))
        assert r.generation() == g0 + 3
        assert [t.qualified for t in r.list_tables()] == ["Mixed Case.tab le", "public.alpha", "public.zeta"]
        got = r.get("public", "zeta")
        assert got == reg(table="zeta", search=("body",), extra={"note": 1})
        assert r.find('"Mixed Case"."tab le"').table == "tab le"
        assert r.find("Mixed Case.tab le").schema == "Mixed Case"  # unquoted convenience form
        assert r.find("ZETA").table == "zeta"  # folded like Postgres
        removed = r.remove("public", "alpha")
        assert removed.table == "alpha"
        assert r.generation() == g0 + 4
    with Registry(tmp_path / "state") as again:  # durable across opens
        assert [t.table for t in again.list_tables()] == ["tab le", "zeta"]


def test_refusals_name_the_fix(tmp_path: Path) -> None:
    with Registry(tmp_path) as r:
        r.add(reg())
        with pytest.raises(RegistryError, match="already registered") as err:
            r.add(reg())
        assert "cdc tables remove" in (err.value.fix or "")
        with pytest.raises(RegistryError, match="not registered") as err:
            r.get("public", "missing")
        assert "cdc tables add" in (err.value.fix or "")
        with pytest.raises(RegistryError, match="not registered"):
            r.remove("public", "missing")
        with pytest.raises(RegistryError, match="not registered"):
            r.find('"Orders"')
        with pytest.raises(RegistryError, match="snapshot state"):
            r.set_snapshot_state("public", "orders", "bogus")


def test_snapshot_state_and_alignment(tmp_path: Path) -> None:
    with Registry(tmp_path) as r:
        r.add(reg())
        g = r.generation()
        r.set_snapshot_state("public", "orders", "running")
        done = r.set_snapshot_state("public", "orders", "done", Alignment(0x16B374D848, {0: 5, 3: 7}))
        assert r.generation() == g  # the capture side's own progress does not wake the reader
        assert r.get("public", "orders") == done
        assert done.alignment == Alignment(0x16B374D848, {0: 5, 3: 7})
        again = r.set_snapshot_state("public", "orders", "pending")  # a re-snapshot request
        assert again.alignment is None and again.snapshot_state == "pending"
        assert r.generation() == g + 1


def test_set_columns_bumps_generation_only_on_change(tmp_path: Path) -> None:
    with Registry(tmp_path) as r:
        r.add(reg())
        g = r.generation()
        r.set_columns("public", "orders", COLS)
        assert r.generation() == g
        new = (*COLS, Column("added", "numeric(10,2)"))
        assert r.set_columns("public", "orders", new).columns == new
        assert r.get("public", "orders").columns == new
        assert r.generation() == g + 1


def test_a_domain_column_keeps_its_domain_name(tmp_path: Path) -> None:
    cols = (
        Column("id", "integer", False),
        Column("y", "integer", True, "year"),
        Column("a", "integer[]", True, "year[]"),
    )
    with Registry(tmp_path) as r:
        r.add(TableReg(schema="public", table="film", topic="cdc.public.film", key=("id",), columns=cols))
    with Registry(tmp_path) as r:
        assert r.get("public", "film").columns == cols
        assert r.set_columns("public", "film", cols).schema_version == 1  # unchanged: no new version
        listed = table_json(r.get("public", "film"), tmp_path, r)["columns"]
    assert listed[1] == {"name": "y", "type": "integer", "nullable": True, "domain": "year"}
    assert "domain" not in listed[0]


def test_state_store(tmp_path: Path) -> None:
    with Registry(tmp_path) as r:
        assert r.get_state("reader.lsn") is None
        r.set_state("reader.lsn", "0/16B3")
        assert r.get_state("reader.lsn") == "0/16B3"
        r.set_state("reader.lsn", None)
        assert r.get_state("reader.lsn") is None


#: the keys as registry.db files written before the typed state API hold them
OLD_KEYS = {
    State.INITIAL_SNAPSHOT: "initial_snapshot",
    State.STREAMED_TABLES: "streamed_tables",
    State.STREAMED_PARTITIONS: "streamed_partitions",
    State.WAL2JSON_NUMERIC_AS_STRING: "wal2json_numeric_as_string",
    State.SLOT_DROPPED: "slot_dropped",
    State.DECODER: "decoder",
}
OLD_TABLE_PREFIXES = {
    TableState.CHUNKED_PROGRESS: "chunked",
    TableState.SOURCE_MISSING: "source_missing",
    TableState.SOURCE_MISSING_DDL: "source_missing_ddl",
    TableState.SCHEMA_REFUSED: "schema_refused",
    TableState.SNAPSHOT_REQUEST: "snapshot_request",
    TableState.PARTITIONS_DETACHED: "partitions_detached",
    TableState.DROP_BEFORE: "drop_before",
    TableState.NONFINITE_RECORDER: "nonfinite_recorder",
    TableState.VERIFIED_CLEAN: "verified_clean",
    TableState.VALUES_UNKNOWN: "values_unknown",
}


def test_typed_state_reads_and_writes_the_keys_existing_files_hold(tmp_path: Path) -> None:
    assert set(OLD_KEYS) == set(State) and set(OLD_TABLE_PREFIXES) == set(TableState)
    with Registry(tmp_path):
        pass
    db = sqlite3.connect(tmp_path / "registry.db")
    with db:
        for old in OLD_KEYS.values():
            db.execute("INSERT INTO state VALUES (?, ?)", (old, f"v-{old}"))
        for prefix in OLD_TABLE_PREFIXES.values():
            db.execute("INSERT INTO state VALUES (?, ?)", (f'{prefix}:["Sch \\"x","t\u00e9"]', f"v-{prefix}"))
    db.close()
    with Registry(tmp_path) as r:
        for entry, old in OLD_KEYS.items():
            assert r.get_state(entry) == f"v-{old}"
        for tentry, prefix in OLD_TABLE_PREFIXES.items():
            assert r.get_table_state(tentry, 'Sch "x', "t\u00e9") == f"v-{prefix}"
            r.set_table_state(tentry, 'Sch "x', "t\u00e9", None)
            assert r.get_table_state(tentry, 'Sch "x', "t\u00e9") is None
        r.set_table_state(TableState.DROP_BEFORE, "s", "t", "42")
    db = sqlite3.connect(tmp_path / "registry.db")
    assert db.execute('SELECT value FROM state WHERE name = \'drop_before:["s","t"]\'').fetchone() == ("42",)
    db.close()


def test_corrupt_file_names_path_and_fix(tmp_path: Path) -> None:
    (tmp_path / "registry.db").write_bytes(b"this is not sqlite" * 300)
    with pytest.raises(RegistryError) as err:
        Registry(tmp_path)
    assert str(tmp_path / "registry.db") in err.value.message
    assert "move it aside" in (err.value.fix or "")


def _adder(state: str, start: int) -> None:
    with Registry(Path(state)) as r:
        for i in range(start, start + 25):
            r.add(reg(table=f"t{i:03d}"))


def test_concurrent_writers_and_reader(tmp_path: Path) -> None:
    ctx = workers(__name__)
    procs = [ctx.Process(target=_adder, args=(str(tmp_path), n * 25)) for n in range(3)]
    for p in procs:
        p.start()
    with Registry(tmp_path) as reader:
        seen = 0
        while any(p.is_alive() for p in procs):
            g = reader.generation()
            assert g >= seen  # never goes back
            seen = g
            assert len(reader.list_tables()) <= 75
        for p in procs:
            p.join()
            assert p.exitcode == 0
        assert len(reader.list_tables()) == 75
        assert reader.generation() == 75
