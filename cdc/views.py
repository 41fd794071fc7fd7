"""Views from joins: the SQL a person registers with ``cdc views add``, parsed and checked.

A view is ``SELECT <columns> FROM a [INNER|LEFT] JOIN b ON a.fk = b.pk ... [WHERE <filters>]`` over
registered tables (``docs/views.md``). :func:`parse_view` parses it with sqlglot (Postgres dialect)
and accepts only what the apply can maintain by recomputing the rows a batch affects:

* one driving table (the ``FROM`` table, the "many" side): the view has at most one row per row of
  it, keyed by its key (``_cdc_key``, the key of its current table);
* inner and left equi-joins, each on the *whole* key of the joined table (the "one" side), its key
  columns equal to columns of one table joined before it (many-to-one: a driving row meets at most
  one row of each joined table, so the view keeps the driving table's key);
* projections of columns, renamed with ``AS`` or not;
* filters: comparisons (``= <> < <= > >=``), ``IS [NOT] NULL`` and ``IN (literals)`` of columns and
  literals, joined by ``AND``.

Everything else (``*``, expressions, aggregates, ``GROUP BY``, ``DISTINCT``, ``ORDER BY``,
``LIMIT``, subqueries, ``WITH``, set operations, ``OR``, non-equi joins, joins not on the one
side's full key, right/full/cross joins, unregistered tables, unknown or ambiguous columns) is
refused with a :class:`~cdc.errors.ConfigError` that says what is supported.

The result, :class:`ViewSpec`, carries the DuckDB SQL the maintenance runs (:mod:`sinks.warehouse.views`):
the view's query with every table qualified, every column qualified by its table's alias and the
driving table's ``_cdc_key`` appended, and per joined table the query that finds the driving rows
referencing a changed key of it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError

from cdc.errors import ConfigError
from cdc.names import sql_ident
from cdc.registry import TableReg, ViewReg

#: the hidden column of a view's table: the key of the driving table's row (its ``_cdc_key``)
VIEW_KEY = "_cdc_key"
#: the table of changed keys a reference query joins (:attr:`ViewSpec.refs_sql`), columns ``k0``...
CHANGED = "__cdc_changed"

SUPPORTED = (
    "a view is SELECT col [AS name], ... FROM a [INNER|LEFT] JOIN b ON a.fk = b.pk [AND ...] ... "
    "[WHERE filters]: over registered tables, each JOIN on the whole key of the joined table "
    "(many-to-one), filters comparing columns and literals (= <> IS [NOT] NULL, IN (literals); "
    "< <= > >= on numbers, dates and timestamps only) joined by AND; no *, expressions, aggregates, "
    "GROUP BY, DISTINCT, ORDER BY, LIMIT, subqueries, WITH, UNION or OR (docs/views.md)"
)
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_REFUSED_CLAUSES = {
    "with": "WITH",
    "group": "GROUP BY",
    "having": "HAVING",
    "order": "ORDER BY",
    "limit": "LIMIT",
    "offset": "OFFSET",
    "distinct": "DISTINCT",
    "windows": "WINDOW",
    "qualify": "QUALIFY",
    "into": "INTO",
    "locks": "FOR UPDATE",
    "sample": "TABLESAMPLE",
}
_COMPARISONS = (exp.EQ, exp.NEQ, exp.GT, exp.GTE, exp.LT, exp.LTE)
_ORDERINGS = (exp.GT, exp.GTE, exp.LT, exp.LTE)
#: the column types whose order in the warehouse (DuckDB over Delta) is the source's: an ordering
#: filter on any other type would select other rows than the same SQL on the source (text by the
#: column's collation there, by bytes here; an enum by its declared order there)
_SAME_ORDER = re.compile(
    r"(smallint|integer|bigint|numeric(\(\d+(,\d+)?\))?|real|double precision|date|"
    r"timestamp(\(\d\))? with(out)? time zone)"
)


@dataclass(frozen=True)
class Join:
    """One joined table: ``alias`` (of ``reg``), ``kind`` (``inner``/``left``), the ``parent``
    alias it is joined to and ``pairs`` (parent column, key column), one per key column."""

    alias: str
    reg: TableReg
    kind: str
    parent: str
    pairs: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class ViewSpec:
    """A parsed view (see the module docstring)."""

    name: str
    sql: str
    driving_alias: str
    driving: TableReg
    joins: tuple[Join, ...]
    columns: tuple[str, ...]
    #: the view's query in DuckDB SQL, its rows keyed by the driving table's ``_cdc_key``
    select_sql: str
    #: per join (same order): DuckDB SQL of the driving keys whose row refers (along the joins, all
    #: taken as LEFT, no filter) to a key of the table ``__cdc_changed_<i>`` (columns ``k0``...)
    refs_sql: tuple[str, ...]
    #: per table (qualified name) the columns the view reads of it (besides ``_cdc_key``)
    used: dict[str, tuple[str, ...]]
    #: per column of :attr:`columns` (same order): the ``(alias, column)`` it is read from
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def tables(self) -> tuple[TableReg, ...]:
        """The registered tables it reads, the driving one first, each once."""
        out = {self.driving.qualified: self.driving}
        for j in self.joins:
            out.setdefault(j.reg.qualified, j.reg)
        return tuple(out.values())


def refuse(what: str, **values: object) -> ConfigError:
    """The error of an unsupported view: what is wrong, and :data:`SUPPORTED` as the fix."""
    return ConfigError(f"view not supported: {what}", fix=SUPPORTED, **values)


def check_name(name: str) -> str:
    """A view's name: lower case letters, digits and ``_`` (what DuckDB and a path take as is)."""
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"invalid view name {name!r}",
            fix="use lower case letters, digits and _ (starting with a letter or _, at most 63)",
            name=name,
        )
    if name.startswith("_cdc_") or name.startswith("__"):
        raise ConfigError(f"invalid view name {name!r}: _cdc_ and __ are reserved", fix="choose another name")
    return name


