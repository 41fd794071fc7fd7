"""The workload's own ledger of what it wrote, counted against the warehouse apart from `cdc verify`.

Every statement the workload runs passes through :class:`Recording`, which parses it (the workload's
statements are single-row: ``INSERT INTO t (cols) VALUES (%s, ...)``, ``UPDATE t SET c = %s, ...
WHERE key = %s [AND ...]``, ``DELETE FROM t WHERE key = %s [AND ...]``, ``TRUNCATE t``) and keeps
it with its transaction. A transaction enters the ledger only once the source says it committed: each
one also inserts its number into a table nobody captures, and a transaction whose commit was cut off
by a fault (a terminated backend, a restart) is looked up there after reconnecting, once the backend
that ran it is gone. A
statement the ledger cannot read is itself a failure of the run, never skipped.

Each change is identified by a fingerprint of the text columns the workload writes with a random
token every time (:data:`TRACKED`): a version of a key is ``(key, fingerprint)``, unique for every
change. The ledger keeps, per table, each live key's fingerprint (what the current table must hold)
and, per key, how many versions it was given and the sum of their fingerprints (what the history must
hold: one row per applied change, see docs/warehouse.md). Against the warehouse:

* lost: a version the history lacks, a live row missing from the current table or holding another
  fingerprint (a lost update or TOAST value), a row deleted at the source still in the current table;
* duplicated: a version the history holds more often than the workload wrote it, a key twice in the
  current table or with two open history rows;
* unexpected: a key in the warehouse the workload never wrote (counted apart; a failure).

Per key the ledger keeps a count and a sum, not each version, so that the full size (millions of
changes) fits in memory; equal counts with different sums count as one lost version.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

#: per table: its key columns and the text columns whose values identify each change
TRACKED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "public.chaos_accounts": (("id",), ("name",)),
    "public.chaos_events": (("tenant", "seq"), ("payload",)),
    "public.chaos_docs": (("slug",), ("title", "body")),
}

Key = Any  # the key's value (one column) or a tuple of them

_INSERT = re.compile(r"INSERT INTO (\w+) \(([^)]*)\) VALUES \((.*)\)\s*$", re.S | re.I)
_UPDATE = re.compile(r"UPDATE (\w+) SET (.*) WHERE (.*?)\s*$", re.S | re.I)
_DELETE = re.compile(r"DELETE FROM (\w+) WHERE (.*?)\s*$", re.S | re.I)
_TRUNCATE = re.compile(r"TRUNCATE (?:TABLE )?(\w+)\s*$", re.I)
_ASSIGN = re.compile(r"^(\w+)\s*=\s*(.*)$", re.S)


def column_digest(value: Any) -> str:
    """What the warehouse query computes for one tracked column: ``substr(md5(value), 1, 16)``."""
    return "-" if value is None else hashlib.md5(str(value).encode()).hexdigest()[:16]


def fingerprint(digests: tuple[str, ...]) -> int:
    """A version's fingerprint from its tracked columns' digests (60 bits, summed exactly in SQL)."""
    return int(hashlib.md5(";".join(digests).encode()).hexdigest()[:15], 16)


def _sql_fingerprint(columns: tuple[str, ...]) -> str:
    parts = ", ".join(f"coalesce(substr(md5(CAST({c} AS VARCHAR)), 1, 16), '-')" for c in columns)
    return f"('0x' || substr(md5(concat_ws(';', {parts})), 1, 15))::BIGINT"


def _split_top(text: str, sep: str) -> list[str]:
    """``text`` split on ``sep`` outside parentheses and quotes."""
    out, depth, quote, cur = [], 0, False, ""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "'":
            quote = not quote
        elif not quote and ch == "(":
            depth += 1
        elif not quote and ch == ")":
            depth -= 1
        if not quote and depth == 0 and text.startswith(sep, i):
            out.append(cur.strip())
            cur, i = "", i + len(sep)
            continue
        cur += ch
        i += 1
    out.append(cur.strip())
    return out


@dataclass
class _Op:
    kind: str  # insert, update, delete, truncate
    table: str
    values: dict[str, Any] = field(default_factory=dict)  # insert: the row; update: what SET sets
    key: Key = None  # update, delete: the WHERE's key


class LedgerError(Exception):
    """A statement the ledger cannot read."""


def _table(name: str) -> str:
    table = f"public.{name.lower()}"
    if table not in TRACKED:
        raise LedgerError(f"a write to {name}, which the ledger does not track")
    return table


def parse(query: str, params: tuple[Any, ...] | None) -> _Op | None:
    """The write ``query`` makes with ``params`` (None for a statement that writes nothing)."""
    text = " ".join(query.split())
    args = list(params or ())
    if text.upper().startswith("SELECT"):
        return None

    def bind(expressions: list[str]) -> list[tuple[bool, Any]]:
        bound = []
        for expr in expressions:
            if expr == "%s":
                if not args:
                    raise LedgerError(f"fewer parameters than placeholders: {text}")
                bound.append((True, args.pop(0)))
            elif "%s" in expr:
                raise LedgerError(f"a placeholder inside an expression: {expr!r} in {text}")
            else:
                bound.append((False, expr))
        return bound

    def where_key(table: str, clause: str) -> Key:
        keys = TRACKED[table][0]
        conds = [_ASSIGN.match(c) for c in _split_top(clause, " AND ")]
        if any(m is None for m in conds):
            raise LedgerError(f"a WHERE that is not `key = %s [AND ...]`: {text}")
        cols = [m.group(1).lower() for m in conds if m]
        vals = bind([m.group(2).strip() for m in conds if m])
        if sorted(cols) != sorted(keys) or not all(p for p, _ in vals):
            raise LedgerError(f"a WHERE on other than the key {keys}: {text}")
        row = dict(zip(cols, (v for _, v in vals), strict=True))
        return row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)

    def assigned(table: str, cols: list[str], exprs: list[str]) -> dict[str, Any]:
        keys, tracked = TRACKED[table]
        values = {}
        for col, (is_param, value) in zip(cols, bind(exprs), strict=True):
            if col in keys or col in tracked:
                if not is_param:
                    raise LedgerError(f"{col} set to an expression the ledger cannot evaluate: {text}")
                values[col] = value
        return values

    if m := _INSERT.match(text):
        table = _table(m.group(1))
        cols = [c.strip().lower() for c in m.group(2).split(",")]
        op = _Op("insert", table, assigned(table, cols, _split_top(m.group(3), ",")))
        missing = set(TRACKED[table][0]) - set(op.values)
        if missing:
            raise LedgerError(f"an insert without its key {sorted(missing)}: {text}")
    elif m := _UPDATE.match(text):
        table = _table(m.group(1))
        sets = [_ASSIGN.match(s) for s in _split_top(m.group(2), ",")]
        if any(s is None for s in sets):
            raise LedgerError(f"a SET the ledger cannot read: {text}")
        cols = [s.group(1).lower() for s in sets if s]
        values = assigned(table, cols, [s.group(2).strip() for s in sets if s])
        op = _Op("update", table, values, where_key(table, m.group(3)))
    elif m := _DELETE.match(text):
        table = _table(m.group(1))
        op = _Op("delete", table, key=where_key(table, m.group(2)))
    elif m := _TRUNCATE.match(text):
        op = _Op("truncate", _table(m.group(1)))
    else:
        raise LedgerError(f"a statement the ledger cannot read: {text}")
    if args:
        raise LedgerError(f"more parameters than placeholders: {text}")
    return op


class Ledger:
    """What the workload (and the harness's own poison rows) committed at the source, per table."""

    def __init__(self) -> None:
        #: live key -> its tracked columns' digests
        self.live: dict[str, dict[Key, tuple[str, ...]]] = {t: {} for t in TRACKED}
        #: key -> (versions written, sum of their fingerprints)
        self.versions: dict[str, dict[Key, tuple[int, int]]] = {t: {} for t in TRACKED}
        self.changes = 0
        self.transactions = 0
        self.uncertain_committed = 0  # commits cut off by a fault that the source had made
        self.uncertain_aborted = 0
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def _key(self, table: str, values: dict[str, Any]) -> Key:
        keys = TRACKED[table][0]
        return values[keys[0]] if len(keys) == 1 else tuple(values[k] for k in keys)

    def _open(self, table: str, key: Key, digests: tuple[str, ...]) -> None:
        self.live[table][key] = digests
        n, total = self.versions[table].get(key, (0, 0))
        self.versions[table][key] = (n + 1, total + fingerprint(digests))

    def apply(self, ops: list[_Op]) -> None:
        """One committed transaction's writes, in their order."""
        with self.lock:
            for op in ops:
                self._apply(op)
            self.changes += len(ops)
            self.transactions += 1

    def _apply(self, op: _Op) -> None:
        live = self.live[op.table]
        keys, tracked = TRACKED[op.table]
        if op.kind == "insert":
            self._open(
                op.table,
                self._key(op.table, op.values),
                tuple(column_digest(op.values.get(c)) for c in tracked),
            )
        elif op.kind == "update":
            old = live.get(op.key)
            if old is None:
                return  # the UPDATE matched no row
            digests = tuple(
                column_digest(op.values[c]) if c in op.values else d
                for c, d in zip(tracked, old, strict=True)
            )
            current = dict(zip(keys, op.key if len(keys) > 1 else (op.key,), strict=True))
            new_key = self._key(op.table, {**current, **{k: v for k, v in op.values.items() if k in keys}})
            if new_key != op.key:
                del live[op.key]
            self._open(op.table, new_key, digests)
        elif op.kind == "delete":
            live.pop(op.key, None)
        else:
            live.clear()

    def insert(self, table: str, row: dict[str, Any]) -> None:
        """A row the harness itself wrote (see ``poison_value``), as one committed change."""
        self.apply([_Op("insert", table, row)])


class Recording:
    """The workload's connection, recording each write of the open transaction for the ledger. Only
    ``execute`` and ``transaction`` are offered: a write by any other way would bypass the ledger."""

    def __init__(self, conn: Any, ledger: Ledger) -> None:
        self._conn = conn
        self._ledger = ledger
        self.pending: list[_Op] = []

    def execute(self, query: str, params: tuple[Any, ...] | None = None) -> Any:
        try:
            op = parse(query, params)
        except LedgerError as exc:
            with self._ledger.lock:
                if len(self._ledger.errors) < 20:
                    self._ledger.errors.append(str(exc)[:500])
            op = None
        result = self._conn.execute(query, params)
        if op is not None:
            self.pending.append(op)
        return result

    def transaction(self) -> AbstractContextManager[Any]:
        return self._conn.transaction()  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the chaos ledger records writes through execute() only, not {name}")


def committed(ops: list[_Op], tx_no: int | None, status: Callable[[int], str | None]) -> bool | None:
    """Whether a transaction whose commit a fault cut off was committed: ``status(tx_no)`` answers
    from the source ("committed", "aborted", or "in progress"/None while it cannot say yet)."""
    if tx_no is None or not ops:
        return False  # it had not started writing
    answer = status(tx_no)
    if answer is None or answer == "in progress":
        return None
    return answer == "committed"


@dataclass
class Count:
    """The ledger against the warehouse (see the module docstring)."""

    lost_versions: int = 0
    missing_rows: int = 0
    stale_rows: int = 0
    deleted_present: int = 0
    open_history_mismatch: int = 0
    duplicated: int = 0
    unexpected: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int:
        return self.lost_versions + self.missing_rows + self.stale_rows + self.deleted_present

    def note(self, example: str) -> None:
        if len(self.examples) < 10:
            self.examples.append(example)

    def line(self) -> str:
        return (
            f"{self.lost_versions} versions missing from the history, {self.missing_rows} live rows "
            f"missing from the current table, {self.stale_rows} stale, {self.deleted_present} deleted "
            f"at the source but present; {self.open_history_mismatch} open history rows unlike the "
            f"current table; {self.unexpected} keys the workload never wrote"
        )


def _key_of(row: dict[str, Any], keys: tuple[str, ...]) -> Key:
    return row[keys[0]] if len(keys) == 1 else tuple(row[k] for k in keys)


def query(table: str) -> str:
    """The one warehouse query of a table (one `cdc sql --json` process): rows of three parts, the
    current table's versions, the history's open rows, and the history's versions per key (how many,
    and the sum of their fingerprints, as text: the sum exceeds 64 bits)."""
    keys, tracked = TRACKED[table]
    cols = ", ".join(keys)
    fp = _sql_fingerprint(tracked)
    return (
        f"SELECT 'current' AS part, {cols}, 1 AS n, CAST({fp} AS VARCHAR) AS fp FROM {table} "
        f"UNION ALL SELECT 'open', {cols}, 1, CAST({fp} AS VARCHAR) FROM {table}__history WHERE is_current "
        f"UNION ALL SELECT 'history', {cols}, count(*), CAST(sum({fp}) AS VARCHAR) "
        f"FROM {table}__history GROUP BY {cols}"
    )


def count(ledger: Ledger, sql: Callable[[str], list[dict[str, Any]]]) -> Count:
    """Count what the warehouse lost or duplicated of the ledger; ``sql`` runs one query."""
    out = Count()
    for table, (keys, _) in TRACKED.items():
        parts: dict[str, dict[Key, tuple[int, int]]] = {"current": {}, "open": {}, "history": {}}
        for r in sql(query(table)):
            part, key = parts[r["part"]], _key_of(r, keys)
            if key in part:  # a key twice in the current table, or with two open history rows
                out.duplicated += 1
                out.note(f"{table} {key}: twice in the warehouse's {r['part']} rows")
            part[key] = (int(r["n"]), int(r["fp"]))
        live = {k: fingerprint(d) for k, d in ledger.live[table].items()}
        written = ledger.versions[table]
        current = {k: fp for k, (_, fp) in parts["current"].items()}
        for key, fp in live.items():
            got = current.get(key)
            if got is None:
                out.missing_rows += 1
                out.note(f"{table} {key}: live at the source, missing from the current table")
            elif got != fp:
                out.stale_rows += 1
                out.note(f"{table} {key}: the current table holds another version")
        for key in current.keys() - live.keys():
            if key in written:
                out.deleted_present += 1
                out.note(f"{table} {key}: deleted at the source, still in the current table")
            else:
                out.unexpected += 1
                out.note(f"{table} {key}: in the current table, never written by the workload")
        opened = {k: fp for k, (_, fp) in parts["open"].items()}
        # the warehouse's own invariant (docs/warehouse.md): a key has an open history row exactly when
        # it has a current row, of the same version, whether or not the pipeline has caught up
        for key in opened.keys() | current.keys():
            if opened.get(key) != current.get(key):
                out.open_history_mismatch += 1
                out.note(f"{table} {key}: its open history row is not its current row")
        history = parts["history"]
        for key, (n, total) in written.items():
            got_n, got_total = history.get(key, (0, 0))
            if got_n < n:
                out.lost_versions += n - got_n
                out.note(f"{table} {key}: {n} versions written, {got_n} in the history")
            elif got_n > n:
                out.duplicated += got_n - n
                out.note(f"{table} {key}: {n} versions written, {got_n} in the history")
            elif got_total != total:
                out.lost_versions += 1
                out.note(f"{table} {key}: {n} versions in the history, not the ones written")
        for key in history.keys() - written.keys():
            out.unexpected += 1
            out.note(f"{table} {key}: in the history, never written by the workload")
    return out
