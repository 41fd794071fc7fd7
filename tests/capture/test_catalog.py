from collections.abc import Iterator

import psycopg
import pytest

from cdc.catalog import describe_table, server_info, slot_info
from cdc.errors import RegistryError
from cdc.registry import Column
from tests.plugins.postgres import PgCluster


@pytest.fixture
def conn(pg: PgCluster, pg_db: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(pg.dsn(pg_db), autocommit=True) as c:
        yield c


def test_describe_table(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    conn.execute(
        'CREATE TABLE public.orders (b text, "A Id" int, gone int, amount numeric(38,9) NOT NULL, '
        'tags integer[], at timestamptz, PRIMARY KEY (b, "A Id"))'
    )
    conn.execute("ALTER TABLE public.orders DROP COLUMN gone")
    conn.execute("INSERT INTO public.orders SELECT i::text, i, i FROM generate_series(1, 500) i")
    conn.execute("ANALYZE public.orders")
    d = describe_table(conn, "public", "orders")
    assert d.relkind == "r" and d.is_table
    assert d.columns == (
        Column("b", "text", False),
        Column("A Id", "integer", False),
        Column("amount", "numeric(38,9)", False),
        Column("tags", "integer[]", True),
        Column("at", "timestamp with time zone", True),
    )
    assert d.primary_key == ("b", "A Id")
    assert d.replica_identity == "d" and d.replica_identity_columns == ("b", "A Id")
    assert d.estimated_rows == 500
    assert d.has_select_privilege
    assert d.sql_name == "public.orders"
    assert d.unique_keys == (("b", "A Id"),)
    assert d.is_unique_key(("b", "A Id")) and not d.is_unique_key(("b",))


def test_unique_keys_ignore_include_partial_and_expression_indexes(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    conn.execute(
        "CREATE TABLE u (a int NOT NULL, b int, c text, d int NOT NULL, PRIMARY KEY (d) INCLUDE (c))"
    )
    conn.execute("CREATE UNIQUE INDEX u_ab ON u (a) INCLUDE (b)")
    conn.execute("CREATE UNIQUE INDEX u_part ON u (b) WHERE b > 0")
    conn.execute("CREATE UNIQUE INDEX u_expr ON u (lower(c))")
    d = describe_table(conn, "public", "u")
    assert d.primary_key == ("d",)
    assert d.unique_keys == (("a",), ("d",))
    assert d.is_unique_key(("a", "b")) and d.is_unique_key(("c", "d"))
    assert not d.is_unique_key(("b",)) and not d.is_unique_key(("c",))
    conn.execute("CREATE TABLE n (x int, y int)")
    conn.execute("CREATE UNIQUE INDEX n_x ON n (x)")
    assert not describe_table(conn, "public", "n").is_unique_key(("x",))  # many NULLs allowed


def test_describe_quoted_names_views_and_identity(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    conn.execute('CREATE SCHEMA "Mixed Case"')
    conn.execute('CREATE TABLE "Mixed Case"."tab le" (x int, y text NOT NULL)')
    conn.execute('CREATE UNIQUE INDEX ux ON "Mixed Case"."tab le" (y)')
    d = describe_table(conn, "Mixed Case", "tab le")
    assert d.primary_key == () and d.replica_identity_columns == () and d.estimated_rows == 0
    assert d.sql_name == '"Mixed Case"."tab le"'
    conn.execute('ALTER TABLE "Mixed Case"."tab le" REPLICA IDENTITY USING INDEX ux')
    d = describe_table(conn, "Mixed Case", "tab le")
    assert (d.replica_identity, d.replica_identity_columns) == ("i", ("y",))
    conn.execute('ALTER TABLE "Mixed Case"."tab le" REPLICA IDENTITY FULL')
    assert describe_table(conn, "Mixed Case", "tab le").replica_identity_columns == ("x", "y")
    conn.execute("CREATE VIEW public.v AS SELECT 1 AS one")
    v = describe_table(conn, "public", "v")
    assert v.relkind == "v" and not v.is_table and v.kind == "view"
    conn.execute('CREATE TABLE public."Orders" (id int)')
    with pytest.raises(RegistryError, match="does not exist") as err:
        describe_table(conn, "public", "orders")
    assert "'public.\"Orders\"'" in (err.value.fix or "")


def test_server_and_slot_info(conn: psycopg.Connection[tuple[object, ...]], pg_db: str) -> None:
    info = server_info(conn)
    assert info.wal_level == "logical"
    assert info.max_replication_slots == 64 and info.max_wal_senders == 64
    assert info.max_slot_wal_keep_size == -1
    assert info.role == "postgres" and info.can_replicate and info.database == pg_db
    assert slot_info(conn, "nope").exists is False
    conn.execute("SELECT pg_create_logical_replication_slot('cat_slot', 'wal2json')")
    conn.execute("CREATE TABLE t (id int primary key)")
    conn.execute("INSERT INTO t SELECT generate_series(1, 1000)")
    s = slot_info(conn, "cat_slot")
    assert s.exists and s.plugin == "wal2json" and s.slot_type == "logical" and s.database == pg_db
    assert not s.active and s.wal_status == "reserved"
    assert s.restart_lsn is not None and s.confirmed_flush_lsn is not None
    assert s.retained_bytes is not None and s.retained_bytes > 0
    assert s.lag_bytes is not None and s.lag_bytes > 0
    assert s.safe_wal_size is None
    assert server_info(conn).slots_in_use >= 1