def _ident(node: exp.Expression | None) -> str:
    """An identifier as Postgres reads it: unquoted folds to lower case."""
    if node is None:
        return ""
    if isinstance(node, exp.Identifier):
        text = str(node.this)
        return text if node.quoted else text.lower()
    return _ident(node.this) if isinstance(node.this, exp.Expression) else str(node.this).lower()


def _statement(sql: str) -> exp.Select:
    try:
        statements = [s for s in sqlglot.parse(sql, read="postgres") if s is not None]
    except ParseError as exc:
        raise ConfigError(f"the view's SQL does not parse: {exc}", fix=SUPPORTED, sql=sql) from exc
    if len(statements) != 1:
        raise refuse(f"{len(statements)} statements; give one SELECT", sql=sql)
    (stmt,) = statements
    if not isinstance(stmt, exp.Select):
        raise refuse(
            f"a {stmt.key.upper()} statement (UNION and the like included); give one SELECT", sql=sql
        )
    for arg, clause in _REFUSED_CLAUSES.items():
        if stmt.args.get(arg) or stmt.args.get(f"{arg}_"):  # sqlglot names some with a trailing _
            raise refuse(clause, sql=sql)
    if any(s is not stmt for s in stmt.find_all(exp.Select)) or stmt.find(exp.Subquery):
        raise refuse("a subquery", sql=sql)
    if stmt.find(exp.AggFunc) or stmt.find(exp.Window):
        raise refuse("an aggregate or window function", sql=sql)
    return stmt


