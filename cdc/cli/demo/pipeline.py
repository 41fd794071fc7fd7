"""``cdc demo``: the whole pipeline on the embedded log store, end to end, on a private Postgres.

Starts a private cluster, creates a small shop schema (customers, products with descriptions,
orders), registers the tables as a DBA would, captures (initial snapshot + streaming), applies with
Spark to the warehouse and the search index, changes some rows, captures and applies again, then
shows an analyst query, a search and ``cdc verify``, each printed. It stops what it started. Every
step runs the real ``cdc`` verb in-process with the same flags a person would type, and a step that
fails stops the demo with that step's exit code: nothing is pretended.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psycopg

from cdc.devcluster import PgCluster, start_cluster
from cdc.errors import CdcError

SCHEMA_SQL = """
CREATE SCHEMA shop;
CREATE TABLE shop.customers (
    id bigint PRIMARY KEY, name text NOT NULL, email text NOT NULL, city text,
    created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE shop.products (
    id bigint PRIMARY KEY, name text NOT NULL, description text NOT NULL,
    price numeric(12,2) NOT NULL, tags text[] NOT NULL DEFAULT '{}', attributes jsonb);
CREATE TABLE shop.orders (
    id bigint PRIMARY KEY, customer_id bigint NOT NULL REFERENCES shop.customers(id),
    product_id bigint NOT NULL REFERENCES shop.products(id), quantity int NOT NULL,
    total numeric(14,2) NOT NULL, ordered_at timestamptz NOT NULL DEFAULT now());
"""

PRODUCTS = [
    (
        "Trail running shoe",
        "Lightweight trail running shoe with a grippy outsole for muddy mountain paths",
        "129.90",
        ["shoes", "running"],
        '{"weight_g": 280}',
    ),
    (
        "Road running shoe",
        "Cushioned road shoe for long distance running on asphalt",
        "119.00",
        ["shoes", "running"],
        '{"weight_g": 250}',
    ),
    (
        "Rain jacket",
        "Waterproof breathable rain jacket, packs into its own pocket",
        "89.50",
        ["jackets"],
        '{"waterproof_mm": 20000}',
    ),
    (
        "Down jacket",
        "Warm goose down jacket for winter hiking and cold mornings",
        "219.00",
        ["jackets", "winter"],
        None,
    ),
    (
        "Headlamp",
        "Rechargeable headlamp, 400 lumen, for night running and camping",
        "39.95",
        ["light", "camping"],
        '{"lumen": 400}',
    ),
    (
        "Trekking poles",
        "Carbon trekking poles, adjustable, for steep mountain descents",
        "79.00",
        ["hiking"],
        None,
    ),
]

CITIES = ["Lyon", "Porto", "Gent", "Turku", "Graz"]


def _seed(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA_SQL)
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO shop.customers (id, name, email, city) VALUES (%s, %s, %s, %s)",
                [
                    (i, f"Customer {i}", f"customer{i}@example.com", CITIES[i % len(CITIES)])
                    for i in range(1, 51)
                ],
            )
            cur.executemany(
                "INSERT INTO shop.products (id, name, description, price, tags, attributes) "
                "VALUES (%s, %s, %s, %s::numeric, %s, %s::jsonb)",
                [(i + 1, *p) for i, p in enumerate(PRODUCTS)],
            )
            cur.executemany(
                "INSERT INTO shop.orders (id, customer_id, product_id, quantity, total) "
                "SELECT %s, %s, p.id, %s, p.price * %s FROM shop.products p WHERE p.id = %s",
                [(i, 1 + i % 50, 1 + i % 3, 1 + i % 3, 1 + i % 6) for i in range(1, 201)],
            )


def _change(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "UPDATE shop.products SET price = price * 0.9, description = description || "
            "' (now 10% off)' WHERE 'running' = ANY(tags)"
        )
        conn.execute(
            "INSERT INTO shop.products (id, name, description, price, tags) VALUES "
            "(7, 'Trail gaiters', 'Gaiters that keep gravel out of trail running shoes', 24.00, "
            "'{running}')"
        )
        conn.execute("DELETE FROM shop.orders WHERE id > 190")
        conn.execute("UPDATE shop.customers SET city = 'Bergen' WHERE id <= 5")
        conn.execute(
            "UPDATE shop.products SET id = 70 WHERE id = 7"  # a primary-key change
        )


def run_demo(
    run_cli: Callable[[list[str]], int],
    workdir: Path | None = None,
    keep: bool = False,
    out: Callable[[str], None] = print,
    verbose: bool = False,
) -> int:
    """Run the demo, each step through ``run_cli`` (``cdc.cli.main``, passed in by the ``demo``
    verb so this module does not import the CLI above it); return the exit code of the first
    failing step, or 0. ``verbose``: ``cdc run`` and ``cdc apply`` with ``--verbose`` (Spark's
    start-up output, a repeated log line)."""
    base = Path(tempfile.mkdtemp(prefix="cdc-demo-")) if workdir is None else workdir
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)  # the cluster runs as the postgres OS user when we are root: it must reach base/pg
    state = base / "state"
    cluster: PgCluster | None = None
    started = time.monotonic()
    try:
        out(f"== starting a private PostgreSQL 15 (wal_level=logical, wal2json) under {base}")
        cluster = start_cluster(base / "pg")
        cluster.execute("CREATE DATABASE app")
        # what `cdc check` asks a DBA for: a bound on the WAL a stalled slot may keep
        cluster.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1GB'")
        cluster.execute("SELECT pg_reload_conf()")
        dsn = cluster.dsn("app")
        _seed(dsn)
        out("== created shop.customers (50 rows), shop.products (6), shop.orders (200)")

        def step(title: str, *args: str) -> None:
            out(f"\n$ cdc {' '.join(shlex.quote(a) for a in args)}    # {title}")
            sys.stdout.flush()
            code = run_cli(["--source", dsn, "--state", str(state), *args])
            sys.stdout.flush()
            if code != 0:
                raise _StepFailed(title, code)

        step("is the source ready?", "check")
        for table, flags in [
            ("shop.customers", []),
            ("shop.products", ["--search", "name,description"]),
            ("shop.orders", []),
        ]:
            step("register a table", "tables", "add", table, *flags)
        step("what is captured", "tables", "list")
        loud = ["--verbose"] if verbose else []
        step("initial snapshot, then stream to the current WAL position", "run", "--once", *loud)
        step("Spark applies the topics to Delta and tantivy", "apply", "--once", *loud)
        out(
            "\n== changing rows at the source: price cut on running gear, a new product, "
            "10 orders deleted, 5 customers moved, a primary-key change"
        )
        _change(dsn)
        step("capture the changes", "run", "--once", *loud)
        step("apply them", "apply", "--once", *loud)
        step(
            "analyst query: revenue per city (join)",
            "sql",
            "SELECT c.city, count(*) AS orders, sum(o.total) AS revenue FROM shop.orders o "
            "JOIN shop.customers c ON c.id = o.customer_id GROUP BY c.city ORDER BY revenue DESC",
        )
        step(
            "history of one product",
            "sql",
            "SELECT id, price, _cdc_op, valid_from, valid_to, is_current FROM shop.products__history "
            "WHERE id = 1 ORDER BY valid_from",
        )
        step("full-text search", "search", "shop.products", "trail running", "--limit", "3")
        step("the derived tables equal the source", "verify")
        out(f"\n== demo finished in {time.monotonic() - started:.0f} s")
        return 0
    except _StepFailed as failed:
        out(f"\n== demo step failed: {failed.title} (exit code {failed.code})")
        return failed.code
    except CdcError as err:
        out(f"\n== demo failed: {err.message}" + (f"\n   fix: {err.fix}" if err.fix else ""))
        return err.exit_code
    finally:
        if cluster is not None:
            cluster.stop("fast")
        if keep:
            out(f"== state kept under {state}")
        else:
            shutil.rmtree(base, ignore_errors=True)


class _StepFailed(Exception):
    def __init__(self, title: str, code: int) -> None:
        super().__init__(title)
        self.title = title
        self.code = code
