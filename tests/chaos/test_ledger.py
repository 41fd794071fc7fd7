"""The chaos ledger's count (pure logic): the workload's statements parsed into a ledger, counted
against warehouse tables in DuckDB with the very queries the harness runs through `cdc sql`. Each
kind of damage a faulty pipeline could do to the warehouse is counted as what it is."""

from __future__ import annotations

from typing import Any

import duckdb
import pytest

from tests.chaos.harness import Report
from tests.chaos.ledger import Count, Ledger, LedgerError, committed, count, parse


def _ledger() -> Ledger:
    ledger = Ledger()
    tx = [
        ("INSERT INTO chaos_accounts (id, name, balance) VALUES (%s, %s, %s)", (1, "account 1 aa", "0")),
        ("INSERT INTO chaos_accounts (id, name, balance) VALUES (%s, %s, %s)", (2, "account 2 bb", "1")),
        ("INSERT INTO chaos_accounts (id, name, balance) VALUES (%s, %s, %s)", (3, "account 3 cc", "1")),
        (
            "UPDATE chaos_accounts SET balance = %s, name = %s, updated_at = now() WHERE id = %s",
            ("2", "renamed 1 dd", 1),
        ),
        ("UPDATE chaos_accounts SET id = %s WHERE id = %s", (4, 2)),  # a key change
        ("DELETE FROM chaos_accounts WHERE id = %s", (3,)),
        ("INSERT INTO chaos_events (tenant, seq, payload) VALUES (%s, %s, %s)", (1, 1, "p1")),
        ("INSERT INTO chaos_events (tenant, seq, payload) VALUES (%s, %s, %s)", (2, 2, "p2")),
        ("DELETE FROM chaos_events WHERE tenant = %s AND seq = %s", (1, 1)),
        ("TRUNCATE chaos_events", None),
        ("INSERT INTO chaos_events (tenant, seq, payload) VALUES (%s, %s, %s)", (3, 3, "p3")),
        ("INSERT INTO chaos_docs (slug, title, body) VALUES (%s, %s, %s)", ("d", "draft", "x" * 9000)),
        ("UPDATE chaos_docs SET title = %s WHERE slug = %s", ("title 1", "d")),  # body unchanged
    ]
    ops = [op for q, p in tx if (op := parse(q, p)) is not None]
    ledger.apply(ops)
    return ledger


def _warehouse() -> duckdb.DuckDBPyConnection:
    """The warehouse a correct pipeline leaves after :func:`_ledger`'s changes."""
    con = duckdb.connect()
    con.execute("CREATE SCHEMA public")
    con.execute("CREATE TABLE public.chaos_accounts (id BIGINT, name VARCHAR)")
    con.execute("CREATE TABLE public.chaos_accounts__history (id BIGINT, name VARCHAR, is_current BOOLEAN)")
    con.execute("INSERT INTO public.chaos_accounts VALUES (1, 'renamed 1 dd'), (4, 'account 2 bb')")
    con.execute(
        "INSERT INTO public.chaos_accounts__history VALUES (1, 'account 1 aa', false), (2, 'account 2 bb', false),"
        " (3, 'account 3 cc', false), (1, 'renamed 1 dd', true), (4, 'account 2 bb', true)"
    )
    con.execute("CREATE TABLE public.chaos_events (tenant INT, seq BIGINT, payload VARCHAR)")
    con.execute(
        "CREATE TABLE public.chaos_events__history AS SELECT *, true AS is_current FROM public.chaos_events"
    )
    con.execute("INSERT INTO public.chaos_events VALUES (3, 3, 'p3')")
    con.execute(
        "INSERT INTO public.chaos_events__history VALUES (1, 1, 'p1', false), (2, 2, 'p2', false), (3, 3, 'p3', true)"
    )
    con.execute("CREATE TABLE public.chaos_docs (slug VARCHAR, title VARCHAR, body VARCHAR)")
    con.execute(
        "CREATE TABLE public.chaos_docs__history AS SELECT *, true AS is_current FROM public.chaos_docs"
    )
    body = "x" * 9000
    con.execute("INSERT INTO public.chaos_docs VALUES ('d', 'title 1', ?)", [body])
    con.execute(
        "INSERT INTO public.chaos_docs__history VALUES ('d', 'draft', ?, false), ('d', 'title 1', ?, true)",
        [body, body],
    )
    return con