class _Scope:
    """The tables of a view by alias, in FROM/JOIN order, and column resolution against them."""

    def __init__(self, tables: list[TableReg]) -> None:
        self.registered = tables
        self.aliases: dict[str, TableReg] = {}
        self.used: dict[str, list[str]] = {}  # qualified table -> the columns the view reads of it

    def add(self, node: exp.Expression) -> str:
        if not isinstance(node, exp.Table) or not isinstance(node.this, exp.Identifier):
            raise refuse(f"{node.sql(dialect='postgres')} in FROM/JOIN: only registered tables can be read")
        if node.args.get("catalog"):
            raise refuse(f"a database-qualified table {node.sql(dialect='postgres')}")
        reg = self._table(_ident(node.args.get("db")), _ident(node.this))
        alias = _ident(node.args["alias"].this) if node.args.get("alias") else reg.table
        if alias in self.aliases:
            raise refuse(f"the name {alias!r} is used by two tables: give each its own alias", alias=alias)
        self.aliases[alias] = reg
        return alias

    def _table(self, schema: str, table: str) -> TableReg:
        found = [r for r in self.registered if r.table == table and (not schema or r.schema == schema)]
        if len(found) == 1:
            return found[0]
        name = f"{schema}.{table}" if schema else table
        if not found:
            known = ", ".join(r.qualified for r in self.registered) or "(none)"
            raise ConfigError(
                f"view not supported: table {name} is not registered",
                fix=f"register it with `cdc tables add` first; registered: {known}",
                table=name,
            )
        raise ConfigError(
            f"view not supported: table name {table} is ambiguous ({', '.join(r.qualified for r in found)})",
            fix="qualify it with its schema",
            table=table,
        )

    def column(self, col: exp.Column) -> tuple[str, str]:
        """``(alias, column)`` of a column reference, or the error saying why it is not one."""
        alias, name = self._column(col)
        used = self.used.setdefault(self.aliases[alias].qualified, [])
        if name not in used:
            used.append(name)
        return alias, name

    def _column(self, col: exp.Column) -> tuple[str, str]:
        name = _ident(col.this)
        if col.args.get("db") or col.args.get("catalog"):
            raise refuse(f"column {col.sql(dialect='postgres')}: qualify columns by table alias only")
        alias = _ident(col.args.get("table"))
        if alias:
            reg = self.aliases.get(alias)
            if reg is None:
                raise refuse(f"column {col.sql(dialect='postgres')}: no table is named {alias!r} in the view")
            if name not in _readable(reg):
                raise ConfigError(
                    f"view not supported: {reg.qualified} has no captured column {name!r}",
                    fix=f"its columns: {', '.join(_readable(reg))}",
                    column=name,
                )
            return alias, name
        owners = [a for a, reg in self.aliases.items() if name in _readable(reg)]
        if len(owners) == 1:
            return owners[0], name
        if not owners:
            raise refuse(f"column {name!r} is in none of the view's tables", column=name)
        raise ConfigError(
            f"view not supported: column {name!r} is ambiguous (in {', '.join(owners)})",
            fix=f"qualify it: {owners[0]}.{name}",
            column=name,
        )


def _readable(reg: TableReg) -> list[str]:
    return [c.name for c in reg.columns if c.name not in reg.exclude]


def _conjuncts(node: exp.Expr) -> list[exp.Expr]:
    while isinstance(node, exp.Paren):
        node = node.this
    if isinstance(node, exp.And):
        return _conjuncts(node.left) + _conjuncts(node.right)
    return [node]


def _join(scope: _Scope, node: exp.Join, earlier: list[str]) -> Join:
    """One JOIN, checked: inner or left, ON equalities of the joined table's whole key."""
    side, kind = (node.args.get("side") or "").upper(), (node.args.get("kind") or "").upper()
    text = node.sql(dialect="postgres")
    if side not in ("", "LEFT") or kind not in ("", "INNER", "OUTER") or (side == "" and kind == "OUTER"):
        raise refuse(f"{text}: only INNER and LEFT joins")
    if node.args.get("using") or node.args.get("method") or not node.args.get("on"):
        raise refuse(f"{text}: a join needs ON a.fk = b.pk (no USING, NATURAL, LATERAL or comma joins)")
    alias = scope.add(node.this)
    reg = scope.aliases[alias]
    pairs: list[tuple[str, str]] = []
    parents: set[str] = set()
    for cond in _conjuncts(node.args["on"]):
        if not (
            isinstance(cond, exp.EQ)
            and isinstance(cond.left, exp.Column)
            and isinstance(cond.right, exp.Column)
        ):
            raise refuse(
                f"{text}: ON may only hold column = column terms joined by AND (filters go in WHERE)"
            )
        (la, lc), (ra, rc) = scope.column(cond.left), scope.column(cond.right)
        if (la == alias) == (ra == alias):
            raise refuse(
                f"{text}: each ON term must compare a column of {alias} with one of an earlier table"
            )
        (pa_, pc_), key = ((ra, rc), lc) if la == alias else ((la, lc), rc)
        if pa_ not in earlier:
            raise refuse(f"{text}: {pa_} is joined after {alias}")
        parents.add(pa_)
        pairs.append((pc_, key))
    keys = [k for _, k in pairs]
    if len(parents) != 1 or sorted(keys) != sorted(reg.key) or len(set(keys)) != len(keys):
        raise ConfigError(
            f"view not supported: {text} is not on the whole key ({', '.join(reg.key)}) of {reg.qualified} "
            "from one earlier table",
            fix="join each table on all its key columns, each once, to columns of one table joined "
            f"before it (many-to-one); {SUPPORTED}",
            table=reg.qualified,
        )
    order = {k: i for i, k in enumerate(reg.key)}
    pairs.sort(key=lambda p: order[p[1]])
    return Join(alias, reg, "left" if side == "LEFT" else "inner", parents.pop(), tuple(pairs))