def _sql(con: duckdb.DuckDBPyConnection) -> Any:
    def run(query: str) -> list[dict[str, Any]]:
        cur = con.execute(query)
        names = [d[0] for d in cur.description or []]
        # as `cdc sql --json` gives them: a HUGEINT sum is cast to text by the query itself
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    return run


def test_a_correct_warehouse_counts_nothing_lost() -> None:
    counted = count(_ledger(), _sql(_warehouse()))
    assert (counted.lost, counted.duplicated, counted.unexpected, counted.open_history_mismatch) == (
        0,
        0,
        0,
        0,
    ), counted.examples


@pytest.mark.parametrize(
    ("damage", "field", "n"),
    [
        # an update applied to the history but never to the current table
        ("UPDATE public.chaos_accounts SET name = 'account 1 aa' WHERE id = 1", "stale_rows", 1),
        # the TOAST value lost on the title update
        ("UPDATE public.chaos_docs SET body = NULL", "stale_rows", 1),
        ("DELETE FROM public.chaos_events WHERE seq = 3", "missing_rows", 1),
        # a delete never applied
        ("INSERT INTO public.chaos_accounts VALUES (3, 'account 3 cc')", "deleted_present", 1),
        ("DELETE FROM public.chaos_accounts__history WHERE name = 'account 1 aa'", "lost_versions", 1),
        # a version written twice
        (
            "INSERT INTO public.chaos_docs__history SELECT * FROM public.chaos_docs__history WHERE title = 'draft'",
            "duplicated",
            1,
        ),
        # a version the workload never wrote in place of one it did: same count, other versions
        ("UPDATE public.chaos_events__history SET payload = 'other' WHERE seq = 2", "lost_versions", 1),
        ("INSERT INTO public.chaos_accounts VALUES (-1, '{not json')", "unexpected", 1),
        ("INSERT INTO public.chaos_accounts VALUES (4, 'account 2 bb')", "duplicated", 1),
        (
            "UPDATE public.chaos_accounts__history SET is_current = false WHERE id = 4",
            "open_history_mismatch",
            1,
        ),
    ],
)
def test_each_damage_is_counted(damage: str, field: str, n: int) -> None:
    con = _warehouse()
    con.execute(damage)
    counted = count(_ledger(), _sql(con))
    assert getattr(counted, field) == n, (field, counted)
    assert counted.examples


@pytest.mark.parametrize(
    ("query", "params"),
    [
        ("UPDATE chaos_accounts SET name = %s WHERE id IN (%s, %s)", ("n", 1, 2)),  # not one key
        ("UPDATE chaos_accounts SET name = upper(name) WHERE id = %s", (1,)),  # unknown value
        ("DELETE FROM chaos_accounts WHERE name = %s", ("n",)),
        ("INSERT INTO chaos_accounts (name) VALUES (%s)", ("n",)),  # no key
        ("INSERT INTO other (id) VALUES (%s)", (1,)),  # an untracked table
        ("MERGE INTO chaos_accounts USING x ON true WHEN MATCHED THEN DELETE", None),
        ("INSERT INTO chaos_accounts (id, name) VALUES (%s, %s)", (1,)),
    ],
)
def test_a_statement_the_ledger_cannot_read_is_an_error(query: str, params: tuple[Any, ...] | None) -> None:
    with pytest.raises(LedgerError):
        parse(query, params)


def test_a_cut_off_commit_counts_as_the_source_says() -> None:
    op = parse("TRUNCATE chaos_events", None)
    assert op is not None
    assert committed([op], 7, lambda tx_no: "committed") is True
    assert committed([op], 7, lambda tx_no: "aborted") is False
    assert committed([op], 7, lambda tx_no: "in progress") is None
    assert committed([], 7, lambda tx_no: "committed") is False  # it had not written yet
    assert committed([op], None, lambda tx_no: "committed") is False  # its number was never written


def test_a_kind_not_injected_fails_the_run_and_is_shown() -> None:
    report = Report("embedded", ledger=Count())
    report.faults["reader_kill9"] += 1
    assert report.ok
    report.skipped["disk_full"] = "mount of a size-limited tmpfs failed: permission denied"
    assert not report.ok
    assert any("disk_full" in line and "NOT INJECTED" in line for line in report.lines())
    uncounted = Report("embedded")
    assert not uncounted.ok and any("NOT COUNTED" in line for line in uncounted.lines())