def _projection(scope: _Scope, stmt: exp.Select) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The view's column names and, per column, the ``(alias, column)`` it reads."""
    names: list[str] = []
    sources: list[tuple[str, str]] = []
    for item in stmt.expressions:
        col = item.this if isinstance(item, exp.Alias) else item
        if isinstance(col, exp.Star) or (isinstance(col, exp.Column) and isinstance(col.this, exp.Star)):
            raise refuse("SELECT *: name the columns")
        if not isinstance(col, exp.Column):
            raise refuse(
                f"the select item {item.sql(dialect='postgres')}: only columns, renamed with AS or not"
            )
        alias, name = scope.column(col)
        out = _ident(item.args["alias"]) if isinstance(item, exp.Alias) else name
        if out.startswith("_cdc_"):
            raise refuse(
                f"the column name {out!r}: names starting with _cdc_ are reserved; rename it with AS"
            )
        if out in names:
            raise refuse(f"two columns are named {out!r}: rename one with AS", column=out)
        names.append(out)
        sources.append((alias, name))
    return tuple(names), tuple(sources)


def _filters(scope: _Scope, where: exp.Expression | None) -> None:
    for cond in _conjuncts(where.this) if where is not None else []:
        inner = cond.this if isinstance(cond, exp.Not) and isinstance(cond.this, exp.Is) else cond
        operands: list[exp.Expr]
        if isinstance(inner, _COMPARISONS):
            operands = [inner.left, inner.right]
        elif isinstance(inner, exp.Is) and isinstance(inner.expression, exp.Null):
            operands = [inner.this]
        elif isinstance(inner, exp.In) and not inner.args.get("query") and inner.expressions:
            if not all(isinstance(e, exp.Literal | exp.Null | exp.Boolean) for e in inner.expressions):
                raise refuse(f"the filter {cond.sql(dialect='postgres')}: IN takes literals only")
            operands = [inner.this]
        else:
            raise refuse(f"the filter {cond.sql(dialect='postgres')}")
        for op in operands:
            if isinstance(op, exp.Column):
                alias, name = scope.column(op)
                if isinstance(inner, _ORDERINGS):
                    _same_order(scope.aliases[alias], name, cond)
            elif not isinstance(op, exp.Literal | exp.Null | exp.Boolean):
                raise refuse(f"the filter {cond.sql(dialect='postgres')}: compare columns and literals only")


def _same_order(reg: TableReg, name: str, cond: exp.Expr) -> None:
    """Refuse an ordering filter (< <= > >=) on a column whose order differs in the warehouse."""
    typ = next(c.type for c in reg.columns if c.name == name)
    if not _SAME_ORDER.fullmatch(typ):
        raise refuse(
            f"the filter {cond.sql(dialect='postgres')} orders {reg.qualified}.{name}, of type {typ}: the "
            "source orders it by its own rules (text by the column's collation, an enum by its declared "
            "order), the warehouse by its bytes, so the view would not equal its SQL on the source; "
            "compare it with =, <>, IN or IS NULL",
            column=name,
            type=typ,
        )


def _table_sql(reg: TableReg, alias: str) -> str:
    return f"{sql_ident(reg.schema)}.{sql_ident(reg.table)} AS {sql_ident(alias)}"


def _on_sql(j: Join) -> str:
    return " AND ".join(
        f"{sql_ident(j.parent)}.{sql_ident(p)} = {sql_ident(j.alias)}.{sql_ident(k)}" for p, k in j.pairs
    )


def _qualified(scope: _Scope, stmt: exp.Select, driving: str) -> str:
    """The view's query in DuckDB SQL: tables schema-qualified, columns alias-qualified, the driving
    table's ``_cdc_key`` appended."""
    out = stmt.copy()
    for col in list(out.find_all(exp.Column)):
        alias, name = scope.column(col)
        col.replace(
            exp.column(exp.to_identifier(name, quoted=True), table=exp.to_identifier(alias, quoted=True))
        )
    for tab in list(out.find_all(exp.Table)):
        alias = _ident(tab.args["alias"].this) if tab.args.get("alias") else _ident(tab.this)
        reg = scope.aliases[alias]
        tab.replace(
            exp.table_(
                exp.to_identifier(reg.table, quoted=True),
                db=exp.to_identifier(reg.schema, quoted=True),
                alias=exp.to_identifier(alias, quoted=True),
            )
        )
    for item in out.expressions:  # an unrenamed column keeps its name as Postgres gives it
        if isinstance(item, exp.Column):
            item.replace(exp.alias_(item.copy(), exp.to_identifier(item.name, quoted=True)))
    out = out.select(f"{sql_ident(driving)}.{sql_ident(VIEW_KEY)} AS {sql_ident(VIEW_KEY)}", dialect="duckdb")
    return out.sql(dialect="duckdb", identify=True)


def _refs_sql(driving: TableReg, driving_alias: str, joins: list[Join], i: int) -> str:
    j = joins[i]
    chain = " ".join(f"LEFT JOIN {_table_sql(p.reg, p.alias)} ON {_on_sql(p)}" for p in joins[:i])
    on = " AND ".join(f"{sql_ident(j.parent)}.{sql_ident(p)} = __c.k{n}" for n, (p, _) in enumerate(j.pairs))
    return (
        f"SELECT DISTINCT {sql_ident(driving_alias)}.{sql_ident(VIEW_KEY)} AS k FROM {_table_sql(driving, driving_alias)} "
        f"{chain} JOIN {CHANGED}_{i} AS __c ON {on}"
    )


def parse_view(name: str, sql: str, tables: list[TableReg]) -> ViewSpec:
    """The view ``name`` of ``sql`` over the registered ``tables``, or the ConfigError refusing it."""
    check_name(name)
    stmt = _statement(sql)
    scope = _Scope(tables)
    source = stmt.args.get("from_")
    if source is None:
        raise refuse("no FROM table", sql=sql)
    driving_alias = scope.add(source.this)
    joins: list[Join] = []
    for node in stmt.args.get("joins") or []:
        joins.append(_join(scope, node, [driving_alias, *(j.alias for j in joins)]))
    columns, sources = _projection(scope, stmt)
    _filters(scope, stmt.args.get("where"))
    driving = scope.aliases[driving_alias]
    return ViewSpec(
        name=name,
        sql=sql,
        driving_alias=driving_alias,
        driving=driving,
        joins=tuple(joins),
        columns=columns,
        select_sql=_qualified(scope, stmt, driving_alias),
        refs_sql=tuple(_refs_sql(driving, driving_alias, joins, i) for i in range(len(joins))),
        used={t: tuple(cols) for t, cols in scope.used.items()},
        sources=sources,
    )


def source_sql(spec: ViewSpec, extra: tuple[tuple[str, str], ...] = ()) -> str:
    """The view's query in Postgres SQL, to run on the source (``cdc verify``): the registered SQL
    (parsed and accepted by :func:`parse_view`) with ``extra`` columns appended, each
    ``(column of the driving table, output name)``, quoted by sqlglot's Postgres dialect."""
    stmt = _statement(spec.sql)
    for column, name in extra:
        col = exp.column(
            exp.to_identifier(column, quoted=True), table=exp.to_identifier(spec.driving_alias, quoted=True)
        )
        stmt = stmt.select(exp.alias_(col, exp.to_identifier(name, quoted=True)), copy=False)
    return stmt.sql(dialect="postgres")


#: :func:`spec_of`'s parses, by the view's name and SQL and the registered tables' ``repr`` (every
#: field: a table's columns, types, exclusions, key; a schema change at the source is a new key)
_SPECS: dict[tuple[str, str, tuple[str, ...]], ViewSpec] = {}
_SPECS_MAX = 256


def spec_of(view: ViewReg, tables: list[TableReg]) -> ViewSpec:
    """The registered view parsed against today's registered tables (a ConfigError names the view).

    The apply asks for every view in every batch: a parse (sqlglot) against the same SQL and the
    same registered tables -- equal in every field, so a column added, dropped, retyped or excluded
    is another key -- is reused. A refusal is not kept: it is raised again from a new parse."""
    key = (view.name, view.sql, tuple(repr(t) for t in tables))
    found = _SPECS.get(key)
    if found is not None:
        return found
    try:
        spec = parse_view(view.name, view.sql, tables)
    except ConfigError as exc:
        raise ConfigError(
            f"view {view.name} no longer parses against the registered tables: {exc.message}",
            fix=f"remove it (`cdc views remove {view.name}`) and add it again as it now fits; {exc.fix}",
            view=view.name,
        ) from exc
    if len(_SPECS) >= _SPECS_MAX:
        _SPECS.clear()
    _SPECS[key] = spec
    return spec
